"""MFU against known device peaks, device memory, and TensorBoard files read back by TensorBoard itself."""

import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxlm import metrics


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("TPU v5 lite", 197e12),
        ("cpu", None),
        ("Some Future Accelerator", None),
    ],
)
def test_peak_flops_by_device_kind_and_unknown_is_none(kind, peak):
    assert metrics.peak_flops(kind) == peak


def test_mfu_is_model_flops_per_device_over_peak():
    # 1e9 FLOPs/token at 989e3 tokens/s over 2 devices = 494.5 TFLOP/s per device = 50% of 989.
    assert metrics.mfu(1e9, 989e3, 2, 989e12) == pytest.approx(0.5)
    assert metrics.mfu(1e9, 989e3, 2, None) is None
    assert metrics.peak_flops("cpu", override=1e12) == 1e12


def test_cpu_reports_no_device_memory():
    import jax

    assert metrics.device_memory(jax.devices("cpu")[0]) is None


def test_tensorboard_scalars_and_text_read_back(tmp_path):
    sink = metrics.TensorBoardSink(tmp_path)
    sink.text(0, "config", "lr = 3e-4")
    for step in range(1, 4):
        sink.write(step, {"loss": 10.0 / step, "note": "not a number", "flag": True})
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 10.0), (2, 5.0), (3, pytest.approx(10 / 3))]
    assert set(events.Tags()["scalars"]) == {"loss"}
    assert events.Tensors("config/text_summary")[0].tensor_proto.string_val == [b"lr = 3e-4"]


def test_a_flush_puts_every_point_written_so_far_into_the_file(tmp_path):
    """What the trainer relies on before each checkpoint: after `flush`, with the sink still open (a process
    killed next), the file holds every point, the resumed run's purge marker first."""
    sink = metrics.TensorBoardSink(tmp_path, purge_step=7)
    for step in range(7, 207):
        sink.write(step, {"loss": float(step)})
    sink.flush()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, float(s)) for s in range(7, 207)]
    sink.close()


def test_parameter_histograms_read_back_from_tensorboard(tmp_path):
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    params = {"blocks": {"w": rng.normal(size=(3, 40, 50)).astype(np.float32)}, "embed": np.arange(10, dtype=np.float32)}
    stats = jax.device_get(metrics.param_histograms(jax.tree.map(jax.numpy.asarray, params)))
    assert set(stats) == {"blocks/w", "embed"}
    sink = metrics.TensorBoardSink(tmp_path)
    for tag, s in stats.items():
        sink.histogram(7, f"params/{tag}", s)
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    events.Reload()
    h = events.Histograms("params/blocks/w")[0]
    w = params["blocks"]["w"]
    assert h.step == 7 and h.histogram_value.num == w.size and sum(h.histogram_value.bucket) == w.size
    assert h.histogram_value.min == pytest.approx(w.min()) and h.histogram_value.max == pytest.approx(w.max())
    assert h.histogram_value.sum_squares == pytest.approx(float((w.astype(np.float64) ** 2).sum()), rel=1e-5)
    expected, _ = np.histogram(w, bins=metrics.HISTOGRAM_BINS, range=(w.min(), w.max()))
    assert np.abs(np.array(h.histogram_value.bucket) - expected).sum() <= 2  # float edges may move a boundary value
    e = events.Histograms("params/embed")[0].histogram_value
    assert sum(e.bucket) == 10 and e.bucket[0] == 1 and e.bucket[-1] == 1 and max(e.bucket) == 1  # 0..9


def test_the_tensorboard_writer_loads_without_pytorch(tmp_path):
    """tensorboardX imports torch when it is installed, a second and a half of every run's start for
    nothing jaxlm uses: the sink keeps it out, and torch still imports afterwards."""
    code = ("import sys, pathlib; from jaxlm import metrics; "
            f"sink = metrics.TensorBoardSink(pathlib.Path({str(tmp_path)!r})); sink.write(1, {{'loss': 2.0}}); "
            "print('torch' in sys.modules); import importlib.util; "
            "print(importlib.util.find_spec('torch') is None or __import__('torch') is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]
    assert list(tmp_path.glob("events.out.tfevents.*"))
