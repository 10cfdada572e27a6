"""Orbax checkpoints: periodic asynchronous saves, exact resume, restoring onto any mesh.

Layout: `<directory>/<step>/{state, meta, data}`: the train state (Orbax's PyTree format, each
process writing its own shards, zstd-compressed only with `compress=True`), JSON metadata (config,
tokenizer, progress, versions) and the grain iterator's position (one small JSON file per process).

A checkpoint counts only once complete. Orbax writes a step into `<step>.orbax-checkpoint-tmp`
and renames it to `<step>` when every item is committed (on object stores, which cannot rename,
it writes `commit_success.txt` last instead); `all_steps` lists only what Orbax itself accepts as
finalized, so a save killed half-way is never picked.

A complete checkpoint can still be damaged later (a truncated or overwritten file, a disk error).
Once a save has committed, process 0 records every file's size and CRC-32 in
`<step>/jaxlm_manifest.json` (in the background, while training goes on), and every reader
(train, evaluate, generate, explore) checks them before restoring: a damaged checkpoint is
reported in one warning line and the one before it is used; nothing is deleted, so the damaged
files are there to inspect. A checkpoint without a manifest (written by an older jaxlm, or by a run
killed in the moment between commit and manifest) is checked by restoring it.

Retention (`keep_last`, `keep_every`, `keep_best`) drops a checkpoint by renaming it into
`<directory>/jaxlm-deleting/` (Orbax's `todelete_subdir`), at once, as part of the save that made it
surplus; process 0 then deletes its files beside training (in the thread that writes the manifest)
and removes the folder at `wait`/`close`. Orbax deletes them inside its commit otherwise, which the
next save waits for: quick on a local disk, but far longer on network filesystems; the rename takes
milliseconds (benchmarks/BENCHMARKS.md, "Checkpoints").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import importlib.metadata
import json
import logging
import mmap
import os
import re
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from jaxlm import lazy
from jaxlm.errors import EnvironmentFailure, UserError
from jaxlm.models import layout
from jaxlm.section import Section, check, check_choice, setting

log = logging.getLogger(__name__)

# Imported by the first save or restore (`jaxlm.lazy`)
grain = lazy.module("grain")
ocp = lazy.module("orbax.checkpoint")
streams = lazy.module("jaxlm.data.streams")

TRASH = "jaxlm-deleting"  # where retention moves checkpoints; their files are deleted in the background

_VERSIONS = {"jax": "jax", "flax": "flax", "orbax": "orbax-checkpoint", "grain": "grain", "jaxlm": "jaxlm"}


def versions() -> dict[str, str]:
    """Versions of the libraries that wrote a checkpoint, to explain a later failure to read it."""
    out = {}
    for name, dist in _VERSIONS.items():
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
            out[name] = "not installed"
    return out


SNAPSHOTS = ("auto", "device", "host", "off")
OCDBT = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """When a run saves, what it keeps and how it writes: `config.checkpoint` (`Checkpointer.from_config`)."""

    section: ClassVar[str] = "checkpoint"
    every_steps: int = setting(1000, "save every N steps (0 = off) ...")
    every_minutes: float = setting(
        30.0, "... and/or every M minutes (0 = off); always at the end and on SIGTERM/SIGINT")
    keep_last: int = setting(3, "the newest checkpoints kept")
    keep_every: int = setting(0, "also keep every step that is a multiple of this, permanently (0 = off)")
    keep_best: int = setting(
        0, "also keep the N checkpoints with the lowest validation loss; each evaluation then saves (0 = off)")
    async_save: bool = setting(True, "write in the background; the loop waits only for the device-to-host copy")
    compress: bool = setting(
        False, "zstd-compress the arrays: a little less disk for several times the background writer's CPU "
               "time (benchmarks/BENCHMARKS.md)")
    snapshot: str = setting(
        "auto", 'auto | device | host | off: "device" copies the state on the devices and leaves the copy to the '
        'host to a thread, so a save does not stall the next step; "auto" does where the devices have room for '
        'the copy (GPUs, one process); "off" copies it to the host before the loop goes on (CPUs); "host" is '
        '"device" that also starts the copy to pinned host memory at once (not yet measured on a GPU)')
    ocdbt: str = setting(
        "auto", 'auto | on | off: Orbax\'s OCDBT layout (a few large files per process) or one array per leaf, '
        'written in parallel (faster commits on a local disk); "auto": off for a local folder and one process')

    def validate(self) -> None:
        check(self.every_steps >= 0, self.key("every_steps"), self.every_steps, "0 (off) or more")
        check(self.every_minutes >= 0, self.key("every_minutes"), self.every_minutes, "0 (off) or more")
        check(self.keep_last >= 1, self.key("keep_last"), self.keep_last, "1 or more")
        check(self.keep_every >= 0, self.key("keep_every"), self.keep_every, "0 (off) or more")
        check(self.keep_best >= 0, self.key("keep_best"), self.keep_best, "0 (off) or more")
        check_choice(self.key("snapshot"), self.snapshot, SNAPSHOTS)
        check_choice(self.key("ocdbt"), self.ocdbt, OCDBT)


class Checkpointer:
    """Orbax CheckpointManager wrapper: <dir>/<step>/{state, meta, data}.

    Saves are asynchronous: `save` returns once the arrays are copied off the devices (the train
    step may then donate them) and the files are written in the background. With a `snapshot` on
    the devices (`snapshot="device"`, or `"auto"` where the devices have room), `save` does not even
    wait for that copy: it dispatches a copy of the state on the devices, which the next step does
    not donate, and returns; a thread copies the snapshot to the host and hands it to Orbax, while
    the next steps run. Retention keeps the
    newest `keep_last` checkpoints, plus, permanently, every step that is a multiple of `keep_every`,
    plus the `keep_best` saved with the lowest `val_loss`; older ones are deleted only after a newer
    save has committed.

    `compress` writes the arrays zstd-compressed (Orbax's default): float32 weights and Adam moments,
    whose mantissas are close to random, shrink little, for several times the CPU time of the
    background write, CPU the host needs for the input pipeline (and, on CPU, for the train step
    itself); so off by default (benchmarks/BENCHMARKS.md). Both kinds restore either way.

    `ocdbt`: how the arrays lie in `<step>/state`. "on": Orbax's OCDBT layout, a few large files per
    process (and fewer objects on an object store, merged across processes); "off": one tensorstore
    array per leaf, written in parallel, which commits faster on a local disk: OCDBT's writer, not
    the disk, set the pace (benchmarks/BENCHMARKS.md). "auto" is "off" for a local folder in a
    single-process run and "on" otherwise. Either layout restores whatever the setting.

    `snapshot`: "off" copies the state to the host in `save` (the loop waits for the step to
    finish and for the copy); "device" first copies it on the devices (at their memory bandwidth,
    far faster than the copy to the host) and leaves the rest to a thread, for one more state's
    worth of device memory while the host copy lasts; "auto" is "device" where every device has
    room for that copy beside the peak it has used so far (read from its allocator at each save
    until one fits, so only after a step has run), else "off".
    "host" is "device" whose copy `save` also sends on, at once, to pinned host memory (the same
    shardings, memory kind `pinned_host`): the device-to-host copy then runs as soon as the devices
    reach it, beside the next steps, instead of after the previous save's commit, which Orbax makes
    each save's copy wait for (with frequent saves of a small model on a GPU, the copy and the commit
    together outlasted the interval: benchmarks/BENCHMARKS.md). Not yet measured on a GPU, so not
    what "auto" picks.
    One process only: with several, Orbax synchronises the processes with collectives on the
    devices, which a thread would issue out of order with the train step's, so they save as "off".
    """

    def __init__(
        self,
        directory,
        *,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        keep_last: int = 3,
        keep_every: int = 0,
        keep_best: int = 0,
        async_save: bool = True,
        compress: bool = False,
        snapshot: str = "auto",
        ocdbt: str = "auto",
        clock: Callable[[], float] = time.monotonic,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if snapshot not in SNAPSHOTS:
            raise ValueError(f"snapshot must be one of {', '.join(SNAPSHOTS)}, got {snapshot!r}")
        if ocdbt not in OCDBT:
            raise ValueError(f"ocdbt must be one of {', '.join(OCDBT)}, got {ocdbt!r}")
        # Only an asynchronous save can overlap the next steps, and only one process's (see above).
        self._snapshot = snapshot if async_save and jax.process_count() == 1 else "off"
        if snapshot in ("device", "host") and self._snapshot == "off":
            log.warning("checkpoint.snapshot=%s needs asynchronous saves in a single process (this run: %s); "
                        "saving with snapshot=off", snapshot, "async_save=False" if not async_save
                        else f"{jax.process_count()} processes")
        if self._snapshot == "host" and not _has_pinned_host():
            log.warning("checkpoint.snapshot=host: these devices have no pinned host memory; saving with "
                        "snapshot=device")
            self._snapshot = "device"
        self._saver: threading.Thread | None = None  # the thread of a save from a device snapshot
        self._saver_error: BaseException | None = None
        self._failure_reported = False  # a failed save was raised once: `close` does not raise it again
        self.directory = epath.Path(directory).absolute()
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self._clock = clock
        self._last_save = clock()
        keep = [ocp.checkpoint_managers.LatestN(keep_last)]
        if keep_every:
            keep.append(ocp.checkpoint_managers.EveryNSteps(keep_every))
        if keep_best:  # descending order, and BestN keeps the last n: the lowest losses
            keep.append(ocp.checkpoint_managers.BestN(
                get_metric_fn=lambda metrics: metrics["val_loss"], reverse=True, n=keep_best,
                keep_checkpoints_without_metrics=False,
            ))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(keep),
            # With best_fn set, Orbax writes each save's metrics and reads them back after a restart.
            best_fn=(lambda metrics: metrics["val_loss"]) if keep_best else None,
            best_mode="min",
            todelete_subdir=TRASH,  # a rename in Orbax's commit; the files are deleted in `_tidy`
        )
        if keep_best:
            logging.getLogger("absl").addFilter(_quiet_unranked_saves)
        self.ocdbt = ocdbt == "on" or (ocdbt == "auto" and ("://" in os.fspath(self.directory)
                                                             or jax.process_count() > 1))
        if not self.ocdbt:
            logging.getLogger("absl").addFilter(_quiet_unmerged_saves)
        state_handler = ocp.PyTreeCheckpointHandler(use_compression=compress, use_ocdbt=self.ocdbt)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()  # the other items: Orbax's defaults
        registry.add("state", ocp.args.PyTreeSave, state_handler)
        registry.add("state", ocp.args.PyTreeRestore, state_handler)
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self._unrecorded: int | None = None  # a saved step whose manifest is not written yet
        self._recorder: threading.Thread | None = None
        # Only a Checkpointer that saves deletes what retention dropped: a reader (evaluate, generate)
        # may look at the folder of a run that is saving, whose Orbax renames into the trash meanwhile.
        self._saving = False
        _quiet_background_failures()

    def should_save(self, step: int) -> bool:
        """Whether `step` is due: a multiple of `every_steps`, or `every_minutes` since the last save.

        With several processes the clock of process 0 decides, so that all of them save together
        (a broadcast, which waits for the devices; the training loop agrees through
        `distributed.StepAgreement` on `time_due` instead).
        """
        due = self.step_due(step)
        if self.every_minutes and not due:
            due = self._clock() - self._last_save >= 60 * self.every_minutes
            if jax.process_count() > 1:
                due = bool(multihost_utils.broadcast_one_to_all(due))
        return due

    def step_due(self, step: int) -> bool:
        """Whether `step` is a multiple of `every_steps` (the same on every process)."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def time_due(self) -> bool:
        """Whether `every_minutes` have passed since the last save, by this process's clock; only
        process 0's clock counts, the others always say no."""
        return (bool(self.every_minutes) and jax.process_index() == 0
                and self._clock() - self._last_save >= 60 * self.every_minutes)

    def save(self, step: int, state, *, meta: dict, data_iter=None, force: bool = False,
             val_loss: float | None = None) -> bool:
        """Start saving `state` (and `data_iter`'s position) as `step` when due or forced.

        Returns whether a save started. A step already on disk is never overwritten. `meta` must be
        JSON-serializable; the step, the save time and library versions are added to it. `val_loss`
        ranks the checkpoint for `keep_best`.
        """
        if not (force or self.should_save(step)):
            return False
        self._join_saver()
        if step in self._manager.all_steps():
            log.warning("checkpoint %s already exists; not overwriting it", self.directory / str(step))
            return False
        stored = _stored(state)
        overlap = self._overlaps(stored)
        snapshots = []  # the device copy (and its pinned host copy), freed once the save has them on the host
        if overlap:
            stored = _device_copy(stored)  # dispatched; the next step may donate `state` meanwhile
            snapshots.append(stored)
            if self._snapshot == "host":
                stored = _to_pinned_host(stored)  # dispatched too: the copy to the host starts when the devices get there
                snapshots.append(stored)
            if data_iter is not None:
                data_iter = _position(data_iter)  # read now, not when the thread gets to it
        items = {
            "state": ocp.args.PyTreeSave(stored),
            "meta": ocp.args.JsonSave({**meta, "step": step, "saved_at": time.time(), "versions": versions(),
                                       "param_layout": layout.LAYOUT}),
        }
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)  # its state is read before save returns
        metrics = {"val_loss": float(val_loss)} if val_loss is not None else None
        self._last_save = self._clock()
        self._saving = True
        if not overlap:
            return self._save(step, items, metrics)
        self._saver = threading.Thread(target=self._save, args=(step, items, metrics, snapshots),
                                       name=f"jaxlm-save-{step}", daemon=True)
        self._saver.start()
        return True

    def _save(self, step: int, items: dict, metrics: dict | None, snapshots: list | None = None) -> bool:
        """Orbax's save of `items` as `step`: returns once the arrays are on the host. In a thread
        (from a device snapshot: `snapshots`), what it raises is kept for `_join_saver` to raise, and
        the snapshots' buffers are freed once on the host (as donating them would)."""
        in_thread = snapshots is not None
        try:
            with self._failed_save(current=step):  # Orbax's save first waits for the previous one, raising what it raised
                started = self._manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)
            # Orbax's save returns only once the previous save has committed: record that one's manifest.
            self._record_manifest(background=True)
        except BaseException as e:
            if not in_thread:
                raise
            self._saver_error = e
            return False
        finally:
            if in_thread:
                for x in jax.tree.leaves(snapshots):
                    x.delete()
        if started:
            self._unrecorded = step
        return started

    def _join_saver(self) -> None:
        """Wait for the thread of a save from a device snapshot (the host copy, a fraction of a
        second after the step), raising what the save raised there."""
        if self._saver is not None:
            self._saver.join()
            self._saver = None
        if self._saver_error is not None:
            e, self._saver_error = self._saver_error, None
            raise e

    def _overlaps(self, stored) -> bool:
        """Whether this save starts from a snapshot on the devices (see `snapshot`)."""
        if self._snapshot == "auto":
            if not all(d.memory_stats() for d in jax.local_devices()):
                self._snapshot = "off"  # no allocator statistics (CPUs): nothing to check room against, ever
                return False
            need = _bytes_per_device(stored)
            if _device_room(need):
                # From now on: the peak the next check would read holds this copy too.
                self._snapshot = "device"
            else:
                return False
        return self.from_snapshot

    @property
    def from_snapshot(self) -> bool:
        """Whether saves start from a copy on the devices ("device" or "host"; what "auto" has decided)."""
        return self._snapshot in ("device", "host")

    def wait(self) -> None:
        """Block until the pending save is committed on disk (and old checkpoints are pruned), and
        its manifest written."""
        self._join_saver()
        with self._failed_save():
            self._manager.wait_until_finished()  # raises what the background write raised
        self._record_manifest(background=False)

    @contextlib.contextmanager
    def _failed_save(self, *, closing: bool = False, current: int | None = None):
        """A save that failed in the background (a disk full, a path no longer writable): one line
        naming it and the newest complete checkpoint, which it left the newest. Orbax raises the
        failure again at every later call; `closing`, once it has been reported, it is not. `current`:
        the step being saved, the one that failed when no earlier save is pending."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 -- tensorstore reports OS errors as ValueError
            if closing and self._failure_reported:
                return
            self._failure_reported = True
            step, self._unrecorded = (self._unrecorded if self._unrecorded is not None else current), None
            newest = complete_steps(self.directory)
            raise EnvironmentFailure(
                f"saving checkpoint {self.directory / str(step if step is not None else '?')} failed "
                f"({_os_reason(e)}); the newest complete checkpoint is "
                f"{self.directory / str(newest[-1]) if newest else 'none'}; free space or fix the path, then run "
                f"the same command to resume"
            ) from None

    def record_manifest(self, step: int) -> None:
        """Write checkpoint `step`'s manifest now (one saved without, once restoring it succeeded)."""
        if jax.process_index() == 0 and not (self.directory / str(step) / MANIFEST).exists():
            write_manifest(self.directory / str(step))

    def reload(self) -> None:
        """Read the list of checkpoints on disk again (after `set_aside` on process 0)."""
        self._join_saver()
        self._manager.reload()

    def _record_manifest(self, *, background: bool) -> None:
        """Write the manifest of the last committed save, then delete the files of the checkpoints
        retention has dropped (process 0; the files are on a filesystem every process shares). Not
        `background` (at `wait`/`close`: no save in flight), the emptied folder goes too."""
        if self._recorder is not None:
            self._recorder.join()
            self._recorder = None
        step, self._unrecorded = self._unrecorded, None
        if jax.process_index() != 0 or not self._saving:
            return
        if background:
            self._recorder = threading.Thread(target=self._tidy, args=(step, False),
                                              name=f"jaxlm-tidy-{step}", daemon=True)
            self._recorder.start()
        else:
            self._tidy(step, True)

    def _tidy(self, step: int | None, final: bool) -> None:
        if step is not None:
            write_manifest(self.directory / str(step))
        empty_trash(self.directory, remove=final)

    def set_aside(self, steps: list[int], destination) -> list[epath.Path]:
        """Move the checkpoints of `steps` into `destination` (renamed, never deleted), so that the
        run can save those steps again; returns their new paths. Process 0 only; the others `reload`."""
        self._join_saver()
        destination = epath.Path(destination)
        moved = []
        for s in steps:
            target = destination / str(s)
            n = 1
            while target.exists():
                target, n = destination / f"{s}.{n}", n + 1
            destination.mkdir(parents=True, exist_ok=True)
            (self.directory / str(s)).rename(target)
            moved.append(target)
        self._manager.reload()
        return moved

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending (never one still being written)."""
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, target, *, step: int | None = None, data_iter=None, verify: bool = True) -> tuple[Any, dict, int]:
        """(state, meta, step) from checkpoint `step`, or from the newest one that loads (and, with
        `verify`, matches its manifest).

        `target` is an abstract state (ShapeDtypeStructs with shardings): each process reads only
        the shards its devices hold, in the target's layout, whatever mesh saved them. `data_iter`,
        if given, is set in place to the saved position when the checkpoint has one. A checkpoint
        whose parameters are in an older layout (`jaxlm.models.layout`) is read in it and renamed.
        """
        self._join_saver()

        def load(s: int):
            saved_layout = self.param_layout(s)
            items = {"state": _pytree_restore(_stored(layout.to_layout(target, saved_layout))),
                     "meta": ocp.args.JsonRestore()}
            data_dir = self.directory / str(s) / "data"
            merged = data_iter is not None and hasattr(data_iter, "set_states")
            if data_iter is not None and not merged and data_dir.exists():
                items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
            restored = self._manager.restore(s, args=ocp.args.Composite(**items))
            if merged and data_dir.exists():
                _restore_merged(data_dir, data_iter)
            return layout.from_layout(_unstored(restored["state"], target), saved_layout), restored["meta"]

        (state, meta), step = newest_loadable(self.directory, self.all_steps(), step, load, verify=verify)
        return state, meta, step

    def read_meta(self, step: int | None = None) -> dict:
        """Only the JSON metadata of checkpoint `step` (default: the newest complete one)."""
        self._join_saver()
        step = self.latest_step() if step is None else step
        if step is None:
            raise UserError(f"no complete checkpoint in {self.directory}")
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def param_layout(self, step: int) -> int:
        """The parameter layout checkpoint `step` was saved in; refused in one line when unknown."""
        saved = self.read_meta(step).get("param_layout", 1)
        layout.check(saved, f"checkpoint {self.directory / str(step)}")
        return saved

    def close(self) -> None:
        """Finish the pending save (and its manifest) and release Orbax's threads."""
        try:
            try:
                self._join_saver()
            finally:
                with self._failed_save(closing=True):
                    self._manager.close()
        finally:
            self._record_manifest(background=False)

    @classmethod
    def from_config(cls, directory, section: CheckpointConfig, **kwargs) -> Checkpointer:
        """A checkpointer for `directory` as the run's `config.checkpoint` section says."""
        return cls(directory, **{key: getattr(section, key) for key in CheckpointConfig.defaults()}, **kwargs)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()




