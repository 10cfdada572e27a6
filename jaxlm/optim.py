"""Optimizer and learning-rate schedules (optax).

AdamW with decoupled weight decay on matrices only, global-norm clipping, and five schedules that
all start with a linear warmup from 0 to `peak_lr`. Gradient accumulation lives in the train step
(a scan over micro-batches inside the one compiled function), not here.

The optimizer's update takes `finite=` (a traced bool): when false, its state stays as it was (the
train step's non-finite guard), selected inside each stateful transform before the new moments feed
the update. Selecting after optax's update instead leaves XLA two consumers of each new moment and
it copies both moments every step (8.8 GB per step for the 1b recipe on XLA:CPU); selected here
they are updated in place. The state's structure is optax's `adamw` (chained after clipping), so
checkpoints are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax


def make_schedule(o, total_steps: int) -> optax.Schedule:
    """The learning rate at each step, from `config.optim` and the run's number of steps."""
    peak, floor = o.peak_lr, o.peak_lr * o.min_lr_ratio
    warmup = min(o.warmup_steps, total_steps)
    after = max(total_steps - warmup, 1)  # steps after warmup

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum(step + 1, max(warmup, 1)) / max(warmup, 1)  # first step already > 0
        t = jnp.clip((step - warmup) / after, 0.0, 1.0)  # progress after warmup, 0..1
        if o.schedule == "cosine":
            main = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * t))
        elif o.schedule == "linear":
            main = peak + (floor - peak) * t
        elif o.schedule == "constant":
            main = jnp.full_like(t, peak)
        elif o.schedule == "wsd":
            # warmup, stable at peak, then linear decay over the last decay_fraction of the steps.
            decay_start = 1.0 - o.decay_fraction
            d = jnp.clip((t - decay_start) / o.decay_fraction, 0.0, 1.0)
            main = peak + (floor - peak) * d
        elif o.schedule == "cyclic":
            # cosine from peak to floor every cycle_steps, restarting at peak (SGDR without growth).
            phase = jnp.mod(step - warmup, o.cycle_steps) / o.cycle_steps
            main = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * phase))
        else:
            raise ValueError(f"unknown schedule {o.schedule!r}")
        return jnp.where(step < warmup, warm, main)

    return schedule


def make_optimizer(o, total_steps: int, decay_mask: Any, *, extra: Sequence[optax.GradientTransformation] = (),
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (+ clipping) over the params pytree; `decay_mask` is a matching tree of bools. `extra`: the
    model's transforms' own steps, applied last (`steps.StepHook.optimizer_transforms`: a pruned model's
    `pruning_masks.keep_pruned`, whose update takes the masks the train step passes)."""

    schedule = make_schedule(o, total_steps)
    adamw = optax.chain(  # optax.adamw's transforms and state, each stateful one taking `finite`
        scale_by_adam_unless(o.b1, o.b2, o.eps),
        optax.add_decayed_weights(o.weight_decay, decay_mask),
        scale_by_learning_rate_unless(schedule),
        *extra,
    )
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw), schedule
    return adamw, schedule


def _keep(finite, new, old):
    """`new` where `finite`, else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def scale_by_adam_unless(b1: float, b2: float, eps: float) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_adam` (same state, same arithmetic) whose count and moments stay unchanged
    when the update's `finite` is false; the updates are then meaningless and must be dropped."""

    def update_fn(updates, state, params=None, *, finite=True, **extra):
        del params, extra
        mu = _keep(finite, optax.tree.update_moment(updates, state.mu, b1, 1), state.mu)
        nu = _keep(finite, optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2), state.nu)
        count = jnp.where(finite, optax.safe_increment(state.count), state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(optax.scale_by_adam(b1, b2, eps).init, update_fn)


def scale_by_learning_rate_unless(schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_learning_rate(schedule)` whose step count stays unchanged when `finite` is false."""

    def update_fn(updates, state, params=None, *, finite=True, **extra):
        del params, extra
        lr = schedule(state.count)
        updates = jax.tree.map(lambda u: jnp.asarray(-lr, u.dtype) * u, updates)
        count = jnp.where(finite, optax.safe_increment(state.count), state.count)
        return updates, optax.ScaleByScheduleState(count=count)

    return optax.GradientTransformationExtraArgs(optax.scale_by_learning_rate(schedule).init, update_fn)
