"""`model.dtype=auto`: the compute dtype the device runs fast and safely.

bfloat16 where the device computes it natively: NVIDIA GPUs of compute capability 8.0 and newer
(Ampere, Hopper, Blackwell), TPUs, and CPUs (as jaxlm always has). float16, with dynamic loss scaling
(`jaxlm.loss_scale`), on older NVIDIA GPUs: their tensor cores run float16 and not bfloat16 (a T4 is
7.5, a V100 7.0), so bfloat16 there is slow, and float16 without a scale loses small gradients.
"""

from __future__ import annotations

import functools

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
    return "bfloat16", f"{platform} computes bfloat16"


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