@jax.jit
def _device_copy(tree):
    """A copy of `tree`'s arrays in new buffers on the same devices, in the same shardings."""
    return jax.tree.map(lambda x: x.copy(), tree)


def _to_pinned_host(tree):
    """`tree`'s arrays sent to pinned host memory in their shardings (`device_put`, asynchronous)."""
    return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), tree))


def _has_pinned_host() -> bool:
    return all(any(m.kind == "pinned_host" for m in d.addressable_memories()) for d in jax.local_devices())


def _bytes_per_device(tree) -> dict:
    """{device: bytes of `tree`'s shards it holds}, for this process's devices."""
    need: dict = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
    return need


def _device_room(need: dict, headroom: float = 0.95) -> bool:
    """Whether each device's allocator has `need[device]` bytes beside the peak it has held so far,
    within `headroom` of its limit; False where a device reports no memory statistics (CPUs)."""
    for device, nbytes in need.items():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return False
        if stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)) + nbytes > headroom * stats["bytes_limit"]:
            return False
    return True


def _position(iterator):
    """`iterator`'s position read now, for a save that writes it later (from a thread), in the form
    grain's checkpoint handler takes: a dataset iterator's dict, a data loader's bytes."""
    state = copy.deepcopy(iterator.get_state())
    if isinstance(iterator, grain.DatasetIterator):
        return streams.SavedPosition(state)
    return _LoaderPosition(state)


