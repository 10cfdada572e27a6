"""Checkpoints: real Orbax checkpoints on disk, restored onto other meshes, kept, skipped when broken."""

import functools
import gc
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import zlib

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import small_config
from jaxlm import axes, checkpoint, config, optim, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.data import pipeline
from jaxlm.errors import UserError

REPO = pathlib.Path(__file__).resolve().parents[1]


def _model_and_optimizer():
    cfg = config.recipe("tiny")
    model_cfg = small_config(n_kv_heads=4)
    tx, _ = optim.make_optimizer(cfg.optim, 10, train_state.build_model_spec(model_cfg).decay_mask)
    return model_cfg, tx, mesh_lib.rules_from_config(cfg.mesh.rules), cfg


def _abstract(shape):
    model_cfg, tx, rules, _ = _model_and_optimizer()
    abstract, *_ = train_state.abstract_state(model_cfg, tx, mesh_lib.make_mesh(shape), rules)
    return abstract


def _vector(value) -> dict:
    """A one-leaf state on the first device, for tests about which checkpoint is picked."""
    return {"w": jax.device_put(jnp.full((8,), value, jnp.float32), jax.devices()[0])}


def _vector_target() -> dict:
    return {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=_vector(0.0)["w"].sharding)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A train state created on an 8-way FSDP mesh, saved as step 7: (directory, host copy of the state)."""
    model_cfg, tx, rules, cfg = _model_and_optimizer()
    state, _, _ = train_state.create(model_cfg, tx, mesh_lib.make_mesh(axes.shape_of(fsdp=8)), rules)
    state = state.replace(step=jnp.array(7, jnp.int32))
    expected = jax.device_get(state)
    directory = tmp_path_factory.mktemp("ckpt")
    meta = {"config": cfg.to_dict(), "tokenizer_sha256": "ab" * 32, "tokens_seen": 7 * 4096, "wall_s": 12.5}
    with checkpoint.Checkpointer(directory) as ckpt:
        assert ckpt.save(7, state, meta=meta, force=True)
        # Once save returns the arrays may be donated to the next step: the write must not need them.
        jax.tree.map(lambda x: x.delete(), state)
    return directory, expected


@pytest.mark.parametrize("shape", [axes.shape_of(data=2, fsdp=2, tensor=2), axes.shape_of()], ids=["mesh222", "one_device"])
def test_restore_onto_another_mesh(saved, shape):
    directory, expected = saved
    target = _abstract(shape)
    with checkpoint.Checkpointer(directory) as ckpt:
        state, meta, step = ckpt.restore(target)
    assert step == 7 and isinstance(state, train_state.TrainState)
    jax.tree.map(lambda got, want: floats.identical(np.asarray(got), want, why=floats.MOVED), state, expected)
    jax.tree.map(lambda got, want: _assert_sharding(got, want.sharding), state, target)
    assert meta["step"] == 7 and meta["tokens_seen"] == 7 * 4096 and meta["tokenizer_sha256"] == "ab" * 32
    assert meta["config"]["model"]["variant"] == config.recipe("tiny").model.variant
    assert set(meta["versions"]) == {"jax", "flax", "orbax", "grain", "jaxlm"}


def _assert_sharding(array, sharding):
    assert array.sharding == sharding
    shard_shape = sharding.shard_shape(array.shape)
    assert {s.data.shape for s in array.addressable_shards} == {shard_shape}


def test_load_params_in_bfloat16_onto_another_mesh(saved):
    directory, expected = saved
    target = _abstract(axes.shape_of(fsdp=2, tensor=4)).params
    params = checkpoint.load_params(directory, target, dtype=jnp.bfloat16)
    assert jax.tree.structure(params) == jax.tree.structure(expected.params)  # no optimizer state
    for got, want, leaf in zip(jax.tree.leaves(params), jax.tree.leaves(expected.params), jax.tree.leaves(target)):
        assert got.dtype == jnp.bfloat16
        _assert_sharding(got, leaf.sharding)
        # a cast rounds each value alone, as ml_dtypes' does: moved, never computed with
        floats.identical(np.asarray(got), want.astype(jnp.bfloat16), why=floats.MOVED)


def test_read_meta(saved):
    directory, _ = saved
    with checkpoint.Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [7] and ckpt.latest_step() == 7
        meta = ckpt.read_meta()
    assert meta["wall_s"] == 12.5 and meta["versions"]["jax"] == jax.__version__


def test_compressed_and_uncompressed_checkpoints_restore_either_way(tmp_path):
    state = {"w": jax.device_put(jnp.arange(65536, dtype=jnp.float32) % 7, jax.devices()[0])}  # compressible
    target = {"w": jax.ShapeDtypeStruct((65536,), jnp.float32, sharding=state["w"].sharding)}
    sizes = {}
    for compress in (False, True):
        directory = tmp_path / f"compress_{compress}"
        with checkpoint.Checkpointer(directory, compress=compress) as ckpt:
            ckpt.save(1, state, meta={}, force=True)
        sizes[compress] = sum(f.stat().st_size for f in (directory / "1" / "state").rglob("*") if f.is_file())
        with checkpoint.Checkpointer(directory, compress=not compress) as ckpt:  # the reader's setting is moot
            restored, _, _ = ckpt.restore(target)
        floats.identical(np.asarray(restored["w"]), np.asarray(state["w"]), why=floats.MOVED)
    assert sizes[False] > 65536 * 4 > 10 * sizes[True]


def test_both_array_layouts_restore_either_way(tmp_path, caplog):
    """checkpoint.ocdbt: "auto" in a local folder, one process, is one array per leaf; "on" is Orbax's
    OCDBT; a checkpoint of either restores whatever the reader's setting (a run resumed across the change)."""
    state = {"w": jax.device_put(jnp.arange(5000, dtype=jnp.float32), jax.devices()[0]),
             "m": {"x": jax.device_put(jnp.ones((64, 64), jnp.bfloat16), jax.devices()[0])}}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    caplog.set_level(logging.WARNING)
    for written, expected in (("auto", False), ("off", False), ("on", True)):
        directory = tmp_path / written
        with checkpoint.Checkpointer(directory, ocdbt=written) as ckpt:
            assert ckpt.ocdbt is expected
            ckpt.save(1, state, meta={}, force=True)
        files = {str(f.relative_to(directory / "1" / "state")) for f in (directory / "1" / "state").rglob("*")}
        assert ("manifest.ocdbt" in files) is expected and ("w/.zarray" in files) is not expected
        assert checkpoint.verify_step(directory / "1")
        for reader in ("on", "off"):
            with checkpoint.Checkpointer(directory, ocdbt=reader) as ckpt:
                restored, _, _ = ckpt.restore(target)
            floats.identical(restored, state, why=floats.MOVED)
    assert not [r.getMessage() for r in caplog.records if "OCDBT" in r.getMessage()]  # Orbax's "nothing to merge"
    with pytest.raises(ValueError, match="ocdbt must be one of auto, on, off"):
        checkpoint.Checkpointer(tmp_path / "x", ocdbt="yes")


