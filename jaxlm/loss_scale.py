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


def enabled(mode: str, compute_dtype) -> bool:
    """Whether a run scales its loss: `optim.loss_scale` (`mode`) dynamic, or auto with float16 compute
    (`compute_dtype`: the model's, `model.dtype=auto` resolved)."""
    return mode == "dynamic" or (mode == "auto" and jnp.dtype(compute_dtype) == jnp.float16)
