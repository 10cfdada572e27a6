"""What a run reports: model FLOP/s and MFU against the device's peak, device memory, and the sinks.

MFU counts the model's FLOPs the way `jaxlm.models.transformer.flops_per_token` defines them (all
matmuls of forward and backward, causal attention, no rematerialization) against the dense bf16
peak of the device kind. An unknown device gives MFU as None (unknown), never a guessed number.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
import sys
import time
import uuid
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import UserError
from jaxlm.section import Section, check, check_choice, setting

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device, by a substring of `jax.Device.device_kind` (first match wins,
# so the more specific names come first). Vendor datasheet figures without sparsity.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM (device_kind "NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),  # v6e (Trillium)
    ("TPU v6e", 918e12),
)


@dataclasses.dataclass(frozen=True)
class MetricsConfig(Section):
    """What a run records beyond the loss and throughput, and where (`config.metrics`)."""

    section: ClassVar[str] = "metrics"
    grad_norm_per_layer: bool = setting(
        False, "also log grad_norm/layer_NN and grad_norm/<group> (embed, unembed, ...)")
    histograms_every: int = setting(0, "TensorBoard histograms of every parameter every N steps (0 = off)")
    grad_numerics: bool = setting(
        False, "grad_zero_fraction and grad_nonfinite_fraction of every step's gradient: precision problems "
               "made visible")
    progress: str = setting("auto", "auto (a progress bar on a terminal, else lines) | bar | lines")
    wandb: bool = setting(
        False, "also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works without a login)")
    wandb_project: str = setting("jaxlm", "the Weights & Biases project")
    wandb_entity: str = setting("", '"" = your default entity')

    def validate(self) -> None:
        check(self.histograms_every >= 0, self.key("histograms_every"), self.histograms_every, "0 (off) or more")
        check_choice(self.key("progress"), self.progress, ("auto", "bar", "lines"))


@dataclasses.dataclass(frozen=True)
class ProfileConfig(Section):
    """Profiler traces on request (`config.profile`)."""

    section: ClassVar[str] = "profile"
    steps: str = setting(
        "", '"start:end": a jax.profiler trace of steps start..end (both included) in <run dir>/profile')

    def window(self) -> tuple[int, int] | None:
        """`steps` as (start, end), both included; None when empty."""
        text = self.steps.strip()
        if not text:
            return None
        start, sep, end = text.partition(":")
        try:
            first, last = int(start), int(end if sep else start)
        except ValueError:
            first, last = 0, -1
        check(1 <= first <= last, self.key("steps"), text, "'start:end' with 1 <= start <= end, e.g. '10:12'")
        return first, last

    def validate(self) -> None:
        self.window()


def peak_flops(device_kind: str, override: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: the override if positive, else the table; None when unknown."""
    if override > 0:
        return override
    for name, flops in PEAK_BF16_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


# What jaxlm's MFU is, said beside it (summary.json, the console's last line, BENCHMARKS.md), since the peers'
# definitions differ (some count the whole attention square, some float8 against float8's peak)
MFU_DEFINITION = ("model FLOPs per second per device (6 x matmul parameters + causal attention, counted half of "
                  "the T x T square, per token; no recompute) over the device's dense bfloat16 peak; float8 "
                  "matmuls count as bfloat16's")


