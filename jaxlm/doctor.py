"""`python -m jaxlm.doctor`: is this machine ready to train, and if not, what to change.

Reports the versions (Python, JAX, jaxlib, the CUDA plugin, CUDA and cuDNN as JAX loaded them, the
libraries jaxlm uses), the devices JAX sees (kinds, memory, process and host layout), whether cuDNN
flash attention runs and agrees with XLA's attention, and a short bf16 matmul timing against the
device's peak. Problems are one-line findings; the last line is the verdict:

    jaxlm doctor: OK (...)              exit 0 (warnings, if any, are listed above it)
    jaxlm doctor: PROBLEM: ...          exit 1

`--expect=gpu` makes a machine where JAX sees no GPU a problem (for cluster scripts); by default a
GPU is expected where `nvidia-smi` lists one. `--json` prints the report as one JSON object.
Multi-host: `--distributed` joins the run first, as `python -m jaxlm.train` does (`jaxlm.distributed`:
`--coordinator`, `--num_processes`, `--process_id`, or the launcher's environment: SLURM, Open MPI,
torchrun-style variables, Kubernetes; else JAX's own detection); process 0 prints the report, with
the layout: which process this is, where the layout came from, devices per process and hosts.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxlm import commands, distributed, energy, metrics, precision
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError, report_error
from jaxlm.models import attention

EXIT_OK, EXIT_PROBLEM = 0, 1
FAIL, WARN = "fail", "warn"
PACKAGES = ("flax", "optax", "orbax-checkpoint", "grain", "numpy", "sentencepiece", "ml_collections")
CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu")
ENV_PREFIXES = ("JAX_", "XLA_", "TF_CPP_", "NCCL_", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
INSTALL_CUDA = "install jax[cuda12]: `make install` on this machine, or pip install 'jax[cuda12]'"
LOW_FRACTION_OF_PEAK = 0.2  # a GPU matmul below this share of the peak gets a warning


def _first_line(error: BaseException, limit: int = 200) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:limit]}" if text else type(error).__name__


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_number(version: int | None) -> str:
    """CUDA's 1000 * major + 10 * minor (12080 -> '12.8')."""
    return "unknown" if not version else f"{version // 1000}.{version % 1000 // 10}"


def _cudnn_number(version: int | None) -> str:
    """cuDNN 9: 10000 * major + 100 * minor + patch (91100 -> '9.11.0'); cuDNN 8: 1000 * major + ..."""
    if not version:
        return "unknown"
    major, rest = divmod(version, 10000) if version >= 90000 else divmod(version, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def cuda_versions() -> dict[str, str]:
    """CUDA runtime, driver and cuDNN versions as loaded by JAX's CUDA plugin; 'unknown' where absent."""
    out = {"cuda_runtime": "unknown", "cuda_driver": "unknown", "cudnn": "unknown"}
    # JAX has no public API for the versions its CUDA plugin loaded (checked on jax 0.10.2): this one
    # internal read is guarded, and a JAX that moves it makes these lines 'unknown', never an error.
    try:
        # local import: private JAX API, guarded (a module of the CUDA plugin, None without one)
        from jax._src.lib import cuda_versions as cv
    except Exception:
        cv = None
    if cv is None:
        return {k: "none (no CUDA plugin)" for k in out}
    calls = {
        "cuda_runtime": ("cuda_runtime_get_version", _cuda_number),
        "cuda_driver": ("cuda_driver_get_version", _cuda_number),
        "cudnn": ("cudnn_get_version", _cudnn_number),
    }
    for key, (name, fmt) in calls.items():
        try:
            out[key] = fmt(int(getattr(cv, name)()))
        except Exception:
            pass
    return out


def versions() -> dict[str, Any]:
    plugins = {name: v for name in CUDA_PLUGINS if (v := _version(name))}
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib") or "unknown",
        "plugins": plugins,
        **cuda_versions(),
        **{name: _version(name) or "not installed" for name in PACKAGES},
    }


