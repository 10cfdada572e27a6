"""Squared ReLU: out(relu(in(x))^2), the MLP of Primer (So et al., 2021) and of the small-GPT speed
records (modded-nanogpt). No Hugging Face architecture has it, so an export refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.models.mlps.gelu import TwoMatrixMLP


class SquaredReluMLP(TwoMatrixMLP):
    name = "relu2"
    autodiff_hidden = 4  # the input, relu's output, its square, and relu's mask (a byte each, counted as one)
    merged_hidden = 1  # one of the activation's intermediates, as measured (memory.cpu_merged_bytes)

    @staticmethod
    def activation(h: jax.Array) -> jax.Array:
        return jnp.square(jax.nn.relu(h))
