"""Tests run on CPU with 8 fake devices so every sharding path is exercised."""

import os
import pathlib
import shutil
import subprocess
import sys

# The flags the user gave, kept in the environment: pytest-xdist's workers (`make test` runs the suite in
# several) inherit XLA_FLAGS as this file has already extended it in the parent
XLA_FLAGS_GIVEN = os.environ.setdefault("JAXLM_TEST_XLA_FLAGS_GIVEN", os.environ.get("XLA_FLAGS", ""))
# Each program's machine code generated as one LLVM module (the tests' processes and the commands they start, through
# `helpers.xla_flags`): XLA:CPU otherwise splits it into many and compiles them on a thread pool, which pays
# off for one large program on idle cores, but the suite keeps every core busy compiling small programs, and
# the splitting itself costs CPU time (benchmarks/BENCHMARKS.md, "The default test suite's time"). The
# generated code and its floats are the same (not a code generation flag for tests/floats.py).
SUITE_FLAGS = ("--xla_cpu_parallel_codegen_split_count=1",)
os.environ["XLA_FLAGS"] = " ".join([*SUITE_FLAGS, XLA_FLAGS_GIVEN, "--xla_force_host_platform_device_count=8"])
# `make test` (JAXLM_TEST_FAST_COMPILE=1): LLVM's optimizations off in XLA:CPU's code generation, and its
# loop and reduction fusions emitted by the elemental emitter instead of the MLIR fusion emitters, which take
# most of the remaining compile time at that level. The layouts and buffers are nearly the default's (the
# elemental emitter fuses a little differently, the temporaries barely change), the machine code unoptimized:
# the default suite compiles hundreds of small programs and runs each a few times, so
# compiling is most of its time (a tiny training step runs 3x slower, which is why the slow suite and the CLI
# runs the tests start keep the optimized code, but for runs of a few steps, `helpers.xla_flags(fast_compile=True)`;
# benchmarks/BENCHMARKS.md, "The default test suite's time"). Its
# floating point differs from the optimized code's in the last bits (summation order): a test that compares to
# the bit with numbers the optimized code computed elsewhere is marked `optimized_codegen` and runs in its own
# process without the flags.
# Not as for a processor without F16C (`make test-isa`'s SSE4_2, or AVX): there the unoptimized code's float16
# kernels fail to link ("Failed to materialize symbols"), with either fusion emitter; the optimized code links.
_NO_F16C = any(f"--xla_cpu_max_isa={isa}" in XLA_FLAGS_GIVEN.split() for isa in ("SSE4_2", "AVX"))
FAST_COMPILE = (os.environ.get("JAXLM_TEST_FAST_COMPILE") == "1" and "xla_backend_optimization_level" not in XLA_FLAGS_GIVEN
                and not _NO_F16C)
if FAST_COMPILE:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session's in-process tests and the CLI runs they start
# (the CLI's default `run.compile_cache_dir`): tests that build the same program compile it once. Every
# program, however short its compilation (the CLI keeps only those of 0.5 s or more, and so does a test
# process from its first in-process `train.run` on): each test file's end drops the in-memory programs
# (`_forget_compiled_programs`), and the next files' small ones (initializers, samplers, eager operations)
# are read back rather than compiled again.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".cache", "jaxlm", "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import gc  # noqa: E402

import floats  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Python's cyclic garbage collector, tuned for a test process: JAX's tracing allocates objects by the million,
# and with the default thresholds (700, 10, 10) a collection of the young objects starts every 700 allocations
# and one of everything a worker holds (the imported libraries, the collected tests) every 70,000 or so: a large
# share of the suite's CPU time (benchmarks/BENCHMARKS.md, "The default test suite's time"). Now the young ones
# every 50,000 and the rest far more rarely; what collection leaves is frozen out of every collection
# (`pytest_collection_finish`); each test file's end still runs a full collection (`_forget_compiled_programs`).
gc.set_threshold(50_000, 50, 1_000)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def _refuse_exact_floats(name, exact):
    """numpy.testing's exact assertion, refusing floating-point values outside tests/floats.py: two programs'
    floats differ in their last bits from one processor to another, so an exact float comparison says why
    it is exact (`floats.identical`) or compares within ulps (`floats.close`)."""

    def check(actual, desired, *args, **kwargs):
        if not floats.exact_is_allowed() and (floats.is_float(actual) or floats.is_float(desired)):
            raise AssertionError(f"np.testing.{name} on floating-point values: use floats.identical(why=...) for "
                                 "the same program on the same machine or values only moved, floats.close for "
                                 "two programs (tests/floats.py)")
        return exact(actual, desired, *args, **kwargs)

    return check