class _LoaderPosition:
    def __init__(self, state: bytes):
        self._state = state

    def get_state(self) -> bytes:
        return self._state


def _restore_merged(data_dir: epath.Path, data_iter) -> None:
    """Give `data_iter` the positions every process of the saving run wrote (grain's
    `process_<i>-of-<n>.json`), so a run resumes its data on another process count too."""
    files = {}
    for path in data_dir.glob("process_*-of-*.json"):
        index, count = path.name[len("process_"):-len(".json")].split("-of-")
        files[int(index)] = (int(count), path)
    counts = {count for count, _ in files.values()}
    if len(counts) != 1 or sorted(files) != list(range(next(iter(counts)))):
        raise ValueError(f"incomplete data positions in {data_dir}: {sorted(p.name for _, p in files.values())}")
    states = [json.loads(files[i][1].read_text()) for i in range(len(files))]
    own = states[jax.process_index()] if len(states) == jax.process_count() else None
    data_iter.set_states(states, own=own)
    data_iter.start_prefetch()


def _quiet_unmerged_saves(record: logging.LogRecord) -> bool:
    """Without OCDBT there is nothing to merge; Orbax warns about it at every save."""
    return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def _quiet_unranked_saves(record: logging.LogRecord) -> bool:
    """Periodic saves carry no validation loss by design; Orbax warns about each of them."""
    return "did not provide metrics" not in record.getMessage()