def nvidia_smi() -> dict[str, Any]:
    """The GPUs the NVIDIA driver lists, independent of JAX: tells 'no GPU' from 'JAX cannot use it'."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"found": False, "gpus": [], "note": "nvidia-smi not found"}
    query = [exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
    try:
        result = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"found": False, "gpus": [], "note": f"nvidia-smi failed: {_first_line(e)}"}
    if result.returncode != 0:
        why = (result.stdout + result.stderr).strip().splitlines()
        return {"found": False, "gpus": [], "note": f"nvidia-smi failed: {why[0] if why else result.returncode}"}
    gpus = []
    for line in result.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            memory = int(parts[1]) * 2**20 if parts[1].isdigit() else None
            gpus.append({"name": parts[0], "memory_bytes": memory, "driver": parts[2]})
    return {"found": bool(gpus), "gpus": gpus, "note": f"{len(gpus)} GPU(s)"}


def environment() -> dict[str, Any]:
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return {"variables": env, "hostname": socket.gethostname(), "nvidia_smi": nvidia_smi()}


def devices_report() -> dict[str, Any]:
    devices, local = jax.devices(), jax.local_devices()
    kinds: dict[str, int] = {}
    for d in devices:
        kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    memory = [(metrics.device_memory(d) or {}).get("memory_limit_bytes") or None for d in local]
    try:
        hosts = list(mesh_lib.hostnames())  # a collective with several processes: every one runs the doctor
    except Exception as e:
        hosts = [f"unknown ({_first_line(e)})"]
    return {
        "platform": local[0].platform,
        "count": len(devices),
        "local_count": len(local),
        "kinds": kinds,
        "compute_capability": getattr(local[0], "compute_capability", None),
        "memory_bytes_per_device": memory,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices_per_process": {str(k): v for k, v in sorted(per_process.items())},
        "hosts": hosts,
        "host_count": len(set(hosts)),
    }


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


ATTENTION_TOLERANCE = 5e-2  # relative error of bf16 kernels against each other; a wrong mask or scale gives ~1


def attention_errors(device: jax.Device, implementation: str, reference: str = "xla",
                     max_segments: int = 0) -> dict[str, float]:
    """Relative errors of one attention kernel against another (`reference`: a kernel name, or
    'float32' for the plain einsum reference) in the output and the gradients, through the model's
    own `attend`: causal, grouped-query heads, packed documents, bf16; with `max_segments`, cuDNN's
    packed layout for `implementation`."""
    batch, seq, heads, kv_heads, head_dim = 2, 256, 8, 4, 64
    keys = jax.random.split(jax.random.key(0), 4)
    with jax.default_device(device):
        q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
        cotangent = jax.random.normal(keys[3], (batch, seq, heads, head_dim), jnp.float32)
        segments = jnp.asarray(np.repeat([[1] * 160 + [2] * 80 + [0] * 16], batch, 0), jnp.int32)

    def forward_backward(name, bound=0):
        def loss(q, k, v):
            if name == "float32":
                out = attention.reference_attention(q, k, v, segment_ids=segments)
            else:
                out = attention.attend(q, k, v, segment_ids=segments, implementation=name, max_segments=bound)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return (out, *grads)

    got, want = forward_backward(implementation, max_segments), forward_backward(reference)
    return {name: _relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def cudnn_attention(device: jax.Device) -> dict[str, Any]:
    """Whether cuDNN flash attention runs here and agrees with XLA's attention, forward and backward;
    on a non-GPU backend it does not apply."""
    choice = attention.select_implementation("auto", device.platform, dtype=jnp.bfloat16, head_dim=64)
    if device.platform != "gpu":
        return {"usable": None, "status": "not applicable (no GPU)", "auto_choice": choice}
    out = _checked_attention(device, 0, choice)
    if out["usable"] and attention.packed_layout_supported(precision.compute_capability(device)):
        out["packed"] = _checked_attention(device, 4, choice)  # the layout training uses here
    return out


def _checked_attention(device: jax.Device, max_segments: int, choice: str) -> dict[str, Any]:
    """cuDNN attention against XLA's (`max_segments` > 0: its packed layout): usable, status, errors."""
    try:
        errors = attention_errors(device, "cudnn", reference="xla", max_segments=max_segments)
    except Exception as e:
        return {"usable": False, "status": f"not usable: {_first_line(e)}", "auto_choice": choice}
    worst = max(errors, key=errors.get)
    if not all(np.isfinite(e) and e < ATTENTION_TOLERANCE for e in errors.values()):
        status = f"not usable: differs from XLA attention ({worst} relative error {errors[worst]:.2g})"
        return {"usable": False, "status": status, "auto_choice": choice, "relative_errors": errors}
    status = f"usable (forward and backward agree with XLA: worst relative error {errors[worst]:.1g})"
    return {"usable": True, "status": status, "auto_choice": choice, "relative_errors": errors}