def test_the_checkpointer_is_built_from_its_config_section(tmp_path):
    from jaxlm import config

    cfg = config.recipe("tiny", checkpoint__keep_last=2, checkpoint__keep_every=4, checkpoint__every_steps=7)
    section = checkpoint.CheckpointConfig.from_config(cfg.checkpoint)
    with checkpoint.Checkpointer.from_config(tmp_path, section) as ckpt:
        assert (ckpt.every_steps, ckpt.every_minutes) == (7, cfg.checkpoint.every_minutes)
        for step in range(1, 11):
            ckpt.save(step, _vector(step), meta={}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 8, 9, 10]


def test_keep_last_and_every(tmp_path):
    with checkpoint.Checkpointer(tmp_path, keep_last=2, keep_every=4) as ckpt:
        for step in range(1, 11):
            ckpt.save(step, _vector(step), meta={}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 8, 9, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "4", "8", "9"]


def test_retention_renames_in_the_commit_and_deletes_beside_training(tmp_path, caplog):
    trash = tmp_path / checkpoint.TRASH
    (trash / "99" / "state").mkdir(parents=True)  # left by a run killed before it emptied the folder
    (trash / "99" / "state" / "d").write_bytes(b"x" * 4096)
    with checkpoint.Checkpointer(tmp_path) as reader:  # a reader (evaluate) leaves a saving run's trash alone
        assert reader.all_steps() == []
    assert (trash / "99" / "state" / "d").exists()

    caplog.set_level(logging.INFO, logger="absl")
    with checkpoint.Checkpointer(tmp_path, keep_last=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, _vector(step), meta={}, force=True)
        ckpt._manager.wait_until_finished()  # Orbax's commits of 3 and 4 dropped 1 and 2
        ckpt._recorder.join()
        assert ckpt.all_steps() == [3, 4] and checkpoint.complete_steps(tmp_path) == [3, 4]
        ckpt.save(5, _vector(5), meta={}, force=True)  # then, after 4's commit, deletes what was dropped
        ckpt._recorder.join()
        assert set(p.name for p in trash.iterdir()) <= {"3"}  # (3: dropped by 5's commit, maybe after that)
        assert (tmp_path / "4" / checkpoint.MANIFEST).exists()
        ckpt.wait()  # no save in flight: the folder goes too
        assert not trash.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]
        # (a restore quiets Orbax's log while it runs: not beside a commit here, which logs its renames)
        floats.identical(np.asarray(ckpt.restore(_vector_target(), step=4)[0]["w"]), np.full(8, 4.0, np.float32),
                         why=floats.MOVED)
        ckpt.save(6, _vector(6), meta={}, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5", "6"]
    assert checkpoint.verify_step(tmp_path / "6")
    # Orbax dropped each by a rename into the trash, inside its commit, not by deleting the files there
    renamed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Renamed step")]
    assert [m.split()[2] for m in renamed] == ["1", "2", "3", "4"]
    assert all(m.endswith(os.path.join(checkpoint.TRASH, m.split()[2])) for m in renamed)


def test_keep_best_by_validation_loss_survives_a_restart(tmp_path):
    val = {2: 3.0, 4: 1.5, 6: 2.5, 8: 1.0, 10: 4.0}  # evaluated steps; odd steps are plain saves
    with checkpoint.Checkpointer(tmp_path, keep_last=1, keep_best=2) as ckpt:
        for step in range(1, 9):
            ckpt.save(step, _vector(step), meta={}, force=True, val_loss=val.get(step))
        ckpt.wait()
        assert ckpt.all_steps() == [4, 8]  # the two lowest losses; 8 is also the newest
    with checkpoint.Checkpointer(tmp_path, keep_last=1, keep_best=2) as ckpt:  # a resumed run
        for step in (9, 10):
            ckpt.save(step, _vector(step), meta={}, force=True, val_loss=val.get(step))
        ckpt.wait()
        assert ckpt.all_steps() == [4, 8, 10]  # the best two, whose losses were read back, + the newest


def test_should_save_every_steps_and_minutes(tmp_path):
    now = [0.0]
    ckpt = checkpoint.Checkpointer(tmp_path, every_steps=5, every_minutes=2, clock=lambda: now[0])
    assert [s for s in range(1, 12) if ckpt.should_save(s)] == [5, 10]
    now[0] = 119.0
    assert not ckpt.should_save(11)
    now[0] = 120.0
    assert ckpt.should_save(11)
    assert ckpt.save(11, _vector(11.0), meta={})  # due by time; the interval restarts here
    now[0] = 200.0
    assert not ckpt.should_save(12) and ckpt.should_save(15)
    assert not ckpt.save(12, _vector(12.0), meta={})  # not due: nothing written
    now[0] = 240.0
    assert ckpt.should_save(12)
    ckpt.wait()
    assert ckpt.all_steps() == [11]
    assert not ckpt.save(11, _vector(0.0), meta={}, force=True)  # an existing step is never overwritten
    ckpt.close()
    off = checkpoint.Checkpointer(tmp_path)
    now[0] = 1e9
    assert not any(off.should_save(s) for s in range(1, 100))
    off.close()


def _data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The files holding the arrays' bytes: OCDBT's data files (`d/<hash>`), or an array's chunks (`0`, `0.0`)."""
    return sorted(f for f in (step_dir / "state").rglob("*")
                  if f.is_file() and (f.parent.name == "d" or f.name.replace(".", "").isdigit()))


def test_a_files_checksum_is_zlibs_crc32_of_its_bytes(tmp_path):
    """What manifests record (a local file summed in place, mapped): zlib's CRC-32 of the whole file, so
    manifests written by the 16 MiB reads before verify the same; an empty file and one past 16 MiB too."""
    from etils import epath

    for size in (0, 1, 4097, (16 << 20) + 3):
        data = np.random.default_rng(size).bytes(size)
        (tmp_path / f"f{size}").write_bytes(data)
        assert checkpoint._crc32(epath.Path(tmp_path / f"f{size}")) == zlib.crc32(data)


def test_manifest_catches_damage_that_orbax_reads_without_complaint(tmp_path, caplog, capfd):
    """One byte changed in place: without the manifest Orbax restores the wrong values; with it,
    the checkpoint is reported in one warning line and the one before is used; nothing is deleted."""
    n = 4096  # large enough to be stored outside Orbax's index, which has checksums of its own
    device = jax.devices()[0]
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jax.device_put(jnp.full((n,), float(step)), device)}, meta={}, force=True)
    for step in (1, 2):
        assert checkpoint.verify_step(tmp_path / str(step))  # written for every save, the last one at close
    assert checkpoint.write_manifest(tmp_path / "1") and checkpoint.verify_step(tmp_path / "1")  # rewritten in place
    recorded = json.loads((tmp_path / "2" / checkpoint.MANIFEST).read_text())["files"]
    victim = max(_data_files(tmp_path / "2"), key=lambda f: f.stat().st_size)
    assert str(victim.relative_to(tmp_path / "2")) in recorded and "meta/metadata" in recorded
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # inside the array's bytes (uncompressed checkpoints)
    victim.write_bytes(bytes(raw))
    target = {"w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))}

    with pytest.raises(checkpoint.DamagedCheckpoint, match="changed since it was saved"):
        checkpoint.verify_step(tmp_path / "2")
    with checkpoint.Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, "jaxlm.checkpoint"):
        state, _, step = ckpt.restore(target)
        assert step == 1 and np.all(np.asarray(state["w"]) == 1.0)
        unverified, _, step = ckpt.restore(target, verify=False)  # what Orbax alone gives: one value wrong
    assert step == 2 and np.sum(np.asarray(unverified["w"]) != 2.0) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "2") in warnings[0] and "trying step 1" in warnings[0]
    assert victim.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]

    os.truncate(victim, 10)
    with pytest.raises(checkpoint.DamagedCheckpoint, match="has 10 bytes"):
        checkpoint.verify_step(tmp_path / "2")
    victim.unlink()
    with pytest.raises(checkpoint.DamagedCheckpoint, match="is missing"):
        checkpoint.verify_step(tmp_path / "2")
    (tmp_path / "2" / checkpoint.MANIFEST).unlink()
    assert checkpoint.verify_step(tmp_path / "2") is False  # nothing to check against
    assert "Traceback" not in capfd.readouterr().err


