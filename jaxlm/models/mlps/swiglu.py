"""SwiGLU, the Llama family's MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxlm.models import layers
from jaxlm.models.mlps.base import EMBED, HIDDEN, MLP, hidden, output

# Remat policies under which the hidden activation is kept for the backward pass, not recomputed
# (transformer.REMAT_POLICIES; without remat autodiff keeps it for the down projection's gradient)
HIDDEN_KEPT = ("none", "dots_mlp")


class GatedMLP(MLP):
    """SwiGLU: down(silu(gate(x)) * up(x)).

    `joint_gate_up`: gate and up as one matmul (`layers.project_gate_up`), where the model joins projections
    (`ModelConfig.joint_projections`) and the remat policy keeps the hidden activation (`HIDDEN_KEPT`). Where
    the backward pass recomputes the hidden activation, XLA splits that recomputation and SwiGLU's gradient
    into two kernels that each read gate and up, and the joint matmul is slower there
    (benchmarks/BENCHMARKS.md).
    """

    name = "swiglu"
    projections = {"w_gate": (EMBED, HIDDEN), "w_up": (EMBED, HIDDEN), "w_down": (HIDDEN, EMBED)}
    saved_hidden = 3  # gate, up and their product (the down projection's input)
    autodiff_hidden = 6
    merged_hidden = 2  # silu's sigmoid and its output (memory.cpu_merged_bytes)
    hf_architectures = ("llama", "qwen2", "qwen3")
    hf_names = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}

    @staticmethod
    def default_dim(d_model: int) -> int:
        """8/3 d (the parameters of 4 d with two matrices), rounded up to a multiple of 256."""
        return 256 * math.ceil(8 * d_model / 3 / 256)

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.joint_gate_up = cfg.joint_projections and cfg.remat in HIDDEN_KEPT
        self.build_projections(cfg, rngs)

    @property
    def joined_projections(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The projections its forward runs as one matmul (`layers.joints`)."""
        if self.joint_gate_up and self.w_gate.fusable and self.w_up.fusable:
            return (("gate_up", ("w_gate", "w_up")),)
        return ()

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        x = layers.tensor_parallel_entry(x)
        key_gate, key_up, key_down = layers.split_keys(dropout_key, 3)  # the adapters' dropout (LoRA)
        if self.joint_gate_up:
            gate, up = layers.project_gate_up(x, self.w_gate, self.w_up, (key_gate, key_up))
        else:
            gate, up = self.w_gate(x, key_gate), self.w_up(x, key_up)
        h = hidden(layers.recomputed(lambda g, u: jax.nn.silu(g) * u)(gate, up))
        return output(self.w_down(h, key_down))
