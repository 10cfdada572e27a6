"""Dynamic loss scaling for float16 compute, inside the one compiled train step.

float16's smallest normal number is 6.1e-5 (subnormals reach 6e-8): gradients of activations smaller
than that flush to zero in the backward pass, silently. The standard remedy (Micikevicius et al. 2018,
PyTorch's GradScaler, jmp): differentiate the loss times a large scale, divide the float32 gradients by
it, and adapt the scale: when a gradient is not finite the step is skipped (the train step's existing
guard keeps parameters and Adam's moments untouched) and the scale halved; after `period` finite steps
in a row it is doubled. The scale lives in the train state, so it is checkpointed and resumed exactly.

An overflow is expected now and then and is not an error: the step's `overflow` metric is 1 and its
`skipped` metric stays 0, so `optim.on_nonfinite=stop` does not stop the run. Only a non-finite loss,
or a non-finite gradient with the scale already at its floor (`MIN_SCALE`), counts as skipped.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from jaxlm.errors import UserError

MIN_SCALE = 1.0  # the scale never goes below this: an overflow at 1 is a real non-finite gradient
FACTOR = 2.0  # halved on overflow, doubled after `period` finite steps


@flax.struct.dataclass
class LossScale:
    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the scale last changed

    @classmethod
    def create(cls, scale: float) -> LossScale:
        return cls(scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32))

    def update(self, finite: jax.Array, period: int) -> LossScale:
        """After a step: halved (not below MIN_SCALE) when `finite` is False, doubled after `period`
        finite steps in a row."""
        grown = self.good_steps + 1 >= period
        scale = jnp.where(finite, jnp.where(grown, self.scale * FACTOR, self.scale),
                          jnp.maximum(self.scale / FACTOR, MIN_SCALE))
        good = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return LossScale(scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32))


def enabled(cfg: ml_collections.ConfigDict, compute_dtype) -> bool:
    """Whether the run scales its loss: `optim.loss_scale` dynamic, or auto with float16 compute
    (`compute_dtype`: the model's, `model.dtype=auto` resolved)."""
    mode = cfg.optim.loss_scale
    return mode == "dynamic" or (mode == "auto" and jnp.dtype(compute_dtype) == jnp.float16)


def validate(cfg: ml_collections.ConfigDict) -> None:
    o = cfg.optim
    if o.loss_scale not in ("auto", "dynamic", "none"):
        raise UserError(f"config.optim.loss_scale={o.loss_scale!r} is not allowed: one of 'auto' (dynamic with "
                        f"float16 compute), 'dynamic', 'none'")
    if o.loss_scale == "dynamic" and cfg.model.dtype == "float32":
        raise UserError("config.optim.loss_scale='dynamic' with config.model.dtype='float32' is not allowed: float32 "
                        "gradients do not underflow; use loss_scale='auto' or a float16 model.dtype")
    if not o.loss_scale_init >= 1:
        raise UserError(f"config.optim.loss_scale_init={o.loss_scale_init!r} is not allowed: 1 or more (e.g. 32768)")
    if not o.loss_scale_period >= 1:
        raise UserError(f"config.optim.loss_scale_period={o.loss_scale_period!r} is not allowed: finite steps "
                        f"before the scale doubles, 1 or more (e.g. 2000)")
