"""Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"): no decaying schedule; the
parameters the gradient is taken at, y, interpolate between z, the AdamW-without-momentum iterate, and
x, the running average of z, which is what to evaluate and keep. optax's `contrib.schedule_free` around
`scale_by_rms` (bias-corrected, eps outside the root), decoupled weight decay (the decay mask's) and the
learning rate, every state taking `finite`.

The train state's parameters are y; the optimizer's state holds z, so x = (y - (1 - b1) z) / b1
(`ScheduleFreeAdamW.eval_params`). Evaluation during training (`val_loss`, and so `checkpoint.keep_best`)
uses x. Checkpoints hold y and z; the commands that read parameters alone from a checkpoint (evaluate,
generate, the Hugging Face export, explore, compress, `run.init_from`) read x: `checkpoint.load_params`
restores y and z alone and computes it. Pruning masks are refused with it (`config.validate`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxlm.optim.base import Optimizer, increment_unless, keep, scale_by_learning_rate_unless

WEIGHT_LR_POWER = 2.0  # each iterate's weight in the average: lr_max^2 (optax's and the paper's default)


def scale_by_rms_unless(b2: float, eps: float) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True)`, its count and second moment
    unchanged when `finite` is false."""
    base = optax.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True)

    def update_fn(updates, state, params=None, *, finite=True, **extra):
        del params, extra
        nu = keep(finite, optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2), state.nu)
        count = increment_unless(finite, state.count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        updates = jax.tree.map(lambda n, g: g / (jnp.sqrt(n) + eps), nu_hat, updates)
        return updates, type(state)(count=count, nu=nu)

    return optax.GradientTransformationExtraArgs(base.init, update_fn)


def schedule_free_unless(base: optax.GradientTransformation, schedule: optax.Schedule,
                         b1: float) -> optax.GradientTransformationExtraArgs:
    """`optax.contrib.schedule_free(base, schedule, b1)` (same state, same arithmetic), every field of its state
    unchanged when `finite` is false (`base` takes `finite` too)."""
    base = optax.with_extra_args_support(base)
    reference = optax.contrib.schedule_free(base, schedule, b1, WEIGHT_LR_POWER)

    def update_fn(grads, state, params=None, *, finite=True, **extra):
        lr = jnp.asarray(schedule(state.step_count), state.max_lr.dtype)
        max_lr = jnp.where(finite, jnp.maximum(state.max_lr, lr), state.max_lr)
        weight = max_lr ** WEIGHT_LR_POWER
        total = state.weight_sum + weight
        ck = jnp.where(jnp.isnan(weight) | jnp.isnan(total), jnp.full(weight.shape, jnp.nan),
                       jnp.nan_to_num(weight / total, nan=0.0, posinf=jnp.inf))
        base_updates, base_state = base.update(grads, state.base_optimizer_state, params, finite=finite, **extra)
        z = keep(finite, jax.tree.map(lambda z, u: (z + u).astype(z.dtype), state.z, base_updates), state.z)
        prev_x = jax.tree.map(lambda y, z: (y - (1.0 - b1) * z) / b1, params, state.z)
        x = jax.tree.map(lambda x, z: (1.0 - ck) * x + ck * z, prev_x, z)
        updates = jax.tree.map(lambda x, z, y: b1 * x + (1.0 - b1) * z - y, x, z, params)
        return updates, optax.contrib.ScheduleFreeState(
            b1=state.b1, weight_sum=jnp.where(finite, total, state.weight_sum),
            step_count=increment_unless(finite, state.step_count), max_lr=max_lr, base_optimizer_state=base_state,
            z=z)

    return optax.GradientTransformationExtraArgs(reference.init, update_fn)


def find_state(opt_state) -> optax.contrib.ScheduleFreeState:
    """The `ScheduleFreeState` inside a chain's state."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.contrib.ScheduleFreeState))
             if isinstance(s, optax.contrib.ScheduleFreeState)]
    if len(found) != 1:
        raise ValueError(f"expected one schedule-free state in the optimizer's state, found {len(found)}")
    return found[0]


class ScheduleFreeAdamW(Optimizer):
    """Schedule-free AdamW (module docstring): `b1` interpolates y between x and z (the paper's 0.9), `b2` and
    `eps` are AdamW's, `weight_decay` on the decay mask's parameters; `optim.schedule` must be constant (its
    warmup still applies)."""

    name = "schedule_free_adamw"
    state = "schedule-free's z (a copy of the parameters) and AdamW's nu (float32), step counts"
    own_eval_params = True

    @classmethod
    def transforms(cls, o, schedule, decay_mask, matrices):
        base = optax.chain(scale_by_rms_unless(o.b2, o.eps), optax.add_decayed_weights(o.weight_decay, decay_mask),
                           scale_by_learning_rate_unless(schedule))
        return [schedule_free_unless(base, schedule, o.b1)]

    @classmethod
    def eval_params(cls, opt_state, params):
        return optax.contrib.schedule_free_eval_params(find_state(opt_state), params)
