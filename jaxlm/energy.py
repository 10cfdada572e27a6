"""Energy, carbon and cost of a run: measured where the hardware has a counter, estimated (and labelled
so, everywhere it appears) where it has none.

Each process meters the devices it computes on, with the first source that works:

- ``nvml``: NVIDIA GPUs' cumulative energy counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules
  since the driver loaded; Volta and newer) through nvidia-ml-py (``import pynvml``). It agrees with
  nvidia-smi's power samples, integrated (checked on a GPU: benchmarks/BENCHMARKS.md, "Energy per run").
- ``rapl``: on CPU runs, the packages' and DRAM's counters under ``/sys/class/powercap`` (``intel-rapl:N``
  and their ``dram`` sub-zones; microjoules, wrapping at ``max_energy_range_uj``), where readable (recent
  kernels let only root read them).
- ``estimate``: a power figure per device (``DEVICE_WATTS``, overridden or extended by
  ``energy.device_watts``) times busy time: an accelerator counts as busy for the whole wall time, so
  the estimate is an upper bound; a CPU counts its process's CPU time, so its figure is watts per busy core.

A background thread reads the counters every ``energy.poll_s`` seconds (RAPL's wrap every few minutes at
full load, and the loop never waits on a read); the loop takes the accumulated joules at its logging
steps. Carbon is energy x ``energy.grid_gco2e_per_kwh``; cost is device-hours x
``energy.price_per_device_hour`` plus kWh x ``energy.price_per_kwh``.

`predict` is the planner's side: a run's energy, carbon and cost from its FLOPs, the device's peak, an
assumed MFU and the device's power.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import ml_collections

from jaxlm import distributed
from jaxlm.errors import UserError
from jaxlm.section import Section, setting

log = logging.getLogger(__name__)

# Board power (TDP) per device, watts, by a substring of `jax.Device.device_kind` (first match wins, so
# the more specific names come first). Vendors' datasheet figures; "cpu" is per busy core, an assumption
# (server parts run 3-7 W per core at full load, laptops more).
DEVICE_WATTS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 350.0),
    ("H100 NVL", 400.0),
    ("H100", 700.0),  # SXM
    ("H200 NVL", 600.0),
    ("H200", 700.0),  # SXM (a busy card ran at this limit: benchmarks/BENCHMARKS.md, "Energy per run")
    ("B200", 1000.0),
    ("A100", 400.0),  # SXM; the PCIe card is 250-300 W
    ("L40S", 350.0),
    ("L4", 72.0),
    ("A10", 150.0),
    ("T4", 70.0),
    ("V100", 300.0),
    ("cpu", 6.0),
)

KWH_J = 3.6e6  # joules in a kilowatt-hour


def parse_device_watts(text: str) -> list[tuple[str, float]]:
    """`energy.device_watts`, "kind=watts,kind=watts" -> [(kind, watts)]; UserError when malformed."""
    pairs = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        kind, sep, watts = item.rpartition("=")
        try:
            value = float(watts)
        except ValueError:
            value = -1.0
        if not sep or not kind.strip() or not value > 0:
            raise UserError(f"config.energy.device_watts={text!r} is not allowed: comma-separated kind=watts pairs "
                            f"with watts > 0, e.g. 'H100=700,cpu=5' (a kind matches part of the device's name)")
        pairs.append((kind.strip(), value))
    return pairs


def watts_table(cfg_energy: EnergyConfig | ml_collections.ConfigDict | None = None) -> list[tuple[str, float]]:
    """The power table in force: `energy.device_watts` entries first (the section, typed or as the config
    holds it), then DEVICE_WATTS."""
    extra = parse_device_watts(cfg_energy.device_watts) if cfg_energy is not None else []
    return [*extra, *DEVICE_WATTS]


def device_watts(device_kind: str, platform: str, table: Sequence[tuple[str, float]]) -> float | None:
    """A device's power figure from the table (CPUs: the "cpu" entry, watts per busy core); None if unknown."""
    name = "cpu" if platform == "cpu" else device_kind
    for kind, watts in table:
        if kind.lower() in name.lower() and (platform == "cpu") == (kind.lower() == "cpu"):
            return watts
    return None


