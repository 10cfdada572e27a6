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
  (the layer loop's stacked weights and activations), and that buffers XLA:TPU placed in on-chip memory
  (layouts marked `S(1)`) cost no HBM traffic.
- **time** = max(FLOPs / peak of its dtype, bytes / HBM bandwidth), times its executions per step
  (the trip counts of the loops around it: layers, micro-batches).
- **collectives**: the bytes one device sends (ring algorithms, `jaxlm.hlo.sent_bytes`) over the link
  bandwidth (NVLink within a host, the network between hosts). An async collective overlaps the
  kernels the schedule puts between its start and its done; what they do not cover is **exposed**.
  XLA:TPU's collective fusions count as the collectives they run (an async collective fusion's start
  and done; an all-reduce-scatter fusion, a reduce-scatter), and so does a collective offloaded to the
  chip's SparseCores (a call-start on the "sparsecore" thread and its call-done).
- **asynchronous copies** (XLA:TPU's copy-start and slice-start: memory-space assignment moving buffers
  between HBM and on-chip memory by DMA): their HBM bytes over the HBM bandwidth, covered only by the
  slack of the kernels between start and done (a kernel's time beyond its own HBM traffic), shared first
  come first served; the rest is exposed and adds to the step.

The step's roofline time is the sum of the kernels' times plus the exposed copies and communication: a lower
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
from collections.abc import Sequence
from typing import Any

import numpy as np

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
    config: str | None = None  # XLA's target description (text proto); GPUs only
    capability: str | None = None  # CUDA compute capability, as in `config`; GPUs only
    # TPUs: the chips of one host as libtpu lays a slice out over hosts (x, y, z), and the default topology
    # (`default_topology`) is 2-D (v5e, v6e: a 2-D torus) or 3-D (v4, v5p)
    host_bounds: tuple[int, int, int] | None = None
    topology_dims: int = 0

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bf16"])

    def link_domain(self, num_devices: int) -> int:
        """Devices that reach each other over the fast links (`link_bytes_per_s`): a GPU's host (NVLink), a
        TPU's whole slice (ICI joins every chip of a slice, across hosts); beyond, `network_bytes_per_s`."""
        return num_devices if self.platform == "tpu" else self.devices_per_host


@contextlib.contextmanager
def cudnn_checks_for(target: Target):
    """While lowering for compile-only `target` devices: jax's cuDNN attention asks the default backend
    (here the CPU) for the GPU's compute capability, finds none, and refuses what needs Hopper (the
    packed layout); within this, it is told the target's instead."""
    if target.capability is None:  # not a GPU: no cuDNN
        yield
        return
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
    if target.platform != "cuda":  # cuDNN and tokamax's GPU kernels: nothing to tell a TPU's compiler
        yield
        return
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
    devices_per_host=8, config=H100_SXM_CONFIG, capability="9.0",
)

