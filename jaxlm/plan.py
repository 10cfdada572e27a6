"""`python -m jaxlm.plan --config=configs/7b.py --devices=8 --device_memory_gib=80 [--compile] [--json]`

Will a run fit in device memory, by how much, and which knob would make it fit. Two figures:

* **analytic** (always, in about a second, no devices needed): `jaxlm.memory.estimate`, the train
  state exact per device, activations from formulas. `--platform` (default gpu) picks the attention
  kernel `model.attention=auto` would.
* **compiled** (`--compile`): the real train step compiled ahead of time for `--devices` devices
  (an abstract state: nothing allocated) and XLA's `memory_analysis()`, which is per device for an
  SPMD program: on the accelerators here when there are enough of them, else on that many fake CPU
  devices, set up by `main` before JAX starts its backends. Its peak is `argument + output - alias
  + temp` bytes: the donated state plus XLA's preallocated temporaries (`peak_memory_in_bytes`
  leaves the temporaries out on CPU, so it is not used). A CPU compile is compared with the
  analytic figure for the same program (XLA attention, the activations' bytes XLA:CPU keeps).

The verdict uses the compiled figure when it was compiled on the platform planned for, else the
analytic one; for compile-only devices (`--target`), whose program lacks what a real GPU adds (cuDNN's
workspaces: the largest is estimated and added), the larger of the two. When the run does not
fit, the analytic estimate is re-run with one knob changed (FSDP over all devices, a cheaper remat
policy, more micro-batches, a smaller global batch), then two or three together, and the changes
that fit are listed as `--config` overrides. Exit code 0: fits; 1: does not fit; 2: a user error
(config, flags).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from jaxlm import axes, commands, energy, hlo, init_from, memory, metrics, roofline, train_setup, xla_flags
from jaxlm import config as config_lib
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError, report_error, run_command
from jaxlm.memory import GIB, format_bytes
from jaxlm.models import transformer

REMAT_ORDER = ("none", "dots_mlp", "dots", "dots_no_batch", "full")  # most memory first


def format_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- the compiled figure


def compile_devices(num_devices: int):
    """`num_devices` accelerators when there are enough, else that many CPU devices (fake ones, set
    up by `use_cpu_devices` before JAX started its backends)."""
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if len(accelerators) >= num_devices:
        return accelerators[:num_devices]
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:
        cpus = []
    if len(cpus) >= num_devices:
        return cpus[:num_devices]
    raise UserError(
        f"--compile needs {num_devices} devices; this process has {len(accelerators)} accelerators and "
        f"{len(cpus)} CPU devices (JAX was started before the planner could add CPU devices); run "
        f"`python -m jaxlm.plan` in its own process, or compile for --devices={max(len(accelerators), len(cpus))}"
    )


def target_devices(target: roofline.Target, num_devices: int, topology: str | None = None, slices: int = 1):
    """`num_devices` compile-only devices of `target` (`jaxlm.roofline.target_devices`; a TPU's from
    `slices` slices of `topology`), or one line that says how to get the compiler they need."""
    if target.platform == "tpu":
        return _tpu_devices(target, num_devices, topology, slices)
    try:
        return roofline.target_devices(target, num_devices, topology)
    except ValueError as e:
        if topology:
            raise UserError(str(e)) from None
        raise UserError(f"--devices={num_devices}: {e}; use 1 to {target.devices_per_host} or a multiple of "
                        f"{target.devices_per_host}") from None
    except Exception as e:  # no plugin, or a plugin JAX did not load
        installed = importlib.util.find_spec("jax_plugins") is not None  # the namespace GPU plugins install into
        hint = "" if installed else " (no JAX GPU plugin is installed in this environment)"
        raise UserError(
            f"--target={target.name} needs XLA's CUDA compiler{hint}: run `make h100-env` once, then "
            f"`.venv-h100/bin/python -m jaxlm.plan ... --target={target.name}` ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120] if str(e) else ''})"
        ) from None


def _tpu_devices(target: roofline.Target, num_devices: int, topology: str | None, slices: int = 1):
    """The compile-only chips of `slices` TPU slices (`jaxlm.roofline.tpu_devices`), or one line: a topology that
    is not the target's, or no libtpu in this environment."""
    try:
        topology = roofline.slice_topology(target, num_devices, topology, slices)  # refused before libtpu is looked for
    except ValueError as e:
        raise UserError(str(e)) from None
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(f"--target={target.name} needs XLA's TPU compiler (libtpu), not installed in this environment: "
                        f"run `make tpu-env` once, then `.venv-tpu/bin/python -m jaxlm.plan ... --target={target.name}`")
    try:
        return roofline.tpu_devices(target, num_devices, topology, slices)
    except ValueError as e:
        raise UserError(str(e)) from None
    except Exception as e:  # libtpu there, and refusing the topology or failing to load
        # libtpu loads in one process at a time (its lock file), chips or none; this variable lifts that
        busy = (" (another process has libtpu loaded: wait for it, or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 to compile "
                "beside it)") if "lockfile" in str(e) else ""
        raise UserError(f"--target={target.name} --topology={topology}: libtpu gave no devices{busy} "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None


def use_cpu_devices(num_devices: int) -> None:
    """Give JAX's CPU backend `num_devices` devices, if its backends have not started yet (else no-op)."""
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:  # backends already initialized (an in-process caller): use what is there
        pass


# A cuDNN custom call's last output, its workspace (u8[bytes]); empty (u8[0]) in a compile-only program.
CUDNN_WORKSPACE = re.compile(r"u8\[(\d+)\]\{0\}\) custom-call\([^\n]*custom_call_target=\"__cudnn\$")
# The packed layout's attention backward (ragged offsets s32[B, n+1] among its operands): its query
# gradient's output, its softmax statistics operand f32[B*n, H, S]
_CUDNN_PACKED_BACKWARD = re.compile(
    r"= \(bf16\[\d+,\d+,\d+,(\d+)\][^\n]*u8\[(\d+)\]\{0\}\) custom-call\([^\n]*"
    r"custom_call_target=\"__cudnn\$fmhaSoftmaxBackward\", operand_layout_constraints=\{[^\n]*?"
    r"f32\[(\d+),(\d+),(\d+)\][^\n]*?s32\[\d+,\d+\]")


def cudnn_workspace_estimate(text: str) -> int:
    """The largest workspace the compile-only program's cuDNN calls will ask for on a real GPU, which
    XLA sizes only there; the calls run one at a time, so they share one buffer. For the packed layout's
    backward, `memory.cudnn_packed_workspace` from the call's shapes (exact for a real GPU's program:
    benchmarks/BENCHMARKS.md); other cuDNN calls: the forward's (`memory.CUDNN_FORWARD_WORKSPACE`; the
    masked kernel's backward is not measured)."""
    largest = memory.CUDNN_FORWARD_WORKSPACE if "0" in CUDNN_WORKSPACE.findall(text) else 0
    for d, workspace, r, h, s in _CUDNN_PACKED_BACKWARD.findall(text):
        if workspace == "0":
            largest = max(largest, int(memory.cudnn_packed_workspace(int(r) * int(h) * int(s), int(d))))
    return largest


class ProgramTooLarge(UserError):
    """XLA refused to compile the program for its devices: it needs more memory than a device has (XLA:TPU
    checks its buffers against the chip's HBM as it compiles; XLA:GPU compiles and leaves that to the plan)."""

    def __init__(self, message: str, needed_bytes: float):
        super().__init__(message)
        self.needed_bytes = needed_bytes


_HBM_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED: .*?required for ([\w ]+?) \(([\d.]+)([KMGT])\) exceeds available "
                            r"HBM \(([\d.]+)([KMGT])\)")


