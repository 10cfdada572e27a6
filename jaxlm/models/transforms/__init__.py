"""Model transforms: what a feature does to a projection, each in its own module.

`layers.Projection` is a plain kernel: `einsum(equation, x, kernel)` in the compute dtype. A feature
that changes how a projection stores or computes its weight, or adds to its output, is a subclass of
it here, a mixin that keeps the parameters' names (so checkpoints read the same whatever the code):

- `quantize.QuantizedKernel`: the kernel stored as integer codes and scales (`kernel_q`, ...),
  dequantized in the step (QLoRA's frozen base, a compressed model).
- `quantize.FakeQuantizedKernel`: a float kernel the forward pass fake-quantizes (QAT).
- `prune.MaskedKernel`: a pruning mask (`kernel_mask`) beside the kernel.
- `lora.Adapted`: LoRA adapters (`lora_a`, `lora_b`) added to the output.

Each module also holds the transform as the model's settings carry it (`ModelConfig.lora`, `.quantized`,
`.pruned`: `LoRA`, `Quantized`, `Pruned`), with what the rest of the code asks of it: which
projections it takes and with what (`parts`), and its own arithmetic (LoRA's parameter count and PEFT
settings, the quantized format's description). `projection_class` composes a projection's parts into
one class (cached, so a model's structure is the same object from build to build);
`transformer.ModelConfig.projection` asks each of the model's transforms for its parts by name.
"""

from __future__ import annotations

import functools

from jaxlm.models import layers
from jaxlm.models.transforms.lora import Adapted, LoRA
from jaxlm.models.transforms.prune import MaskedKernel, Pruned
from jaxlm.models.transforms.quantize import FakeQuantizedKernel, Quantized, QuantizedKernel

__all__ = ["LoRA", "Adapted", "MaskedKernel", "Pruned", "FakeQuantizedKernel", "Quantized", "QuantizedKernel",
           "PROJECTION_TRANSFORMS", "projection_class"]

# Every transform of a projection, in the order they compose (the first one's methods run first)
PROJECTION_TRANSFORMS = (Adapted, MaskedKernel, FakeQuantizedKernel, QuantizedKernel)


@functools.cache
def projection_class(parts: frozenset[type]) -> type[layers.Projection]:
    """The Projection class with the transforms `parts` (a set of `PROJECTION_TRANSFORMS`), composed."""
    if not parts:
        return layers.Projection
    unknown = parts - set(PROJECTION_TRANSFORMS)
    if unknown:
        raise ValueError(f"not projection transforms: {sorted(t.__name__ for t in unknown)}")
    bases = tuple(t for t in PROJECTION_TRANSFORMS if t in parts)
    if len(bases) == 1:
        return bases[0]
    return type("".join(t.__name__ for t in bases) + "Projection", bases, {"__module__": __name__})