def test_restore_falls_back_past_a_truncated_checkpoint_without_a_manifest(tmp_path, caplog, capfd):
    """A checkpoint of an older jaxlm (no manifest): restoring it is the check, reported in one line."""
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _vector(float(step)), meta={}, force=True)
    data_files = _data_files(tmp_path / "2")
    for f in data_files:
        os.truncate(f, f.stat().st_size // 2)
    for step in (1, 2):
        (tmp_path / str(step) / checkpoint.MANIFEST).unlink()
    with checkpoint.Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING):
        assert ckpt.latest_step() == 2  # complete on disk, but damaged
        state, _, step = ckpt.restore(_vector_target())
    assert step == 1
    floats.identical(np.asarray(state["w"]), np.full(8, 1.0, np.float32), why=floats.MOVED)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "2") in warnings[0], warnings
    assert "Traceback" not in capfd.readouterr().err  # Orbax's abandoned reads stay quiet
    assert all(f.exists() for f in data_files) and sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]

    (tmp_path / "1" / "meta" / "metadata").write_text("{")  # now none loads
    with checkpoint.Checkpointer(tmp_path) as ckpt, pytest.raises(UserError, match=str(tmp_path)) as err:
        ckpt.restore(_vector_target())
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_set_aside_moves_checkpoints_so_their_steps_can_be_saved_again(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        for step in (1, 2):
            ckpt.save(step, _vector(float(step)), meta={}, force=True)
        ckpt.wait()
        moved = ckpt.set_aside([2], tmp_path / "aside")
        assert [str(p) for p in moved] == [str(tmp_path / "aside" / "2")] and ckpt.all_steps() == [1]
        assert ckpt.save(2, _vector(5.0), meta={}, force=True)  # saved again, not refused as existing
        ckpt.wait()
        assert ckpt.set_aside([2], tmp_path / "aside")[0].name == "2.1"  # never over an earlier one
    assert checkpoint.verify_step(tmp_path / "aside" / "2") and checkpoint.verify_step(tmp_path / "aside" / "2.1")


def test_restore_without_checkpoints_or_of_a_missing_step(tmp_path):
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UserError, match="no complete checkpoint in"):
            ckpt.restore(_vector_target())
        ckpt.save(3, _vector(3.0), meta={}, force=True)
        ckpt.wait()
        with pytest.raises(UserError, match=r"step 4 .*complete: \[3\]"):
            ckpt.restore(_vector_target(), step=4)


