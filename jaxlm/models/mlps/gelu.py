"""GPT-2's MLP: out(gelu(in(x))), with biases where the model has them."""

from __future__ import annotations

import jax
from flax import nnx

from jaxlm.models import layers
from jaxlm.models.mlps.base import EMBED, HIDDEN, MLP, hidden, output


class TwoMatrixMLP(MLP):
    """out(act(in(x) + b_in) + b_out): two projections around an elementwise activation, `activation`,
    with biases when the model has them (config.model.use_bias)."""

    projections = {"w_in": (EMBED, HIDDEN), "w_out": (HIDDEN, EMBED)}
    biases = {"b_in": HIDDEN, "b_out": EMBED}
    saved_hidden = 2  # the activation's input and output (the out projection's input)

    @staticmethod
    def default_dim(d_model: int) -> int:
        return 4 * d_model

    @staticmethod
    def activation(h: jax.Array) -> jax.Array:
        raise NotImplementedError

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.dtype, self.use_bias = cfg.dtype, cfg.use_bias
        self.build_projections(cfg, rngs)
        self.build_biases(cfg, rngs)

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        x = layers.tensor_parallel_entry(x)
        key_in, key_out = layers.split_keys(dropout_key, 2)  # the adapters' dropout (LoRA)
        h = self.w_in(x, key_in)
        if self.use_bias:
            h = h + self.b_in[...].astype(self.dtype)
        h = hidden(layers.recomputed(self.activation)(h))
        y = self.w_out(h, key_out)
        if self.use_bias:
            y = y + self.b_out[...].astype(self.dtype)
        return output(y)


class GeluMLP(TwoMatrixMLP):
    """GPT-2's MLP: GELU in its tanh approximation (transformers' gelu_new)."""

    name = "gelu"
    autodiff_hidden = 6
    merged_hidden = 1  # one of the activation's intermediates, as measured (memory.cpu_merged_bytes)
    hf_architectures = ("gpt2",)
    hf_names = {"w_in": "c_fc", "w_out": "c_proj", "b_in": "c_fc", "b_out": "c_proj"}

    @staticmethod
    def activation(h: jax.Array) -> jax.Array:
        return jax.nn.gelu(h, approximate=True)
