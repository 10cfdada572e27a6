"""The roofline of a compiled program, read from its optimized HLO: every kernel it launches per
step, with the FLOPs and bytes that bound its time on a target device, and what that makes the step.

No GPU is needed. XLA compiles the real GPU program on a CPU machine for compile-only devices
(`target_devices`: H100s from XLA's own target description, in an environment holding the CUDA
plugin; `make h100-env`), and the scheduled HLO text lists the kernels in launch order. Per kernel:

- **FLOPs**: the dots of a GEMM fusion (Triton) or a cuBLAS call, 2·M·N·K; cuDNN attention
  4·B·H·T·S·D forward (two matmuls), x2.5 backward (five), halved when cuDNN is told the mask is
  causal (it skips the blocks above the diagonal); tokamax's grouped GEMMs (an MoE's experts, Triton or
  Mosaic GPU custom calls) 2·rows·K·N, every ragged row in a group (the routed FLOPs, read from the op and
  shapes tokamax names its kernels' scope with). Elementwise work counts no FLOPs (memory-bound).
- **bytes** (HBM traffic): what the kernel reads and writes: its operands and results, except that
  a dynamic slice reads only the slice and an in-place dynamic-update-slice writes only the update
  (the layer loop's stacked weights and activations).
- **time** = max(FLOPs / peak of its dtype, bytes / HBM bandwidth), times its executions per step
  (the trip counts of the loops around it: layers, micro-batches).
- **collectives**: the bytes one device sends (ring algorithms, `jaxlm.hlo.sent_bytes`) over the link
  bandwidth (NVLink within a host, the network between hosts). An async collective overlaps the
  kernels the schedule puts between its start and its done; what they do not cover is **exposed**.

The step's roofline time is the sum of the kernels' times plus the exposed communication: a lower
bound on the real step (every kernel at its roof, nothing else). The **roofline-bound MFU** is the
model's FLOPs per device (`flops_per_token` x tokens / devices) over peak x that time: the best MFU
this program can reach on the target, which changes to the program move and launch overheads,
autotuning and kernel efficiency do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections import defaultdict
from typing import Any

from jaxlm import hlo
from jaxlm.table import Table

# XLA's GpuTargetConfigProto for an H100 SXM (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb), with the
# cuDNN and CUDA runtime versions of the jax-cuda13 0.10 wheels: what compile-only devices compile for.
H100_SXM_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to compile for and its roofs (dense datasheet figures, no sparsity)."""

    name: str
    device_kind: str
    platform: str
    peak_flops: dict[str, float]  # by the dot's operand dtype
    hbm_bytes_per_s: float
    memory_bytes: int
    link_bytes_per_s: float  # one device's send bandwidth within a host (NVLink), one direction
    network_bytes_per_s: float  # one device's send bandwidth between hosts (InfiniBand / RoCE NIC)
    devices_per_host: int
    config: str  # XLA's target description (text proto)
    capability: str = "9.0"  # CUDA compute capability, as in `config`

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bf16"])


@contextlib.contextmanager
def cudnn_checks_for(target: Target):
    """While lowering for compile-only `target` devices: jax's cuDNN attention asks the default backend
    (here the CPU) for the GPU's compute capability, finds none, and refuses what needs Hopper (the
    packed layout); within this, it is told the target's instead."""
    # local import: private JAX API, only needed when compiling for a GPU target
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    have = tuple(int(x) for x in target.capability.split("."))
    saved = cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal
    cudnn.check_compute_capability = lambda c: have >= tuple(int(x) for x in c.split("."))
    cudnn.is_cuda_compute_capability_equal = lambda c: have == tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal = saved