def _matmul(a, b):
    return jnp.matmul(a, b)  # bf16 in and out, f32 accumulation


def bf16_matmul(device: jax.Device, size: int | None = None, budget_s: float = 0.5) -> dict[str, Any]:
    """Time an n x n x n bf16 matmul on one device; check a block of the result against NumPy."""
    n = size or (8192 if device.platform in ("gpu", "tpu") else 1024)
    ka, kb = jax.random.split(jax.random.key(0))
    with jax.default_device(device):
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    step = jax.jit(_matmul)
    c = step(a, b).block_until_ready()  # compile and warm up
    start = time.perf_counter()
    step(a, b).block_until_ready()
    runs = max(2, min(200, int(budget_s / max(time.perf_counter() - start, 1e-6))))
    start = time.perf_counter()
    for _ in range(runs):  # queued back to back; only the last is waited for
        out = step(a, b)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / runs
    rows, cols = min(n, 64), min(n, 128)
    want = np.asarray(a[:rows], np.float32) @ np.asarray(b[:, :cols], np.float32)
    error = _relative_error(c[:rows, :cols], want)
    tflops = 2 * n**3 / seconds / 1e12
    peak = metrics.peak_flops(device.device_kind)
    return {
        "size": n,
        "dtype": "bfloat16",
        "device": str(device),
        "runs": runs,
        "seconds_per_matmul": seconds,
        "tflops": tflops,
        "peak_tflops": None if peak is None else peak / 1e12,
        "fraction_of_peak": None if peak is None else tflops * 1e12 / peak,
        "relative_error": error,
    }


def matmul_on_every_device(devices: list[jax.Device], n: int = 256) -> dict[str, float]:
    """A small bf16 matmul on each local device against NumPy: finds one bad device among many."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(jnp.bfloat16)
    want = np.asarray(a, np.float32) @ np.asarray(a, np.float32)
    step = jax.jit(_matmul)
    return {str(d): _relative_error(step(jax.device_put(a, d), jax.device_put(a, d)), want) for d in devices}


# ----------------------------------------------------------------------------- findings


def platform_findings(
    backend: str, gpus_listed: int, jax_platforms: str, plugins: dict[str, str], jaxlib: str, expect: str,
    backend_error: str = "",
) -> list[tuple[str, str]]:
    """Whether JAX runs on the accelerator the machine has (or `--expect` names): pure, so testable."""
    findings = []
    for name, version in plugins.items():
        if name.startswith("jax-cuda") and jaxlib not in ("unknown", version):
            findings.append((FAIL, f"{name} {version} does not match jaxlib {jaxlib}: {INSTALL_CUDA}"))
    wanted = expect if expect != "auto" else ("gpu" if gpus_listed else None)
    if wanted is None or backend == wanted:
        return findings
    if wanted == "cpu":
        findings.append((FAIL, f"expected cpu (--expect=cpu) but JAX uses {backend}"))
        return findings
    listed = f"nvidia-smi lists {gpus_listed} GPU(s)" if gpus_listed else "nvidia-smi lists no GPU"
    seen = f"JAX sees only {backend}"
    if wanted == "tpu":
        why = "" if _version("libtpu") else ": libtpu is not installed (pip install 'jax[tpu]')"
        findings.append((FAIL, f"expected a TPU (--expect=tpu) but {seen}{why}"))
    elif not gpus_listed:
        findings.append((FAIL, f"expected a GPU (--expect=gpu) but {seen} and {listed}: run on a GPU machine, "
                               "or check the NVIDIA driver"))
    elif jax_platforms and not {"cuda", "gpu"} & {p.strip() for p in jax_platforms.split(",")}:
        findings.append((FAIL, f"{listed} but JAX_PLATFORMS={jax_platforms} hides them: unset JAX_PLATFORMS "
                               "(or pass --expect=cpu to check the CPU on purpose)"))
    elif not any(n.startswith("jax-cuda") for n in plugins):
        findings.append((FAIL, f"{listed} but {seen}: no CUDA plugin is installed; {INSTALL_CUDA}"))
    else:
        why = f" ({backend_error})" if backend_error else ""
        findings.append((FAIL, f"{listed} but {seen}: the CUDA plugin did not start{why}; check that the NVIDIA "
                               "driver supports the plugin's CUDA version (the 'cuda driver' line above)"))
    return findings


def _backend_error() -> str:
    """Why the CUDA backend did not start, as JAX recorded it; "" when unknown. JAX has no public API
    for it (checked on jax 0.10.2): an internal read, guarded, that only adds detail to a finding."""
    try:
        from jax._src import xla_bridge  # local import: private JAX API, guarded

        errors = dict(getattr(xla_bridge, "_backend_errors", {}))
    except Exception:
        return ""
    text = errors.get("cuda") or errors.get("gpu") or ""
    return (text.strip().splitlines() or [""])[0][:200]


def energy_report(devices) -> dict[str, Any]:
    """How a run here would meter its energy (jaxlm.energy, the default settings): the source, measured
    or estimated, and the devices' power limits where NVML reads them."""
    cfg = ml_collections.ConfigDict(energy.EnergyConfig.defaults())  # base_config's energy section
    reader, line = energy.open_reader(cfg, devices)
    out = {"source": reader.source if reader else "off", "measured": bool(reader and reader.measured),
           "how": line.removeprefix("energy: ")}
    if isinstance(reader, energy.NvmlReader):
        out["power_limits_w"] = reader.power_limits_w()
    return out


