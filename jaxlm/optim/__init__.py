"""Optimizers and learning-rate schedules (optax).

The optimizer is `optim.name`'s entry of `OPTIMIZERS`, one module each: AdamW (`adamw`, decoupled weight
decay on matrices only), Muon (`muon`), Lion (`lion`), schedule-free AdamW (`schedule_free_adamw`) and
Adafactor (`adafactor`); global-norm clipping before it, and five schedules that all start with a linear
warmup from 0 to `peak_lr`. Gradient accumulation lives in the train step (a scan over micro-batches
inside the one compiled function), not here.

Every optimizer's update takes `finite=` (a traced bool): when false, its state stays as it was (the
train step's non-finite guard), selected inside each stateful transform so that XLA updates it in place
(`jaxlm.optim.base`). AdamW's state is optax's `adamw` (chained after clipping), as it always was, so
checkpoints are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
import optax

from jaxlm.optim import muon as muon_lib
from jaxlm.optim.adafactor import Adafactor
from jaxlm.optim.adamw import AdamW, scale_by_adam_unless
from jaxlm.optim.base import Matrix, Optimizer, scale_by_learning_rate_unless
from jaxlm.optim.lion import Lion
from jaxlm.optim.muon import Muon
from jaxlm.optim.schedule_free import ScheduleFreeAdamW
from jaxlm.section import Section, check, check_choice, setting

SCHEDULES = ("cosine", "wsd", "linear", "constant", "cyclic")
OPTIMIZERS: dict[str, type[Optimizer]] = {cls.name: cls for cls in (AdamW, Muon, Lion, ScheduleFreeAdamW, Adafactor)}

__all__ = ["OPTIMIZERS", "SCHEDULES", "Matrix", "OptimConfig", "Optimizer", "make_optimizer", "make_schedule",
           "scale_by_adam_unless", "scale_by_learning_rate_unless"]


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
    """How the parameters train: the optimizer (AdamW, Muon, Lion, schedule-free AdamW, Adafactor), the
    learning-rate schedule, clipping, gradient accumulation, the non-finite guard and float16 loss scaling
    (`config.optim`)."""

    section: ClassVar[str] = "optim"
    name: str = setting("adamw", " | ".join(OPTIMIZERS) + " (docs/training.md, \"Optimizers\")")
    peak_lr: float = setting(3e-4, "the learning rate after warmup")
    schedule: str = setting("cosine", " | ".join(SCHEDULES))
    warmup_steps: int = setting(100, "steps of linear warmup from 0 to peak_lr")
    min_lr_ratio: float = setting(0.1, "final (or floor) learning rate as a fraction of peak_lr")
    decay_fraction: float = setting(0.2, "wsd: the last fraction of steps that decays")
    cycle_steps: int = setting(1000, "cyclic: length of one cosine cycle after warmup")
    b1: float = setting(0.9, "Adam's first-moment decay (Lion: the update's interpolation; schedule-free: y's)")
    b2: float = setting(0.95, "Adam's second-moment decay (Lion: its momentum's decay, the paper's 0.99)")
    eps: float = setting(1e-8, "added to the second moment's square root (Muon: to the matrix's norm too)")
    weight_decay: float = setting(0.1, "applied to matrices only (not norms, biases), times the learning rate")
    muon_momentum: float = setting(0.95, "Muon: its momentum's decay")
    muon_nesterov: bool = setting(True, "Muon: Nesterov momentum")
    muon_ns_steps: int = setting(5, "Muon: Newton-Schulz iterations", limit=100)
    muon_ns_coeffs: str = setting("3.4445,-4.775,2.0315", "Muon: the quintic iteration's a,b,c (Keller Jordan's)")
    muon_lr_scale: str = setting(
        "rms", "Muon: each matrix's update times 0.2 sqrt(max(rows, cols)), AdamW's RMS (rms) | sqrt(max(1, "
               "cols/rows)) (shape) | 1 (none)")
    muon_adam_lr_ratio: float = setting(
        1.0, "Muon: the AdamW learning rate of the parameters it does not orthogonalize, as a fraction of the "
             "schedule's")
    muon_layout: str = setting(
        "distributed", "Muon under sharding: whole matrices spread over the devices, each iterating on its own "
                       "(distributed) | each matrix gathered on every device (gather) | split matmuls (sharded)")
    adafactor_decay_rate: float = setting(0.8, "Adafactor: its second moment's decay is 1 - (step + 1)^-this")
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
        check_choice(self.key("name"), self.name, tuple(OPTIMIZERS))
        check(self.peak_lr > 0, self.key("peak_lr"), self.peak_lr, "a positive number")
        check_choice(self.key("schedule"), self.schedule, SCHEDULES)
        check(self.name != ScheduleFreeAdamW.name or self.schedule == "constant", self.key("schedule"), self.schedule,
              f"'constant' with optim.name={self.name!r}: it averages its iterates in place of a decaying schedule "
              "(warmup_steps still applies)")
        check(self.name != ScheduleFreeAdamW.name or self.b1 > 0, self.key("b1"), self.b1,
              f"a number in (0, 1) with optim.name={self.name!r}: its evaluation parameters divide by it")
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
        check(0.0 <= self.muon_momentum < 1.0, self.key("muon_momentum"), self.muon_momentum, "a number in [0, 1)")
        check(self.muon_ns_steps >= 1, self.key("muon_ns_steps"), self.muon_ns_steps, "a positive integer (e.g. 5)")
        try:
            muon_lib.parse_coeffs(self.muon_ns_coeffs)
        except ValueError:
            check(False, self.key("muon_ns_coeffs"), self.muon_ns_coeffs,
                  "three comma-separated numbers a,b,c (Keller Jordan's: 3.4445,-4.775,2.0315)")
        check_choice(self.key("muon_lr_scale"), self.muon_lr_scale, muon_lib.LR_SCALES)
        check(self.muon_adam_lr_ratio > 0, self.key("muon_adam_lr_ratio"), self.muon_adam_lr_ratio, "a positive number")
        check_choice(self.key("muon_layout"), self.muon_layout, muon_lib.LAYOUTS)
        check(0.0 < self.adafactor_decay_rate <= 1.0, self.key("adafactor_decay_rate"), self.adafactor_decay_rate,
              "a number in (0, 1] (e.g. 0.8)")


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
                   matrices: Any = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """`optim.name`'s optimizer (+ clipping) over the trainable params pytree; `decay_mask` is a matching tree
    of bools, `matrices` one of `Matrix` or None (`train_state.ModelSpec.matrices`: what Muon orthogonalizes;
    None: every 2-D parameter). `extra`: the model's transforms' own steps, applied last
    (`steps.StepHook.optimizer_transforms`: a pruned model's `pruning_masks.keep_pruned`, whose update takes the
    masks the train step passes)."""

    schedule = make_schedule(o, total_steps)
    name = getattr(o, "name", AdamW.name)  # a config saved before optim.name: AdamW
    chain = optax.chain(*OPTIMIZERS[name].transforms(o, schedule, decay_mask, matrices), *extra)
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), chain), schedule
    return chain, schedule


def eval_params(o, opt_state, params):
    """The trainable parameters to evaluate: `params` as they are, or for an optimizer whose training
    parameters are not those (schedule-free AdamW), its own (`Optimizer.eval_params`)."""
    return OPTIMIZERS[getattr(o, "name", AdamW.name)].eval_params(opt_state, params)