# TPUs, from Google Cloud's pages (dense figures per chip; "GB" of HBM read as GiB, as the v5p page writes it):
# https://cloud.google.com/tpu/docs/v4, https://cloud.google.com/tpu/docs/v5e, https://cloud.google.com/tpu/docs/v5p
# and https://cloud.google.com/tpu/docs/v6e. ICI: the chip's bidirectional bandwidth halved (one direction, all its
# ports together: a collective over one mesh axis uses some of them, so this is the optimistic roof); DCN (between
# slices): the host's NICs shared by its chips. libtpu's compile-only devices are the chips of a slice (v5p, v5e,
# v6e: one device per chip, v5p's two TensorCores as one, as on a real one).
TPU_V4 = Target(
    name="v4", device_kind="TPU v4", platform="tpu",
    peak_flops={"bf16": 275e12, "s8": 275e12},  # "275 teraflops (bf16 or int8)"
    hbm_bytes_per_s=1200e9, memory_bytes=32 * 2**30,  # HBM2 32 GiB, 1200 GBps
    # Cloud's v4 page gives no per-chip ICI figure: 6 links of 45 GB/s one way each (Google DeepMind's "How to
    # Scale Your Model", https://jax-ml.github.io/scaling-book/tpus/)
    link_bytes_per_s=270e9,
    network_bytes_per_s=6.25e9,  # not on the page: v5p's 50 Gbps per chip assumed
    devices_per_host=4, host_bounds=(2, 2, 1), topology_dims=3,
)
TPU_V5E = Target(
    name="v5e", device_kind="TPU v5 lite", platform="tpu",
    peak_flops={"bf16": 197e12, "s8": 393e12},  # 197 TFLOPs bf16, 393 TOPs int8
    hbm_bytes_per_s=819e9, memory_bytes=16 * 2**30,  # 16 GB, 819 GBps
    link_bytes_per_s=200e9,  # bidirectional ICI 400 GBps per chip (1600 Gbps)
    network_bytes_per_s=25e9 / 8,  # 2 x 100 Gbps NICs per host of 8 chips
    devices_per_host=8, host_bounds=(2, 4, 1), topology_dims=2,
)
TPU_V5P = Target(
    name="v5p", device_kind="TPU v5", platform="tpu",
    peak_flops={"bf16": 459e12, "s8": 918e12, "f8e4m3fn": 459e12, "f8e5m2": 459e12},  # bf16 = fp8 459 TFLOPs, int8 918
    hbm_bytes_per_s=2765e9, memory_bytes=95 * 2**30,  # HBM2e 95 GiB, 2765 GBps
    link_bytes_per_s=600e9,  # bidirectional ICI 1200 GBps per chip (4800 Gbps)
    network_bytes_per_s=50e9 / 8,  # DCN 50 Gbps per chip
    devices_per_host=4, host_bounds=(2, 2, 1), topology_dims=3,
)
TPU_V6E = Target(
    name="v6e", device_kind="TPU v6 lite", platform="tpu",
    peak_flops={"bf16": 918e12, "s8": 1836e12},  # 918 TFLOPs bf16, 1836 TOPs int8
    hbm_bytes_per_s=1640e9, memory_bytes=32 * 2**30,  # 32 GB, 1640 GBps
    link_bytes_per_s=400e9,  # bidirectional ICI 800 GBps per chip (3200 Gbps; a later version of the page: 3584)
    network_bytes_per_s=100e9 / 8,  # 4 x 200 Gbps NICs per host of 8 chips
    devices_per_host=8, host_bounds=(2, 4, 1), topology_dims=2,
)
TARGETS = {"h100": H100, "v4": TPU_V4, "v5e": TPU_V5E, "v5p": TPU_V5P, "v6e": TPU_V6E}

# What libtpu, loaded on a machine without TPUs, would otherwise ask the VM's metadata for and warn about (the
# accelerator type, the workers' host names); the topology compiled for is `--topology`, not these.
TPU_QUIET_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost"}


def quiet_libtpu() -> None:
    """Set `TPU_QUIET_ENV` (where unset): before libtpu is loaded, and only when compiling for compile-only TPUs
    (on a TPU VM these would misdescribe the real chips)."""
    import os  # local import: only the compile-only tools call this

    for key, value in TPU_QUIET_ENV.items():
        os.environ.setdefault(key, value)


_TOPOLOGY = re.compile(r"(v4|v5e|v5p|v6e|v5litepod):(\d+(?:x\d+){1,2})")


def parse_topology(target: Target, topology: str) -> tuple[int, ...]:
    """`v5p:2x2x1` -> (2, 2, 1) for `target`: the chip grid of a slice as libtpu names it (generation, then
    2 or 3 dimensions); ValueError with what is allowed when it is not one, or not of `target`'s generation."""
    m = _TOPOLOGY.fullmatch(topology.strip())
    example = "v5p:2x2x1" if target.topology_dims == 3 else f"{target.name}:2x4"
    if m is None:
        raise ValueError(f"--topology={topology!r} is not a TPU topology: write the generation and the chip grid, "
                         f"e.g. {example}")
    generation = "v5e" if m.group(1) == "v5litepod" else m.group(1)
    if generation != target.name:
        raise ValueError(f"--topology={topology} is a {generation} slice, not a {target.name} one (--target="
                         f"{target.name}): use e.g. {example}, or --target={generation}")
    dims = tuple(int(d) for d in m.group(2).split("x"))
    if len(dims) != target.topology_dims or min(dims) < 1:
        raise ValueError(f"--topology={topology}: a {target.name} slice is a {target.topology_dims}-D grid of chips, "
                         f"e.g. {example}")
    return dims


def default_topology(target: Target, num_devices: int) -> str:
    """The slice shape Cloud offers for `num_devices` chips of a TPU `target` (v5p: 2x2x1, 2x2x2, 2x4x4, 4x4x4,
    4x4x8, ...; v5e, v6e: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, ...): powers of two, doubling the smallest side."""
    if num_devices & (num_devices - 1):
        raise ValueError(f"{num_devices} {target.name} chips: no default slice shape for a count that is not a power "
                         f"of two; give --topology (e.g. {target.name}:{'x'.join(['2'] * target.topology_dims)})")
    dims = [1] * target.topology_dims
    while math.prod(dims) < num_devices:
        if math.prod(dims) < 4:  # 1x1(x1) -> 2x1(x1) -> 2x2(x1)
            i = 0 if dims[0] == 1 else 1
        else:  # the smallest side, the last of equals (2x2x1 -> 2x2x2 -> 2x2x4 -> 2x4x4)
            i = max(j for j, d in enumerate(dims) if d == min(dims))
        dims[i] *= 2
    return f"{target.name}:{'x'.join(map(str, dims))}"


