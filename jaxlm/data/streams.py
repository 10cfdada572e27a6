"""jaxlm's grain iterators: the classes that derive from grain's, kept apart so that the modules that
use them (`jaxlm.data.loader`, `jaxlm.data.mixture`, `jaxlm.checkpoint`) import grain only when a run
reads data or a checkpoint (`jaxlm.lazy`), not when a command starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grain
import numpy as np

from jaxlm.data import mixture, pipeline
from jaxlm.errors import UserError


class ShardedStream(grain.DatasetIterator):
    """This process's rows of each global batch, read from the data shards those rows come from.

    The global batch is `shards` streams side by side, stream j giving rows [j * B/S, (j+1) * B/S).
    A process opens only the streams its rows overlap (all of them on one process, its own one
    when each process has a shard), so the global batch is the same for any process count and a
    checkpoint of the streams' positions resumes on any process count. Its state holds the position
    of each stream it reads; `set_states` merges the states saved by every process of the run.
    """

    def __init__(self, open_shard: Callable[[int], Any], shards: int, rows: slice, global_batch: int):
        self.shards, self.rows, self.per_shard = shards, rows, global_batch // shards
        first, last = rows.start // self.per_shard, (rows.stop - 1) // self.per_shard
        try:
            self.streams = {j: open_shard(j) for j in range(first, last + 1)}
        except BaseException:
            super().__init__([])  # a whole (empty) iterator: grain's __del__ closes what __init__ set up
            raise
        self._offset = first * self.per_shard  # global row of the first row read
        super().__init__(list(self.streams.values()))
        self.tokens_seen = 0  # real target tokens in this process's rows so far

    @property
    def epoch(self) -> int:
        """The latest 0-based pass over the data that a batch has drawn from."""
        return max(stream.epoch for stream in self.streams.values())

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(stream) for stream in self.streams.values()]
        batch = parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        lo, hi = self.rows.start - self._offset, self.rows.stop - self._offset
        if (lo, hi) != (0, len(batch["inputs"])):
            batch = {k: v[lo:hi] for k, v in batch.items()}
        self.tokens_seen += int(np.count_nonzero(batch["segment_ids"]))
        return batch

    def get_state(self) -> dict:
        return {"data_shards": self.shards, "tokens_seen": self.tokens_seen,
                "shards": {str(j): stream.get_state() for j, stream in self.streams.items()}}

    def set_state(self, state: dict) -> None:
        self.set_states([state], own=state)

    def set_states(self, states: list[dict], own: dict | None = None) -> None:
        """Resume from the states every process of the saving run wrote, in process order; `own` is
        this process's when the process count is unchanged.

        States from before data shards (one stream per process, no 'data_shards' key) resume on the
        same process count."""
        merged: dict[str, Any] = {}
        for i, state in enumerate(states):
            if "data_shards" not in state:  # the older format: process i's single stream
                state = {"data_shards": len(states), "shards": {str(i): state}, "tokens_seen": state.get("tokens_seen", 0)}
            if state["data_shards"] != self.shards:
                raise UserError(
                    f"the checkpoint's data stream has {state['data_shards']} data shards but this run reads "
                    f"{self.shards}; set config.data.shards={state['data_shards']} (or 0) to resume it"
                )
            merged.update(state["shards"])
        missing = [j for j in self.streams if str(j) not in merged]
        if missing:
            raise UserError(f"the checkpoint holds no position for data shard(s) {missing}; it is incomplete")
        for j, stream in self.streams.items():
            stream.set_state(merged[str(j)])
        # Its own count when the process count is unchanged, else its share of all processes' counts.
        total = sum(int(state.get("tokens_seen", 0)) for state in states)
        share = (self.rows.stop - self.rows.start) / (self.per_shard * self.shards)
        self.tokens_seen = int(own.get("tokens_seen", 0)) if own is not None else int(total * share)


class MixtureIterator(grain.DatasetIterator):
    """One data shard's batches of a mixture: `rows` rows a step, each drawn from a source's row stream
    (`mixture.draw`), with `source_ids` [rows, seq_len] (the row's source, its index in `schedule.names`) before the
    loss `weights`. Like `pipeline.TrainIterator`, it knows `epoch` (the latest pass over any source; per
    source in `epochs`) and `tokens_seen`; its state is the step and each source's position, by name."""

    def __init__(self, streams: Mapping[str, grain.DatasetIterator], schedule: mixture.Schedule, rows: int, seed: int,
                 shard: int):
        if tuple(streams) != schedule.names:
            raise ValueError(f"the streams {list(streams)} are not the schedule's sources {list(schedule.names)}")
        super().__init__(list(streams.values()))
        self._streams = dict(streams)
        self.schedule, self.rows, self.seed, self.shard = schedule, rows, seed, shard
        self.step = 0  # the batches given so far: the next is training step step + 1's
        self.epochs = dict.fromkeys(schedule.names, 0)
        self.tokens_seen = 0

    @property
    def epoch(self) -> int:
        return max(self.epochs.values())

    def __next__(self) -> pipeline.Batch:
        names = self.schedule.names
        choice = mixture.draw(self.schedule.weights(self.step + 1), self.seed, self.shard, self.step, self.rows)
        rows = [next(self._streams[names[i]]) for i in choice]
        for i, row in zip(choice, rows):
            self.epochs[names[i]] = max(self.epochs[names[i]], int(row["epoch"]))
        batch = {k: np.stack([row[k] for row in rows]) for k in ("inputs", "targets", "segment_ids", "positions")}
        batch["source_ids"] = np.repeat(choice.astype(np.int32)[:, None], batch["inputs"].shape[1], axis=1)
        self.step += 1
        self.tokens_seen += int(np.count_nonzero(batch["segment_ids"]))
        return pipeline.add_loss_weights(batch)

    def get_state(self) -> dict:
        return {"step": self.step, "epochs": dict(self.epochs), "tokens_seen": self.tokens_seen,
                "sources": {name: stream.get_state() for name, stream in self._streams.items()}}

    def set_state(self, state: dict) -> None:
        saved = list(state["sources"])
        if sorted(saved) != sorted(self._streams):
            raise UserError(
                f"the checkpoint's data mixture has the sources {', '.join(saved)} but data.sources names "
                f"{', '.join(self._streams)}; a resumed run may change their weights (and data.stages), not which "
                f"sources there are")
        for name, stream in self._streams.items():
            stream.set_state(state["sources"][name])
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.epochs = {name: int(state["epochs"].get(name, 0)) for name in self._streams}


class SavedPosition(grain.DatasetIterator):
    """A dataset iterator's position read at a save, for grain's checkpoint handler to write later (from a
    thread): `jaxlm.checkpoint`."""

    def __init__(self, state: dict):
        super().__init__()
        self._state = state

    def __next__(self):
        raise TypeError("a saved data position is not an iterator")

    def get_state(self):
        return self._state

    def set_state(self, state):
        raise TypeError("a saved data position cannot be set")
