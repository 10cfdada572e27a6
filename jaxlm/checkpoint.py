"""Orbax checkpoints of the train state.

For now: the final save at the end of a run (state + metadata), written with Orbax's
CheckpointManager so that periodic asynchronous saves and exact resume can build on the same
layout: `<run>/checkpoints/<step>/{state, meta}`.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp


def save_final(directory: pathlib.Path, state, cfg: ml_collections.ConfigDict, **meta: Any) -> pathlib.Path:
    """Save `state` at its step with the config and `meta`; returns the step's directory."""
    directory = pathlib.Path(directory).absolute()
    step = int(jax.device_get(state.step))
    with ocp.CheckpointManager(directory) as manager:
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(
                    {"step": step, "config": cfg.to_dict(), "saved_at": time.time(), "jax": jax.__version__, **meta}
                ),
            ),
        )
        manager.wait_until_finished()
    return directory / str(step)


def restore(directory: pathlib.Path, target, step: int | None = None):
    """Restore (state, meta) onto `target`, an abstract state whose leaves carry the shardings wanted."""
    with ocp.CheckpointManager(pathlib.Path(directory).absolute()) as manager:
        step = manager.latest_step() if step is None else step
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        )
    return restored["state"], restored["meta"]