def slice_topology(target: Target, num_devices: int, topology: str | None, slices: int = 1) -> str:
    """Each slice's topology for `num_devices` chips over `slices` slices: `topology`, or Cloud's shape
    (`default_topology`); ValueError when the slices or the topology do not make up the chips."""
    if slices < 1 or num_devices % slices:
        raise ValueError(f"--slices={slices} does not divide --devices={num_devices}")
    topology = topology or default_topology(target, num_devices // slices)
    chips = math.prod(parse_topology(target, topology))
    if chips * slices != num_devices:
        raise ValueError(f"--topology={topology} has {chips} chips" + (f" a slice, x {slices} slices"
                         if slices > 1 else "") + f", not --devices={num_devices}")
    return topology


def tpu_devices(target: Target, num_devices: int, topology: str | None = None, slices: int = 1) -> list:
    """The compile-only chips of `slices` TPU slices of `topology` each (default `default_topology` for
    num_devices / slices chips), from libtpu's own description of them, laid out over hosts as Cloud's are
    (`Target.host_bounds`), each chip with its `slice_index`; needs libtpu (`make tpu-env`)."""
    from jax.experimental import topologies  # local import: experimental JAX API, only for compile-only targets

    topology = slice_topology(target, num_devices, topology, slices)
    dims = parse_topology(target, topology)
    grid = (*dims, 1) if len(dims) == 2 else dims
    bounds = [min(d, b) for d, b in zip(grid, target.host_bounds)]
    quiet_libtpu()
    extra = {"num_slices": slices} if slices > 1 else {}
    devices = list(topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                                chips_per_host_bounds=bounds, **extra).devices)
    if len(devices) != num_devices:  # v4: libtpu gives each of a chip's two TensorCores, where a v4 runs megacore
        raise ValueError(f"libtpu describes {topology} as {len(devices)} devices (one per TensorCore), not one per chip "
                         f"as a {target.name} runs; its program cannot be compiled here: plan it analytically, "
                         f"without --target (--platform=tpu --device_memory_gib={target.memory_bytes / 2**30:g})")
    return devices


def partition_domains(devices: Sequence) -> list[int]:
    """The link domain of each partition of a TPU program compiled over `devices` in partition order (a
    mesh's devices, flattened): its slice (ICI joins a slice's chips, DCN the slices)."""
    return [int(getattr(d, "slice_index", 0) or 0) for d in devices]


def target_devices(target: Target, num_devices: int, topology: str | None = None, slices: int = 1) -> list:
    """`num_devices` compile-only devices of `target` (whole hosts of `devices_per_host`, or fewer on
    one; TPUs: the chips of `topology`, `tpu_devices`), for `jax.jit(...).lower(...).compile()` on this
    machine. Needs the target's PJRT plugin installed (`make h100-env`, `make tpu-env`) and JAX started
    with `JAX_PLATFORMS=cpu` (the plugin is not initialised for a device that is not there)."""
    # local import: experimental JAX API, only for compile-only targets (the rest of this module needs no JAX)
    from jax.experimental import topologies

    if target.platform == "tpu":
        return tpu_devices(target, num_devices, topology, slices)
    if topology:
        raise ValueError(f"--topology is a TPU slice's shape; --target={target.name} is not a TPU")
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
    exposed_seconds: float = 0.0  # an asynchronous collective or copy: per execution, not covered by the kernels
    dma: bool = False  # an asynchronous copy (XLA:TPU's copy-start and slice-start): overlaps the kernels beside it
    full_attention_flops: float = 0.0  # attention: the flops of the whole T x S square (no causal skip)
    recompute_flops: float = 0.0  # attention backward: what it recomputes of the forward (left out of the model's)
    network: bool = False  # a collective across link domains (hosts' NICs, TPU slices' DCN), at network_bytes_per_s
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