def _too_large(error: Exception, platform: str, target: roofline.Target | None) -> ProgramTooLarge | None:
    """XLA:TPU's out-of-memory refusal as one line that says what to change, or None for another error."""
    m = _HBM_EXHAUSTED.search(str(error))
    if m is None:
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    needed, available = float(m.group(2)) * units[m.group(3)], float(m.group(4)) * units[m.group(5)]
    where = target.name if target is not None else platform
    return ProgramTooLarge(
        f"XLA refuses to compile the train step for {where}: its {m.group(1)} need {format_bytes(needed)} of the "
        f"{format_bytes(available)} of HBM a chip has; it does not fit: raise optim.micro_batches, choose a remat "
        f"policy that keeps less (model.remat=dots_mlp, dots, full), or use more chips", needed)


def compiled_memory(cfg: ml_collections.ConfigDict, devices, target: roofline.Target | None = None) -> dict[str, Any]:
    """Compile the real train step ahead of time on `devices` (an abstract state: nothing allocated)
    and read XLA's per-device memory analysis; for compile-only `target` devices also the roofline of
    the compiled program (`jaxlm.roofline`)."""
    setup = train_setup.build(cfg, devices, abstract=True)
    start = time.perf_counter()
    # The attention kernel the trainer runs for batches that fit cuDNN's packed layout; a run across
    # hosts (several processes) keeps the conditional that chooses it on the device (TrainSetup.attention_choice).
    packed = None if target is not None and len(devices) > target.devices_per_host else "expected"
    with roofline.kernel_checks_for(target) if target is not None else contextlib.nullcontext():
        try:
            compiled = setup.compile_train_step(packed)
        except jax.errors.JaxRuntimeError as e:
            if (too_large := _too_large(e, devices[0].platform, target)) is None:
                raise
            raise too_large from None
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise UserError(f"--compile: XLA gives no memory analysis on {devices[0].platform}; use the analytic figure")
    figures = {
        "argument_bytes": analysis.argument_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes,
        "alias_bytes": analysis.alias_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
    }
    peak = figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
    out = {
        **figures, "per_device_bytes": peak, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "num_devices": len(devices), "attention": setup.model_cfg.attention, "compile_s": round(seconds, 2),
        "compile_only": target is not None,
    }
    if target is not None:
        text = compiled.as_text()
        out["compiled_bytes"] = peak
        if target.platform == "cuda":
            # XLA sizes each cuDNN call's workspace by asking cuDNN on a real GPU; compiled here, they are empty
            out["cudnn_calls_without_workspace"] = CUDNN_WORKSPACE.findall(text).count("0")
            # what a real GPU adds to this program's peak: the cuDNN calls' (shared) workspace
            out["cudnn_workspace_bytes"] = cudnn_workspace_estimate(text)
            out["per_device_bytes"] = peak + out["cudnn_workspace_bytes"]
        tokens = setup.derived.tokens_per_step
        model_flops = transformer.flops_per_token(setup.model_cfg, cfg.data.seq_len) * tokens / len(devices)
        module = hlo.Module(text)
        # a TPU's collectives at ICI within a slice, at DCN across slices (partitions in the mesh's order)
        domains = roofline.partition_domains(setup.mesh.devices.flat) if target.platform == "tpu" else None
        r = roofline.summarize(roofline.kernels(module, target, len(devices), domains), target, model_flops)
        r["unknown_trip_counts"] = module.unknown_trip_counts
        r["host_syncs"] = module.host_syncs() if target.platform == "cuda" else 0  # a TPU branches on the device
        # A loop whose trip count could not be read counts its kernels once: the program's matmul FLOPs
        # then fall short of the model's, and the MFU would be flattered; say so instead of a number.
        if module.unknown_trip_counts or r["matmul_flops"] < model_flops * (1 - 1e-6):
            r["incomplete"] = (f"{module.unknown_trip_counts} loop(s) of unknown trip count; the program's matmuls "
                               f"{r['matmul_flops'] / 1e12:.1f} TFLOP against the model's {model_flops / 1e12:.1f}")
            r["roofline_mfu"] = None
        out["roofline"] = r
    return out


