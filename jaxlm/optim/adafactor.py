"""Adafactor (Shazeer and Stern 2018): a second moment factored into its row and column means for each
matrix, no first moment; optax's `scale_by_factored_rms` (its state taking `finite`), the update clipped
to RMS 1 per parameter (`clip_by_block_rms`), weight decay and the learning rate as AdamW has them.

Unlike `optax.adafactor`, the learning rate is the schedule's as it is (not relative to each parameter's
scale) and the weight decay is decoupled and multiplied by it, as AdamW's: `peak_lr` and
`weight_decay` mean what they mean for AdamW. A stack of matrices (scanned layers, experts) factors its
two largest dimensions, optax's rule: each layer's matrix, in practice; a dimension under 128 is not
factored (its parameter keeps a full second moment, as norms and biases do).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlm.optim.base import Optimizer, increment_unless, keep, scale_by_learning_rate_unless

MIN_DIM_TO_FACTOR = 128  # optax's default
EPSILON = 1e-30  # added to the squared gradient, optax's default
CLIP_RMS = 1.0  # the update's RMS per parameter at most this (the paper's d = 1)


def factored_dims(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The two largest dimensions (second largest, largest) a second moment is factored over, or None:
    optax's `_factored_dims` with `min_dim_size_to_factor` = `MIN_DIM_TO_FACTOR`."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < MIN_DIM_TO_FACTOR:
        return None
    return int(order[-2]), int(order[-1])


def scale_by_factored_rms_unless(decay_rate: float) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_factored_rms` (same state, same arithmetic; its decay 1 - (t + 1)^-decay_rate at step t)
    whose count and second moments stay unchanged when `finite` is false."""
    base = optax.scale_by_factored_rms(decay_rate=decay_rate, min_dim_size_to_factor=MIN_DIM_TO_FACTOR,
                                       epsilon=EPSILON)

    def update_fn(grads, state, params=None, *, finite=True, **extra):
        del extra
        decay = 1.0 - jnp.asarray(state.count + 1, jnp.float32) ** (-decay_rate)
        treedef = jax.tree.structure(grads)

        def one(grad, v_row, v_col, v, param):
            grad_sqr = jnp.square(grad) + EPSILON
            dims = factored_dims(param.shape)
            if dims is None:
                v = keep(finite, (decay * v + (1.0 - decay) * grad_sqr).astype(param.dtype), v)
                return grad * v ** -0.5, v_row, v_col, v
            d1, d0 = dims
            v_row = keep(finite, (decay * v_row + (1.0 - decay) * jnp.mean(grad_sqr, axis=d0)).astype(param.dtype),
                         v_row)
            v_col = keep(finite, (decay * v_col + (1.0 - decay) * jnp.mean(grad_sqr, axis=d1)).astype(param.dtype),
                         v_col)
            reduced_d1 = d1 - 1 if d1 > d0 else d1
            row_factor = (v_row / jnp.mean(v_row, axis=reduced_d1, keepdims=True)) ** -0.5
            col_factor = v_col ** -0.5
            update = grad * jnp.expand_dims(row_factor, axis=d0) * jnp.expand_dims(col_factor, axis=d1)
            return update, v_row, v_col, v

        trees = (grads, state.v_row, state.v_col, state.v, params)
        out = [one(*leaves) for leaves in zip(*(treedef.flatten_up_to(t) for t in trees))]
        updates, v_row, v_col, v = (treedef.unflatten([o[i] for o in out]) for i in range(4))
        return updates, type(state)(count=increment_unless(finite, state.count), v_row=v_row, v_col=v_col, v=v)

    return optax.GradientTransformationExtraArgs(base.init, update_fn)


class Adafactor(Optimizer):
    """Adafactor (module docstring): `adafactor_decay_rate`, `weight_decay`, the schedule's learning rate."""

    name = "adafactor"
    state = "Adafactor's factored second moments (rows and columns of each matrix; whole for the rest), step counts"

    @classmethod
    def transforms(cls, o, schedule, decay_mask, matrices):
        return [scale_by_factored_rms_unless(o.adafactor_decay_rate), optax.clip_by_block_rms(CLIP_RMS),
                optax.add_decayed_weights(o.weight_decay, decay_mask), scale_by_learning_rate_unless(schedule)]