def load_params(directory, target_params, *, step: int | None = None, dtype=None):
    """Only the model parameters (no optimizer state), onto `target_params` (abstract, with shardings,
    any mesh), cast to `dtype` if given: for evaluation, sampling and fine-tuning.

    The cast happens as each shard is read, so no float32 copy of the model is ever on the devices.
    A schedule-free AdamW checkpoint (its optimizer state holds a `ScheduleFreeState`) gives its evaluation
    point x = (y - (1 - b1) z) / b1, not the y it trains at (`_schedule_free_eval_params`): y and z are read
    in float32 (two float32 copies of the trainable parameters on the devices while x is computed), not the
    rest of the optimizer state.
    """
    return load_params_and_step(directory, target_params, step=step, dtype=dtype)[0]


def load_params_and_step(directory, target_params, *, step: int | None = None, dtype=None) -> tuple[Any, int]:
    """`load_params`, and the step it read: `step`, or the newest that loads."""
    directory = epath.Path(directory).absolute()
    if dtype is not None:
        target_params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding), target_params
        )
    steps = complete_steps(directory)
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False)) as manager:

        def load(s: int):
            meta = manager.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            saved_layout = meta.get("param_layout", 1)
            layout.check(saved_layout, f"checkpoint {directory / str(s)}")
            target = layout.to_layout({"params": target_params}, saved_layout)
            handler = ocp.PyTreeCheckpointHandler()
            try:  # the stored tree's structure (no array read): is it a schedule-free AdamW state's?
                stored = handler.metadata(directory / str(s) / "state").tree
            finally:
                handler.close()
            path = _schedule_free_path(stored.get("opt_state"))
            if path is None:
                args = ocp.args.Composite(state=_pytree_restore(target, partial=True))
                return layout.from_layout(manager.restore(s, args=args)["state"]["params"], saved_layout)
            params = _schedule_free_eval_params(manager, s, target["params"], stored, path)
            return layout.from_layout(params, saved_layout)

        return newest_loadable(directory, steps, step, load)


