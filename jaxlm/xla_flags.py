"""XLA flags from the config (`run.xla_flags`), checked, then set before JAX starts its backends.

XLA reads `XLA_FLAGS` once, when the first backend starts, and aborts the whole process (a fatal
log line, no Python exception) on a flag it does not know; flags also come and go between XLA
versions (`--xla_gpu_graph_level` is gone, for one). So `apply` first starts XLA on the CPU in a
throwaway process with the merged flags: every XLA flag, GPU ones included, is parsed there, and a
bad one becomes one error line naming it, before this process has done any device work. The GPU
flags worth setting are measured with `benchmarks/mfu.py --sweep run.xla_flags=...`; jaxlm sets
none by default until a measurement says one helps (see benchmarks/BENCHMARKS.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax

from jaxlm.errors import UserError

_PROBE = "import jax; jax.devices()"


def merge(current: str, flags: str) -> str:
    """`current` (an XLA_FLAGS value) with `flags` appended, replacing any flag of the same name."""
    names = _parse(flags)
    kept = [flag for flag in current.split() if flag.partition("=")[0] not in names]
    return " ".join(kept + flags.split())


def _parse(flags: str) -> dict[str, str]:
    return {name: value for name, _, value in (flag.partition("=") for flag in flags.split())}


def apply(flags: str) -> str:
    """Add `flags` ("--xla_name=value ...") to this process's XLA_FLAGS (its child processes inherit
    them); returns the flags now set. A no-op for "". Raises UserError, naming the flag, for
    anything that is not an XLA flag this XLA accepts, and when JAX has already started (too late)."""
    flags = " ".join(flags.split())
    if not flags:
        return os.environ.get("XLA_FLAGS", "")
    not_xla = [flag for flag in flags.split() if not re.fullmatch(r"--xla_\w+(=\S*)?", flag)]
    if not_xla:
        raise UserError(f"run.xla_flags: {not_xla[0]!r} is not an XLA flag; write them as --xla_name=value, "
                        f"separated by spaces")
    from jax._src import xla_bridge  # local import: private JAX API, only needed when flags are given

    merged = merge(os.environ.get("XLA_FLAGS", ""), flags)
    if xla_bridge.backends_are_initialized():
        if _parse(merged) != _parse(os.environ.get("XLA_FLAGS", "")):  # only if it changes something
            raise UserError("run.xla_flags can only be set before JAX starts its backends; pass it on the "
                            "command line, or set the XLA_FLAGS environment variable before Python starts")
        return os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "XLA_FLAGS": merged, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        found = re.search(r"(Unknown flags? in XLA_FLAGS: .*|Couldn't interpret value .*)", probe.stderr)
        reason = found.group(1).strip() if found else (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"run.xla_flags: XLA (jax {jax.__version__}) refuses them: {reason[:300]}; "
                        f"remove or rename that flag")
    os.environ["XLA_FLAGS"] = merged
    return merged