def mfu(flops_per_token: float, tokens_per_s: float, num_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak."""
    if peak is None or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / num_devices / peak


def device_memory(device: jax.Device) -> dict[str, int] | None:
    """Bytes in use and peak on one device, where the backend reports them (GPU/TPU; not CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats:
        return None
    return {
        "memory_bytes": int(stats.get("bytes_in_use", 0)),
        "peak_memory_bytes": int(stats.get("peak_bytes_in_use", 0)),
        "memory_limit_bytes": int(stats.get("bytes_limit", 0)),
    }


HISTOGRAM_BINS = 30


@jax.jit
def param_histograms(params) -> dict[str, dict[str, jax.Array]]:
    """Per parameter (`blocks/attn/wq`, ...): min, max, count, sum, sum of squares and the counts
    of HISTOGRAM_BINS equal-width buckets between min and max, computed where the parameter lives
    (only these few numbers leave the devices)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = x.astype(jnp.float32)
        lo, hi = jnp.min(x), jnp.max(x)
        edges = lo + (hi - lo) * jnp.arange(1, HISTOGRAM_BINS) / HISTOGRAM_BINS  # inner edges
        below = jnp.stack([jnp.sum(x < e) for e in edges] + [jnp.asarray(x.size, jnp.int32)])
        out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = {
            "min": lo, "max": hi, "num": jnp.asarray(x.size, jnp.float32), "sum": jnp.sum(x),
            "sum_squares": jnp.sum(x * x), "counts": jnp.diff(below, prepend=0),
        }
    return out


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """A step's metrics (device or host arrays) as named floats: a scalar as it is, an array (a per-layer
    auxiliary output, `jaxlm.models.aux.by_layer`: [n_layers, ...]) one float per element, named
    `<name>/layer_<i>` and `<name>/layer_<i>/<j>` (TensorBoard, metrics.jsonl and W&B plot each)."""
    out = {}
    for name, value in jax.device_get(metrics).items():
        array = np.asarray(value)
        if array.ndim == 0:
            out[name] = float(array)
            continue
        for index in np.ndindex(array.shape):
            out["/".join([name, f"layer_{index[0]:02d}", *map(str, index[1:])])] = float(array[index])
    return out


class JsonlSink:
    """One JSON object per line, appended and flushed so a crash loses at most the line being written."""

    def __init__(self, path: pathlib.Path):
        self._file = open(path, "a")

    def write(self, step: int, values: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _tensorboardx():
    """tensorboardX, imported without PyTorch: tensorboardX imports torch when it is installed (the test
    extras install it), only to accept torch tensors, which jaxlm never passes; that import alone took
    1.4 s of a run's start here."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
        try:
            # local import: heavy (at the top, tensorboardX would import torch: 1.4 s, see above)
            import tensorboardX  # noqa: F401
        finally:
            del sys.modules["torch"]
    # local import: loaded without torch (above)
    import tensorboardX.event_file_writer
    import tensorboardX.summary

    return tensorboardX


class TensorBoardSink:
    """Scalars, histograms and text in a TensorBoard event file, written in this thread through
    tensorboardX's `EventsWriter` (read back by TensorBoard's own reader in the tests).

    Not through tensorboardX's `SummaryWriter`: it hands events to a background thread through a queue,
    and its `flush` flushes the file without waiting for that queue, so a point "flushed" before a
    checkpoint could still be in the queue when the process was killed (seen: a resumed run's
    TensorBoard missing the step its checkpoint was saved at). Here `flush` puts every point written so
    far into the file.

    `purge_step`: a resumed run's first step. The writer marks it (a session-start event), and
    TensorBoard then drops the points of earlier event files from that step on: the steps lost with the
    killed process are trained again and each appears once.
    """

    # Scalars reach the file at most this late, and at every checkpoint (`flush`): a killed run loses
    # none that its resume does not train again. metrics.jsonl has every line at once.
    FLUSH_EVERY_S = 1.0

    def __init__(self, logdir: pathlib.Path, purge_step: int | None = None):
        tbx = _tensorboardx()
        from tensorboardX.proto.event_pb2 import Event, SessionLog  # local import: after `_tensorboardx` (no torch)

        self._summary, self._event = tbx.summary, Event
        pathlib.Path(logdir).mkdir(parents=True, exist_ok=True)
        self._events = tbx.event_file_writer.EventsWriter(str(pathlib.Path(logdir) / "events"))
        if purge_step is not None:
            self._events.write_event(Event(step=purge_step, wall_time=time.time(),
                                           session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def _add(self, step: int, summary) -> None:
        self._events.write_event(self._event(step=step, wall_time=time.time(), summary=summary))

    def write(self, step: int, values: dict[str, Any]) -> None:
        """A step's scalars as one event (one `add_scalar` each took 10x the time, 0.61 against 0.06 ms
        for 14 scalars, and a flush per step 0.2 ms more: a small model's step on a GPU is a few ms)."""
        from tensorboardX.proto.summary_pb2 import Summary  # local import: after `_tensorboardx` (no torch)

        scalars = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)]
        if scalars:
            self._add(step, Summary(value=scalars))
        if time.monotonic() - self._flushed >= self.FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self._events.flush()
        self._flushed = time.monotonic()

    def histogram(self, step: int, tag: str, stats: dict[str, Any]) -> None:
        """One histogram from `param_histograms` statistics (host values)."""
        lo, hi, counts = float(stats["min"]), float(stats["max"]), np.asarray(stats["counts"], np.float64)
        limits = [lo + (hi - lo) * (i + 1) / len(counts) for i in range(len(counts))]
        self._add(step, self._summary.histogram_raw(
            tag, min=lo, max=hi, num=float(stats["num"]), sum=float(stats["sum"]),
            sum_squares=float(stats["sum_squares"]), bucket_limits=limits, bucket_counts=counts.tolist()))
        self.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        self._add(step, self._summary.text(tag, text))
        self.flush()

    def close(self) -> None:
        self._events.close()


WANDB_ID = re.compile(r"[0-9a-f]{16}")  # what `wandb_run_id` writes


def wandb_run_id(run_dir: pathlib.Path) -> str:
    """The W&B run id kept in `run_dir/wandb_id`, made and written (whole: `write_bytes_atomically`) on a
    run's first start. One that is not a whole id (cut by a killed process or a lost disk) would silently
    log to another W&B run: a new one is made instead, with a warning."""
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text(errors="replace").strip() if id_file.exists() else None
    if run_id is not None and not WANDB_ID.fullmatch(run_id):
        log.warning("%s holds %r, not a whole W&B run id (cut by an interrupted write?): this run logs to a new "
                    "W&B run", id_file, run_id[:40])
        run_id = None
    if run_id is None:
        run_id = uuid.uuid4().hex[:16]
        write_bytes_atomically(id_file, (run_id + "\n").encode())
    return run_id


class WandbSink:
    """Weights & Biases: the same values, one W&B run per run directory (its id is kept there, so a
    resumed run continues the same W&B run). W&B ignores steps at or below its last logged one; a
    resumed run re-logs the lost steps with identical values, so its curves stay whole."""

    def __init__(self, run_dir: pathlib.Path, config: dict[str, Any], project: str, entity: str, name: str):
        try:
            import wandb  # local import: optional dependency (pip install jaxlm[tracking])
        except ImportError:
            raise UserError(
                "config.metrics.wandb=true needs the wandb package: pip install wandb (or the [tracking] extra), "
                "or set config.metrics.wandb=false"
            ) from None
        run_id = wandb_run_id(run_dir)
        self._run = wandb.init(project=project, entity=entity or None, name=name, id=run_id, resume="allow",
                               dir=str(run_dir), config=config)

    def write(self, step: int, values: dict[str, Any]) -> None:
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._run.log(numbers, step=step)

    def histogram(self, step: int, tag: str, stats: dict[str, Any]) -> None:
        import wandb  # local import: optional dependency (pip install jaxlm[tracking])

        lo, hi, counts = float(stats["min"]), float(stats["max"]), np.asarray(stats["counts"])
        edges = np.linspace(lo, hi, len(counts) + 1)
        self._run.log({tag: wandb.Histogram(np_histogram=(counts, edges))}, step=step)

    def close(self) -> None:
        self._run.finish()