def check(expect: str = "auto", matmul_size: int | None = None) -> dict[str, Any]:
    """Run every check; the report is plain data (what `--json` prints)."""
    findings: list[tuple[str, str]] = []
    report: dict[str, Any] = {"versions": versions(), "environment": environment()}
    try:
        report["devices"] = devices_report()
    except Exception as e:
        requested = os.environ.get("JAX_PLATFORMS", "")
        where = f" for JAX_PLATFORMS={requested}" if requested else ""
        if {"cuda", "gpu"} & set(requested.split(",")) and not report["versions"]["plugins"]:
            hint = f"; no CUDA plugin is installed: {INSTALL_CUDA}"
        else:
            hint = f" ({_backend_error()})" if _backend_error() else ""
        findings.append((FAIL, f"JAX could not start a backend{where}: {_first_line(e)}{hint}"))
        return _finish(report, findings)
    dev = report["devices"]
    smi = report["environment"]["nvidia_smi"]
    findings += platform_findings(
        dev["platform"], len(smi["gpus"]), os.environ.get("JAX_PLATFORMS", "") or (jax.config.jax_platforms or ""),
        report["versions"]["plugins"], report["versions"]["jaxlib"], expect, _backend_error(),
    )
    if dev["platform"] == "gpu" and dev["local_count"] < len(smi["gpus"]) and not (
        os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("JAX_LOCAL_DEVICE_IDS")
    ):
        findings.append((WARN, f"JAX uses {dev['local_count']} of the {len(smi['gpus'])} GPUs nvidia-smi lists"))
    if len(set(dev["devices_per_process"].values())) > 1:
        findings.append((FAIL, f"processes have different numbers of devices ({dev['devices_per_process']}): "
                               "every process needs the same, or the mesh cannot be built"))
    if len(dev["kinds"]) > 1:
        findings.append((WARN, f"mixed device kinds {dev['kinds']}: the slowest sets the pace"))

    device = jax.local_devices()[0]
    report["energy"] = energy_report(jax.local_devices())

    chosen, why = precision.auto_dtype(device.platform, precision.compute_capability(device))
    report["precision"] = {"auto_chooses": chosen, "why": why}
    report["attention"] = cudnn_attention(device)
    if report["attention"]["usable"] is False:
        findings.append((WARN, f"cuDNN attention {report['attention']['status']}; "
                               "train with --config.model.attention=xla"))
    elif report["attention"].get("packed", {}).get("usable") is False:
        findings.append((WARN, f"cuDNN attention's packed layout {report['attention']['packed']['status']}; "
                               "train with --config.model.attention_segments=0 (the document mask)"))
    try:
        mm = bf16_matmul(device, matmul_size)
        mm["per_device_relative_error"] = matmul_on_every_device(jax.local_devices())
        report["matmul"] = mm
    except Exception as e:
        findings.append((FAIL, f"a bf16 matmul failed on {device}: {_first_line(e)}"))
        return _finish(report, findings)
    bad = {d: e for d, e in mm["per_device_relative_error"].items() if not (e < 1e-2)}
    if not (mm["relative_error"] < 1e-2):
        findings.append((FAIL, f"a bf16 matmul on {device} is wrong: relative error {mm['relative_error']:.2g} "
                               "against NumPy (want < 1e-2)"))
    if bad:
        findings.append((FAIL, f"a bf16 matmul is wrong on {', '.join(bad)}: relative errors "
                               f"{', '.join(f'{e:.2g}' for e in bad.values())} against NumPy (want < 1e-2)"))
    fraction = mm["fraction_of_peak"]
    if dev["platform"] == "gpu" and fraction is not None and fraction < LOW_FRACTION_OF_PEAK:
        findings.append((WARN, f"the bf16 matmul reached only {fraction:.0%} of {device.device_kind}'s peak: "
                               "another process on the GPU, low clocks, or a wrong peak in jaxlm.metrics"))
    return _finish(report, findings)