_SCHEDULE_FREE_FIELDS = frozenset({"b1", "z", "weight_sum", "base_optimizer_state"})  # optax's ScheduleFreeState


def _schedule_free_path(opt_state) -> tuple | None:
    """Where a stored optimizer state (Orbax's metadata tree: dicts and lists) holds schedule-free AdamW's
    state (`optax.contrib.ScheduleFreeState`, saved as a dict of its fields), or None: not schedule-free."""
    found = []

    def walk(tree, path):
        if isinstance(tree, dict) and _SCHEDULE_FREE_FIELDS <= set(tree):
            found.append(path)
        elif isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, (*path, key))
        elif isinstance(tree, (list, tuple)):
            for i, value in enumerate(tree):
                walk(value, (*path, i))

    walk(opt_state, ())
    if len(found) > 1:
        raise ValueError(f"expected at most one schedule-free state in the optimizer's state, found {len(found)}")
    return found[0] if found else None


def _along(stored, path: tuple, leaf) -> Any:
    """A partial-restore target for the subtree at `path` of the stored tree `stored` alone: dicts keep the
    one key, lists hold None at every other index."""
    if not path:
        return leaf
    key, rest = path[0], path[1:]
    if isinstance(stored, dict):
        return {key: _along(stored[key], rest, leaf)}
    return [_along(stored[i], rest, leaf) if i == key else None for i in range(len(stored))]


