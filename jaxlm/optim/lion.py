"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolation
of the momentum and the gradient; optax's `lion` (`scale_by_lion`, decoupled weight decay, the learning
rate), its state taking `finite`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxlm.optim.base import Optimizer, increment_unless, keep, scale_by_learning_rate_unless


def scale_by_lion_unless(b1: float, b2: float) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_lion` (same state, same arithmetic: update sign((1 - b1) g + b1 m), then
    m <- b2 m + (1 - b2) g) whose count and momentum stay unchanged when `finite` is false."""

    def update_fn(updates, state, params=None, *, finite=True, **extra):
        del params, extra
        signs = jax.tree.map(lambda g, m: jnp.sign((1.0 - b1) * g + b1 * m), updates, state.mu)
        mu = keep(finite, optax.tree.update_moment(updates, state.mu, b2, 1), state.mu)
        return signs, optax.ScaleByLionState(count=increment_unless(finite, state.count), mu=mu)

    return optax.GradientTransformationExtraArgs(optax.scale_by_lion(b1, b2).init, update_fn)


class Lion(Optimizer):
    """Lion: `b1` interpolates the update's sign, `b2` decays the momentum (the paper's 0.9 and 0.99);
    every update is +-1 per entry, so its learning rate is 3-10x smaller than AdamW's and its weight
    decay as much larger, for the same decay per step (weight_decay x lr)."""

    name = "lion"
    state = "Lion's momentum (float32), step counts"

    @classmethod
    def transforms(cls, o, schedule, decay_mask, matrices):
        return [scale_by_lion_unless(o.b1, o.b2), optax.add_decayed_weights(o.weight_decay, decay_mask),
                scale_by_learning_rate_unless(schedule)]