SOURCES = ("auto", "nvml", "rapl", "estimate", "off")


@dataclasses.dataclass(frozen=True)
class EnergyConfig(Section):
    """Energy, carbon and cost of the run: metrics.jsonl, TensorBoard, the console, summary.json
    (`config.energy`)."""

    section: ClassVar[str] = "energy"
    source: str = setting("auto", "auto (NVML on NVIDIA GPUs, RAPL on CPUs, else an estimate) | nvml | rapl | "
                                  "estimate | off")
    device_watts: str = setting("", '"kind=watts,...": power figures added to (and before) the table, e.g. '
                                    '"H100=650,cpu=4"')
    poll_s: float = setting(5.0, "seconds between counter reads, on a background thread")
    grid_gco2e_per_kwh: float = setting(
        480.0, "carbon intensity of the electricity: about the world's 2023 average (Ember)")
    price_per_kwh: float = setting(0.0, "the electricity's price (0 = not priced)")
    price_per_device_hour: float = setting(0.0, "the machines' price per device per hour (0 = not priced)")
    device: str = setting("", "jaxlm.plan's prediction: the device kind to assume (\"\" = the target's or this "
                              "machine's)")
    assume_mfu: float = setting(0.45, "... and the MFU it assumes (benchmarks/BENCHMARKS.md has measured ones)")

    def validate(self) -> None:
        for key in ("grid_gco2e_per_kwh", "price_per_kwh", "price_per_device_hour"):
            if not getattr(self, key) >= 0:
                raise UserError(f"config.energy.{key}={getattr(self, key)!r} is not allowed: 0 or more")
        if not self.poll_s > 0:
            raise UserError(f"config.energy.poll_s={self.poll_s!r} is not allowed: seconds between counter reads, "
                            f"more than 0")
        if not 0 < self.assume_mfu <= 1:
            raise UserError(f"config.energy.assume_mfu={self.assume_mfu!r} is not allowed: a fraction in (0, 1], "
                            f"e.g. 0.45")
        if self.source not in SOURCES:
            raise UserError(f"config.energy.source={self.source!r} is not allowed: one of "
                            f"{', '.join(repr(s) for s in SOURCES)}")
        table = watts_table(self)
        if self.device and device_watts(self.device, "cpu" if self.device.lower() == "cpu" else "gpu", table) is None:
            known = ", ".join(k for k, _ in table)
            raise UserError(f"config.energy.device={self.device!r} is not in the power table ({known}); add it with "
                            f"config.energy.device_watts='{self.device}=<watts>'")


# ----------------------------------------------------------------------------- counters


class NvmlReader:
    """NVML's energy counters of this process's GPUs: joules since `__init__`."""

    source, measured = "nvml", True

    def __init__(self, nvml: Any, handles: Sequence[Any]):
        self._nvml, self._handles = nvml, list(handles)
        self._start = [self._read(h) for h in self._handles]

    def _read(self, handle) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3  # millijoules

    def joules(self) -> float:
        return sum(self._read(h) - s for h, s in zip(self._handles, self._start, strict=True))

    def power_limits_w(self) -> list[float]:
        return [self._nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3 for h in self._handles]

    def describe(self) -> str:
        return f"NVML energy counters of {len(self._handles)} GPU(s)"

    @classmethod
    def open(cls, devices: Sequence[Any], nvml: Any = None) -> tuple[NvmlReader | None, str]:
        """(reader, "") for `devices` (jax GPU devices of this process), or (None, why not)."""
        if not devices or any(d.platform != "gpu" for d in devices):
            return None, "not NVIDIA GPUs"
        try:
            if nvml is None:
                import pynvml as nvml  # local import: optional dependency (pip install jaxlm[cuda12])
            nvml.nvmlInit()
            visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            handles = []
            for d in devices:
                ordinal = getattr(d, "local_hardware_id", None)
                ordinal = d.id if ordinal is None else ordinal
                entry = visible[ordinal] if ordinal < len(visible) else str(ordinal)
                handles.append(nvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                               else nvml.nvmlDeviceGetHandleByUUID(entry))
            return cls(nvml, handles), ""
        except ImportError:
            return None, "nvidia-ml-py (pynvml) is not installed"
        except Exception as e:  # NVMLError_NotSupported (pre-Volta), no driver, no permission
            return None, f"NVML: {type(e).__name__}: {e}"


