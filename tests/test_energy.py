"""Energy, carbon and cost (jaxlm.energy): the counters against a fake powercap tree and a stand-in
with NVML's interface, the estimate and its label, the accounts across a resume, the planner's
arithmetic, and a real run's metrics, TensorBoard scalars and summary."""

from __future__ import annotations

import json
import pathlib
import types

import pytest

from jaxlm import config, energy


def energy_cfg(**overrides):
    cfg = config.base_config()
    for key, value in overrides.items():
        cfg.energy[key] = value
    config.validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- RAPL


def zone(root: pathlib.Path, name: str, label: str, uj: int | None, top: int = 1_000_000_000) -> pathlib.Path:
    z = root / name
    z.mkdir(parents=True)
    (z / "name").write_text(label + "\n")
    (z / "max_energy_range_uj").write_text(f"{top}\n")
    if uj is not None:
        (z / "energy_uj").write_text(f"{uj}\n")
    return z


def set_uj(z: pathlib.Path, uj: int) -> None:
    (z / "energy_uj").write_text(f"{uj}\n")


def test_rapl_sums_packages_and_dram_and_survives_a_counter_wrap(tmp_path):
    pkg0 = zone(tmp_path, "intel-rapl:0", "package-0", 100_000_000)
    dram0 = zone(tmp_path, "intel-rapl:0:1", "dram", 5_000_000)
    core0 = zone(tmp_path, "intel-rapl:0:0", "core", 7_000_000)  # inside the package: not added again
    pkg1 = zone(tmp_path, "intel-rapl:1", "package-1", 999_000_000)  # 1 J below its range
    psys = zone(tmp_path, "intel-rapl:2", "psys", 0)  # the whole platform: would count everything twice
    reader, why = energy.RaplReader.open(tmp_path)
    assert why == "" and reader.measured and reader.source == "rapl"
    assert "package-0" in reader.describe() and "dram" in reader.describe() and "core" not in reader.describe()
    set_uj(pkg0, 130_000_000)   # +30 J
    set_uj(dram0, 7_000_000)    # +2 J
    set_uj(core0, 900_000_000)  # ignored
    set_uj(pkg1, 4_000_000)     # wrapped: +1 J to the top, then +4 J
    set_uj(psys, 500_000_000)   # ignored
    assert reader.joules() == pytest.approx(30 + 2 + 5)
    set_uj(pkg0, 131_000_000)   # +1 J more; the others unchanged
    assert reader.joules() == pytest.approx(38)


def test_rapl_missing_files_and_denied_counters_fall_back_with_the_reason(tmp_path, monkeypatch):
    assert energy.RaplReader.open(tmp_path / "nowhere")[0] is None
    zone(tmp_path, "intel-rapl:0", "package-0", None)  # no energy_uj
    reader, why = energy.RaplReader.open(tmp_path)
    assert reader is None and "intel-rapl:0" in why and "FileNotFoundError" in why

    set_uj(tmp_path / "intel-rapl:0", 1)
    real = energy.RaplReader._read

    def denied(path):  # what a non-root user meets on kernels since 2020 (CVE-2020-8694); root here reads all
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(energy.RaplReader, "_read", staticmethod(denied))
    reader, why = energy.RaplReader.open(tmp_path)
    assert reader is None and "permission denied" in why
    # and a run on this CPU estimates instead, saying so
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu", id=0)
    reader, line = energy.open_reader(energy_cfg().energy, [cpu], rapl_root=tmp_path)
    assert isinstance(reader, energy.EstimateReader) and not reader.measured
    assert line.startswith("energy: estimated") and "permission denied" in line
    with pytest.raises(energy.UserError, match="energy.source='rapl' cannot be read here"):
        energy.open_reader(energy_cfg(source="rapl").energy, [cpu], rapl_root=tmp_path)


# ----------------------------------------------------------------------------- NVML