# ----------------------------------------------------------------------------- knobs


def knob_candidates(cfg: ml_collections.ConfigDict, num_devices: int) -> list[list[dict[str, Any]]]:
    """Per knob (fsdp, remat, micro-batches, batch size), the changes to try, least disruptive first."""
    derived = config_lib.derive(cfg, num_devices)
    sizes = axes.sizes_of(derived.mesh_shape)
    knobs = []
    # shard the state over the data-parallel devices too (expert keeps its size: MoE layers split experts over it)
    if sizes["data"] > 1:
        knobs.append([{f"mesh.{a}": 1 if a == "data" else -1 if a == "fsdp" else n for a, n in sizes.items()}])
    policies = REMAT_ORDER[REMAT_ORDER.index(cfg.model.remat) + 1:] if cfg.model.remat in REMAT_ORDER else ()
    knobs.append([{"model.remat": p} for p in policies])
    micro, options = cfg.optim.micro_batches, []
    while derived.per_device_batch * cfg.optim.micro_batches // (micro * 2) >= 1 and len(options) < 4:
        micro *= 2
        options.append({"optim.micro_batches": micro})
    knobs.append(options)
    batch, options = cfg.data.global_batch_size, []
    while len(options) < 3 and batch % 2 == 0:
        batch //= 2
        options.append({"data.global_batch_size": batch})
    knobs.append(options)
    return [k for k in knobs if k]


