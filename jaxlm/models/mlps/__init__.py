"""The MLPs a block can use, by `config.model.mlp` name.

Each MLP is one file here, a subclass of `base.MLP` that declares its own arithmetic (parameters,
matmuls, saved activations, Hugging Face counterpart); adding one is that file and its entry in `MLPS`.
"""

from jaxlm.models.mlps.base import MLP
from jaxlm.models.mlps.gelu import GeluMLP
from jaxlm.models.mlps.moe import MoEMLP, MoESpec
from jaxlm.models.mlps.relu2 import SquaredReluMLP
from jaxlm.models.mlps.swiglu import GatedMLP

MLPS: dict[str, type[MLP]] = {cls.name: cls for cls in (GatedMLP, GeluMLP, SquaredReluMLP, MoEMLP)}

__all__ = ["MLP", "MLPS", "MoESpec"]
