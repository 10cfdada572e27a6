"""How the tests compare floating-point numbers: three kinds of comparison, one function each.

XLA:CPU generates code for the processor it runs on (AVX-512, AVX2, SSE4.2, NEON; LLVM's tuning for the
model): the order of a sum, and with it the last bits of a float, change with the instruction set. So a
float comparison is one of three kinds, and says which:

- `identical(a, b, why=...)`: bit-exact, for the same program on the same machine (a rerun, a resume, a
  restore: determinism is the claim), or for values that were moved and never computed (a copy, a
  transpose, a save and load, a cast, which rounds each element alone). `why` names which, for the reader.
- `close(actual, expected)`: two different programs on the same machine (sharded and unsharded, scanned
  and unrolled, two meshes, two kernels, two libraries), or numbers worked out by hand: each element within
  a few ulps of the values' scale, `|a - e| <= ulps * eps(dtype) * max|e|`; a real bug (a wrong mask, a
  missing scale, a mixed-up axis) moves values by a large fraction of their scale, far beyond it.
- `matches_reference(actual, expected, made_on)`: values stored from another machine (`tests/data/`):
  bit-exact where this machine is the one that made them (same processor, same XLA flags, same jaxlib,
  `machine()`), within `close` otherwise; either way it prints which it did, and `make test`'s summary
  lists those lines.

`tests/conftest.py` makes numpy.testing's exact assertions refuse floating-point values outside this
module, so a new test cannot compare two programs' floats to the bit by accident; `make test-isa` runs the
files that compare floats under the instruction sets users have (`--xla_cpu_max_isa`).
"""

import contextlib
import contextvars
import os
import platform

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

# Why a comparison may be bit-exact (`identical`'s `why`).
SAME_PROGRAM = "the same program on the same machine"
MOVED = "values moved, never computed"
_WHYS = (SAME_PROGRAM, MOVED)

# The default for `close`: 8 ulps of the values' scale (float32: 9.5e-7 of max|e|). Reordered float32 sums
# differ by a few ulps of their scale: sharded GPTQ on an AVX2-only EPYC against AVX-512, 1.7 (issue 45's
# report); the suite's two-program comparisons, 0-2 under AVX-512, AVX2 and SSE4_2. A bug is off by percents.
ULPS = 8

_EXACT_ALLOWED = contextvars.ContextVar("jaxlm_tests_exact_floats", default=False)


@contextlib.contextmanager
def exact_allowed():
    """numpy.testing's exact assertions accept floats inside (tests/conftest.py's guard reads this)."""
    token = _EXACT_ALLOWED.set(True)
    try:
        yield
    finally:
        _EXACT_ALLOWED.reset(token)


def exact_is_allowed() -> bool:
    return _EXACT_ALLOWED.get()


def is_float(value) -> bool:
    """Whether `value` (an array, a scalar, or a dict, list or tuple of them) holds floating-point numbers."""
    if isinstance(value, dict):
        return any(is_float(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(is_float(v) for v in value)
    if isinstance(value, (float, complex)):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _leaves(tree) -> list[tuple[str, np.ndarray]]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in flat]


def _pairs(actual, expected, err_msg: str):
    a, e = _leaves(actual), _leaves(expected)
    assert [p for p, _ in a] == [p for p, _ in e], f"{err_msg}: the trees differ: {[p for p, _ in a]} != " \
                                                   f"{[p for p, _ in e]}"
    for (path, x), (_, y) in zip(a, e):
        yield f"{err_msg}{path}", x, y


def identical(actual, expected, *, why: str, err_msg: str = "") -> None:
    """Equal to the bit, leaf by leaf (arrays or trees of them): only for the same program on the same machine
    (`why=SAME_PROGRAM`) or values moved without arithmetic (`why=MOVED`)."""
    assert why in _WHYS, f"why must be floats.SAME_PROGRAM or floats.MOVED, not {why!r}"
    with exact_allowed():
        for name, x, y in _pairs(actual, expected, err_msg):
            np.testing.assert_array_equal(x, y, err_msg=f"{name} ({why})", strict=True)


def tolerance(expected: np.ndarray, ulps: float = ULPS) -> float:
    """`ulps` units in the last place of `expected`'s scale (its largest finite magnitude), in its dtype."""
    expected = np.asarray(expected)
    dtype = expected.dtype if jnp.issubdtype(expected.dtype, jnp.inexact) else np.dtype(np.float64)
    magnitudes = np.abs(expected.astype(np.float64))
    scale = float(np.nanmax(magnitudes)) if np.isfinite(magnitudes).any() else 0.0  # NaN: a missing value
    return ulps * float(jnp.finfo(dtype).eps) * scale


def close(actual, expected, *, ulps: float = ULPS, err_msg: str = "") -> None:
    """Each element within `ulps` ulps of the values' scale (per leaf: the largest magnitude of `expected`):
    for two programs that compute the same numbers in another order."""
    for name, x, y in _pairs(actual, expected, err_msg):
        assert x.shape == y.shape, f"{name}: shape {x.shape} != {y.shape}"
        assert jnp.issubdtype(x.dtype, jnp.inexact) == jnp.issubdtype(y.dtype, jnp.inexact), \
            f"{name}: dtype {x.dtype} against {y.dtype}"
        atol = tolerance(y, ulps)
        np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=0, atol=atol,
                                   err_msg=f"{name} (within {ulps} ulps of the values' scale: {atol:.3g})")