def suggest(
    cfg: ml_collections.ConfigDict, num_devices: int, budget_bytes: float, platform: str, limit: int = 8
) -> list[dict[str, Any]]:
    """Changes that make the analytic estimate fit in `budget_bytes`: single knobs first, then two or
    three together when no single one fits. Of the settings that fit, only the least disruptive are
    kept: none that another fitting setting beats on every knob (each knob's options go from mild
    to strong: fewer micro-batches before more, dots before full remat)."""
    knobs = knob_candidates(cfg, num_devices)
    found: list[dict[str, Any]] = []
    for n_knobs in range(1, min(3, len(knobs)) + 1):
        for group in itertools.combinations(knobs, n_knobs):
            fitting = []  # (option index per knob, suggestion)
            for index in itertools.product(*(range(len(options)) for options in group)):
                overrides = {k: v for options, i in zip(group, index) for k, v in options[i].items()}
                try:
                    changed = memory.with_overrides(cfg, overrides)
                    per_device = memory.estimate(changed, num_devices, platform=platform).per_device_bytes
                except UserError:  # e.g. a batch that no longer splits over the devices
                    continue
                if per_device <= budget_bytes:
                    fitting.append((index, {"overrides": overrides, "per_device_bytes": per_device,
                                            "spare_bytes": budget_bytes - per_device}))
            for index, suggestion in fitting:
                if not any(other != index and all(o <= i for o, i in zip(other, index)) for other, _ in fitting):
                    found.append(suggestion)
        if found:
            break
    return found[:limit]


# ----------------------------------------------------------------------------- choosing from the compiled program

# A compiled program whose matmul FLOPs exceed its policy's own (its largest micro-batch count) by more
# than this was rematerialized by XLA to fit: recompute the model's FLOP count ignores.
RECOMPUTE_TOLERANCE = 0.005


