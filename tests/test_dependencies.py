"""The exact behaviour of other projects that jaxlm relies on beyond their documented API, pinned
here so that an upgrade that changes it fails a test instead of every run (versions in
constraints.txt)."""

import json

import grain
import jax
import jax.numpy as jnp

from jaxlm import checkpoint


def test_grain_writes_one_position_file_per_process_named_as_checkpoint_py_reads_them(tmp_path):
    """`checkpoint._restore_merged` resumes a run's data on another process count by reading every
    process's position, `<step>/data/process_<i>-of-<n>.json`, which grain's CheckpointSave writes
    (its file names are not documented): the names and the JSON in them are the iterator's state."""
    it = iter(grain.MapDataset.range(20).to_iter_dataset())
    for _ in range(7):
        next(it)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": jnp.zeros(4)}, meta={}, data_iter=it, force=True)
    files = sorted(p.name for p in (tmp_path / "1" / "data").iterdir() if p.suffix == ".json")
    assert files == [f"process_{jax.process_index()}-of-{jax.process_count()}.json"]
    assert json.loads((tmp_path / "1" / "data" / files[0]).read_text()) == json.loads(json.dumps(it.get_state()))

    class Merged:  # what jaxlm's ShardedStream offers: every process's state at once
        def set_states(self, states, own=None):
            self.states, self.own = states, own

        def start_prefetch(self):
            pass

    merged = Merged()
    checkpoint._restore_merged(tmp_path / "1" / "data", merged)
    assert merged.states == [it.get_state()] and merged.own == it.get_state()