class RaplReader:
    """RAPL's package and DRAM counters under a powercap tree: joules since `__init__`, wraps included
    (as long as reads come more often than a counter's range lasts: minutes at full load)."""

    source, measured = "rapl", True

    def __init__(self, zones: Sequence[tuple[str, pathlib.Path, float]]):
        self._zones = list(zones)  # (name, energy_uj path, max_energy_range_uj)
        self._last = [self._read(path) for _, path, _ in self._zones]
        self._total = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def _read(path: pathlib.Path) -> int:
        with open(path) as f:
            return int(f.read().strip())

    def joules(self) -> float:
        with self._lock:
            for i, (_, path, top) in enumerate(self._zones):
                now = self._read(path)
                delta = now - self._last[i]
                if delta < 0:  # the counter wrapped past max_energy_range_uj
                    delta += top
                self._total += delta / 1e6
                self._last[i] = now
            return self._total

    def describe(self) -> str:
        return "RAPL counters " + ", ".join(name for name, _, _ in self._zones)

    @classmethod
    def open(cls, root: str | os.PathLike = "/sys/class/powercap") -> tuple[RaplReader | None, str]:
        """(reader, "") over the packages and their DRAM zones under `root`, or (None, why not)."""
        root = pathlib.Path(root)
        zones, problems = [], []
        for zone in sorted(root.glob("intel-rapl:*")):
            parts = zone.name.split(":")
            try:
                name = (zone / "name").read_text().strip()
            except OSError as e:
                problems.append(f"{zone.name}: {type(e).__name__}")
                continue
            package = len(parts) == 2 and name.startswith("package")
            if not (package or (len(parts) == 3 and name == "dram")):
                continue  # core, uncore: inside their package; psys: the whole platform
            try:
                top = float((zone / "max_energy_range_uj").read_text().strip())
                cls._read(zone / "energy_uj")
            except PermissionError:
                problems.append(f"{zone.name}/energy_uj: permission denied (only root may read it)")
                continue
            except (OSError, ValueError) as e:
                problems.append(f"{zone.name}: {type(e).__name__}")
                continue
            zones.append((f"{name}({zone.name})", zone / "energy_uj", top))
        if not any(n.startswith("package") for n, _, _ in zones):
            why = "; ".join(problems) if problems else f"no RAPL package zones under {root}"
            return None, why
        return cls(zones), ""


class EstimateReader:
    """Joules estimated from a power figure: accelerators x wall time, CPUs per busy core x CPU time."""

    source, measured = "estimate", False

    def __init__(self, watts: float, num_devices: int, cpu: bool,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = lambda: sum(os.times()[:2])):
        self.watts, self.num_devices, self.cpu = watts, num_devices, cpu
        self._clock = cpu_clock if cpu else clock
        self._start = self._clock()

    def joules(self) -> float:
        busy = self._clock() - self._start
        return self.watts * busy * (1 if self.cpu else self.num_devices)

    def describe(self) -> str:
        return (f"estimated: {self.watts:g} W per busy core x this process's CPU time" if self.cpu else
                f"estimated: {self.watts:g} W x {self.num_devices} device(s) x wall time")


def open_reader(cfg_energy: EnergyConfig | ml_collections.ConfigDict, devices: Sequence[Any],
                rapl_root: str | os.PathLike = "/sys/class/powercap", nvml: Any = None):
    """The first source that works for this process's `devices` (or the one `energy.source` names):
    (reader or None, a line saying what is metered and how, or why nothing is)."""
    want = cfg_energy.source
    if want == "off" or not devices:
        return None, "energy: off"
    platform, kind = devices[0].platform, devices[0].device_kind
    tried = []
    if want in ("auto", "nvml") and platform == "gpu":
        reader, why = NvmlReader.open(devices, nvml)
        if reader:
            return reader, f"energy: measured ({reader.describe()})"
        tried.append(why)
    if want in ("auto", "rapl") and platform == "cpu":
        reader, why = RaplReader.open(rapl_root)
        if reader:
            return reader, f"energy: measured ({reader.describe()})"
        tried.append(why)
    if want in ("nvml", "rapl"):
        raise UserError(f"config.energy.source={want!r} cannot be read here ({'; '.join(tried) or platform}); "
                        f"use 'auto' or 'estimate'")
    watts = device_watts(kind, platform, watts_table(cfg_energy))
    if watts is None:
        return None, (f"energy: not metered: no counter ({'; '.join(tried) or 'none for ' + platform}) and no power "
                      f"figure for {kind!r}; set config.energy.device_watts='{kind}=<watts>' to estimate it")
    reader = EstimateReader(watts, len(devices), cpu=platform == "cpu")
    return reader, f"energy: {reader.describe()}" + (f" (no counter: {'; '.join(tried)})" if tried else "")