def pick(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best compiled candidate: of those that fit and carry no recompute XLA added, the highest
    roofline-bound MFU (ties: fewer micro-batches, then the policy listed first)."""
    eligible = [r for r in rows if r["fits"] and not r["xla_recompute"] and r["roofline_mfu"] is not None]
    if not eligible:
        return None
    order = {policy: i for i, policy in enumerate(REMAT_ORDER)}
    return max(eligible, key=lambda r: (round(r["roofline_mfu"], 4), -r["micro_batches"], -order[r["remat"]]))


def xla_recomputes(summary: dict[str, Any], reference: float | None) -> tuple[bool, float | None]:
    """(whether a compiled program's matmuls exceed a policy's `reference` FLOPs by more than
    RECOMPUTE_TOLERANCE: XLA rematerializing to fit, the reference now): the reference is the first program
    of the policy whose matmuls were all counted. One with a loop the roofline cannot read (no MFU: its
    FLOPs undercounted) neither sets it nor is judged by it."""
    if summary["roofline_mfu"] is None:
        return False, reference
    if reference is None:
        return False, summary["matmul_flops"]
    return summary["matmul_flops"] > reference * (1 + RECOMPUTE_TOLERANCE), reference


def choose(cfg: ml_collections.ConfigDict, num_devices: int, target: roofline.Target, devices=None,
           policies: Sequence[str] = REMAT_ORDER, progress=None, topology: str | None = None) -> dict[str, Any]:
    """Remat policy and micro-batches chosen from the compiled program's own figures, not the analytic
    estimate. For each policy, the train step is compiled for `target` at each micro-batch count the
    batch allows (`memory.micro_batch_options`), from twice the analytic choice (`memory.resolve_micro_batches`)
    down, until one does not fit in `memory.AUTO_SHARE` of the target's memory (the share
    micro_batches=0 plans for) or XLA rematerializes to fit (its matmul FLOPs exceed the policy's own,
    at the first count whose matmuls were all counted, by more than `RECOMPUTE_TOLERANCE`: `xla_recomputes`,
    recompute the model's count ignores); fewer
    micro-batches would only need more memory. Then `pick`. Each row: the policy, micro-batches,
    per-device bytes (XLA's memory analysis), matmul FLOPs, the roofline step time and roofline-bound MFU."""
    devices = devices if devices is not None else target_devices(target, num_devices, topology)
    options = memory.micro_batch_options(cfg, num_devices)
    rows: list[dict[str, Any]] = []
    for policy in policies:
        base = memory.with_overrides(cfg, {"model.remat": policy, "optim.micro_batches": 0})
        platform = "tpu" if target.platform == "tpu" else "gpu"  # the kernels the analytic start counts: the target's
        resolved, _ = memory.resolve_micro_batches(base, num_devices, target.memory_bytes, platform)
        start = resolved.optim.micro_batches
        tried = [k for k in options if k <= 2 * start][::-1]
        reference = None
        for k in tried:
            trial = memory.with_overrides(cfg, {"model.remat": policy, "optim.micro_batches": k})
            try:
                compiled = compiled_memory(trial, devices, target)
            except ProgramTooLarge as e:  # XLA:TPU refuses what does not fit: fewer micro-batches need more still
                row = {"remat": policy, "micro_batches": k, "per_device_bytes": e.needed_bytes, "fits": False,
                       "matmul_flops": 0.0, "step_seconds": 0.0, "roofline_mfu": None, "compile_s": 0.0,
                       "xla_recompute": False}
                rows.append(row)
                if progress:
                    progress(format_choice_row(row))
                break
            r = compiled["roofline"]
            recompute, reference = xla_recomputes(r, reference)
            row = {"remat": policy, "micro_batches": k, "per_device_bytes": compiled["per_device_bytes"],
                   "fits": compiled["per_device_bytes"] <= memory.AUTO_SHARE * target.memory_bytes,
                   "matmul_flops": r["matmul_flops"], "step_seconds": r["step_seconds"],
                   "roofline_mfu": r["roofline_mfu"], "compile_s": compiled["compile_s"],
                   "xla_recompute": recompute}
            rows.append(row)
            if progress:
                progress(format_choice_row(row))
            if not row["fits"] or row["xla_recompute"]:
                break  # fewer micro-batches only need more memory
    return {"rows": rows, "best": pick(rows)}


def format_choice_row(r: dict[str, Any]) -> str:
    note = ("does not fit" if not r["fits"] else "XLA recomputes to fit" if r["xla_recompute"] else
            "" if r["roofline_mfu"] is not None else "not counted: a loop of unknown trip count")
    return (f"  remat={r['remat']:<14} micro_batches={r['micro_batches']:<4} {format_bytes(r['per_device_bytes']):>10}"
            f"  matmul {r['matmul_flops'] / 1e12:9.1f} TFLOP  step {r['step_seconds'] * 1e3:8.1f} ms"
            f"  MFU {'n/a' if r['roofline_mfu'] is None else format(r['roofline_mfu'], '.3f')}  {note}")


CHOICE_HEADER = "\n  choosing remat and micro-batches from the compiled program (each candidate compiled):"


def format_choice(choice: dict[str, Any], report: dict[str, Any]) -> str:
    """The choice's last line (its rows are printed as they compile: `format_choice_row`)."""
    best = choice["best"]
    if best is None:
        return "  none of them fits without recompute XLA adds: use more devices or tensor parallelism"
    return (f"  best: --config.model.remat={best['remat']} --config.optim.micro_batches={best['micro_batches']}"
            f"  (roofline-bound MFU {best['roofline_mfu']:.3f}; the config's own: remat={report['remat']}, "
            f"{report['micro_batches']} micro-batch(es)"
            + (f", {report['compiled']['roofline']['roofline_mfu']:.3f}"
               if report.get("compiled") and report["compiled"]["roofline"]["roofline_mfu"] is not None else "")
            + ")")


# ----------------------------------------------------------------------------- the plan


# --compile refuses a program the analytic plan puts at more than this many times a device's memory:
# tracing and compiling such sizes hangs or aborts XLA (10**12 layers; a 10**9-wide model), and no
# layout of a real run is that far from fitting.
COMPILE_CEILING = 1000


def plan(
    cfg: ml_collections.ConfigDict, num_devices: int, device_memory_bytes: float, *, platform: str = "gpu",
    compile: bool = False, devices=None, target: roofline.Target | None = None, topology: str | None = None,
) -> dict[str, Any]:
    """The whole report as plain data (what `--json` prints)."""
    cfg, auto = memory.resolve_micro_batches(cfg, num_devices, device_memory_bytes, platform)
    est = memory.estimate(cfg, num_devices, platform=platform)
    report: dict[str, Any] = {
        "recipe": cfg.run.get("recipe", ""),
        "num_devices": num_devices,
        "topology": topology,
        "mesh": axes.sizes_of(est.mesh_shape),
        "platform": platform,
        "device_memory_bytes": device_memory_bytes,
        "param_count": est.param_count,
        "bytes_per_param": est.bytes_per_param,
        "global_batch_size": cfg.data.global_batch_size,
        "seq_len": cfg.data.seq_len,
        "micro_batches": cfg.optim.micro_batches,
        "micro_batches_auto": auto,
        "per_device_batch": est.per_device_batch,
        "remat": cfg.model.remat,
        "dtype": np.dtype(transformer.ModelConfig.from_config(cfg.model, platform, log_choice=False).dtype).name,
        "param_dtype": cfg.model.param_dtype,
        "attention": est.attention,
        "attention_segments": est.attention_segments,
        "analytic": {"per_device_bytes": est.per_device_bytes, "rows": [dataclasses.asdict(r) for r in est.rows]},
        "pipeline": None if est.pipeline is None else {
            "stages": est.pipeline.stages, "microbatches": est.pipeline.microbatches,
            "repeats": est.pipeline.repeats, "schedule": cfg.pipeline.schedule, "bubble": est.pipeline.bubble,
            "iterations": est.pipeline.iterations, "stage_bytes_per_step": est.stage_bytes_per_step},
        "compiled": None,
    }
    decided_by, per_device = "analytic", est.per_device_bytes
    if compile and est.per_device_bytes > COMPILE_CEILING * device_memory_bytes:
        raise UserError(
            f"--compile: the analytic plan needs {format_bytes(est.per_device_bytes)} per device, over "
            f"{COMPILE_CEILING:,} times a device's {format_bytes(device_memory_bytes)}; XLA can take hours on (or "
            "abort) a program of that size, so it is not compiled: shrink the model or the batch, or use more "
            "devices (without --compile, the plan says what fits)")
    if compile:
        if devices is None:
            devices = (target_devices(target, num_devices, topology) if target is not None
                       else compile_devices(num_devices))
        compiled = compiled_memory(cfg, devices, target)
        cpu = compiled["platform"] == "cpu"
        same = memory.estimate(cfg, num_devices, platform=compiled["platform"],
                               act_bytes=memory.cpu_act_bytes() if cpu else None)
        compiled["analytic_same_program_bytes"] = same.per_device_bytes
        if axes.sizes_of(same.mesh_shape)["context"] > 1:  # the kernel the sequence's split attends with
            compiled["attention"] = same.attention
        compiled["ratio"] = compiled["per_device_bytes"] / same.per_device_bytes
        compiled["within_tolerance"] = abs(compiled["ratio"] - 1) <= memory.TOLERANCE
        report["compiled"] = compiled
        if compiled["platform"] == platform:
            decided_by, per_device = "compiled", compiled["per_device_bytes"]
            # A compile-only program lacks what a real GPU adds: cuDNN's workspace, estimated and added
            # (`cudnn_workspace_estimate`), which brings it close to the real one, but an earlier step on a
            # real GPU had peaked further above its compile-only figure than its workspace explains
            # (benchmarks/BENCHMARKS.md), so the verdict takes the larger of the two.
            # A TPU's compile-only program is the one a TPU runs (no library sizes buffers at run time): its figure.
            if compiled["compile_only"] and platform == "gpu" and est.per_device_bytes > per_device:
                decided_by, per_device = "analytic, above the compile-only program", est.per_device_bytes
    report["energy"] = predict_energy(cfg, num_devices, platform, target)
    report["decided_by"] = decided_by
    report["per_device_bytes"] = per_device
    report["fits"] = per_device <= device_memory_bytes
    report["margin_bytes"] = device_memory_bytes - per_device
    report["suggestions"] = [] if report["fits"] else suggest(cfg, num_devices, device_memory_bytes, platform)
    return report


def predict_energy(cfg: ml_collections.ConfigDict, num_devices: int, platform: str,
                   target: roofline.Target | None) -> dict[str, Any] | None:
    """The whole run's (run.steps) time, energy, carbon and cost at `energy.assume_mfu` on `energy.device`,
    else the target's device, else an H100 when planning for GPUs (`jaxlm.energy.predict`)."""
    kind = cfg.energy.device or (target.device_kind if target else "H100" if platform == "gpu" else "")
    if not kind:
        return None
    model_cfg = transformer.ModelConfig.from_config(cfg.model, platform)
    tokens = cfg.run.steps * cfg.data.global_batch_size * cfg.data.seq_len
    flops = transformer.flops_per_token(model_cfg, cfg.data.seq_len) * tokens
    p = energy.predict(flops, num_devices, kind, platform, metrics.peak_flops(kind), cfg.energy)
    return None if p is None else {**p, "steps": cfg.run.steps, "tokens": tokens, "model_flops": flops}


def format_energy(p: dict[str, Any], recipe: str) -> str:
    what = f"{recipe or 'the config'}, {p['steps']:,} steps ({format_count(p['tokens'])} tokens)"
    return "energy: " + energy.format_prediction(p, what)


def format_pipeline(p: dict[str, Any]) -> str:
    """One line: the pipeline's schedule, its bubble and what each device sends to the next stage per step."""
    return (f"  pipeline: {p['stages']} stages, {p['schedule']}"
            + (f" with {p['repeats']} layer groups per stage" if p["repeats"] > 1 else "")
            + f", {p['microbatches']} micro-batches in flight: {p['iterations']} iterations, bubble "
            f"{p['bubble']:.1%} ((S - 1) / (M R + S - 1)); {format_bytes(p['stage_bytes_per_step'])} per device "
            f"to the next stage per step (activations forward, their gradients backward)")


def format_report(report: dict[str, Any]) -> str:
    r = report
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"jaxlm plan: {r['recipe'] or 'config'}, {format_count(r['param_count'])} parameters, on {r['num_devices']} "
        f"device{'s' if r['num_devices'] != 1 else ''}"
        + (f" of {r['slices']} {r['topology']} slices" if r.get("slices", 1) > 1
           else f" of a {r['topology']} slice" if r.get("topology") else "")
        + f" ({mesh}), {format_bytes(r['device_memory_bytes'])} each",
        f"  batch {r['global_batch_size']} x {r['seq_len']} tokens, {r['micro_batches']} micro-batch(es) of "
        f"{r['per_device_batch']} sequence(s) per device; remat={r['remat']}; compute {r['dtype']}, params "
        f"{r['param_dtype']}; attention {r['attention']}"
        + (f" (packed layout, up to {r['attention_segments']} documents per row)" if r.get("attention_segments") else "")
        + f" (planned for {r['platform']})",
        *([f"  {r['micro_batches_auto']}"] if r.get("micro_batches_auto") else []),
        *([format_pipeline(r["pipeline"])] if r.get("pipeline") else []),
        "",
        f"  {'component':<22}{'per device':>14}{'unsharded':>14}   {'alive':<9}",
    ]
    alive = {memory.ALWAYS: "", memory.BACKWARD: "passes", memory.UPDATE: "update"}
    for row in r["analytic"]["rows"]:
        lines.append(f"  {row['name']:<22}{format_bytes(row['per_device_bytes']):>14}"
                     f"{format_bytes(row['total_bytes']):>14}   {alive[row.get('phase', memory.ALWAYS)]:<9}{row['note']}")
    lines.append(f"  {'peak (analytic)':<22}{format_bytes(r['analytic']['per_device_bytes']):>14}   what is held "
                 "throughout + the larger of the passes and the update")
    lines.append(f"  parameters + gradients + optimizer state: {r['bytes_per_param']:.1f} bytes per parameter")
    c = r["compiled"]
    if c:
        lines += [
            "",
            f"  compiled (XLA, {c['num_devices']} {c['platform']} device{'s' if c['num_devices'] != 1 else ''}, "
            f"{c['compile_s']} s): "
            f"{format_bytes(c['per_device_bytes'])} per device = arguments {format_bytes(c['argument_bytes'])}"
            f" + outputs not aliased {format_bytes(c['output_bytes'] - c['alias_bytes'])}"
            f" + temporaries {format_bytes(c['temp_bytes'])}"
            + (f" + cuDNN's workspace {format_bytes(c['cudnn_workspace_bytes'])} (estimated)"
               if c.get("cudnn_workspace_bytes") else ""),
            f"  analytic for the same program ({c['attention']} attention"
            + (", float32 activations as the CPU keeps them" if c["platform"] == "cpu" else "")
            + f"): {format_bytes(c['analytic_same_program_bytes'])}; compiled / analytic = {c['ratio']:.3f} "
            + ("(within " if c["within_tolerance"] else "(OUTSIDE ") + f"the stated ±{memory.TOLERANCE:.0%})",
        ]
        if c.get("compile_only") and c["platform"] == "gpu":
            lines.append(f"  compile-only: XLA sizes cuDNN's workspaces on a real GPU, so this program's "
                         f"{c.get('cudnn_calls_without_workspace', 0)} cuDNN calls have none; the per-device figure "
                         f"adds the one they share, estimated {format_bytes(c.get('cudnn_workspace_bytes', 0))} (the "
                         "packed layout's backward), most of what a real GPU's program adds to the compile-only "
                         "one (benchmarks/BENCHMARKS.md)")
        if c.get("roofline"):
            lines += ["", *("  " + line if line else "" for line in roofline.format_summary(c["roofline"]).splitlines())]
    lines.append("")
    if r.get("energy"):
        lines += [format_energy(r["energy"], r["recipe"]), ""]
    verdict = (f"{format_bytes(r['per_device_bytes'])} of {format_bytes(r['device_memory_bytes'])} per device "
               f"({r['decided_by']})")
    if r["fits"]:
        lines.append(f"fits: {verdict}, {format_bytes(r['margin_bytes'])} to spare")
    else:
        lines.append(f"does not fit: {verdict}, short by {format_bytes(-r['margin_bytes'])}")
        if r["suggestions"]:
            lines.append("these changes would fit (analytic):")
            for s in r["suggestions"]:
                flags = " ".join(f"--config.{k}={v}" for k, v in s["overrides"].items())
                lines.append(f"  {flags:<64} {format_bytes(s['per_device_bytes']):>12}"
                             f"  ({format_bytes(s['spare_bytes'])} to spare)")
        else:
            lines.append("no change of fsdp, remat, micro-batches or batch size tried fits: use more devices, "
                         "tensor parallelism (config.mesh.tensor) or a smaller model")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command line


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """The command: `_main`, its errors, interrupts and environment failures as one line and an exit code."""
    return run_command(lambda: _main(argv, own_process=own_process), resume="run the same command again")


make_parser = commands.plan_parser  # the command line, declared in jaxlm.commands (light to import)


def _main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """The command; `own_process`: nothing else runs in this process (`python -m jaxlm.plan`), so
    without --compile JAX is kept off the accelerators (the analytic figure needs no device)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    try:
        config_args = [a for a in argv if a.startswith("--config")]
        args = parser.parse_args([a for a in argv if not a.startswith("--config")])
        target = roofline.TARGETS[args.target] if args.target else None
        if args.topology and (target is None or target.platform != "tpu"):
            raise UserError(f"--topology={args.topology} is a TPU slice's shape: add --target=v5e, v5p or v6e "
                            f"(after `make tpu-env`)")
        if args.slices > 1 and (target is None or target.platform != "tpu"):
            raise UserError(f"--slices={args.slices} joins TPU slices: add --target=v5e, v5p or v6e (after "
                            "`make tpu-env`)")
        if args.devices is None:
            if not args.topology:
                raise UserError("--devices is required (the number of devices the run uses), or, for a TPU target, "
                                "--topology (e.g. --topology=v5p:2x2x1)")
            try:
                args.devices = math.prod(roofline.parse_topology(target, args.topology)) * args.slices
            except ValueError as e:
                raise UserError(str(e)) from None
        if target is not None and target.platform == "tpu":
            try:  # each slice: given, or Cloud's shape for that many chips
                args.topology = roofline.slice_topology(target, args.devices, args.topology, args.slices)
            except ValueError as e:
                raise UserError(str(e)) from None
            args.platform = "tpu"  # model.attention=auto and the analytic estimate as for a TPU
            roofline.quiet_libtpu()  # before libtpu loads: no warnings about the VM it is not on
            # a compile-only TPU program cannot be loaded back from JAX's persistent cache (no client): none
            jax.config.update("jax_enable_compilation_cache", False)
        if args.device_memory_gib is None:
            args.device_memory_gib = target.memory_bytes / GIB if target else 80.0
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # planning never needs device memory
        if target is not None:  # compile-only devices: JAX itself runs on the CPU (the plugin needs no GPU then)
            jax.config.update("jax_platforms", "cpu")
            args.compile = True
        elif args.compile:
            use_cpu_devices(args.devices)
        elif own_process:
            jax.config.update("jax_platforms", "cpu")
        cfg = init_from.config_from_cli(config_args)
        if args.compile:  # the program compiled as the trainer compiles it: with the run's XLA flags
            xla_flags.apply(cfg.run.xla_flags)
            xla_flags.apply_libtpu(cfg.run.libtpu_flags)  # a TPU target's compiler reads them as it loads
        if args.choose and target is None:
            raise UserError("--choose compiles for a target's devices: add --target=h100 (after `make h100-env`) "
                            "or a TPU's (--target=v5p, after `make tpu-env`)")
        devices = None
        if target is not None and target.platform == "tpu":
            devices = target_devices(target, args.devices, args.topology, args.slices)
            if args.slices > 1 and not cfg.mesh.hybrid:
                cfg.mesh.hybrid = "slice"  # data across the slices (DCN), fsdp within each (ICI)
        # the run's layout (mesh.hybrid's groups) is the planned devices', not this machine's
        with mesh_lib.planned_devices(devices) if devices is not None else contextlib.nullcontext():
            report = plan(cfg, args.devices, args.device_memory_gib * GIB, platform=args.platform,
                          compile=args.compile, devices=devices, target=target, topology=args.topology)
            report["slices"] = args.slices
            if args.choose:
                if not args.json:  # the rows as they compile (seconds each), then the choice
                    print(format_report(report), CHOICE_HEADER, sep="\n", flush=True)
                report["choice"] = choose(cfg, args.devices, target, devices=devices, topology=args.topology,
                                          progress=None if args.json else lambda line: print(line, flush=True))
    except UserError as e:
        return report_error(e)
    if args.json:
        print(json.dumps(report, default=float), flush=True)
    else:
        print(format_choice(report["choice"], report) if args.choose else format_report(report), flush=True)
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main(own_process=True))
