"""The auxiliary-output channel: values a block returns beside its output (a router's load-balancing
loss, a z-loss, the fraction of tokens an expert dropped), carried to the loss and the metrics through
every way the layers run: scanned, unrolled, rematerialized and pipelined.

An `Aux` is {name: float32 array}, one entry per name the model declares (`Transformer.aux_shapes`,
from its components: `MLP.aux_names`, `MLP.aux_shapes`), summed over the layers: a scalar per name.
A name ending in `_by_layer` is kept per layer instead, stacked in layer order: [n_layers, *its
shape] (an MoE's load of each expert in each layer). A name ending in `_loss` is a term of the
training loss, added as it is (a block scales its own term: its coefficient, a mean over the layers);
every name is also a metric of the train step, `aux/<name>` (a per-layer one as a scalar per element,
`metrics.scalars`). A value is a mean over the tokens its block saw: the pipeline's micro-batches
average it, the step's micro-batches average it weighted by their loss weights. Evaluation reports
the language-model loss alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Aux = dict[str, jax.Array]
Shapes = dict[str, tuple[int, ...]]  # each name's value's shape, the whole model's ([n_layers, ...] per layer)
LOSS_SUFFIX = "_loss"
BY_LAYER_SUFFIX = "_by_layer"


def by_layer(name: str) -> bool:
    """Whether the entry `name` is kept per layer (stacked) rather than summed over the layers."""
    return name.endswith(BY_LAYER_SUFFIX)


def over_layers(per_layer: Aux) -> Aux:
    """The layers' values stacked along a leading layer axis -> the model's: summed over it, or kept."""
    return {name: value if by_layer(name) else jnp.sum(value, axis=0) for name, value in per_layer.items()}


def as_float32(values: Aux) -> Aux:
    return {name: jnp.asarray(value, jnp.float32) for name, value in values.items()}


def zeros(shapes: Shapes, lead: tuple[int, ...] = ()) -> Aux:
    """Zeros of the model's `shapes` (`Transformer.aux_shapes`), each with `lead` dimensions first."""
    return {name: jnp.zeros((*lead, *shape), jnp.float32) for name, shape in shapes.items()}


def add(a: Aux, b: Aux) -> Aux:
    return {name: a[name] + b[name] for name in a}


def scale(values: Aux, by) -> Aux:
    return {name: value * by for name, value in values.items()}


def loss_terms(values: Aux) -> list[jax.Array]:
    """The entries that are terms of the training loss."""
    return [value for name, value in values.items() if name.endswith(LOSS_SUFFIX)]