@contextlib.contextmanager
def kernel_checks_for(target: Target):
    """While lowering for compile-only `target` devices: `cudnn_checks_for`, and the same for tokamax
    (model.moe_impl=tokamax), where it is installed: its kernels check the default device (here the CPU)
    and fall back to XLA's masked dense grouped matmul; within this they compile for the target (its
    `cross_compile` option), and its Mosaic GPU kernels are told the target's compute capability, as
    a real H100 picks them before Triton's."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(cudnn_checks_for(target))
        try:
            import tokamax  # local import: an optional package (the cuda12 extra)
            from tokamax._src import gpu_utils  # local import: private, the capability its Mosaic GPU kernels check
        except ImportError:
            tokamax = None
        if tokamax is not None:
            from absl import flags  # local import: only with tokamax, for compile-only targets

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()  # tokamax's options are absl flags (jaxlm.models.mlps.moe._tokamax)
            stack.enter_context(tokamax.config.cross_compile(True))
            saved = gpu_utils._compute_capability
            gpu_utils._compute_capability = lambda device=None: float(target.capability)
            stack.callback(setattr, gpu_utils, "_compute_capability", saved)
        yield


H100 = Target(
    name="h100", device_kind="NVIDIA H100 80GB HBM3", platform="cuda",
    # bf16/fp16 989.4 TFLOP/s, fp8 1979, tf32 (XLA's default for float32 dots on GPUs) 494.7
    peak_flops={"bf16": 989e12, "f16": 989e12, "f8e4m3fn": 1979e12, "f8e5m2": 1979e12, "f32": 494.5e12},
    hbm_bytes_per_s=3.35e12, memory_bytes=84978434048,
    link_bytes_per_s=450e9,  # NVLink 4: 900 GB/s per GPU both directions
    network_bytes_per_s=50e9,  # one 400 Gb/s NIC per GPU
    devices_per_host=8, config=H100_SXM_CONFIG,
)
TARGETS = {"h100": H100}


def target_devices(target: Target, num_devices: int) -> list:
    """`num_devices` compile-only devices of `target` (whole hosts of `devices_per_host`, or fewer on
    one), for `jax.jit(...).lower(...).compile()` on this machine. Needs the target's PJRT plugin
    installed (`make h100-env`) and JAX started with `JAX_PLATFORMS=cpu` (the plugin is not
    initialised for a device that is not there)."""
    # local import: experimental JAX API, only for compile-only targets (the rest of this module needs no JAX)
    from jax.experimental import topologies

    per_host = min(num_devices, target.devices_per_host)
    if num_devices % per_host:
        raise ValueError(f"{num_devices} {target.name} devices are not whole hosts of {target.devices_per_host}")
    topology = f"1x{num_devices // per_host}x{per_host}"
    return list(topologies.get_topology_desc(platform=target.platform, topology=topology,
                                             target_config=target.config).devices)


# ----------------------------------------------------------------------------- kernels

NOT_KERNELS = {  # instructions that launch nothing: bookkeeping, control flow, the done halves of async pairs
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call", "after-all",
    "partition-id", "replica-id", "opt-barrier", "domain", "add-dependency", "copy-done", "send-done", "recv-done",
    "async-done", "async-update", "all-gather-done", "all-reduce-done", "reduce-scatter-done", "collective-permute-done",
    "all-to-all-done", "optimization-barrier", "get-dimension-size", "iota-done",
}
SLICING = ("dynamic-slice", "slice", "gather")


@dataclasses.dataclass
class Kernel:
    name: str
    kind: str  # gemm, attention, loop fusion, input fusion, dynamic slice, copy, collective, ...
    computation: str
    runs: int  # executions per step
    flops: float  # per execution, what the kernel computes
    bytes: float  # per execution, HBM read + written
    seconds: float  # per execution, at the roof
    dtype: str = ""  # a matmul's operand dtype
    comm_bytes: float = 0.0  # a collective: what one device sends
    exposed_seconds: float = 0.0  # a collective: per execution, not covered by kernels scheduled beside it
    full_attention_flops: float = 0.0  # attention: the flops of the whole T x S square (no causal skip)
    op_name: str = ""
    source: str = ""

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.runs


def _json_config(attrs: str) -> dict:
    """An instruction's backend_config JSON (empty when absent or unreadable)."""
    i = attrs.find("backend_config=")
    if i < 0 or attrs[i + 15:i + 16] != "{":
        return {}
    depth, start = 0, i + 15
    for j in range(start, len(attrs)):
        depth += {"{": 1, "}": -1}.get(attrs[j], 0)
        if depth == 0:
            try:
                return json.loads(attrs[start:j + 1])
            except json.JSONDecodeError:
                return {}
    return {}


def control_computations(module: hlo.Module) -> set[str]:
    """The computations whose instructions are launched as kernels: the entry, loop bodies and
    conditions, conditional branches and called computations (not fusion bodies or reducers)."""
    out, todo = set(), [module.entry]
    while todo:
        name = todo.pop()
        if name in out or name not in module.computations:
            continue
        out.add(name)
        for inst in module.computations[name]:
            if inst["op"] in ("while", "conditional", "call", "async-start"):
                todo += [callee for _, callee in hlo.CALLS.findall(inst["attrs"])]
                for group in hlo.BRANCHES.findall(inst["attrs"]):
                    todo += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
    return out