for _name in ("assert_array_equal", "assert_equal"):
    setattr(np.testing, _name, _refuse_exact_floats(_name, getattr(np.testing, _name)))


@pytest.fixture(scope="module", autouse=True)
def _forget_compiled_programs():
    """After each test file, JAX's in-memory caches (compiled programs, traces) are dropped: without this a
    process that runs many files holds every program it compiled (3 GB per xdist worker by the suite's end).
    A program needed again comes back from the persistent compilation cache above."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _command_fork_servers():
    """The fork servers `command_forks.run_command` started in this process, stopped at its end: each one's
    stderr must be empty (a warning at import or at a fork is a difference from a real start)."""
    yield
    import command_forks

    said = {log: text for log, text in command_forks.close_all().items() if text}
    assert not said, f"a fork server wrote to its stderr: {said}"


def _shared_run(tmp_path_factory, name: str, train) -> pathlib.Path:
    """`train(directory)`'s run directory, trained once per session by whichever pytest-xdist worker asks
    first, in the session's temporary directory common to the workers (under a file lock: the others wait
    for it; if that training failed, the next one tries again)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is a folder of the session's
        base = base.parent
    directory = base / f"{name}-shared"
    with open(base / f"{name}-shared.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = directory / "trained"
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a failed attempt's remains
            directory.mkdir()
            run = train(directory)
            done.write_text(str(run))
        return pathlib.Path(done.read_text())


@pytest.fixture(scope="session")
def facts_run(tmp_path_factory):
    """A small run trained once by the CLI (tests/tiny_run.py), shared by the tests that read one (once per
    session: `_shared_run`). The tests only read it (a test that trains on from it copies it or writes
    elsewhere); its data cache beside it has its own lock for processes sharing it."""
    from tiny_run import train_tiny_run

    return _shared_run(tmp_path_factory, "facts", train_tiny_run)


@pytest.fixture(scope="session")
def source_run(tmp_path_factory):
    """The facts run's command stopped at 40 steps, checkpoints at steps 20 and 40, at the suite's fast
    compilation where it has it (`helpers.xla_flags`): the run tests/test_init_from.py starts from and
    tests/test_bad_inputs.py's cases damage copies of, trained once per session (`_shared_run`). Read only,
    as the facts run; its corpus is `facts.txt` beside it."""
    from tiny_run import train_tiny_run

    return _shared_run(tmp_path_factory, "source", lambda directory: train_tiny_run(
        directory, steps=40, extra=("--config.checkpoint.every_steps=20",), fast_compile=True))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Under FAST_COMPILE, a test marked `optimized_codegen` runs in a pytest of its own with XLA's default
    code generation (its fixtures are still set up here, unused)."""
    if not FAST_COMPILE or pyfuncitem.get_closest_marker("optimized_codegen") is None:
        return None
    env = {k: v for k, v in os.environ.items() if k != "JAXLM_TEST_FAST_COMPILE"}
    env["XLA_FLAGS"] = XLA_FLAGS_GIVEN
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rP", "-p", "no:cacheprovider", "-m", "",
                             pyfuncitem.nodeid], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    for line in result.stdout.splitlines():  # what floats.matches_reference said there, for this summary
        if line.startswith(floats.REFERENCE_PREFIX):
            print(line)
    if result.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} (in its own process, XLA's default code generation):\n"
                    f"{result.stdout[-6000:]}{result.stderr[-2000:]}", pytrace=False)
    return True


def pytest_report_header(config):
    return f"XLA:CPU's floats here: {floats.describe(floats.machine())} (tests/floats.py)"


def pytest_collection_modifyitems(config, items):
    """The tests of a file that compares floats through tests/floats.py are marked `floats`: `make test-isa`
    runs them under other instruction sets."""
    for item in items:
        if getattr(getattr(item, "module", None), "floats", None) is floats:
            item.add_marker(pytest.mark.floats)


_REFERENCE_LINES: list[str] = []


def pytest_runtest_logreport(report):
    """Collects what `floats.matches_reference` printed (in an xdist worker too: the report carries it)."""
    if report.when == "call":
        for line in report.capstdout.splitlines():
            if line.startswith(floats.REFERENCE_PREFIX):
                _REFERENCE_LINES.append(f"{report.nodeid}: {line[len(floats.REFERENCE_PREFIX):]}")


def pytest_terminal_summary(terminalreporter):
    if _REFERENCE_LINES:
        terminalreporter.section("floats compared with values stored from a machine (tests/floats.py)")
        for line in sorted(set(_REFERENCE_LINES)):
            terminalreporter.write_line(line)