def _shared(z, target):
    """The leaves of the stored z (metadata) that `target` (abstract params, the saved layout) asks for too:
    abstract arrays in the target's shape and sharding, z's stored dtype; None if none."""
    if isinstance(z, dict):
        if not isinstance(target, dict):
            return None
        out = {key: _shared(value, target[key]) for key, value in z.items() if key in target}
        return {key: value for key, value in out.items() if value is not None} or None
    if isinstance(target, dict) or target is None or tuple(z.shape) != tuple(target.shape):
        return None
    return jax.ShapeDtypeStruct(target.shape, z.dtype, sharding=target.sharding)


def _schedule_free_eval_params(manager, step: int, target: dict, stored: dict, path: tuple) -> dict:
    """Schedule-free AdamW's evaluation point x = (y - (1 - b1) z) / b1 (optax's `schedule_free_eval_params`)
    from checkpoint `step`: the parameters y (`target`: abstract, in the saved layout) and, of the optimizer
    state, z's leaves that `target` has and b1 alone (a partial restore: not its second moments). y and z are
    read in their stored dtype (float32) and x is cast to the target's dtype; parameters outside z (frozen
    ones: pruning masks, a LoRA base) are y's."""
    sf = stored["opt_state"]
    for key in path:
        sf = sf[key]
    z_target = _shared(sf["z"], target)
    if z_target is None:
        raise ValueError("the schedule-free state's z shares no parameter with the ones asked for")
    stored_y = stored["params"]

    def y_target(t, z, y):  # mixed leaves in y's stored dtype, the rest as asked
        if isinstance(t, dict):
            return {k: y_target(v, (z or {}).get(k), y.get(k) if isinstance(y, dict) else None) for k, v in t.items()}
        return t if z is None else jax.ShapeDtypeStruct(t.shape, y.dtype, sharding=t.sharding)

    b1 = jax.ShapeDtypeStruct(tuple(sf["b1"].shape), sf["b1"].dtype,
                              sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    restore = {"params": y_target(target, z_target, stored_y),
               "opt_state": _along(stored["opt_state"], path, {"z": z_target, "b1": b1})}
    got = manager.restore(step, args=ocp.args.Composite(state=_pytree_restore(restore, partial=True)))["state"]
    sf = got["opt_state"]
    for key in path:
        sf = sf[key]
    b1_value = np.asarray(jax.device_get(sf["b1"]))[()]  # a float32 scalar, as optax's arithmetic has it

    def mix(t, y, z):
        if isinstance(t, dict):
            return {k: mix(v, y[k], (z or {}).get(k)) for k, v in t.items()}
        if z is None:
            return y
        return ((y - (1.0 - b1_value) * z) / b1_value).astype(t.dtype)  # optax's arithmetic, in y's dtype

    params = mix(target, got["params"], sf["z"])
    if jax.process_index() == 0:
        print(f"jaxlm: schedule-free AdamW checkpoint {step}: read its evaluation point x = (y - (1 - b1) z) / b1 "
              f"(b1={b1_value:g}), not the training point y", file=sys.stderr, flush=True)
    return params


def _stored(state):
    """The tree a train state is saved as and restored onto: without its `loss_scale` field when that is
    None (bfloat16 and float32 runs), so the on-disk tree is the one checkpoints had before float16
    runs carried a scale, and those checkpoints restore as they always did."""
    if hasattr(state, "loss_scale") and state.loss_scale is None:
        return {name: getattr(state, name) for name in ("step", "params", "opt_state", "rng")}
    return state


def _unstored(tree, target):
    """`tree` restored onto `_stored(target)`, as `target`'s type."""
    return target.replace(**tree) if isinstance(tree, dict) and hasattr(target, "loss_scale") else tree


def _pytree_restore(target, *, partial: bool = False) -> ocp.args.PyTreeRestore:
    """Restore onto `target` (abstract arrays with shardings): each array in its target's sharding
    and dtype; `partial` reads only the subtree `target` names."""
    return ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=partial
    )


