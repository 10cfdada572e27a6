"""The real CLI, in a subprocess: bad input gets one line and exit code 2; a short run works end to end."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=ROOT, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "jaxlm.train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config.optim.peak_lrr=1e-3"], "unknown config key 'optim.peak_lrr' (did you mean 'optim.peak_lr'?)"),
        (["--config.optim.lr=1e-3"], "unknown config key 'optim.lr' (did you mean 'optim.peak_lr'?)"),
        (["--config.optimizer.lr=1e-3"], "unknown config key 'optimizer.lr' (did you mean 'optim'?)"),
        (["--config.model.d_model=wide"], "--config.model.d_model=wide: expected an integer"),
        (["--config.model.scan_layers=maybe"], "expected a bool"),
        (["--config.optim.peak_lr=0"], "config.optim.peak_lr=0.0 is not allowed: a positive number"),
        (["--config.optim.peak_lr=-3e-4"], "config.optim.peak_lr=-0.0003 is not allowed"),
        (["--config.model.variant=mamba"], "config.model.variant='mamba' is not allowed: one of 'gpt2', 'llama'"),
        (["--config.model.n_kv_heads=3"], "config.model.n_kv_heads=3 is not allowed: a divisor of model.n_heads=4"),
        (["--config.mesh.fsdp=8", "--config.data.global_batch_size=12"],
         "global_batch_size=12 with optim.micro_batches=1 gives 12 sequences per micro-batch, which does not divide"),
        (["--config.mesh.fsdp=1", "--config.mesh.tensor=8"], "must be divisible by the tensor axis mesh.tensor=8"),
        (["--config.mesh.fsdp=3"], "config.mesh (data=1, fsdp=3, tensor=1) needs 3 devices but 8 are available"),
        (["--config.optim.micro_batches=5"], "a divisor of data.global_batch_size=16"),
        (["--steps=10"], "unrecognised argument '--steps=10'"),
        (["--config.run.xla_flags=--xla_bogus_flag=1"],
         "run.xla_flags: XLA (jax " + jax.__version__ + ") refuses them: Unknown flag in XLA_FLAGS: --xla_bogus_flag=1"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(args, expected):
    result = run_cli("--config=configs/tiny.py", *args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("jaxlm: error:")]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_a_missing_recipe_lists_the_recipes():
    result = run_cli("--config=configs/nope.py")
    assert result.returncode == 2
    assert "no recipe file 'configs/nope.py'" in result.stderr and "tiny" in result.stderr


def test_a_short_run_trains_and_writes_its_run_directory(tmp_path):
    result = run_cli(
        "--config=configs/tiny.py",
        f"--config.run.output_dir={tmp_path}",
        "--config.run.name=short",
        "--config.run.steps=30",
        "--config.run.log_every=10",
        "--config.run.eval_every=10",
        "--config.checkpoint.keep_last=1",
        "--config.checkpoint.keep_best=1",
        "--config.data.builtin_max_bytes=400000",
        "--config.data.val_fraction=0.3",  # 2 of the 12 documents
        "--config.model.vocab_size=512",
        f"--config.data.cache_dir={tmp_path / 'cache'}",
        "--config.mesh.fsdp=2",
        "--config.mesh.data=-1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "short"
    assert f"run directory {run_dir}" in result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    val = {r["step"]: r for r in records if "val_loss" in r}
    assert list(val) == [10, 20, 30]
    for r in val.values():
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]))
        # A BPE token of code stands for more than one byte, and every token for at least one.
        assert 0 < r["val_bits_per_byte"] < r["val_loss"] / math.log(2) < r["val_bits_per_byte"] * 8
    assert train[-1]["loss"] < train[0]["loss"] - 0.5  # it learns
    assert train[0]["lr"] < train[-1]["lr"] or train[10]["lr"] > train[0]["lr"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["vocab_size"] == 512 and config["mesh"]["fsdp"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["final_loss"] == train[-1]["loss"]
    assert (run_dir / "checkpoints" / "30" / "state").is_dir()
    assert (run_dir / "tokenizer.model").is_file()
    assert "jaxlm: done: 30 steps" in result.stdout
    assert all(r["model_tflops_per_device"] > 0 and "mfu" not in r for r in train)  # CPU: MFU unknown
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in train]
    assert [e.step for e in events.Scalars("val_bits_per_byte")] == [10, 20, 30]
    best = min(val, key=lambda step: val[step]["val_loss"])
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == sorted({best, 30})  # best + last


def test_bad_data_is_one_line_before_any_run_directory_is_made(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    for corpus, expected in [
        (str(tmp_path / "missing" / "*.jsonl"), "no input files match"),
        (str(bad), f"{bad}:2: not valid JSON"),
    ]:
        result = run_cli("--config=configs/tiny.py", f"--config.data.corpus={corpus}",
                         f"--config.run.output_dir={tmp_path}/runs")
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("policy", ["stop", pytest.param("skip", marks=pytest.mark.slow)])
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
