"""The MFU harness runs on CPU and its numbers are consistent with each other and with the config."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_mfu_harness_sweeps_and_reports_consistent_numbers(tmp_path):
    out = tmp_path / "mfu.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/mfu.py", "--recipe", "tiny", "--steps", "2", "--warmup", "1",
         "--peak_tflops", "0.5", "--set", "data.global_batch_size=8", "--sweep", "model.remat=none,full,bogus",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 1, result.stderr[-2000:]  # one point failed, the others ran
    none, full, bogus = json.loads(out.read_text())
    assert bogus["status"].startswith("error:") and "model.remat" in bogus["status"]
    from jaxlm import config
    from jaxlm.models.transformer import ModelConfig, flops_per_token

    flops = flops_per_token(ModelConfig.from_config(config.load_recipe("tiny").model), 128) * 8 * 128
    for r in (none, full):
        assert r["status"] == "ok" and r["batch"] == "8x128"
        devices = int(r["devices"].split("x")[0])  # the tests' 8 fake CPU devices
        assert r["tokens_per_s"] == pytest.approx(8 * 128 / r["step_s"], rel=1e-3)
        assert r["tflops_per_device"] == pytest.approx(flops / r["step_s"] / devices / 1e12, rel=2e-2, abs=1e-3)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5, rel=2e-2, abs=2e-3)  # against --peak_tflops
    assert full["loss"] == pytest.approx(none["loss"], rel=1e-3)  # remat recomputes, it does not change the math
    assert full["peak_memory_gib"] < none["peak_memory_gib"]  # and it is what saves memory
    table = result.stdout.strip().splitlines()
    assert table[-5].startswith("| batch | remat |")  # the table of every point comes last
    assert "| none |" in table[-3] and "| full |" in table[-2] and "error" in table[-1]