@pytest.mark.parametrize("snapshot", ["off", "device"])
def test_data_iterator_resumes_exactly(tmp_path, snapshot):
    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 100, rng.integers(5, 60)).astype(np.int32) for _ in range(200)]

    def new_iterator():
        return iter(pipeline.make_train_dataset(docs, seq_len=16, batch_size=4, seed=3))

    it = new_iterator()
    for _ in range(3):
        next(it)
    with checkpoint.Checkpointer(tmp_path, snapshot=snapshot) as ckpt:
        ckpt.save(3, _vector(3.0), meta={}, data_iter=it, force=True)
        expected, tokens_seen = next(it), it.tokens_seen
        next(it)  # the saved position must not follow the live iterator
        ckpt.wait()
        resumed = new_iterator()
        ckpt.restore(_vector_target(), data_iter=resumed)
    got = next(resumed)
    assert got.keys() == expected.keys()
    for key in expected:
        floats.identical(got[key], expected[key], why=floats.SAME_PROGRAM)  # the same stream, resumed (tokens, weights)
    assert resumed.tokens_seen == tokens_seen


@pytest.mark.parametrize("snapshot", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_a_device_snapshot_saves_each_step_as_it_was_while_the_next_steps_donate_it(tmp_path, snapshot,
                                                                                     monkeypatch):
    """snapshot="device": `save` returns before the state is on the host, and the next steps donate
    (and overwrite) the state's buffers; every checkpoint must still hold its own step's state, on
    an 8-way FSDP mesh, key and optimizer state included. "host": the same, the snapshot sent on to
    pinned host memory by `save` itself."""
    model_cfg, tx, rules, _ = _model_and_optimizer()
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=8))
    state, _, _ = train_state.create(model_cfg, tx, mesh, rules)
    initial = jax.device_get(state)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(s):  # a stand-in update: every parameter + 1, the counter + 1, a new key
        return s.replace(params=jax.tree.map(lambda p: p + 1, s.params), step=s.step + 1,
                         rng=jax.random.split(s.rng)[0])

    keys, params = [initial.rng], [initial.params]  # each step's, computed apart (float32 sums round)
    for _ in range(6):
        keys.append(jax.random.split(keys[-1])[0])
        params.append(jax.tree.map(lambda p: p + np.float32(1), params[-1]))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    live = _live_bytes()  # the state's, before any snapshot
    sent = []  # what `save` sent on to pinned host memory ("host"), as the real function returned it
    to_pinned_host = checkpoint._to_pinned_host
    monkeypatch.setattr(checkpoint, "_to_pinned_host", lambda tree: sent.append(to_pinned_host(tree)) or sent[-1])
    with checkpoint.Checkpointer(tmp_path, snapshot=snapshot) as ckpt:
        assert ckpt._snapshot == snapshot  # (these CPU devices have pinned host memory)
        for i in range(1, 7):
            state = step(state)
            if i % 2 == 0:
                assert ckpt.save(i, state, meta={"i": i}, force=True)
                assert ckpt._saver is not None  # the host copy was left to a thread; the next step runs now
        ckpt._join_saver()
        # Once on the host, the snapshot's buffers are freed (Orbax keeps a save's arrays referenced
        # until the next save: left to it, two states would share the devices).
        assert _live_bytes() - live < state_bytes / 4, (_live_bytes(), live, state_bytes)
        # "host": each save's copy went to pinned host memory, in the state's shardings, and was freed
        assert len(sent) == (3 if snapshot == "host" else 0)
        for tree in sent:
            assert {x.sharding.memory_kind for x in jax.tree.leaves(tree)} == {"pinned_host"}
            assert all(x.is_deleted() for x in jax.tree.leaves(tree))
        ckpt.wait()
        assert ckpt.all_steps() == [2, 4, 6]
        assert all((tmp_path / str(i) / checkpoint.MANIFEST).exists() for i in (2, 4, 6))
        target = _abstract(axes.shape_of(fsdp=8))
        for i in (2, 4, 6):
            restored, meta, got_step = ckpt.restore(target, step=i)
            assert got_step == i and meta["i"] == i and int(restored.step) == i
            np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(keys[i]))
            floats.close(restored.params, params[i])  # XLA's p + 1 against numpy's
            floats.identical(restored.opt_state, initial.opt_state, why=floats.MOVED)  # passed through the steps
            restored_sharding = restored.params["embed"]["embedding"].sharding
            assert restored_sharding.spec == target.params["embed"]["embedding"].sharding.spec
            assert restored_sharding.memory_kind == jax.devices()[0].default_memory().kind  # not pinned_host


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