def dot_flops(module: hlo.Module, inst: dict) -> float:
    """2 x result elements x contracted size of a `dot`."""
    _, lhs = hlo.dtype_dims(module.shapes.get(inst["operands"][0], "?"))
    _, res = hlo.dtype_dims(inst["shape"])
    contracted = math.prod(lhs[d] for d in hlo.dims_attr(inst["attrs"], "lhs_contracting_dims") if d < len(lhs))
    return 2.0 * math.prod(res) * contracted


def _fused_dots(module: hlo.Module, computation: str, seen: frozenset = frozenset()) -> list[tuple[dict, float]]:
    """The dots inside a fusion's computation and the fusions nested in it: (dot, flops)."""
    out = []
    for inst in module.computations.get(computation, []):
        if inst["op"] == "dot":
            out.append((inst, dot_flops(module, inst)))
        elif inst["op"] == "fusion":
            callee = module.callee(inst)
            if callee and callee not in seen:
                out += _fused_dots(module, callee, seen | {computation})
    return out


def _cublas(module: hlo.Module, inst: dict) -> tuple[float, str]:
    """A cuBLAS GEMM custom call's flops and operand dtype, from its dot dimension numbers."""
    dims = _json_config(inst["attrs"]).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    lhs_t, lhs = hlo.dtype_dims(module.shapes.get(inst["operands"][0], "?"))
    shape = inst["shape"]
    if shape.startswith("("):
        shape = hlo.tuple_parts(shape)[0]  # (result, workspace)
    _, res = hlo.dtype_dims(shape)
    contracted = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []) if int(d) < len(lhs))
    return 2.0 * math.prod(res) * contracted, lhs_t