def _finish(report: dict[str, Any], findings: list[tuple[str, str]]) -> dict[str, Any]:
    fails = [m for level, m in findings if level == FAIL]
    warns = [m for level, m in findings if level == WARN]
    report["findings"] = [{"level": level, "message": m} for level, m in findings]
    report["ok"] = not fails
    if fails:
        more = f" (and {len(fails) - 1} more above)" if len(fails) > 1 else ""
        report["verdict"] = f"jaxlm doctor: PROBLEM: {fails[0]}{more}"
    else:
        report["verdict"] = f"jaxlm doctor: OK ({_summary(report, len(warns))})"
    return report


def _summary(report: dict[str, Any], warnings: int) -> str:
    dev, mm, attn = report["devices"], report["matmul"], report["attention"]
    if dev["platform"] == "cpu":
        kinds = f"{dev['count']} cpu device{'s' if dev['count'] > 1 else ''}"
    else:
        kinds = ", ".join(f"{n} x {k}" for k, n in dev["kinds"].items())
    parts = [f"jax {report['versions']['jax']}", kinds]
    if dev["process_count"] > 1:
        hosts = dev["host_count"]
        parts.append(f"{dev['process_count']} processes on {hosts} host{'s' if hosts > 1 else ''}")
    peak = "" if mm["fraction_of_peak"] is None else f" = {mm['fraction_of_peak']:.0%} of peak"
    parts.append(f"bf16 matmul {mm['tflops']:.3g} TFLOP/s{peak}")
    if attn["usable"]:
        parts.append("cuDNN attention usable")
    if warnings:
        parts.append(f"{warnings} warning{'s' if warnings > 1 else ''} above")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- output


def _gib(n: int | None) -> str:
    return "unknown" if not n else f"{n / 2**30:.1f} GiB"


def memory_share_note(limit: int | None, card: int | None) -> str:
    """What to add to XLA's per-device memory limit when it leaves a good part of the card unused (jax
    preallocates 75% of a GPU by default), against which `optim.micro_batches=0` plans more micro-batches
    than the card needs (an example: benchmarks/BENCHMARKS.md)."""
    if not limit or not card or limit >= 0.85 * card:
        return ""
    return (f" of the card's {_gib(card)}: jax holds {limit / card:.0%} by default; XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 "
            f"gives it more (the memory optim.micro_batches=0 plans against)")


