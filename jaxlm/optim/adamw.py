"""AdamW: optax's `adamw` (decoupled weight decay on the decay mask's parameters), its state taking `finite`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxlm.optim.base import Optimizer, increment_unless, keep, scale_by_learning_rate_unless


def scale_by_adam_unless(b1: float, b2: float, eps: float) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_adam` (same state, same arithmetic) whose count and moments stay unchanged
    when the update's `finite` is false; the updates are then meaningless and must be dropped."""

    def update_fn(updates, state, params=None, *, finite=True, **extra):
        del params, extra
        mu = keep(finite, optax.tree.update_moment(updates, state.mu, b1, 1), state.mu)
        nu = keep(finite, optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2), state.nu)
        count = increment_unless(finite, state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(optax.scale_by_adam(b1, b2, eps).init, update_fn)


def adamw_transforms(b1: float, b2: float, eps: float, weight_decay: float, decay_mask,
                     schedule: optax.Schedule) -> list[optax.GradientTransformation]:
    """optax.adamw's transforms (and state), each stateful one taking `finite`."""
    return [scale_by_adam_unless(b1, b2, eps), optax.add_decayed_weights(weight_decay, decay_mask),
            scale_by_learning_rate_unless(schedule)]


class AdamW(Optimizer):
    """AdamW: `optim.b1`, `b2`, `eps`, and `weight_decay` on matrices only (not norms, biases)."""

    name = "adamw"
    state = "AdamW mu and nu (float32), step counts"

    @classmethod
    def transforms(cls, o, schedule, decay_mask, matrices):
        return adamw_transforms(o.b1, o.b2, o.eps, o.weight_decay, decay_mask, schedule)
