"""`model.dtype=auto`: the compute dtype the device runs fast and safely.

bfloat16 where the device computes it natively: NVIDIA GPUs of compute capability 8.0 and newer
(Ampere, Hopper, Blackwell), TPUs, and CPUs with bfloat16 instructions (x86's AVX512_BF16 or AMX-BF16,
Arm's BF16: `cpu_bfloat16`). float32 on other CPUs (AVX2-only x86 laptops and desktops, Apple M1): XLA:CPU
computes bfloat16 there by converting to float32 and back, which made nanoGPT's shape and a 33.6M Llama
slower than in float32 (benchmarks/BENCHMARKS.md, "CPU without bfloat16 units"). float16, with dynamic loss scaling
(`jaxlm.loss_scale`), on older NVIDIA GPUs: their tensor cores run float16 and not bfloat16 (a T4 is
7.5, a V100 7.0), so bfloat16 there is slow, and float16 without a scale loses small gradients.
"""

from __future__ import annotations

import functools
import platform as platform_lib
import subprocess

import jax
import jax.numpy as jnp

from jaxlm.errors import UserError

BF16_MIN_CAPABILITY = 8.0
FP8_MIN_CAPABILITY = 8.9  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell


def compute_capability(device=None) -> str | None:
    """The CUDA compute capability of `device` (default: the first local device) as "major.minor"; None
    off NVIDIA GPUs or where JAX does not say."""
    try:
        device = device or jax.local_devices()[0]
    except RuntimeError:
        return None
    if device.platform != "gpu":
        return None
    cc = getattr(device, "compute_capability", None)
    return str(cc) if cc else None


def auto_dtype(platform: str, capability: str | None) -> tuple[str, str]:
    """(the dtype `model.dtype=auto` means on this device, why)."""
    if platform == "gpu" and capability:
        try:
            major_minor = float(capability)
        except ValueError:
            major_minor = None
        if major_minor is not None and major_minor < BF16_MIN_CAPABILITY:
            return "float16", (f"compute capability {capability} has float16 tensor cores and no bfloat16 ones: "
                               f"float16 with dynamic loss scaling")
        return "bfloat16", f"compute capability {capability} computes bfloat16 natively"
    if platform == "cpu":
        native, what = cpu_bfloat16()
        if not native:
            return "float32", f"this CPU has no bfloat16 instructions ({what}): it would convert every bfloat16"
        return "bfloat16", f"this CPU computes bfloat16 ({what})"
    return "bfloat16", f"{platform} computes bfloat16"


# The names Linux gives the bfloat16 arithmetic extensions in /proc/cpuinfo: x86's `flags` (AVX512_BF16's
# dot products and conversions; AMX's bfloat16 tiles) and Arm's `Features` (FEAT_BF16).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@functools.cache
def cpu_bfloat16() -> tuple[bool, str]:
    """(whether this machine's CPU has bfloat16 arithmetic instructions, what says so). Read from the
    processor's own flags (Linux: /proc/cpuinfo; macOS: sysctl's FEAT_BF16), never from
    `--xla_cpu_max_isa`, which caps the vector width XLA:CPU generates for and leaves bfloat16's cost on
    the processor as it is. A machine whose flags cannot be read counts as having none."""
    system = platform_lib.system()
    if system == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        return out == "1", "sysctl hw.optional.arm.FEAT_BF16=" + (out or "unknown")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False, f"no /proc/cpuinfo to read on {system or 'this system'}"
    found = bfloat16_flags(text)
    if found:
        return True, ", ".join(found)
    return False, "no " + ", ".join(CPU_BF16_FLAGS) + " in /proc/cpuinfo"


def bfloat16_flags(cpuinfo: str) -> list[str]:
    """The `CPU_BF16_FLAGS` that the text of a /proc/cpuinfo names on its x86 `flags` or Arm `Features` lines."""
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    return [flag for flag in CPU_BF16_FLAGS if flag in words]


def check_fp8(platform: str, capability: str | None) -> None:
    """`model.matmul=fp8` refused in one line on a GPU without float8 tensor cores (a CPU runs it emulated)."""
    if platform == "gpu" and capability and float(capability) < FP8_MIN_CAPABILITY:
        raise UserError(f"config.model.matmul='fp8' needs float8 tensor cores (compute capability {FP8_MIN_CAPABILITY}+: "
                        f"Ada, Hopper, Blackwell); this GPU is {capability}: use model.matmul=auto")


@functools.cache
def float16_computes() -> bool:
    """Whether XLA:CPU compiles float16 arithmetic on this processor. jaxlib 0.10 converts float16 with the
    F16C instructions and has no fallback where they are missing (an SSE4.2-only x86 processor, or
    `--xla_cpu_max_isa=SSE4_2`): the program fails to link (`__extendhfsf2` not found)."""
    try:
        x = jax.device_put(jnp.arange(4, dtype=jnp.float16), jax.local_devices(backend="cpu")[0])
        jax.block_until_ready(jax.jit(lambda v: v * v + 1)(x))
    except jax.errors.JaxRuntimeError:
        return False
    return True


def check_float16(platform: str) -> None:
    """`model.dtype=float16` refused in one line where XLA:CPU cannot compile float16 (`float16_computes`)."""
    if platform == "cpu" and not float16_computes():
        raise UserError("config.model.dtype='float16' does not compile on this CPU: XLA:CPU needs the F16C "
                        "instructions for float16, which this processor (or --xla_cpu_max_isa) lacks; use "
                        "model.dtype=bfloat16 or float32")
