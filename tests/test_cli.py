"""The real CLI, `python -m jaxlm.train` (forked: tests/command_forks.py): a short run works end to end; a
diverging one follows its policy."""

import json
import math
import os
import pathlib

import floats
import jax
import numpy as np
import pytest
from command_forks import run_command

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=ROOT, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_command("train", args, cwd=cwd, env=env, timeout=timeout)


# Bad input (config keys and values, the mesh, recipes, data): tests/test_bad_inputs.py, the catalogue.


def test_a_short_run_trains_and_writes_its_run_directory(tmp_path):
    result = run_cli(
        "--config=configs/tiny.py",
        f"--config.run.output_dir={tmp_path}",
        "--config.run.name=short",
        # 12 steps, all of them the warmup's: the console, the metrics and three evaluations to keep the best of,
        # each every 4 steps, and a learning rate that rises to its peak at the last step
        "--config.run.steps=12",
        "--config.run.log_every=4",
        "--config.run.eval_every=4",
        "--config.optim.warmup_steps=12",
        "--config.checkpoint.keep_last=1",
        "--config.checkpoint.keep_best=1",
        "--config.data.builtin_max_bytes=400000",
        "--config.data.val_fraction=0.3",  # 2 of the 12 documents
        "--config.model.vocab_size=512",
        "--config.model.n_layers=2",  # the tiny recipe at half its depth and rows of 64 tokens: a quarter of
        "--config.data.seq_len=64",  # its steps' work, enough to learn what the assertions below check
        f"--config.data.cache_dir={tmp_path / 'cache'}",
        "--config.mesh.fsdp=2",
        "--config.mesh.data=-1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "short"
    assert f"run directory {run_dir}" in result.stdout
    # the console: the first step at once (training started, compilation included), then every 4
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step      1/12 |") and "compilation included" in lines[0]
    assert [line.split("/")[0].split()[-1] for line in lines if "| epoch" in line][1:4] == ["4", "8", "12"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    val = {r["step"]: r for r in records if "val_loss" in r}
    assert list(val) == [4, 8, 12]
    for r in val.values():
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]))
        # A BPE token of code stands for more than one byte, and every token for at least one.
        assert 0 < r["val_bits_per_byte"] < r["val_loss"] / math.log(2) < r["val_bits_per_byte"] * 8
    assert train[-1]["loss"] < train[0]["loss"] - 0.5  # it learns
    assert train[0]["lr"] < train[-1]["lr"] or train[10]["lr"] > train[0]["lr"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["vocab_size"] == 512 and config["mesh"]["fsdp"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12
    assert summary["mfu"] is None and summary["peak_flops_per_device"] is None  # a CPU's peak: unknown, not guessed
    floats.identical(summary["final_loss"], train[-1]["loss"], why=floats.MOVED)  # the last step's, written again
    assert (run_dir / "checkpoints" / "12" / "state").is_dir()
    assert (run_dir / "tokenizer.model").is_file()
    assert "jaxlm: done: 12 steps" in result.stdout
    assert all(r["model_tflops_per_device"] > 0 and "mfu" not in r for r in train)  # CPU: MFU unknown
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in train]
    assert [e.step for e in events.Scalars("val_bits_per_byte")] == [4, 8, 12]
    best = min(val, key=lambda step: val[step]["val_loss"])
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == sorted({best, 12})  # best + last


@pytest.mark.slow  # the guard itself: test_train_step.py::test_a_non_finite_loss_never_reaches_the_state
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_diverging_run_follows_the_non_finite_policy(tmp_path, policy):
    """A learning rate of 1e9 makes the loss non-finite within a few steps."""
    result = run_cli(
        "--config=configs/tiny.py", f"--config.run.output_dir={tmp_path}", "--config.run.name=nan",
        "--config.run.steps=12", "--config.run.eval_every=0", "--config.optim.peak_lr=1e9", "--config.optim.warmup_steps=0",
        "--config.optim.clip_norm=0", f"--config.optim.on_nonfinite={policy}", "--config.data.builtin_max_bytes=400000",
        "--config.model.vocab_size=512", f"--config.data.cache_dir={tmp_path / 'cache'}",
    )
    run_dir = tmp_path / "nan"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped, records
    if policy == "stop":
        assert result.returncode == 3, result.stderr[-2000:]
        assert f"step {skipped[0]}: the loss" in result.stderr and "last good state saved in" in result.stderr
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads((run_dir / "summary.json").read_text())["skipped_steps"] == skipped
    import orbax.checkpoint as ocp  # the saved state holds no NaN

    step_dirs = sorted((run_dir / "checkpoints").iterdir())
    restored = ocp.StandardCheckpointer().restore((step_dirs[-1] / "state").absolute())
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored["params"]))