class Poller:
    """Reads a reader every `every_s` seconds on a daemon thread; `joules()` is the latest total (and reads
    once more, so a caller sees the energy up to now)."""

    def __init__(self, reader, every_s: float):
        self.reader, self._every = reader, every_s
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._latest = 0.0
        self._thread = threading.Thread(target=self._loop, name="jaxlm-energy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            self._sample()

    def _sample(self) -> float:
        try:
            value = self.reader.joules()
        except Exception as e:  # a counter that went away (OSError, NVMLError): keep the last total
            log.warning("energy: reading %s failed (%s); the totals stop here", self.reader.describe(), e)
            self._stop.set()
            return self._latest
        with self._lock:
            self._latest = max(self._latest, value)
            return self._latest

    def joules(self) -> float:
        return self._latest if self._stop.is_set() else self._sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ----------------------------------------------------------------------------- a run's accounts


@dataclasses.dataclass
class Prices:
    grid_gco2e_per_kwh: float
    price_per_kwh: float
    price_per_device_hour: float

    @classmethod
    def from_config(cls, e: EnergyConfig | ml_collections.ConfigDict) -> Prices:
        return cls(e.grid_gco2e_per_kwh, e.price_per_kwh, e.price_per_device_hour)

    @property
    def priced(self) -> bool:
        return self.price_per_kwh > 0 or self.price_per_device_hour > 0

    def co2e_kg(self, joules: float) -> float:
        return joules / KWH_J * self.grid_gco2e_per_kwh / 1e3

    def cost(self, joules: float, device_hours: float) -> float:
        return joules / KWH_J * self.price_per_kwh + device_hours * self.price_per_device_hour


class RunMeter:
    """A run's energy across its processes and restarts. `interval` is called by every process at the
    same logging steps (it sums the processes' joules, a collective); `before_j` is what earlier
    segments of the run (before a resume) recorded in the checkpoint."""

    def __init__(self, settings: EnergyConfig, devices: Sequence[Any], num_devices: int,
                 before_j: float = 0.0, before_device_s: float = 0.0,
                 sum_processes: Callable[[int], list[int]] | None = None, **open_kwargs):
        self.prices = Prices.from_config(settings)
        reader, self.line = open_reader(settings, devices, **open_kwargs)
        self.measured = bool(reader and reader.measured)
        self.source = reader.source if reader else "off"
        self._poller = Poller(reader, settings.poll_s) if reader else None
        self._sum = sum_processes or distributed.all_values
        self.num_devices = num_devices
        self.before_j, self.before_device_s = before_j, before_device_s
        self._start = time.monotonic()
        self._last_j, self._last_t, self._last_step = before_j, self._start, None
        self.total_j = before_j

    def rebase(self, before_j: float, before_device_s: float) -> None:
        """The earlier segments' totals, from the checkpoint actually restored (an older one than first
        read, when the newest did not restore)."""
        self.before_j, self.before_device_s = before_j, before_device_s
        self._last_j = self.total_j = before_j

    @property
    def active(self) -> bool:
        return self._poller is not None

    def run_joules(self) -> float:
        """The run's joules so far, all processes, earlier segments included (a collective)."""
        mine = self._poller.joules() if self._poller else 0.0
        self.total_j = self.before_j + sum(self._sum(int(round(mine * 1e3)))) / 1e3  # millijoules: an int gather
        return self.total_j

    def device_seconds(self) -> float:
        return self.before_device_s + (time.monotonic() - self._start) * self.num_devices

    def interval(self, step: int, tokens_per_step: int) -> dict[str, float]:
        """Metrics for the steps since the last call (or since this segment began): joules per step
        and token, mean power, and the run's cumulative kWh, carbon and cost."""
        if not self.active:
            return {}
        total, now = self.run_joules(), time.monotonic()
        steps = step - self._last_step if self._last_step is not None else None
        delta_j, delta_t = total - self._last_j, now - self._last_t
        self._last_j, self._last_t, self._last_step = total, now, step
        out = self.totals()
        if delta_t > 0:
            out["power_w"] = delta_j / delta_t
        if steps:  # the first interval of a segment includes start-up and compilation: no per-step figure
            out["energy_j_per_step"] = delta_j / steps
            out["energy_j_per_token"] = delta_j / (steps * tokens_per_step)
            out["energy_kwh_per_mtok"] = delta_j / (steps * tokens_per_step) * 1e6 / KWH_J
        return out

    def totals(self) -> dict[str, float]:
        """The cumulative figures as of the last reading (no collective)."""
        hours = self.device_seconds() / 3600
        out = {"energy_kwh": self.total_j / KWH_J, "energy_j": self.total_j, "device_hours": hours,
               "co2e_kg": self.prices.co2e_kg(self.total_j), "energy_measured": float(self.measured)}
        if self.prices.priced:
            out["cost"] = self.prices.cost(self.total_j, hours)
        return out

    def describe_totals(self) -> str:
        t = self.totals()
        how = f"measured, {self.source}" if self.measured else "estimated"
        cost = f", cost {t['cost']:,.2f}" if "cost" in t else ""
        return f"energy {format_energy(t['energy_j'])} ({how}), {format_mass(t['co2e_kg'])} CO2e{cost}"

    def close(self) -> None:
        if self._poller:
            self._poller.close()


def format_energy(joules: float) -> str:
    """Joules as Wh below a kWh, else kWh (3 significant figures)."""
    return f"{joules / 3600:.3g} Wh" if joules < KWH_J else f"{joules / KWH_J:,.3g} kWh"


def format_mass(kg: float) -> str:
    return f"{kg * 1e3:.3g} g" if kg < 1 else f"{kg:,.3g} kg"


# ----------------------------------------------------------------------------- before a run


def predict(model_flops: float, num_devices: int, device_kind: str, platform: str, peak_flops: float | None,
            cfg_energy: ml_collections.ConfigDict) -> dict[str, Any] | None:
    """A run's time, device-hours, energy, carbon and cost from its model FLOPs, the devices' peak,
    `energy.assume_mfu` and the device's power figure (all devices at that power throughout); None
    where the peak or the power is unknown."""
    kind = cfg_energy.device or device_kind
    device_platform = "cpu" if kind.lower() == "cpu" else platform
    watts = device_watts(kind, device_platform, watts_table(cfg_energy))
    if not peak_flops or watts is None or device_platform == "cpu":
        return None
    mfu = cfg_energy.assume_mfu
    seconds = model_flops / (num_devices * peak_flops * mfu)
    hours = seconds * num_devices / 3600
    joules = watts * num_devices * seconds
    prices = Prices.from_config(cfg_energy)
    out = {"device": kind, "devices": num_devices, "assume_mfu": mfu, "watts": watts, "seconds": seconds,
           "device_hours": hours, "energy_kwh": joules / KWH_J, "co2e_kg": prices.co2e_kg(joules),
           "grid_gco2e_per_kwh": prices.grid_gco2e_per_kwh}
    if prices.priced:
        out["cost"] = prices.cost(joules, hours)
    return out


def format_prediction(p: dict[str, Any], what: str) -> str:
    cost = f", cost {p['cost']:,.0f}" if "cost" in p else " (set energy.price_per_device_hour for a cost)"
    return (f"{what} on {p['devices']} {p['device']} at {100 * p['assume_mfu']:.0f}% MFU: about "
            f"{p['device_hours']:,.1f} device-hours, {p['energy_kwh']:,.1f} kWh at {p['watts']:g} W each, "
            f"{p['co2e_kg']:,.1f} kg CO2e at {p['grid_gco2e_per_kwh']:g} g/kWh{cost}")