def empty_trash(directory, *, remove: bool) -> None:
    """Delete the checkpoints retention moved into `<directory>/jaxlm-deleting` (local folders only:
    on object stores Orbax deletes them itself); with `remove`, the folder too, which only a caller
    with no save in flight may do (Orbax creates it, then renames into it)."""
    trash = epath.Path(directory) / TRASH
    if "://" in os.fspath(trash):
        return
    try:
        entries = list(os.scandir(trash))
    except FileNotFoundError:
        return
    for entry in entries:
        shutil.rmtree(entry.path, ignore_errors=True)
    if remove:
        try:
            os.rmdir(trash)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not delete %s, which holds checkpoints retention dropped (%s)", trash,
                        e.strerror)


def complete_steps(directory) -> list[int]:
    """Steps of the complete checkpoints in `directory`, ascending (none when it does not exist)."""
    directory = epath.Path(directory)
    return sorted(ocp.path.step.checkpoint_steps(directory)) if directory.is_dir() else []


def newest_loadable(directory, steps: list[int], step: int | None, load: Callable[[int], Any], *,
                    verify: bool = True) -> tuple[Any, int]:
    """(load(step), step), or, with no step asked for, that of the newest of `steps` that loads:
    the one way a checkpoint (state, parameters or metadata) is chosen. With `verify`, a checkpoint
    must also match its manifest (`verify_step`), checked before `load` reads it.

    A checkpoint that fails is reported in one warning line and skipped, never deleted; a UserError
    from `load` (not damage, e.g. a layout this version cannot read) is raised at once.
    """
    directory = epath.Path(directory)
    if step is not None and step not in steps:
        raise UserError(f"no complete checkpoint for step {step} in {directory} (complete: {steps or 'none'})")
    candidates = [step] if step is not None else steps[::-1]
    if not candidates:
        raise UserError(f"no complete checkpoint in {directory}")
    errors = []
    for s in candidates:
        try:
            if verify:
                verify_step(directory / str(s))
            with _quiet_failures():
                loaded = load(s)
        except UserError:  # not damage (a layout this version cannot read): falling back would hide it
            raise
        except Exception as e:  # noqa: BLE001 -- truncated files, bad JSON, tensorstore errors, ...
            errors.append(f"step {s}: {_one_line(e)}")
            older = [c for c in candidates if c < s]
            log.warning("checkpoint %s could not be restored (%s)%s", directory / str(s), _one_line(e),
                        f"; trying step {older[0]}" if older else "")
            continue
        return loaded, s
    raise UserError(f"no checkpoint in {directory} could be restored; {'; '.join(errors)}")


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    first = text[0].split(" See full TensorStore details")[0] if text else ""
    return first if isinstance(e, DamagedCheckpoint) else f"{type(e).__name__}: {first}"[:300]


