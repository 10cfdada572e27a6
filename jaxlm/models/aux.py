"""The auxiliary-output channel: values a block returns beside its output (a router's load-balancing
loss, a z-loss, the fraction of tokens an expert dropped), carried to the loss and the metrics through
every way the layers run: scanned, unrolled, rematerialized and pipelined.

An `Aux` is {name: float32 scalar}, one entry per name the model declares (`Transformer.aux_names`,
from its components: `MLP.aux_names`), summed over the layers. A name ending in `_loss` is a term of
the training loss, added as it is (a block scales its own term: its coefficient, a mean over the
layers); every name is also a metric of the train step, `aux/<name>`. A value is a mean over the
tokens its block saw: the pipeline's micro-batches average it, the step's micro-batches average it
weighted by their loss weights. Evaluation reports the language-model loss alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp

Aux = dict[str, jax.Array]
LOSS_SUFFIX = "_loss"


def as_float32(values: Aux) -> Aux:
    return {name: jnp.asarray(value, jnp.float32) for name, value in values.items()}


def zeros(names: Iterable[str]) -> Aux:
    return {name: jnp.zeros((), jnp.float32) for name in names}


def add(a: Aux, b: Aux) -> Aux:
    return {name: a[name] + b[name] for name in a}


def scale(values: Aux, by) -> Aux:
    return {name: value * by for name, value in values.items()}


def loss_terms(values: Aux) -> list[jax.Array]:
    """The entries that are terms of the training loss."""
    return [value for name, value in values.items() if name.endswith(LOSS_SUFFIX)]