def _cudnn_attention(module: hlo.Module, inst: dict, backward: bool) -> tuple[float, float, str]:
    """A cuDNN attention call's flops as computed (causal: half the square), its full-square flops,
    and its dtype. The forward does two matmuls of B·H·T·S·D, the backward five."""
    config = _json_config(inst["attrs"]).get("cudnn_fmha_backend_config", {})
    bhts = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    q_t, q = hlo.dtype_dims(module.shapes.get(inst["operands"][0], "?"))
    contracting = [int(d) for d in config.get("bmm1_dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])]
    head_dim = math.prod(q[d] for d in contracting if d < len(q)) if contracting else (q[-1] if q else 0)
    if len(bhts) != 4:
        return 0.0, 0.0, q_t
    full = 2 * 2.0 * math.prod(bhts) * head_dim
    if backward:
        full *= 2.5
    # causal; PADDING_CAUSAL is causal within each packed segment, counted as causal over the row (the
    # model's count; documents shorter than the row skip blocks, so the kernel does no more than this)
    causal = config.get("mask_type", "") in ("CAUSAL", "PADDING_CAUSAL")
    return (full / 2 if causal else full), full, q_t


_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')  # the escaped quotes of a name holding JSON included


def _tokamax_ragged_dot(attrs: str) -> tuple[float, str] | None:
    """A tokamax grouped-matmul kernel's FLOPs and operand dtype, or None for another custom call. tokamax
    names its kernels' scope after the op and its arguments as JSON (`tokamax:{...}` in op_name): the
    FLOPs are 2 x lhs elements x the rhs's kept size, every ragged row in a group (a dropless dispatch
    routes every row; block padding not counted), the routed FLOPs."""
    m = _OP_NAME.search(attrs)
    name = m.group(1).replace('\\"', '"') if m else ""
    start = name.find("tokamax:{")
    if start < 0 or "RaggedDot" not in name:
        return None
    try:
        op, _ = json.JSONDecoder().raw_decode(name[start + len("tokamax:"):])
        args = op["arguments"]
        dims = args["ragged_dot_dimension_numbers"]
        lhs_t, lhs = hlo.dtype_dims(args["lhs"])
        _, rhs = hlo.dtype_dims(args["rhs"])
        (_, rhs_contracting), (_, rhs_batch) = dims["dot_dimension_numbers"]
        dropped = [*rhs_contracting, *rhs_batch, *dims["rhs_group_dimensions"]]
    except (ValueError, KeyError, TypeError):
        return None
    kept = math.prod(n for i, n in enumerate(rhs) if i not in dropped)
    return 2.0 * math.prod(lhs) * kept, lhs_t


def _users(computation: list[dict], name: str) -> list[dict]:
    return [i for i in computation if name in i["operands"]]


def _param_read_bytes(module: hlo.Module, computation: str, index: int, full: float, depth: int = 0) -> float:
    """Bytes a fusion reads of its operand `index` (of `full` bytes): only the slices when every use
    slices it, nothing when it is only the buffer an in-place dynamic-update-slice writes into;
    nested fusions are followed."""
    insts = module.computations.get(computation, [])
    param = next((i for i in insts if i["op"] == "parameter" and i["operands"] == [str(index)]), None)
    if param is None or depth > 8:
        return full
    return min(full, _read_through(module, insts, param["name"], full, depth))


def _read_through(module: hlo.Module, insts: list[dict], name: str, full: float, depth: int) -> float:
    total = 0.0
    for user in _users(insts, name):
        position = user["operands"].index(name)
        if user["op"] in SLICING and position == 0:
            total += hlo.shape_bytes(user["shape"])
        elif user["op"] == "dynamic-update-slice" and position == 0:
            pass  # written in place: the update is counted as the write
        elif user["op"] in ("bitcast", "reshape"):
            total += _read_through(module, insts, user["name"], full, depth)
        elif user["op"] == "fusion":
            callee = module.callee(user)
            total += _param_read_bytes(module, callee, position, full, depth + 1) if callee else full
        else:
            return full
    return total


def _written_bytes(module: hlo.Module, inst: dict) -> float:
    """Bytes a fusion writes: its result, except that an in-place dynamic-update-slice writes only
    its update."""
    callee = module.callee(inst)
    body = {i["name"]: i for i in module.computations.get(callee, [])}
    root = next((i for i in body.values() if i["root"]), None)
    if root is None:
        return hlo.shape_bytes(inst["shape"])
    elements = [body.get(o) for o in root["operands"]] if root["op"] == "tuple" else [root]
    total = 0.0
    for element in elements:
        if element is None:
            continue
        if element["op"] == "dynamic-update-slice":
            total += hlo.shape_bytes(module.shapes.get(element["operands"][1], ""))
        else:
            total += hlo.shape_bytes(element["shape"])
    return total


def _fusion_kind(inst: dict, config: dict) -> str:
    backend = config.get("fusion_backend_config", {})
    kind = backend.get("kind", "")
    if kind == "__custom_fusion":
        name = backend.get("custom_fusion_config", {}).get("name", "custom")
        return "dynamic slice" if "dynamic_slice" in name else f"custom fusion ({name})"
    m = re.search(r"\bkind=k(\w+)", inst["attrs"])
    return {"Loop": "loop fusion", "Input": "input fusion", "Output": "output fusion"}.get(m.group(1) if m else "",
                                                                                          "custom fusion")


def kernels(module: hlo.Module, target: Target, num_devices: int) -> list[Kernel]:
    """Every kernel of an optimized (scheduled) module with its roofline time, in launch order per
    computation; collectives with the part of their time the schedule does not overlap."""
    out: list[Kernel] = []
    for comp in control_computations(module):
        insts = module.computations[comp]
        runs = module.runs.get(comp, 0)
        pending: dict[str, Kernel] = {}  # async collectives started and not yet done
        covered: dict[str, float] = {}
        for inst in insts:
            op = inst["op"]
            if op.endswith("-done") and inst["operands"] and inst["operands"][0] in pending:
                kernel = pending.pop(inst["operands"][0])
                kernel.exposed_seconds = max(0.0, kernel.seconds - covered.pop(kernel.name))
                continue
            if op in NOT_KERNELS or op.endswith("-done"):
                continue
            config = _json_config(inst["attrs"])
            op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', inst["attrs"])) else ""
            kernel = Kernel(name=inst["name"], kind=op, computation=comp, runs=runs, flops=0.0, bytes=0.0, seconds=0.0,
                            op_name=op_name, source=module.source(inst["attrs"]))
            if (collective := hlo.collective_op(op)) is not None:
                groups = hlo.device_groups(inst["attrs"], num_devices)
                size = hlo.collective_result_bytes(inst)
                kernel.kind, kernel.comm_bytes = collective, hlo.sent_bytes(collective, size, groups.shape[1])
                cross = any(len(set(g // target.devices_per_host)) > 1 for g in groups)
                bandwidth = target.network_bytes_per_s if cross else target.link_bytes_per_s
                kernel.seconds = kernel.comm_bytes / bandwidth if groups.shape[1] > 1 else 0.0
                is_sync = config.get("collective_backend_config", {}).get("is_sync", False)
                if op.endswith("-start") and not is_sync:
                    pending[inst["name"]], covered[inst["name"]] = kernel, 0.0
                else:
                    kernel.exposed_seconds = kernel.seconds
                out.append(kernel)
                continue
            operand_bytes = [hlo.shape_bytes(module.shapes.get(o, "")) for o in inst["operands"]]
            if op == "fusion":
                callee = module.callee(inst)
                dots = _fused_dots(module, callee) if callee else []
                kernel.kind = "gemm" if dots else _fusion_kind(inst, config)
                kernel.flops = sum(f for _, f in dots)
                if dots:
                    kernel.dtype = hlo.dtype_dims(module.shapes.get(dots[0][0]["operands"][0], "?"))[0]
                kernel.bytes = sum(_param_read_bytes(module, callee, i, b) for i, b in enumerate(operand_bytes)) \
                    + _written_bytes(module, inst)
            elif op == "custom-call":
                call = m.group(1) if (m := re.search(r'custom_call_target="([^"]+)"', inst["attrs"])) else ""
                if "cublas" in call:
                    kernel.kind = "gemm"
                    kernel.flops, kernel.dtype = _cublas(module, inst)
                elif "cudnn$fmha" in call:
                    kernel.kind = "attention backward" if "Backward" in call else "attention"
                    kernel.flops, kernel.full_attention_flops, kernel.dtype = _cudnn_attention(module, inst,
                                                                                          "Backward" in call)
                elif (grouped := _tokamax_ragged_dot(inst["attrs"])) is not None:  # Triton or Mosaic GPU
                    kernel.kind = "gemm"
                    kernel.flops, kernel.dtype = grouped
                else:
                    kernel.kind = f"custom call ({call})"
                kernel.bytes = sum(operand_bytes) + hlo.shape_bytes(inst["shape"])
            elif op == "dot":  # an unfused dot (CPU modules)
                kernel.kind, kernel.flops = "gemm", dot_flops(module, inst)
                kernel.dtype = hlo.dtype_dims(module.shapes.get(inst["operands"][0], "?"))[0]
                kernel.bytes = sum(operand_bytes) + hlo.shape_bytes(inst["shape"])
            elif op == "dynamic-update-slice":
                kernel.bytes = 2.0 * (operand_bytes[1] if len(operand_bytes) > 1 else 0)
            elif op in SLICING:
                kernel.bytes = 2.0 * hlo.shape_bytes(inst["shape"])
            else:  # copy, copy-start, transpose, reduce, sort, ...: reads its operands, writes its result
                kernel.kind = "copy" if op in ("copy", "copy-start") else op
                kernel.bytes = sum(operand_bytes) + hlo.shape_bytes(inst["shape"])
            kernel.seconds = max(kernel.flops / target.peak(kernel.dtype or "bf16"), kernel.bytes / target.hbm_bytes_per_s)
            for name in covered:
                covered[name] += kernel.seconds
            out.append(kernel)
        for name, kernel in pending.items():  # never done in this computation: nothing seen to overlap
            kernel.exposed_seconds = max(0.0, kernel.seconds - covered[name])
    return out


# ----------------------------------------------------------------------------- the step


def summarize(kernel_list: list[Kernel], target: Target, model_flops_per_device: float, top: int = 15) -> dict[str, Any]:
    """Totals per kind, the step's roofline time, the roofline-bound MFU and the largest kernels."""
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: dict(kernels=0, launches=0, seconds=0.0, flops=0.0,
                                                                    bytes=0.0, exposed_seconds=0.0))
    compute = [k for k in kernel_list if not k.comm_bytes and k.kind not in hlo.COLLECTIVES]
    comm = [k for k in kernel_list if k.kind in hlo.COLLECTIVES]
    for k in kernel_list:
        row = by_kind[k.kind]
        row["kernels"] += 1
        row["launches"] += k.runs
        row["seconds"] += k.total_seconds
        row["flops"] += k.flops * k.runs
        row["bytes"] += (k.comm_bytes or k.bytes) * k.runs
        row["exposed_seconds"] += k.exposed_seconds * k.runs  # collectives: the time the step waits for them
    compute_s = sum(k.total_seconds for k in compute)
    comm_s = sum(k.total_seconds for k in comm)
    exposed_s = sum(k.exposed_seconds * k.runs for k in comm)
    step_s = compute_s + exposed_s
    matmul_flops = sum(k.flops * k.runs for k in compute if k.kind in ("gemm", "attention", "attention backward"))
    full_flops = sum((k.full_attention_flops or k.flops) * k.runs for k in compute
                     if k.kind in ("gemm", "attention", "attention backward"))
    peak = target.peak("bf16")
    largest = sorted(compute + comm, key=lambda k: -k.total_seconds)[:top]
    return dict(
        target=target.name, step_seconds=step_s, compute_seconds=compute_s, communication_seconds=comm_s,
        exposed_communication_seconds=exposed_s, matmul_flops=matmul_flops, matmul_flops_full_attention=full_flops,
        # cuDNN's backward recomputes the scores (one of its five matmuls), which the model's count leaves out
        attention_recompute_flops=0.2 * sum(k.flops * k.runs for k in compute if k.kind == "attention backward"),
        model_flops=model_flops_per_device,
        roofline_mfu=(model_flops_per_device / peak / step_s) if step_s else None,
        matmul_seconds=sum(k.total_seconds for k in compute if k.kind in ("gemm", "attention", "attention backward")),
        kernels=len(compute), launches=sum(k.runs for k in compute),
        by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["seconds"])),
        largest=[dict(name=k.name, kind=k.kind, runs=k.runs, seconds=k.total_seconds, flops=k.flops * k.runs,
                      bytes=(k.comm_bytes or k.bytes) * k.runs, exposed_seconds=k.exposed_seconds * k.runs,
                      source=k.source, op_name=k.op_name) for k in largest],
    )


def collective_shares(summary: dict[str, Any]) -> str:
    """One line: each kind of collective's bytes sent per device, its time and share of the roofline step, and
    the part of it exposed (not overlapped by kernels), largest first (an MoE's all-to-all among them)."""
    step = summary["step_seconds"]
    parts = [f"{kind} {r['bytes'] / 1e9:.2f} GB, {r['seconds'] * 1e3:.1f} ms"
             + (f" ({r['seconds'] / step:.1%} of the step), exposed {r.get('exposed_seconds', 0.0) * 1e3:.1f} ms "
                f"({r.get('exposed_seconds', 0.0) / step:.1%})" if step else "")
             for kind, r in summary["by_kind"].items() if kind in hlo.COLLECTIVES]
    return "collectives per device: " + "; ".join(parts)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few readable lines and two tables."""
    ms = 1e3
    mfu = summary["roofline_mfu"]
    lines = [
        f"roofline on {summary['target']}: step >= {summary['step_seconds'] * ms:.1f} ms per device "
        f"(kernels {summary['compute_seconds'] * ms:.1f} ms, of which matmuls {summary['matmul_seconds'] * ms:.1f} ms; "
        f"communication {summary['communication_seconds'] * ms:.1f} ms, "
        f"exposed {summary['exposed_communication_seconds'] * ms:.1f} ms)",
        f"model FLOPs {summary['model_flops'] / 1e12:.2f} TFLOP per device per step; the program's matmuls "
        f"{summary['matmul_flops'] / 1e12:.2f} TFLOP; roofline-bound MFU "
        + (f"{mfu:.3f}" if mfu is not None else "n/a")
        + (f" (not counted: {summary['incomplete']})" if summary.get("incomplete") else ""),
        *([collective_shares(summary)] if any(kind in hlo.COLLECTIVES for kind in summary["by_kind"]) else []),
        *([f"the device waits for the host {summary['host_syncs']} time(s) per step (conditionals: each copies "
           f"its predicate to the host, which then launches a branch)"] if summary.get("host_syncs") else []),
        "",
        str(Table(["kind", "kernels", "launches", "ms", "share", "TFLOP", "GB"],
                       [[kind, int(r["kernels"]), int(r["launches"]), f"{r['seconds'] * ms:.2f}",
                         f"{r['seconds'] / summary['step_seconds']:.1%}" if summary["step_seconds"] else "",
                         f"{r['flops'] / 1e12:.3f}", f"{r['bytes'] / 1e9:.2f}"]
                        for kind, r in summary["by_kind"].items()])),
        "",
        str(Table(["largest kernels", "kind", "launches", "ms", "source"],
                       [[k["name"], k["kind"], k["runs"], f"{k['seconds'] * ms:.2f}", (k["source"] or k["op_name"])[:100]]
                        for k in summary["largest"]])),
    ]
    return "\n".join(lines)