def _os_reason(e: Exception) -> str:
    """The operating system's words for the error code inside a tensorstore error
    ("[os_error_code='28']": "No space left on device"), or the error's first line."""
    found = re.search(r"\[os_error_code='?(\d+)'?\]", str(e))
    return os.strerror(int(found.group(1))) if found else _one_line(e)


class _DropOrbaxThreadFailures(logging.Filter):
    """A save that fails in Orbax's background threads is raised by the next `save`/`wait` and
    reported there in one line; the same failure logged from each thread would be pages."""

    PATTERNS = ("_SignalingThread.run() raised an exception", "exception was never retrieved",
                "Handler Commit operations", "Save Finalize thread")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p in record.getMessage() for p in self.PATTERNS)


def _quiet_background_failures() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropOrbaxThreadFailures) for f in logger.filters):
            logger.addFilter(_DropOrbaxThreadFailures())
    if not getattr(sys.unraisablehook, "jaxlm_quiet", False):
        sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)


def _quiet_closed_loops(hook):
    """Tensorstore completes the reads and writes of a failed save on Orbax's event loops after
    they closed, each reporting "Event loop is closed" as unraisable: drop exactly those."""

    def unraisablehook(unraisable):
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            hook(unraisable)

    unraisablehook.jaxlm_quiet = True
    return unraisablehook


@contextlib.contextmanager
def _quiet_failures():
    """While a checkpoint is tried: Orbax's error logs and the exceptions its abandoned reads raise
    in other threads would print pages of tracebacks for one damaged file; the caller reports it
    in one line instead."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels, unraisable, thread_hook = [lg.level for lg in loggers], sys.unraisablehook, threading.excepthook
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda *_: None
    threading.excepthook = lambda *_: None
    try:
        yield
    finally:
        gc.collect()  # the abandoned reads' tasks report their exceptions when collected: now, quietly
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        sys.unraisablehook, threading.excepthook = unraisable, thread_hook


# ----------------------------------------------------------------------------- manifests

MANIFEST = "jaxlm_manifest.json"


class DamagedCheckpoint(Exception):
    """A checkpoint's files differ from what its manifest recorded when it was saved."""


_REWRITTEN = {"_CHECKPOINT_METADATA"}  # Orbax's own step metadata, which it may update after the commit


def _files(root: epath.Path) -> dict[str, epath.Path]:
    """Every file under `root` by relative path, the manifest itself left out."""
    found, stack = {}, [root]
    while stack:
        for path in stack.pop().iterdir():
            if path.is_dir():
                stack.append(path)
            elif not path.name.startswith(MANIFEST) and path.name not in _REWRITTEN:
                found[str(path.relative_to(root))] = path
    return found


def _crc32(path: epath.Path) -> int:
    """The file's CRC-32. zlib releases the GIL while it sums, so training goes on beside a manifest being
    written. A local file is summed where it lies, mapped from the page cache (7.0 GB/s on the CPU VM
    against 4.5 GB/s for 16 MiB reads, which copy it first); a remote one (gs://...) is read in chunks."""
    name = os.fspath(path)
    if "://" not in name:
        with open(name, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return 0  # (mmap refuses an empty file)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                if hasattr(mapped, "madvise"):
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                return zlib.crc32(mapped)
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(step_dir) -> bool:
    """Record the size and CRC-32 of every file of the committed checkpoint `step_dir`; False when
    it is gone (removed by retention meanwhile)."""
    step_dir = epath.Path(step_dir)
    try:
        files = {rel: [path.stat().length, _crc32(path)] for rel, path in sorted(_files(step_dir).items())}
        partial = step_dir / f"{MANIFEST}.partial"
        partial.write_text(json.dumps({"version": 1, "files": files}, indent=1))
        partial.replace(step_dir / MANIFEST)  # (rename refuses to overwrite)
    except FileNotFoundError:
        return False
    except OSError as e:  # a disk full: the checkpoint is complete, only unverifiable (restoring it is the check)
        log.warning("could not write the manifest of %s (%s)", step_dir, e.strerror)
        return False
    return True


def verify_step(step_dir) -> bool:
    """Check checkpoint `step_dir` against its manifest: True when it matches, False when it has
    none (nothing to check against); raises DamagedCheckpoint naming the first file that differs."""
    step_dir = epath.Path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        return False
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(f"its manifest {MANIFEST} is unreadable ({type(e).__name__})") from None
    for rel, (size, crc) in recorded.items():
        path = step_dir / rel
        if not path.exists():
            raise DamagedCheckpoint(f"{rel} is missing")
        if (now := path.stat().length) != size:
            raise DamagedCheckpoint(f"{rel} has {now:,} bytes, {size:,} when saved")
        if _crc32(path) != crc:
            raise DamagedCheckpoint(f"{rel} has changed since it was saved (CRC-32)")
    return True