def format_report(report: dict[str, Any]) -> str:
    v = report["versions"]
    lines = ["versions"]
    lines += [f"  {k:<16} {v[k]}" for k in ("python", "jax", "jaxlib")]
    plugins = ", ".join(f"{k} {x}" for k, x in v["plugins"].items()) or "none (CPU-only install)"
    lines.append(f"  {'plugins':<16} {plugins}")
    lines += [f"  {k.replace('_', ' '):<16} {v[k]}" for k in ("cuda_runtime", "cuda_driver", "cudnn")]
    lines += [f"  {k:<16} {v[k]}" for k in PACKAGES]
    env = report["environment"]
    lines += ["environment", f"  {'host':<16} {env['hostname']}"]
    lines += [f"  {k}={x}" for k, x in env["variables"].items()]
    smi = env["nvidia_smi"]
    gpus = "; ".join(f"{g['name']} ({_gib(g['memory_bytes'])}, driver {g['driver']})" for g in smi["gpus"])
    lines.append(f"  {'nvidia-smi':<16} {smi['note']}{': ' + gpus if gpus else ''}")
    if "devices" in report:
        d = report["devices"]
        memory = sorted(set(d["memory_bytes_per_device"]), key=lambda m: m or 0)
        lines += [
            "devices",
            f"  {'platform':<16} {d['platform']}",
            f"  {'devices':<16} {d['count']} global, {d['local_count']} local",
            f"  {'kinds':<16} {', '.join(f'{n} x {k}' for k, n in d['kinds'].items())}",
            f"  {'memory':<16} {', '.join(_gib(m) for m in memory)} per device"
            + (" (not reported on cpu)" if d["platform"] == "cpu" else " (XLA's limit)")
            + (memory_share_note(memory[0], smi["gpus"][0]["memory_bytes"])
               if d["platform"] == "gpu" and smi["gpus"] and len(memory) == 1 else ""),
        ]
        if d["compute_capability"]:
            lines.append(f"  {'compute cap.':<16} {d['compute_capability']}")
        lines.append(
            f"  {'processes':<16} {d['process_count']} on {d['host_count']} host(s), this is process "
            f"{d['process_index']}; devices per process {d['devices_per_process']}"
        )
        if d["process_count"] > 1:
            lines.append(f"  {'hosts':<16} {', '.join(d['hosts'])}")
        if report.get("layout"):
            lines.append(f"  {'layout':<16} {report['layout']}")
    if "attention" in report:
        a = report["attention"]
        lines += ["attention", f"  {'cudnn':<16} {a['status']}"]
        if "packed" in a:
            lines.append(f"  {'packed layout':<16} {a['packed']['status']}")
        lines.append(f"  {'auto chooses':<16} {a['auto_choice']}")
    if "precision" in report:
        p = report["precision"]
        lines += ["precision", f"  {'auto chooses':<16} {p['auto_chooses']} ({p['why']})"]
    if "energy" in report:
        e = report["energy"]
        lines += ["energy", f"  {'source':<16} {e['source']} ({'measured' if e['measured'] else 'not measured'})",
                  f"  {'how':<16} {e['how']}"]
        if e.get("power_limits_w"):
            lines.append(f"  {'power limits':<16} {', '.join(f'{w:g} W' for w in e['power_limits_w'])}")
    if "matmul" in report:
        m = report["matmul"]
        peak = (
            f"{m['fraction_of_peak']:.0%} of the {m['peak_tflops']:.0f} TFLOP/s peak"
            if m["peak_tflops"] else "peak unknown for this device kind"
        )
        lines += [
            f"bf16 matmul ({m['size']} x {m['size']} x {m['size']} on {m['device']}, {m['runs']} runs)",
            f"  {'time':<16} {m['seconds_per_matmul'] * 1e3:.3g} ms per matmul",
            f"  {'achieved':<16} {m['tflops']:.3g} TFLOP/s; {peak}",
            f"  {'result':<16} relative error {m['relative_error']:.1g} against NumPy; "
            f"checked on {len(m['per_device_relative_error'])} local device(s)",
        ]
    if report["findings"]:
        lines.append("findings")
        lines += [f"  {f['level'].upper()}: {f['message']}" for f in report["findings"]]
    lines.append(report["verdict"])
    return "\n".join(lines)


def _initialize_distributed(args) -> tuple[str | None, str | None]:
    """Join the run as the trainer does (flags, then the launcher's environment, then JAX's own
    detection): (this process's layout, or the error line if joining failed)."""
    try:
        joined = distributed.join(args.coordinator, args.num_processes, args.process_id,
                                  timeout_s=args.distributed_timeout_s)
        return joined or "one process (no launcher or cluster detected)", None
    except UserError as e:
        return None, str(e)
    except Exception as e:
        return None, f"jax.distributed.initialize failed: {_first_line(e)}"


make_parser = commands.doctor_parser  # the command line, declared in jaxlm.commands (light to import)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except UserError as e:
        return report_error(e)
    distributed_error = layout = None
    if args.distributed or args.coordinator:
        layout, distributed_error = _initialize_distributed(args)
    report = check(expect=args.expect, matmul_size=args.matmul_size)
    report["layout"] = layout
    if distributed_error:
        report["findings"].insert(0, {"level": FAIL, "message": distributed_error})
        report["ok"] = False
        report["verdict"] = f"jaxlm doctor: PROBLEM: {distributed_error}"
    process = report.get("devices", {}).get("process_index", 0)
    if process == 0:
        print(json.dumps(report, default=str) if args.json else format_report(report), flush=True)
    else:  # the other processes of a multi-host run: only their verdict, marked
        print(f"[process {process}, {socket.gethostname()}] {report['verdict']}", file=sys.stderr, flush=True)
    return EXIT_OK if report["ok"] else EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
