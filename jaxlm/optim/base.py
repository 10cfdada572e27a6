"""What every optimizer of the registry (`jaxlm.optim.OPTIMIZERS`) is built from.

An optimizer is a subclass of `Optimizer` that chains optax transforms. Each stateful transform takes
the train step's `finite=` (a traced bool) and, when it is false, returns its state unchanged, selected
inside its update before the new state feeds anything else: selecting after optax's update instead
leaves XLA two consumers of each new moment and it copies them every step (8.8 GB per step for the 1b
recipe's AdamW on XLA:CPU); selected inside they are updated in place. Where optax's own transform
cannot take `finite`, its `_unless` twin here keeps optax's state (same structure, same arithmetic), so
its checkpoints are optax's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Matrix:
    """How a parameter is a matrix (or a stack of them) for an optimizer that treats it as one (Muon):
    its dimensions that index independent matrices (`batch`: a scanned stack's layers, an MoE's experts),
    the ones contracted with the projection's input (`rows`) and its outputs (`cols`), each group flattened
    into one axis of the matrix; `batch_names` are the batch dimensions' logical axis names. Not a pytree
    node: a leaf of `train_state.ModelSpec.matrices`, where None marks the parameters that are not matrices."""

    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    batch_names: tuple[str | None, ...] = ()

    def shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(rows, cols) of the matrix a parameter of `shape` is."""
        rows = cols = 1
        for i in self.rows:
            rows *= shape[i]
        for i in self.cols:
            cols *= shape[i]
        return rows, cols


def is_matrix_leaf(x: Any) -> bool:
    """A leaf of a `matrices` tree: a `Matrix`, or None (not a matrix)."""
    return x is None or isinstance(x, Matrix)


def plain_matrices(tree) -> Any:
    """A `matrices` tree for params alone (no model to ask): every 2-D leaf a [rows, cols] matrix."""
    return jax.tree.map(lambda p: Matrix((), (0,), (1,)) if p.ndim == 2 else None, tree)


class Optimizer:
    """An entry of `OPTIMIZERS`. A subclass sets `name` (its `optim.name`) and `state` (what its state holds,
    for the planner's row) and implements `transforms`; one whose training parameters are not the ones to
    evaluate (schedule-free) overrides `eval_params` and sets `own_eval_params`."""

    name: ClassVar[str]
    state: ClassVar[str]
    own_eval_params: ClassVar[bool] = False  # whether `eval_params` is its own (not the training parameters)

    @classmethod
    def transforms(cls, o, schedule: optax.Schedule, decay_mask: Any, matrices: Any) -> list[optax.GradientTransformation]:
        """Its chain, before the model's own transforms (`make_optimizer`'s `extra`): `o` the `optim` section,
        `decay_mask` and `matrices` trees like the trainable parameters (`train_state.ModelSpec`)."""
        raise NotImplementedError

    @classmethod
    def eval_params(cls, opt_state, params):
        """The trainable parameters to evaluate, from the training ones `params` and the optimizer's state."""
        del opt_state
        return params


def keep(finite, new, old):
    """`new` where `finite`, else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def increment_unless(finite, count):
    """The step count, incremented when `finite`."""
    return jnp.where(finite, optax.safe_increment(count), count)


def scale_by_learning_rate_unless(schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_learning_rate(schedule)` whose step count stays unchanged when `finite` is false."""

    def update_fn(updates, state, params=None, *, finite=True, **extra):
        del params, extra
        lr = schedule(state.count)
        updates = jax.tree.map(lambda u: jnp.asarray(-lr, u.dtype) * u, updates)
        return updates, optax.ScaleByScheduleState(count=increment_unless(finite, state.count))

    return optax.GradientTransformationExtraArgs(optax.scale_by_learning_rate(schedule).init, update_fn)