_DIM_LABELS = re.compile(r"dim_labels=([0-9bf]+)_([0-9io]+)->([0-9bf]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _window(attrs: str, spatial: int) -> dict[str, list]:
    """A convolution's window per spatial dimension: size, stride, pad (low, high), lhs_dilate, rhs_dilate."""
    m = _WINDOW.search(attrs)
    fields = dict(f.split("=", 1) for f in (m.group(1).split() if m else []) if "=" in f)
    out: dict[str, list] = {}
    for key, default in (("size", 1), ("stride", 1), ("lhs_dilate", 1), ("rhs_dilate", 1)):
        out[key] = [int(v) for v in fields[key].split("x")] if key in fields else [default] * spatial
    out["pad"] = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields \
        else [(0, 0)] * spatial
    return out


def _window_pairs(size_in: int, kernel: int, size_out: int, stride: int, pad_low: int, lhs_dilate: int,
                  rhs_dilate: int) -> int:
    """(output position, kernel position) pairs of one spatial dimension that land on an input element (not
    on padding, nor on a hole lhs dilation leaves): the multiply-adds that dimension contributes."""
    span, pairs = (size_in - 1) * lhs_dilate, 0
    for k in range(kernel):
        shift = k * rhs_dilate - pad_low  # input position = o * stride + shift
        if lhs_dilate == 1:  # 0 <= o * stride + shift <= span, o in [0, size_out)
            first, last = max(0, -(shift // stride)), min(size_out - 1, (span - shift) // stride)
            pairs += max(0, last - first + 1)
        else:
            pairs += sum(1 for o in range(size_out) if 0 <= (p := o * stride + shift) <= span and p % lhs_dilate == 0)
    return pairs


def conv_flops(module: hlo.Module, inst: dict) -> float:
    """2 x the multiply-adds of a `convolution`: what XLA:TPU turns dots into (a batched matmul's batch dims
    become padded, dilated spatial windows whose off-diagonal positions fall on padding). Per output batch
    element and output feature, the kernel's input features times, per spatial dimension, the (output,
    kernel) position pairs that read an input element."""
    m = _DIM_LABELS.search(inst["attrs"])
    if m is None or len(inst["operands"]) < 2:
        return 0.0
    lhs_labels, rhs_labels, out_labels = m.groups()
    _, lhs = hlo.dtype_dims(module.shapes.get(inst["operands"][0], "?"))
    _, rhs = hlo.dtype_dims(module.shapes.get(inst["operands"][1], "?"))
    _, out = hlo.dtype_dims(inst["shape"])
    if (len(lhs), len(rhs), len(out)) != (len(lhs_labels), len(rhs_labels), len(out_labels)):
        return 0.0
    spatial = len(out_labels) - 2
    window = _window(inst["attrs"], spatial)
    total = float(out[out_labels.index("b")] * out[out_labels.index("f")] * rhs[rhs_labels.index("i")])
    for d in range(spatial):
        total *= _window_pairs(lhs[lhs_labels.index(str(d))], rhs[rhs_labels.index(str(d))],
                               out[out_labels.index(str(d))], window["stride"][d], window["pad"][d][0],
                               window["lhs_dilate"][d], window["rhs_dilate"][d])
    return 2.0 * total


def _fused_dots(module: hlo.Module, computation: str, seen: frozenset = frozenset()) -> list[tuple[dict, float]]:
    """The dots (and convolutions: XLA:TPU's matmuls) inside a fusion's computation and the fusions nested in
    it: (dot, flops)."""
    out = []
    for inst in module.computations.get(computation, []):
        if inst["op"] == "dot":
            out.append((inst, dot_flops(module, inst)))
        elif inst["op"] == "convolution":
            out.append((inst, conv_flops(module, inst)))
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


_SPLASH = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_BLOCKS = re.compile(r'"xprof_metadata":"(\{.*?\})"')
# splash's kernels' matmuls per [block_q, block_kv] block they visit, in units of one [bq, bkv] x head_dim
# matmul: forward scores and values; dq: scores and the values' gradient again, then dq; dkv: scores,
# dp, dv and dk. What each recomputes of the forward: the scores, and in dq also dp, which dkv computes too.
# The fused backward (`dkv_fused`: one kernel that also writes dq, per key block, summed after): scores, dp,
# dv, dk and dq, the scores recomputed.
_SPLASH_MATMULS = {"fwd": (2, 0), "dq": (3, 2), "dkv": (4, 1), "dkv_fused": (5, 1)}  # phase: (matmuls, recomputed)


def _splash_attention(module: hlo.Module, inst: dict) -> tuple[str, float, float, float, str] | None:
    """A Pallas TPU splash attention kernel (`jaxlm.models.attention.splash_attention`): (kind, flops,
    full-square flops, recomputed flops, dtype), or None for another custom call. Its phase comes from the
    kernel's name, its block sizes from the kernel metadata splash records, q [B, N, T, H] and k [B, K, S, H]
    are its first two floating operands of rank 4; the blocks it visits are those a causal mask leaves any
    pair in (jaxlm gives splash only causal masks: documents shorter than the row skip no blocks here)."""
    m = _SPLASH.search(inst["name"]) or ((op := _OP_NAME.search(inst["attrs"])) and _SPLASH.search(op.group(1)))
    if not m:
        return None
    phase = m.group(1)
    arrays = [hlo.dtype_dims(module.shapes.get(o, "?")) for o in inst["operands"]]
    floats = [(t, d) for t, d in arrays if t.startswith(("bf", "f")) and len(d) == 4]
    if len(floats) < 2:
        return None
    (q_t, (b, n, t, h)), (_, (_, _, s_len, _)) = floats[:2]
    if phase == "dkv" and any(dims[-3:] == [n, t, h] and len(dims) == 5  # dq's partial sums [B, S / bkv, N, T, H]
                              for _, dims in map(hlo.dtype_dims, hlo.tuple_parts(inst["shape"]))):
        phase = "dkv_fused"
    sizes = {}
    if meta := _SPLASH_BLOCKS.search(inst["attrs"]):  # "xprof_metadata":"{\"block_q\": 512, ...}"
        sizes = json.loads(meta.group(1).replace('\\"', '"'))
    suffix = {"fwd": "", "dq": "_dq", "dkv": "_dkv", "dkv_fused": "_dkv"}[phase]
    bq = int(sizes.get("block_q" + suffix, t) or t)
    bkv = int(sizes.get("block_kv" + suffix, s_len) or s_len)
    visited = sum(min(-(-s_len // bkv), ((i + 1) * bq - 1) // bkv + 1) for i in range(-(-t // bq)))
    matmuls, recomputed = _SPLASH_MATMULS[phase]
    per_block = 2.0 * bq * bkv * h * b * n  # one matmul over one block, every row and head
    full = matmuls * per_block * (-(-t // bq)) * (-(-s_len // bkv))
    kind = "attention" if phase == "fwd" else "attention backward"
    return kind, matmuls * per_block * visited, full, recomputed * per_block * visited, q_t


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
    if any(i["root"] and i["name"] == name for i in insts):  # passed on whole (a nested fusion's bitcast: XLA:TPU)
        return full
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


def hbm_bytes(shape: str) -> int:
    """The bytes of a shape that live in the device's main memory (HBM): what a kernel reading or writing it moves
    through HBM. Buffers XLA:TPU placed in on-chip memory (`S(1)`, and scalars elsewhere) cost no HBM traffic."""
    return hlo.shape_bytes(shape, memory_space=0)


def _written_bytes(module: hlo.Module, inst: dict) -> float:
    """HBM bytes a fusion writes: its result (the parts in HBM), except that an in-place
    dynamic-update-slice writes only its update."""
    callee = module.callee(inst)
    body = {i["name"]: i for i in module.computations.get(callee, [])}
    root = next((i for i in body.values() if i["root"]), None)
    if root is None:
        return hbm_bytes(inst["shape"])
    if root["op"] == "tuple":
        elements, outer = [body.get(o) for o in root["operands"]], hlo.tuple_parts(inst["shape"])
    else:
        elements, outer = [root], [inst["shape"]]
    total = 0.0
    for element, shape in zip(elements, outer):
        if element is None or not hbm_bytes(shape):
            continue  # written to on-chip memory
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


_MEGASCALE_TARGET = re.compile(r'_xla_megascale_target="\{([^}]*)\}')
_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
                    "ALL_TO_ALL": "all-to-all"}


def _megascale(attrs: str) -> tuple[str, int] | None:
    """A multi-slice TPU program's collective across slices, (its kind, the slices it spans), or None. XLA:TPU
    compiles one slice's program and sends what crosses DCN to the host's megascale runtime: a `send` (and a
    `recv`) whose attributes name the transfer (ALL_REDUCE, ...) and its target, `{slices}x{chips}` with
    slices listed as ids and `a:b` ranges."""
    target, kind = _MEGASCALE_TARGET.search(attrs), _MEGASCALE_TYPE.search(attrs)
    if target is None or kind is None:
        return None
    slices = 0
    for part in target.group(1).split(","):
        lo, _, hi = part.strip().partition(":")
        slices += int(hi) - int(lo) + 1 if hi else 1
    return _MEGASCALE_KINDS.get(kind.group(1), "collective-permute"), slices


def _collective_fusion(module: hlo.Module, inst: dict) -> tuple[str, dict | None]:
    """XLA:TPU's collective fusions, (phase, the collective in the fusion's body): "start" for an asynchronous
    one whose body ends in an AsyncCollectiveStart custom call and "done" (no collective) for its
    AsyncCollectiveDone (the collective runs between the two, beside the kernels scheduled there);
    "fused" for a synchronous one (the all-reduce-scatter fusion: an all-reduce of the whole gradient, each
    chip keeping its slice); ("", None) for anything else. A collective offloaded to the chip's SparseCores
    (`--xla_tpu_enable_sparse_core_collective_offload_*`) is a call-start on the "sparsecore" thread whose
    computation is the collective: "start" too, its call-done the end (the generic "-done")."""
    if inst["op"] == "call-start" and 'async_execution_thread="sparsecore"' in inst["attrs"]:
        body = module.computations.get(module.callee(inst, "to_apply") or "", [])
        collective = next((i for i in body if hlo.collective_op(i["op"]) is not None), None)
        return ("start", collective) if collective is not None else ("", None)
    if inst["op"] != "fusion" or "kind=kCustom" not in inst["attrs"]:
        return "", None
    body = module.computations.get(module.callee(inst) or "", [])
    collective = next((i for i in body if hlo.collective_op(i["op"]) is not None), None)
    root = next((i for i in body if i["root"]), None)
    target = re.search(r'custom_call_target="([^"]+)"', root["attrs"]) if root and root["op"] == "custom-call" else None
    if target is not None and target.group(1) == "AsyncCollectiveDone":
        return "done", None
    if target is not None and target.group(1) == "AsyncCollectiveStart":
        return "start", collective
    return ("fused", collective) if collective is not None else ("", None)


def kernels(module: hlo.Module, target: Target, num_devices: int, domains: Sequence[int] | None = None) -> list[Kernel]:
    """Every kernel of an optimized (scheduled) module with its roofline time, in launch order per
    computation; asynchronous collectives and copies with the part of their time the schedule does not
    overlap (`exposed_seconds`). A collective runs at
    `link_bytes_per_s` within one link domain, at `network_bytes_per_s` across them: `domains[i]` is the
    domain of the program's partition i (a TPU's slice: `partition_domains`); by default partitions are
    numbered host by host (`Target.link_domain`)."""
    if domains is None:
        domains = [i // target.link_domain(num_devices) for i in range(num_devices)]
    domain_of = np.asarray(domains)
    out: list[Kernel] = []
    for comp in control_computations(module):
        insts = module.computations[comp]
        runs = module.runs.get(comp, 0)
        pending: dict[str, Kernel] = {}  # async collectives started and not yet done
        covered: dict[str, float] = {}
        # async copies started and not yet done, with the HBM time each still needs: they share HBM with the
        # kernels, so only a kernel's slack (its time beyond its own HBM traffic) covers them, first come first
        dmas: dict[str, list] = {}
        by_name = {i["name"]: i for i in insts}
        for inst in insts:
            op = inst["op"]
            phase, collective_inst = _collective_fusion(module, inst)
            if phase == "done":  # its operands are the start's tuple's elements
                start = next((by_name[o]["operands"][0] for o in inst["operands"]
                              if by_name.get(o, {}).get("op") == "get-tuple-element"
                              and by_name[o]["operands"][0] in pending), None)
                if start is not None:
                    kernel = pending.pop(start)
                    kernel.exposed_seconds = max(0.0, kernel.seconds - covered.pop(kernel.name))
                continue
            if op.endswith("-done") and inst["operands"] and inst["operands"][0] in pending:
                kernel = pending.pop(inst["operands"][0])
                kernel.exposed_seconds = max(0.0, kernel.seconds - covered.pop(kernel.name))
                continue
            if op.endswith("-done") and inst["operands"] and inst["operands"][0] in dmas:
                kernel, need = dmas.pop(inst["operands"][0])
                kernel.exposed_seconds = need  # the step waits for the rest of the copy here
                continue
            if op in NOT_KERNELS or op.endswith("-done"):
                continue
            config = _json_config(inst["attrs"])
            op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', inst["attrs"])) else ""
            kernel = Kernel(name=inst["name"], kind=op, computation=comp, runs=runs, flops=0.0, bytes=0.0, seconds=0.0,
                            op_name=op_name, source=module.source(inst["attrs"]))
            if op in ("send", "recv") and (dcn := _megascale(inst["attrs"])) is not None:
                if op == "recv":
                    continue  # the transfer is counted once, at its send
                collective, slices = dcn
                size = hlo.shape_bytes(module.shapes.get(inst["operands"][0], "")) if inst["operands"] else 0
                size = size / slices if collective == "reduce-scatter" else size * slices if collective == "all-gather" \
                    else size  # sent_bytes takes the result's size; the send holds this chip's operand
                kernel.kind, kernel.comm_bytes = collective, hlo.sent_bytes(collective, size, slices)
                kernel.seconds = kernel.comm_bytes / target.network_bytes_per_s if slices > 1 else 0.0
                kernel.network = True
                pending[inst["name"]], covered[inst["name"]] = kernel, 0.0  # until its send-done
                out.append(kernel)
                continue
            if (collective := hlo.collective_op((collective_inst or inst)["op"])) is not None:
                collective_inst = collective_inst or inst
                groups = hlo.device_groups(collective_inst["attrs"], num_devices)
                size = hlo.collective_result_bytes(collective_inst)
                if collective == "all-reduce" and phase == "fused" \
                        and hlo.shape_bytes(inst["shape"]) < size:  # each chip keeps its slice: a reduce-scatter
                    collective, size = "reduce-scatter", hlo.shape_bytes(inst["shape"])
                kernel.kind, kernel.comm_bytes = collective, hlo.sent_bytes(collective, size, groups.shape[1])
                kernel.network = any(len(set(domain_of[g])) > 1 for g in groups)
                bandwidth = target.network_bytes_per_s if kernel.network else target.link_bytes_per_s
                kernel.seconds = kernel.comm_bytes / bandwidth if groups.shape[1] > 1 else 0.0
                is_sync = config.get("collective_backend_config", {}).get("is_sync", False)
                if (op.endswith("-start") or phase == "start") and not is_sync:
                    pending[inst["name"]], covered[inst["name"]] = kernel, 0.0
                else:
                    kernel.exposed_seconds = kernel.seconds
                out.append(kernel)
                continue
            operand_bytes = [hbm_bytes(module.shapes.get(o, "")) for o in inst["operands"]]
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
                    # cuDNN's backward recomputes the scores: one of its five matmuls
                    kernel.recompute_flops = 0.2 * kernel.flops if "Backward" in call else 0.0
                elif (splash := _splash_attention(module, inst)) is not None:  # XLA:TPU: a Pallas TPU kernel
                    kernel.kind, kernel.flops, kernel.full_attention_flops, kernel.recompute_flops, kernel.dtype = splash
                elif call in ("AllocateBuffer", "ConcatBitcast", "PrepareAsyncCallStart", "PrepareAsyncCallDone"):
                    # XLA:TPU: a buffer reserved, the slices an asynchronous slice landed side by side read as one
                    # (a bitcast, by its name), a SparseCore call's bookkeeping: free
                    continue
                elif (grouped := _tokamax_ragged_dot(inst["attrs"])) is not None:  # Triton or Mosaic GPU
                    kernel.kind = "gemm"
                    kernel.flops, kernel.dtype = grouped
                else:
                    kernel.kind = f"custom call ({call})"
                kernel.bytes = sum(operand_bytes) + hbm_bytes(inst["shape"])
            elif op in ("dot", "convolution"):  # an unfused dot (CPU modules) or convolution
                kernel.kind = "gemm"
                kernel.flops = dot_flops(module, inst) if op == "dot" else conv_flops(module, inst)
                kernel.dtype = hlo.dtype_dims(module.shapes.get(inst["operands"][0], "?"))[0]
                kernel.bytes = sum(operand_bytes) + hbm_bytes(inst["shape"])
            elif op == "dynamic-update-slice":  # in place: reads the update, writes it into the buffer
                update = hlo.shape_bytes(module.shapes.get(inst["operands"][1], "")) if len(inst["operands"]) > 1 else 0
                kernel.bytes = (operand_bytes[1] if len(operand_bytes) > 1 else 0) + (update if hbm_bytes(inst["shape"])
                                                                                      else 0)
            elif op in SLICING:  # reads the slice of its operand, writes it
                kernel.bytes = (hlo.shape_bytes(inst["shape"]) if operand_bytes and operand_bytes[0] else 0) \
                    + hbm_bytes(inst["shape"])
            elif op in ("slice-start", "copy-start"):
                # XLA:TPU's asynchronous copies, done by DMA engines beside the kernels: a slice-start's shape is
                # ((operand), slice, context), a copy-start's (destination, source, context); memory-space
                # assignment moves buffers between HBM and on-chip memory with them, so one side is in HBM
                parts = hlo.tuple_parts(inst["shape"])
                moved = parts[1] if op == "slice-start" else parts[0]
                kernel.kind, kernel.dma = ("slice" if op == "slice-start" else "copy"), True
                kernel.bytes = (hlo.shape_bytes(moved) if operand_bytes and operand_bytes[0] else 0) + hbm_bytes(moved)
            else:  # copy, transpose, reduce, sort, ...: reads its operands, writes its result
                kernel.kind = "copy" if op == "copy" else op
                kernel.bytes = sum(operand_bytes) + hbm_bytes(inst["shape"])
            kernel.seconds = max(kernel.flops / target.peak(kernel.dtype or "bf16"), kernel.bytes / target.hbm_bytes_per_s)
            if kernel.dma:
                dmas[inst["name"]] = [kernel, kernel.seconds]
                out.append(kernel)
                continue
            for name in covered:
                covered[name] += kernel.seconds
            slack = kernel.seconds - kernel.bytes / target.hbm_bytes_per_s
            for entry in dmas.values():  # the oldest copy first
                if slack <= 0:
                    break
                took = min(slack, entry[1])
                entry[1] -= took
                slack -= took
            out.append(kernel)
        for name, kernel in pending.items():  # never done in this computation: nothing seen to overlap
            kernel.exposed_seconds = max(0.0, kernel.seconds - covered[name])
        for kernel, need in dmas.values():
            kernel.exposed_seconds = need
    return out


# ----------------------------------------------------------------------------- the step


_FUNCTION = re.compile(r"\S+:\d+ \(([^)\s]+)\)")  # a kernel's source, "jaxlm/models/layers.py:120 (to_fp8) ..."


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
        row["exposed_seconds"] += k.exposed_seconds * k.runs  # async collectives, copies: what the step waits for
    # an asynchronous copy adds to the step only what the kernels beside it leave uncovered
    compute_s = sum(k.exposed_seconds * k.runs if k.dma else k.total_seconds for k in compute)
    comm_s = sum(k.total_seconds for k in comm)
    exposed_s = sum(k.exposed_seconds * k.runs for k in comm)
    step_s = compute_s + exposed_s
    matmul_flops = sum(k.flops * k.runs for k in compute if k.kind in ("gemm", "attention", "attention backward"))
    full_flops = sum((k.full_attention_flops or k.flops) * k.runs for k in compute
                     if k.kind in ("gemm", "attention", "attention backward"))
    peak = target.peak("bf16")
    largest = sorted(compute + comm, key=lambda k: -k.total_seconds)[:top]
    # the kernels by the function of this repository that made them (`hlo.Module.source`): e.g. float8's
    # scaling work, `layers.to_fp8`'s amax reductions and casts, launches and time per step
    by_function: dict[str, dict[str, float]] = defaultdict(lambda: dict(kernels=0, launches=0, seconds=0.0))
    for k in compute:
        m = _FUNCTION.match(k.source or "")
        row = by_function[m.group(1) if m else ""]
        row["kernels"] += 1
        row["launches"] += k.runs
        row["seconds"] += k.exposed_seconds * k.runs if k.dma else k.total_seconds
    return dict(
        target=target.name, step_seconds=step_s, compute_seconds=compute_s, communication_seconds=comm_s,
        exposed_communication_seconds=exposed_s, matmul_flops=matmul_flops, matmul_flops_full_attention=full_flops,
        # of the communication, what crosses hosts' NICs or TPU slices' DCN
        network_bytes=sum(k.comm_bytes * k.runs for k in comm if k.network),
        network_seconds=sum(k.total_seconds for k in comm if k.network),
        # what the attention kernels' backward recompute of the forward (the model's count leaves it out)
        attention_recompute_flops=sum(k.recompute_flops * k.runs for k in compute if k.kind == "attention backward"),
        model_flops=model_flops_per_device,
        roofline_mfu=(model_flops_per_device / peak / step_s) if step_s else None,
        matmul_seconds=sum(k.total_seconds for k in compute if k.kind in ("gemm", "attention", "attention backward")),
        kernels=len(compute), launches=sum(k.runs for k in compute),
        by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["seconds"])),
        by_function=dict(sorted(by_function.items(), key=lambda kv: -kv[1]["seconds"])),
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
        str(Table(["made by (function)", "kernels", "launches", "ms", "share"],
                  [[name or "(outside jaxlm)", int(r["kernels"]), int(r["launches"]), f"{r['seconds'] * ms:.2f}",
                    f"{r['seconds'] / summary['step_seconds']:.1%}" if summary["step_seconds"] else ""]
                   for name, r in list(summary.get("by_function", {}).items())[:12]])),
        "",
        str(Table(["largest kernels", "kind", "launches", "ms", "source"],
                       [[k["name"], k["kind"], k["runs"], f"{k['seconds'] * ms:.2f}", (k["source"] or k["op_name"])[:100]]
                        for k in summary["largest"]])),
    ]
    return "\n".join(lines)
