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

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from jaxlm.section import Section, check, check_choice, setting

SCHEDULES = ("cosine", "wsd", "linear", "constant", "cyclic")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
    """How the parameters train: AdamW, the learning-rate schedule, clipping, gradient accumulation, the
    non-finite guard and float16 loss scaling (`config.optim`)."""

    section: ClassVar[str] = "optim"
    peak_lr: float = setting(3e-4, "the learning rate after warmup")
    schedule: str = setting("cosine", " | ".join(SCHEDULES))
    warmup_steps: int = setting(100, "steps of linear warmup from 0 to peak_lr")
    min_lr_ratio: float = setting(0.1, "final (or floor) learning rate as a fraction of peak_lr")
    decay_fraction: float = setting(0.2, "wsd: the last fraction of steps that decays")
    cycle_steps: int = setting(1000, "cyclic: length of one cosine cycle after warmup")
    b1: float = setting(0.9, "Adam's first-moment decay")
    b2: float = setting(0.95, "Adam's second-moment decay")
    eps: float = setting(1e-8, "added to the second moment's square root")
    weight_decay: float = setting(0.1, "applied to matrices only (not norms, biases)")
    clip_norm: float = setting(1.0, "global-norm clipping; 0 = off")
    trainable: str = setting(
        "", 'which parameters train; the rest stay frozen (no gradient, no optimizer state). "" = all; else '
            "comma-separated regexes searched in paths (blocks/attn/wq/kernel) or type:<NNX variable type>")
    micro_batches: int = setting(
        1, "gradient accumulation: the global batch split into this many, scanned; 0 = as few as fit in memory")
    z_loss: float = setting(0.0, "weight of the log(Z)^2 auxiliary loss; 0 = off")
    on_nonfinite: str = setting(
        "stop", "a NaN/inf loss or gradient: never applied; 'skip' the step, or 'stop' with a checkpoint")
    loss_scale: str = setting(
        "auto", "dynamic loss scaling (jaxlm.loss_scale): auto = on with float16 compute | dynamic | none")
    loss_scale_init: float = setting(32768.0, "the first scale (2^15)")
    loss_scale_period: int = setting(
        2000, "finite steps in a row before the scale doubles (halved on every overflow)")

    def validate(self) -> None:
        check(self.peak_lr > 0, self.key("peak_lr"), self.peak_lr, "a positive number")
        check_choice(self.key("schedule"), self.schedule, SCHEDULES)
        check(self.warmup_steps >= 0, self.key("warmup_steps"), self.warmup_steps, "0 or more")
        check(0.0 <= self.min_lr_ratio <= 1.0, self.key("min_lr_ratio"), self.min_lr_ratio, "a number in [0, 1]")
        check(0.0 < self.decay_fraction <= 1.0, self.key("decay_fraction"), self.decay_fraction,
              "a number in (0, 1]")
        check(self.cycle_steps > 0, self.key("cycle_steps"), self.cycle_steps, "a positive integer")
        check(0.0 <= self.b1 < 1.0, self.key("b1"), self.b1, "a number in [0, 1)")
        check(0.0 <= self.b2 < 1.0, self.key("b2"), self.b2, "a number in [0, 1)")
        check(self.weight_decay >= 0, self.key("weight_decay"), self.weight_decay, "0 or more")
        check(self.clip_norm >= 0, self.key("clip_norm"), self.clip_norm, "0 (off) or more")
        check(self.z_loss >= 0, self.key("z_loss"), self.z_loss, "0 (off) or more")
        check(self.on_nonfinite in ("skip", "stop"), self.key("on_nonfinite"), self.on_nonfinite, "'skip' or 'stop'")
        check(self.micro_batches >= 0, self.key("micro_batches"), self.micro_batches,
              "a positive integer, or 0 for as few as fit in device memory")
        check(self.loss_scale in ("auto", "dynamic", "none"), self.key("loss_scale"), self.loss_scale,
              "one of 'auto' (dynamic with float16 compute), 'dynamic', 'none'")
        check(self.loss_scale_init >= 1, self.key("loss_scale_init"), self.loss_scale_init, "1 or more (e.g. 32768)")
        check(self.loss_scale_period >= 1, self.key("loss_scale_period"), self.loss_scale_period,
              "finite steps before the scale doubles, 1 or more (e.g. 2000)")


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