class _Device:
    """A device as `_device_room` sees one: only its allocator's statistics (a GPU's, which this
    machine has none of)."""

    def __init__(self, peak, limit):
        self.stats = {"peak_bytes_in_use": peak, "bytes_in_use": peak // 2, "bytes_limit": limit}

    def memory_stats(self):
        return self.stats


def test_auto_snapshot_only_where_the_copy_fits_beside_the_peak(tmp_path):
    assert checkpoint._device_room({_Device(60, 100): 30, _Device(10, 100): 80})
    assert not checkpoint._device_room({_Device(60, 100): 30, _Device(10, 100): 90})  # over 95% of one
    assert not checkpoint._device_room({jax.devices()[0]: 1})  # a CPU reports no allocator statistics
    state = _vector(1.0)
    assert checkpoint._bytes_per_device(state) == {jax.devices()[0]: 32}
    with checkpoint.Checkpointer(tmp_path) as ckpt:  # auto, on a CPU: the save copies to the host itself
        ckpt.save(1, state, meta={}, force=True)
        assert ckpt._saver is None and ckpt._snapshot == "off"
    with pytest.raises(ValueError, match="snapshot must be one of auto, device, host, off"):
        checkpoint.Checkpointer(tmp_path, snapshot="gpu")


_FAILED_SAVE = """
import resource, sys
import jax.numpy as jnp
from jaxlm import checkpoint
from jaxlm.errors import EnvironmentFailure
ckpt = checkpoint.Checkpointer(sys.argv[1], snapshot=sys.argv[2])
ckpt.save(1, {"w": jnp.full((8,), 1.0)}, meta={}, force=True)
ckpt.wait()
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # as a full disk: no file grows past 1 MiB
ckpt.save(2, {"w": jnp.ones((4, 1024, 1024))}, meta={}, force=True)  # 16 MiB: its write fails in the background
# Orbax raises that failure when the next save starts: here (off) or in the save's thread (device), so at `wait`
for call in (lambda: ckpt.save(3, {"w": jnp.full((8,), 3.0)}, meta={}, force=True), ckpt.wait, ckpt.close):
    try:
        call()
    except EnvironmentFailure as e:
        print("FAILED:", e)
"""


@pytest.mark.parametrize("snapshot", [pytest.param("off", marks=pytest.mark.slow), "device"])
def test_a_failed_background_save_is_reported_once_and_keeps_the_last_good_checkpoint(tmp_path, snapshot):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FAILED_SAVE), str(tmp_path), snapshot], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("FAILED:")]
    assert len(lines) == 1, proc.stdout  # `close` does not repeat it
    assert f"saving checkpoint {tmp_path / '2'} failed (File too large" in lines[0], lines
    assert f"newest complete checkpoint is {tmp_path / '1'}" in lines[0], lines
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        state, _, step = ckpt.restore(_vector_target())
    assert step == 1
    floats.identical(np.asarray(state["w"]), np.full(8, 1.0, np.float32), why=floats.MOVED)


