"""What a run reports, read back from the files a researcher opens: JSONL, TensorBoard (scalars and
histograms), a profiler trace, a Weights & Biases offline run, and the progress bar."""

import glob
import gzip
import json
import os
import pathlib
import struct
import subprocess

import floats
import numpy as np
import pytest
from command_forks import run_command
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 8


def run_cli(*argv: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    # One CPU device: with the profiler on, 8 fake CPU devices sometimes deadlock in XLA:CPU's
    # collectives (two all-gathers of one step entered in different orders by different device
    # threads, then "Termination timeout ... of 40 seconds"); nothing here needs a mesh. The suite's fast
    # compilation, if on: the run's two programs (init, step) compile for most of its time, its 8 steps are short.
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1",
               XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=1", fast_compile=True))
    return run_command("train", argv, cwd=ROOT, env=env, timeout=600)


def wandb_history(run_dir: pathlib.Path) -> list[dict[str, str]]:
    """History rows of an offline W&B run, read from its .wandb file: a LevelDB-style log of
    protobuf records (7-byte file header; 32 KiB blocks; each record: crc32 4, length 2, type 1)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    raw, pos, block = pathlib.Path(path).read_bytes(), 7, 32768
    records, partial = [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            records.append(data)
        elif kind in (2, 3):  # first, middle
            partial = data if kind == 2 else partial + data
        elif kind == 4:  # last
            records.append(partial + data)
    rows = []
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


def _has_wandb() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    """One run that reports everything; to W&B (offline) too where wandb is installed (the dev extra)."""
    tmp = tmp_path_factory.mktemp("obs")
    result = run_cli(
        "--config=configs/tiny.py", f"--config.run.output_dir={tmp}", f"--config.run.steps={STEPS}",
        "--config.run.log_every=4", "--config.data.builtin_max_bytes=400000", "--config.model.vocab_size=512",
        "--config.data.seq_len=64",  # half the recipe's rows: every metric is per step or per parameter
        f"--config.data.cache_dir={tmp / 'cache'}", "--config.metrics.grad_norm_per_layer=true",
        "--config.metrics.histograms_every=4", f"--config.metrics.wandb={str(_has_wandb()).lower()}",
        "--config.metrics.progress=bar", "--config.profile.steps=3:4", "--config.run.peak_flops=1e12", tmp_path=tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "tiny", result


def test_every_step_has_norms_and_per_layer_gradient_norms(observed_run):
    run_dir, _ = observed_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        groups = {k: v for k, v in r.items() if k.startswith("grad_norm/")}
        assert set(groups) == {"grad_norm/embed", "grad_norm/final_norm", "grad_norm/unembed",
                               *(f"grad_norm/layer_{i:02d}" for i in range(4))}
        # The groups partition the parameters: their squares add up to the global norm's square.
        np.testing.assert_allclose(np.sqrt(sum(v * v for v in groups.values())), r["grad_norm"], rtol=1e-4)
        assert r["param_norm"] > 0
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"])  # one device
    assert train[0]["param_norm"] != train[-1]["param_norm"]  # the parameters moved


def test_tensorboard_has_the_scalars_and_parameter_histograms(observed_run):
    run_dir, _ = observed_run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("grad_norm/layer_03")] == list(range(1, STEPS + 1))
    assert [e.step for e in events.Scalars("param_norm")] == list(range(1, STEPS + 1))
    wq = events.Histograms("params/blocks/attn/wq/kernel")
    assert [h.step for h in wq] == [4, 8]
    assert all(sum(h.histogram_value.bucket) == h.histogram_value.num == 4 * 128 * 4 * 32 for h in wq)


def test_profile_trace_holds_the_requested_steps(observed_run):
    run_dir, result = observed_run
    (trace,) = glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    assert glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))  # for TensorBoard
    events = json.load(gzip.open(trace))["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert steps == [3, 4]
    assert "profile of steps 3-4 written to" in result.stdout


def test_run_throughput_leaves_out_the_profiled_steps(observed_run):
    """The summary's tokens/s is the mean over the timed steps: not the first (compilation), nor the
    intervals the trace distorts (steps 2-4 for a trace of 3:4: its start, the traced steps, writing it out);
    its data_time_fraction is the share of those steps' time the loop spent on their batches."""
    run_dir, _ = observed_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}
    tokens_per_step = rows[0]["tokens"]
    timed = [seconds[s] for s in range(5, STEPS + 1)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_per_s"] == pytest.approx(tokens_per_step * len(timed) / sum(timed), rel=1e-9)
    with_trace = [seconds[s] for s in range(2, STEPS + 1)]
    assert summary["tokens_per_s"] != pytest.approx(tokens_per_step * len(with_trace) / sum(with_trace), rel=1e-6)
    # each step's seconds spent on its batch, and over the same timed steps their share of the time
    data = {r["step"]: r["data_time_s"] for r in rows if "data_time_s" in r}
    assert sorted(data) == list(range(1, STEPS + 1)) and all(v > 0 for v in data.values())
    assert summary["data_time_fraction"] == pytest.approx(sum(data[s] for s in range(5, STEPS + 1)) / sum(timed),
                                                          rel=1e-9)


def test_the_summary_and_the_last_line_give_mfu_with_its_definition(observed_run):
    """MFU over the same timed steps as tokens/s, against the peak given (run.peak_flops: a CPU's is unknown),
    with the model FLOPs it counts and its definition beside it, so a reader can set it against the peers'."""
    from jaxlm import metrics

    run_dir, result = observed_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    devices = round(rows[-1]["tokens_per_s"] / rows[-1]["tokens_per_s_per_device"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_flops_per_device"] == 1e12 and summary["mfu_definition"] == metrics.MFU_DEFINITION
    assert summary["tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / devices, rel=1e-12)
    assert summary["mfu"] == pytest.approx(
        summary["model_flops_per_token"] * summary["tokens_per_s"] / devices / 1e12, rel=1e-12)
    for r in rows:  # each step's, from the same model FLOPs
        assert r["mfu"] == pytest.approx(r["model_tflops_per_device"] * 1e12 / 1e12, rel=1e-9)
    done = next(line for line in result.stdout.splitlines() if line.startswith("jaxlm: done:"))
    assert f"MFU {100 * summary['mfu']:.1f}% (causal attention counted half, of the bf16 peak)" in done


@pytest.mark.skipif(not _has_wandb(), reason="wandb is not installed (pip install -e '.[dev]' installs it)")
def test_wandb_offline_run_has_the_same_values(observed_run):
    run_dir, _ = observed_run
    rows = wandb_history(run_dir)
    losses = {int(r["_step"]): float(r["loss"]) for r in rows if "loss" in r}
    expected = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if "loss" in r}
    floats.identical(losses, expected, why=floats.MOVED)  # the values logged, sent to W&B as well
    assert any("params/blocks/attn/wq/kernel/values" in r for r in rows)  # the histograms went there too
    assert (run_dir / "wandb_id").read_text().strip()  # a resumed run continues this W&B run


def test_progress_bar_reaches_the_last_step(observed_run):
    _, result = observed_run
    assert f"{STEPS}/{STEPS} [" in result.stdout and "tok/s" in result.stdout


def test_bad_profile_steps_is_one_line(tmp_path):
    result = run_cli("--config=configs/tiny.py", "--config.profile.steps=5:2", tmp_path=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "jaxlm: error: config.profile.steps='5:2' is not allowed: 'start:end' with 1 <= start <= end, e.g. '10:12'"
    )
