"""What the rest of jaxlm asks of an MLP, declared once by the MLP itself.

An MLP is a subclass of `MLP` whose class attributes state its arithmetic; the parameter count, the
training FLOPs, LoRA's sizes, the planner's activation bytes and the Hugging Face export all read
them from here, never from a formula of their own (`tests/test_registries.py` runs every registered
MLP through each of them against the built model, the compiled program and the compiled memory).
"""

from __future__ import annotations

from typing import ClassVar

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxlm.mesh import constrain
from jaxlm.models import layers

# The logical axis names a projection of an MLP reads or writes: the residual stream's width and the
# hidden width (config.model.mlp_dim)
EMBED, HIDDEN = "embed", "mlp"
_EQUATIONS = {(EMBED, HIDDEN): "btd,df->btf", (HIDDEN, EMBED): "btf,fd->btd"}


class MLP(nnx.Module):
    """A block's feed-forward layer: [B, T, D] -> [B, T, D].

    A subclass sets:
      name: its `config.model.mlp` name.
      projections: its weight matmuls in the order they are created, attribute name -> (input axis,
        output axis), each EMBED or HIDDEN. `__init__` builds them from this table (`build_projections`),
        so the table and the model cannot disagree.
      biases: the biases it has when the model has biases (config.model.use_bias), in the order they are
        created: attribute name -> its size, EMBED or HIDDEN (`build_biases`).
      saved_hidden: how many [tokens, mlp_dim] activations a layer keeps for the backward pass without
        remat, its activation function recomputed (`layers.recomputed`): memory.layer_forward_bytes.
      autodiff_hidden: the same with every intermediate of the activation function kept, as autodiff
        saves them (what a layer holds at its backward pass's peak: memory.layer_backward_bytes).
      merged_hidden: how many more XLA:CPU keeps in a float32 program of unrolled layers without remat,
        where it merges the recomputed activation function with the forward's (memory.cpu_merged_bytes).
      hf_architectures: the Hugging Face model types whose MLP this is; () for none, and an export
        refuses in one line.
      hf_names: each projection's and bias's module name in those models' MLP (a kernel is the module's
        `weight`, a bias its `bias`; models/hf.py lays them out as the architecture stores its matrices).
      hf_layouts: where the architectures differ (Mixtral's and Qwen3-MoE's MLPs), each one's own table:
        architecture -> weight -> module path under the layer (not only under "mlp."); a module path with
        "{expert}" is one Linear per expert, stacked on the kernel's first axis (`expert_shapes`).
      aux_names: the auxiliary outputs its `__call__` returns beside its output, as (y, {name: value})
        (`jaxlm.models.aux`: a name ending in `_loss` is a term of the training loss, one ending in
        `_by_layer` is kept per layer; each a scalar unless `aux_shapes` says otherwise); () for none, and
        `__call__` returns y alone.
    and implements `default_dim` and `__call__`.
    """

    name: ClassVar[str]
    projections: ClassVar[dict[str, tuple[str, str]]]
    biases: ClassVar[dict[str, str]] = {}
    saved_hidden: ClassVar[int]
    autodiff_hidden: ClassVar[int]
    merged_hidden: ClassVar[int]
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    hf_names: ClassVar[dict[str, str]] = {}
    hf_layouts: ClassVar[dict[str, dict[str, str]]] = {}
    aux_names: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def default_dim(d_model: int) -> int:
        """The hidden width config.model.mlp_dim=0 stands for."""
        raise NotImplementedError

    @classmethod
    def aux_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """Each auxiliary output's shape as one layer returns it: scalars, unless a subclass says."""
        return {name: () for name in cls.aux_names}

    @classmethod
    def projection_shapes(cls, cfg) -> dict[str, tuple[int, int]]:
        """Each projection's (inputs, outputs), for the model config `cfg` (a `ModelConfig`)."""
        size = {EMBED: cfg.d_model, HIDDEN: cfg.mlp_dim}
        return {name: (size[i], size[o]) for name, (i, o) in cls.projections.items()}

    @classmethod
    def bias_shapes(cls, cfg) -> dict[str, int]:
        """Each bias's size (none without biases)."""
        size = {EMBED: cfg.d_model, HIDDEN: cfg.mlp_dim}
        return {name: size[axis] for name, axis in cls.biases.items()} if cfg.use_bias else {}

    @classmethod
    def weight_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """The shapes of the weights that are neither projections nor biases (one layer's, jaxlm's layout: an
        MoE's router [D, E]); {} for most."""
        return {}

    @classmethod
    def expert_shapes(cls, cfg) -> dict[str, tuple[int, int, int]]:
        """The kernels of the projections with an experts axis, [experts, inputs, outputs] (an MoE's experts,
        counted in `other_params`, not in `projection_shapes`); {} for most."""
        return {}

    @classmethod
    def hf_modules(cls, arch: str) -> dict[str, str]:
        """Each weight's module path under a layer of the Hugging Face architecture `arch`: its own table in
        `hf_layouts`, else `hf_names` under "mlp."."""
        if arch in cls.hf_layouts:
            return cls.hf_layouts[arch]
        return {name: f"mlp.{module}" for name, module in cls.hf_names.items()}

    @classmethod
    def hf_unsupported(cls, cfg) -> str:
        """What in this MLP's settings (`cfg`: a ModelConfig) none of its Hugging Face architectures holds, in
        one phrase naming the key; "" for nothing (the export's refusal: `models.hf.architecture_of`)."""
        return ""

    @classmethod
    def other_params(cls, cfg) -> int:
        """Weights that are neither projections nor biases (an MoE's experts and router); 0 for most."""
        return 0

    @classmethod
    def params(cls, cfg) -> int:
        """Every parameter of one layer's MLP."""
        return (sum(i * o for i, o in cls.projection_shapes(cfg).values()) + sum(cls.bias_shapes(cfg).values())
                + cls.other_params(cfg))

    @classmethod
    def unrouted_params(cls, cfg) -> int:
        """Weights of one layer's MLP a token does not go through (an MoE's other experts); 0 for most."""
        return 0

    @classmethod
    def matmul_params(cls, cfg) -> int:
        """Weights that take part in a matmul per token (an MoE: those of the experts a token is routed to)."""
        return sum(i * o for i, o in cls.projection_shapes(cfg).values())

    @classmethod
    def hidden_copies(cls, cfg, gather: int = 1) -> float:
        """[tokens, mlp_dim] hidden activations per token, in `saved_hidden`'s units: 1 (an MoE: the rows
        its experts compute per token; `gather`: the devices whose rows its dispatch gathers, with
        expert parallelism)."""
        return 1

    @classmethod
    def extra_saved(cls, cfg, act_bytes: int, gather: int = 1) -> tuple[float, float]:
        """(bytes per [tokens, d_model] element, bytes per token) kept for the backward pass beyond the
        hidden activations (an MoE's dispatch); (0, 0) for most."""
        return 0.0, 0.0

    @classmethod
    def gathered_params(cls, cfg) -> int:
        """Weights its backward pass holds whole on every device while the batch is split, their float32
        gradient before it is reduced (an MoE's experts, whole in its per-shard dispatch); 0 for most."""
        return 0

    @classmethod
    def hidden_dots(cls) -> int:
        """The matmuls whose outputs are [tokens, mlp_dim] (saved under remat's dots policies)."""
        return sum(o == HIDDEN for _, o in cls.projections.values())

    def build_projections(self, cfg, rngs: nnx.Rngs) -> None:
        """One `layers.Projection` per entry of `projections`, in its order. A projection back into the
        residual stream starts smaller (`cfg.residual_init_std`), so that the stream's variance does not
        grow with depth."""
        for name, (i, o) in self.projections.items():
            init = layers.normal(cfg.residual_init_std if o == EMBED else cfg.init_std)
            shape = (cfg.d_model, cfg.mlp_dim) if i == EMBED else (cfg.mlp_dim, cfg.d_model)
            setattr(self, name, cfg.projection(name, _EQUATIONS[i, o], shape, (i, o), init=init, dtype=cfg.dtype,
                                               param_dtype=cfg.param_dtype, rngs=rngs))

    def build_biases(self, cfg, rngs: nnx.Rngs) -> None:
        """The biases of `biases`, zeros, when the model has biases (a hidden one split like the hidden
        units; one of the residual stream's width named as the norms' weights are)."""
        for name, axis in self.biases.items() if cfg.use_bias else ():
            size, names = (cfg.mlp_dim, ("mlp",)) if axis == HIDDEN else (cfg.d_model, ("norm",))
            setattr(self, name, layers.make_param(rngs, layers.zeros, (size,), names, cfg.param_dtype))

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        raise NotImplementedError


def hidden(h: jax.Array) -> jax.Array:
    """The hidden activation [B, T, F] as every MLP marks it: named for remat's dots_mlp policy
    (`layers.MLP_HIDDEN`) and split over the hidden axis."""
    return constrain(checkpoint_name(h, layers.MLP_HIDDEN), ("act_batch", "act_seq", "act_mlp"))


def output(y: jax.Array) -> jax.Array:
    """The MLP's output [B, T, D], laid out as the residual stream."""
    return constrain(y, ("act_batch", "act_seq", "act_embed"))