# XLA flags that change XLA:CPU's generated code, and so the last bits of its floats.
_CODEGEN_FLAGS = ("--xla_cpu_max_isa", "--xla_backend_optimization_level", "--xla_cpu_enable_fast_math",
                  "--xla_cpu_fast_math", "--xla_cpu_use_thunk_runtime", "--xla_cpu_enable_concurrency",
                  "--xla_cpu_prefer_vector_width", "--xla_cpu_use_fusion_emitters", "--xla_llvm")
# The processor's features that XLA:CPU's code generation uses (Linux's /proc/cpuinfo names).
_CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpu() -> tuple[str, list[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine(), []
    fields = {key.strip(): value for key, value in
              (line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)}
    name = (fields.get("model name") or fields.get("Hardware") or fields.get("CPU part") or "").strip()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return name or platform.machine(), [f for f in _CPU_FEATURES if f in flags]


def machine(xla_flags: str | None = None) -> dict:
    """What XLA:CPU's float results depend on here: the processor (model and features), the XLA flags that
    change its code generation (`xla_flags`, default this process's XLA_FLAGS), jaxlib's version."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    name, features = _cpu()
    return {"arch": platform.machine(), "cpu": name, "features": features,
            "xla_flags": sorted(f for f in flags.split() if f.split("=")[0] in _CODEGEN_FLAGS),
            "jaxlib": jaxlib.__version__}


def describe(made_on: dict) -> str:
    flags = " ".join(made_on["xla_flags"]) or "no codegen flags"
    isa = next((f for f in ("amx_bf16", "avx512f", "avx2", "avx", "sse4_2") if f in made_on["features"]), "?")
    return f"{made_on['cpu']} ({isa}), {flags}, jaxlib {made_on['jaxlib']}"


REFERENCE_PREFIX = "[float reference] "


def say(line: str) -> None:
    """Prints what a comparison with stored values did, for the run's summary (tests/conftest.py collects it)."""
    print(REFERENCE_PREFIX + line)


def where(made_on: dict, here: dict) -> str:
    return f"made on {describe(made_on)}, compared here on {describe(here)}"


def matches_reference(actual, expected, made_on: dict, *, ulps: float = ULPS, err_msg: str = "",
                      here: dict | None = None) -> str:
    """Values stored from `made_on` (a `machine()` record): bit-exact where this is that machine, within
    `close(ulps)` elsewhere. `here`: the machine `actual` was computed on, if not this process's (a subprocess
    with other XLA flags). Prints (and returns) which it did; conftest collects the line for the summary."""
    here = machine() if here is None else here
    what = f"{err_msg}: " if err_msg else ""
    if here == made_on:
        identical(actual, expected, why=SAME_PROGRAM, err_msg=err_msg)
        said = f"{what}bit-exact: made on this machine ({describe(here)})"
    else:
        close(actual, expected, ulps=ulps, err_msg=err_msg)
        said = f"{what}within {ulps} ulps of the values' scale: {where(made_on, here)}"
    say(said)
    return said