class FakeNvml:
    """NVML's interface as nvidia-ml-py exposes it (the calls jaxlm makes), over counters a test moves."""

    class NVMLError(Exception):
        pass

    def __init__(self, count: int = 4, fail: bool = False):
        self.millijoules = [1_000_000 * (i + 1) for i in range(count)]
        self.fail = fail

    def nvmlInit(self):
        if self.fail:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(self, index):
        if index >= len(self.millijoules):
            raise self.NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return int(uuid.removeprefix("GPU-"))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self.millijoules[handle]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000


def gpus(n: int, kind: str = "NVIDIA H100 80GB HBM3"):
    return [types.SimpleNamespace(platform="gpu", device_kind=kind, id=i, local_hardware_id=i) for i in range(n)]


def test_nvml_reads_this_processs_gpus_through_cuda_visible_devices(monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    reader, line = energy.open_reader(energy_cfg().energy, gpus(2), nvml=nvml)
    assert isinstance(reader, energy.NvmlReader) and reader.measured and line.startswith("energy: measured")
    nvml.millijoules[0] += 9_999_000  # not this process's GPU
    nvml.millijoules[2] += 1_500_000
    nvml.millijoules[3] += 2_000_000
    assert reader.joules() == pytest.approx(3500.0)
    assert reader.power_limits_w() == [700.0, 700.0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1")
    reader, _ = energy.NvmlReader.open(gpus(1), nvml)
    nvml.millijoules[1] += 250
    assert reader.joules() == pytest.approx(0.25)


def test_without_nvml_a_gpu_is_estimated_from_the_table_and_labelled(monkeypatch):
    reader, line = energy.open_reader(energy_cfg().energy, gpus(2), nvml=FakeNvml(fail=True))
    assert isinstance(reader, energy.EstimateReader) and not reader.measured
    assert "estimated: 700 W x 2 device(s) x wall time" in line and "Driver Not Loaded" in line
    clock = iter([100.0, 130.0])  # 30 s of wall time
    reader = energy.EstimateReader(700.0, 2, cpu=False, clock=lambda: next(clock))
    assert reader.joules() == pytest.approx(700 * 2 * 30)
    cpu_clock = iter([5.0, 25.0])  # 20 s of this process's CPU time
    reader = energy.EstimateReader(6.0, 1, cpu=True, cpu_clock=lambda: next(cpu_clock))
    assert reader.joules() == pytest.approx(120.0) and "per busy core" in reader.describe()
    # a table entry the user adds wins; a device in no table is not metered, and the line says how to fix it
    _, line = energy.open_reader(energy_cfg(device_watts="H100=650").energy, gpus(1), nvml=FakeNvml(fail=True))
    assert "650 W" in line
    tpu = [types.SimpleNamespace(platform="tpu", device_kind="TPU v9", id=0)]
    reader, line = energy.open_reader(energy_cfg().energy, tpu)
    assert reader is None and "energy.device_watts='TPU v9=<watts>'" in line


# ----------------------------------------------------------------------------- a run's accounts


def test_the_accounts_across_a_resume_count_each_joule_once():
    """Every process's joules are summed; a resumed segment counts on from the checkpoint's total, so a
    run killed after its checkpoint at step 10 and resumed ends with the uninterrupted run's total: the
    lost steps' energy (spent, in no checkpoint) is not counted, and nothing is counted twice."""
    cfg = energy_cfg(price_per_kwh=0.2, price_per_device_hour=2.0, grid_gco2e_per_kwh=400.0, poll_s=60.0)
    nvml = FakeNvml(count=1)

    def burn(joules):
        nvml.millijoules[0] += int(joules * 1e3)

    two_processes = lambda mj: [mj, mj]  # noqa: E731  (this process's millijoules, and another's equal share)
    settings = energy.EnergyConfig.from_config(cfg.energy)
    whole = energy.RunMeter(settings, gpus(1), 2, sum_processes=two_processes, nvml=nvml)
    burn(1000)
    first = whole.interval(1, 100)
    assert first["energy_j"] == pytest.approx(2000) and "energy_j_per_step" not in first  # start-up: no per-step
    burn(500)
    at_10 = whole.interval(10, 100)
    assert at_10["energy_j_per_step"] == pytest.approx(1000 / 9) and at_10["energy_j_per_token"] == pytest.approx(1000 / 900)
    checkpoint_j = whole.run_joules()
    burn(700)  # the uninterrupted run's steps 11-20
    uninterrupted = whole.run_joules()
    whole.close()

    burn(300)  # another run's steps 11-15, then it is killed: spent, but in no checkpoint
    resumed = energy.RunMeter(settings, gpus(1), 2, before_j=0.0, sum_processes=two_processes, nvml=nvml)
    resumed.rebase(checkpoint_j, 0.0)  # the checkpoint restored
    burn(700)  # steps 11-20 again
    out = resumed.interval(20, 100)
    resumed.close()
    assert out["energy_j"] == pytest.approx(uninterrupted) == pytest.approx(2 * (1000 + 500 + 700))
    assert out["energy_kwh"] == pytest.approx(out["energy_j"] / 3.6e6)
    assert out["co2e_kg"] == pytest.approx(out["energy_kwh"] * 0.4)
    assert out["cost"] == pytest.approx(out["energy_kwh"] * 0.2 + out["device_hours"] * 2.0)
    assert out["energy_measured"] == 1.0


def test_the_prediction_is_the_hand_calculation():
    """1e21 FLOPs on 8 H100s at 40% MFU: 1e21 / (8 x 989e12 x 0.4) s each; 700 W per device."""
    cfg = energy_cfg(assume_mfu=0.4, price_per_device_hour=2.5, price_per_kwh=0.1, grid_gco2e_per_kwh=300.0)
    p = energy.predict(1e21, 8, "NVIDIA H100 80GB HBM3", "gpu", 989e12, cfg.energy)
    seconds = 1e21 / (8 * 989e12 * 0.4)
    kwh = 700 * 8 * seconds / 3.6e6
    assert p["seconds"] == pytest.approx(seconds) and p["device_hours"] == pytest.approx(8 * seconds / 3600)
    assert p["energy_kwh"] == pytest.approx(kwh) and p["co2e_kg"] == pytest.approx(kwh * 0.3)
    assert p["cost"] == pytest.approx(8 * seconds / 3600 * 2.5 + kwh * 0.1)
    line = energy.format_prediction(p, "1b")
    assert f"{8 * seconds / 3600:,.1f} device-hours" in line and f"{kwh:,.1f} kWh" in line
    # energy.device names what to assume; a CPU or an unknown peak predicts nothing
    assert energy.predict(1e21, 8, "cpu", "cpu", None, cfg.energy) is None


def test_plan_prints_the_runs_energy():
    from jaxlm import plan

    cfg = config.load_recipe("1b")
    config.apply_overrides(cfg, [("run.steps", "1000"), ("energy.device", "H200")])
    report = plan.plan(cfg, 8, 80 * 2**30)
    e = report["energy"]
    from jaxlm.models import transformer

    flops = transformer.flops_per_token(transformer.ModelConfig.from_config(cfg.model, "gpu"), 2048) * 1000 * 256 * 2048
    assert e["device"] == "H200" and e["model_flops"] == pytest.approx(flops)
    assert e["energy_kwh"] == pytest.approx(700 * flops / (989e12 * 0.45) / 3.6e6)
    assert "energy: 1b, 1,000 steps" in plan.format_report(report)


# ----------------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_a_run_reports_its_energy_and_a_resume_counts_on(tmp_path):
    """The tiny recipe on this CPU (an estimate here: RAPL is not readable): energy figures at the logging
    steps in metrics.jsonl and TensorBoard, the totals in summary.json; resumed, the run's total counts on
    from its checkpoint's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from helpers import train_tiny
    from jaxlm import checkpoint

    def run(steps):
        return train_tiny(tmp_path, "e", ("run.steps", str(steps)), ("run.log_every", "4"),
                          ("checkpoint.every_steps", "4"), ("energy.price_per_device_hour", "3.0"),
                          ("energy.poll_s", "0.05"))

    first = run(8)
    assert first["energy_source"] in ("rapl", "estimate") and first["energy_j"] > 0
    assert first["energy_measured"] == (first["energy_source"] == "rapl")
    assert first["cost"] == pytest.approx(first["device_hours"] * 3.0 + 0)
    with checkpoint.Checkpointer(tmp_path / "e" / "checkpoints") as ckpt:
        saved = ckpt.read_meta(8)
    assert 0 < saved["energy_j"] <= first["energy_j"]
    second = run(12)
    assert second["energy_j"] > saved["energy_j"] and second["device_hours"] > first["device_hours"]
    records = [json.loads(line) for line in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["energy_j"]) for r in records if "energy_j" in r]
    assert [s for s, _ in logged] == [1, 4, 8, 9, 12]  # the first step of each segment, then every 4
    assert all(b >= a for (_, a), (_, b) in zip(logged, logged[1:]))  # cumulative across the resume
    assert logged[3][1] >= saved["energy_j"]
    assert all("power_w" in r and "energy_j_per_token" in r for r in records if r["step"] in (4, 8, 12) and "loss" in r)
    events = EventAccumulator(str(tmp_path / "e" / "tensorboard")).Reload()
    assert {"energy_kwh", "power_w", "co2e_kg"} <= set(events.Tags()["scalars"])


def test_a_counter_that_fails_mid_run_keeps_the_last_total():
    """NVML can fail while a run goes on (a GPU reset, a driver reload): the meter keeps the total it had
    and the training loop never sees the error."""
    nvml = FakeNvml(count=1)
    reader, _ = energy.NvmlReader.open(gpus(1), nvml)
    poller = energy.Poller(reader, every_s=3600)
    nvml.millijoules[0] += 5_000
    assert poller.joules() == pytest.approx(5.0)

    def broken(handle):
        raise FakeNvml.NVMLError("GPU is lost")

    nvml.nvmlDeviceGetTotalEnergyConsumption = broken
    assert poller.joules() == pytest.approx(5.0) and poller.joules() == pytest.approx(5.0)
    poller.close()


def test_ablation_tables_show_energy_per_variant_marked_when_estimated():
    from jaxlm import experiment

    def row(variant, wh, drop_wh, measured):
        return {"variant": variant, "status": "done", "overrides": "{}", "final_loss": 3.0, "best_loss": 3.0,
                "final_val_loss": 3.1, "best_val_loss": 3.1, "final_val_bits_per_byte": None,
                "best_val_bits_per_byte": None, "tokens_per_s": 1000.0, "energy_wh": wh,
                "wh_per_loss_drop": drop_wh, "energy_measured": measured}

    table = experiment.variant_table([row("a", 2.0, 0.5, 1.0), row("a", 4.0, 1.5, 1.0), row("b", 9.0, 3.0, 0.0)])
    assert table.columns[-2:] == ["energy (Wh)", "Wh per nat of loss"]
    cells = {r[0].strip("*"): r for r in table.rows}
    assert cells["a"][-2:] == ["3", "1"] and cells["b"][-2:] == ["9 (est.)", "3 (est.)"]


@pytest.mark.parametrize("overrides, words", [
    (dict(price_per_kwh=-0.1), "config.energy.price_per_kwh=-0.1 is not allowed: 0 or more"),
    (dict(grid_gco2e_per_kwh=-1.0), "grid_gco2e_per_kwh=-1.0"),
    (dict(device_watts="H100=-5"), "kind=watts pairs with watts > 0"),
    (dict(device_watts="H100"), "kind=watts pairs"),
    (dict(device="Z80"), "config.energy.device='Z80' is not in the power table"),
    (dict(source="smart-plug"), "config.energy.source='smart-plug' is not allowed"),
    (dict(assume_mfu=1.5), "assume_mfu=1.5"),
])
def test_bad_energy_settings_are_one_line(overrides, words):
    with pytest.raises(energy.UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        energy_cfg(**overrides)
    assert energy_cfg(device="Z80", device_watts="Z80=40").energy.device == "Z80"  # a device the user adds is known
