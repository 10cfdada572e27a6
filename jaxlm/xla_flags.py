"""XLA flags from the config (`run.xla_flags`), checked, then set before JAX starts its backends.

XLA reads `XLA_FLAGS` once, when the first backend starts, and aborts the whole process (a fatal
log line, no Python exception) on a flag it does not know; flags also come and go between XLA
versions (`--xla_gpu_graph_level` is gone, for one). So `apply` first starts XLA on the CPU in a
throwaway process with the merged flags: every XLA flag, GPU ones included, is parsed there, and a
bad one becomes one error line naming it, before this process has done any device work. The GPU
flags worth setting are measured with `benchmarks/mfu.py --sweep run.xla_flags=...`; jaxlm sets
none by default until a measurement says one helps (see benchmarks/BENCHMARKS.md).

XLA:TPU's own flags are libtpu's, read from `LIBTPU_INIT_ARGS` when libtpu loads (`run.libtpu_flags`,
`apply_libtpu`): checked the same way where libtpu is installed (a throwaway process loads it with them),
inert elsewhere. Its default (`LIBTPU_DEFAULT`) turns XLA:TPU's collective matmul off and makes FSDP's
all-gathers asynchronous: measured on the compiled TPU programs, the FSDP step is faster with whole GEMMs
and separate collectives that overlap them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax

from jaxlm.errors import UserError

log = logging.getLogger(__name__)

_PROBE = "import jax; jax.devices()"


def merge(current: str, flags: str) -> str:
    """`current` (an XLA_FLAGS value) with `flags` appended, replacing any flag of the same name."""
    names = _parse(flags)
    kept = [flag for flag in current.split() if flag.partition("=")[0] not in names]
    return " ".join(kept + flags.split())


def _refuse_words(flags: str, key: str) -> None:
    """UserError naming the first word of `flags` that is not written as an XLA flag (--xla_name=value)."""
    not_xla = [flag for flag in flags.split() if not re.fullmatch(r"--xla_\w+(=\S*)?", flag)]
    if not_xla:
        raise UserError(f"{key}: {not_xla[0]!r} is not an XLA flag; write them as --xla_name=value, separated by "
                        f"spaces")


def _parse(flags: str) -> dict[str, str]:
    return {name: value for name, _, value in (flag.partition("=") for flag in flags.split())}


def apply(flags: str) -> str:
    """Add `flags` ("--xla_name=value ...") to this process's XLA_FLAGS (its child processes inherit
    them); returns the flags now set. A no-op for "". Raises UserError, naming the flag, for
    anything that is not an XLA flag this XLA accepts, and when JAX has already started (too late)."""
    flags = " ".join(flags.split())
    if not flags:
        return os.environ.get("XLA_FLAGS", "")
    _refuse_words(flags, "run.xla_flags")
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


# run.libtpu_flags' default, measured on the compiled 1b and 7b steps (benchmarks/BENCHMARKS.md):
# - no collective matmul (XLA:TPU's windowed einsum, which splits an FSDP matmul into a loop of partial GEMMs
#   beside collective-permutes; its small GEMMs are memory-bound): faster on v5e, v5p and v6e;
# - FSDP's all-gathers asynchronous, as continuation fusions overlapping the matmuls beside them (the set
#   MaxText passes on its TPU recipes): v5p and v6e compile them synchronous without it, v5e async already.
LIBTPU_COLLECTIVE_MATMUL_OFF = "--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000"
LIBTPU_ASYNC_ALL_GATHER = ("--xla_tpu_enable_async_collective_fusion=true "
                           "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
                           "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
                           "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true")
LIBTPU_DEFAULT = f"{LIBTPU_COLLECTIVE_MATMUL_OFF} {LIBTPU_ASYNC_ALL_GATHER}"
# Not in the default, for `run.libtpu_flags` beside it: FSDP's gradient reduce-scatters offloaded to the chip's
# SparseCores (MaxText's ENABLE_SPARSECORE_OFFLOADING_FOR_REDUCE_SCATTER, less its chip-config word, which is
# not an XLA flag), where XLA:TPU otherwise runs them synchronously on v6e. The compiled 1b v6e-8 step hides
# them and is faster, but XLA:TPU's schedule then holds more of the backward pass's activations than the
# planner counts, so the planner's micro-batches can overfill the chip: take it with 8 micro-batches on
# v6e-8 (benchmarks/BENCHMARKS.md, docs/tpus.md). The 1b programs compiled for v5e-8 and v5p-8 gain nothing.
LIBTPU_SPARSE_CORE_REDUCE_SCATTER = (
    "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=false "
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true "
    "--xla_tpu_enable_reduce_scatter_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=true "
    "--xla_sc_enable_instruction_fusion=false --xla_sc_disjoint_spmem=false "
    "--xla_sc_disable_megacore_partitioning=true")
_LIBTPU_PROBE = ("from jax.experimental import topologies\n"
                 "try:\n    topologies.get_topology_desc(topology_name='v5e:2x2', platform='tpu')\n"
                 "except Exception:\n    pass")


def _libtpu_loaded() -> bool:
    """Whether this process has loaded libtpu (which reads LIBTPU_INIT_ARGS once, as it loads)."""
    try:
        return "libtpu" in pathlib.Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: libtpu runs on Linux TPU VMs only
        return False


def apply_libtpu(flags: str, required: bool = True) -> str:
    """Add `flags` ("--xla_name=value ...") to this process's LIBTPU_INIT_ARGS, replacing any of the same name,
    before libtpu loads (its child processes inherit them); returns the flags now set. A no-op for "". Where
    libtpu is installed, a throwaway process loads it with them first: a flag it does not know is one
    UserError naming it (libtpu itself would end this process). Raises UserError for a word that is not an
    XLA flag, and when this process has loaded libtpu already (too late; with `required` False, as for the
    default in a notebook whose TPU is already running, a warning instead); elsewhere (CPUs, GPUs) the
    variable is set and nothing reads it."""
    flags = " ".join(flags.split())
    current = os.environ.get("LIBTPU_INIT_ARGS", "")
    if not flags:
        return current
    _refuse_words(flags, "run.libtpu_flags")
    merged = merge(current, flags)
    if _parse(merged) == _parse(current):
        return current
    if _libtpu_loaded():
        if not required:
            log.warning("run.libtpu_flags not applied: libtpu is already loaded in this process (%s)", flags)
            return current
        raise UserError("run.libtpu_flags can only be set before libtpu loads (JAX on a TPU, or a TPU target's "
                        "compiler); pass it on the command line, or set the LIBTPU_INIT_ARGS environment variable "
                        "before Python starts")
    if importlib.util.find_spec("libtpu") is not None:
        env = {**os.environ, "LIBTPU_INIT_ARGS": merged, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": ""}
        probe = subprocess.run([sys.executable, "-c", _LIBTPU_PROBE], env=env, capture_output=True, text=True,
                               timeout=300)
        unknown = re.search(r"Unknown command line flag '([^']+)'", probe.stderr + probe.stdout)
        if unknown:
            raise UserError(f"run.libtpu_flags: libtpu does not know --{unknown.group(1)}; remove or rename it "
                            f"(run.libtpu_flags=\"\" leaves XLA:TPU's defaults)")
    os.environ["LIBTPU_INIT_ARGS"] = merged
    return merged