_KILLED_SAVE = """
import glob, os, signal, sys, time
import jax.numpy as jnp
from jaxlm import checkpoint
ckpt = checkpoint.Checkpointer(sys.argv[1])
ckpt.save(1, {"w": jnp.full((8,), 1.0)}, meta={}, force=True)
ckpt.wait()
ckpt.save(2, {"w": jnp.ones((16, 1024, 1024))}, meta={}, force=True)  # 64 MB, written in the background
# killed once the background save has begun writing (on a loaded machine it may not have yet at this line)
deadline = time.monotonic() + 60
while not glob.glob(os.path.join(sys.argv[1], "2.orbax-checkpoint-tmp*")) and time.monotonic() < deadline:
    time.sleep(0.0005)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert any(p.name.startswith("2.orbax-checkpoint-tmp") for p in tmp_path.iterdir())  # killed mid-save
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
        state, _, step = ckpt.restore(_vector_target())
        assert step == 1
        floats.identical(np.asarray(state["w"]), np.full(8, 1.0, np.float32), why=floats.MOVED)
        # The run resumes and saves step 2 again over the partial one.
        ckpt.save(2, _vector(2.0), meta={}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_versions_of_a_source_tree_that_is_not_installed(monkeypatch):
    """Run from a checkout on PYTHONPATH (as on a GPU machine with no installs), jaxlm has no package
    metadata: the checkpoint records that instead of failing the save (seen on an H200, 2026-11-26)."""
    real = checkpoint.importlib.metadata.version

    def version(dist):
        if dist == "jaxlm":
            raise checkpoint.importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(checkpoint.importlib.metadata, "version", version)
    found = checkpoint.versions()
    assert found["jaxlm"] == "not installed" and found["jax"] == jax.__version__
