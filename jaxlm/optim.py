"""Optimizer and learning-rate schedules (optax).

AdamW with decoupled weight decay on matrices only, global-norm clipping, and five schedules that
all start with a linear warmup from 0 to `peak_lr`. Gradient accumulation lives in the train step
(a scan over micro-batches inside the one compiled function), not here.
"""

from __future__ import annotations

from typing import Any

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


def make_optimizer(o, total_steps: int, decay_mask: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (+ clipping) over the params pytree; `decay_mask` is a matching tree of bools."""
    schedule = make_schedule(o, total_steps)
    adamw = optax.adamw(
        learning_rate=schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask
    )
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw), schedule
    return adamw, schedule
