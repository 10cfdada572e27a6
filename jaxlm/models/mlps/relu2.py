"""Squared ReLU: out(relu(in(x))^2), the MLP of Primer (So et al., 2021) and of the small-GPT speed
records (modded-nanogpt). No Hugging Face architecture has it, so an export refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.models.mlps.gelu import TwoMatrixMLP


class SquaredReluMLP(TwoMatrixMLP):
    name = "relu2"
    autodiff_hidden = 4  # the input, relu's output, its square, and relu's mask (a byte each, counted as one)
    # none: XLA:CPU keeps the input and the square (`saved_hidden`), nothing of relu's beside them, with
    # either contraction (read from the float32 step's buffer live ranges: memory.cpu_merged_bytes)
    merged_hidden = 0

    @staticmethod
    def activation(h: jax.Array) -> jax.Array:
        return jnp.square(jax.nn.relu(h))
