"""tests/floats.py, the suite's three kinds of float comparison, and conftest's guard against the fourth
(an exact comparison of two programs' floats): each passes what it should and fails on what it should."""

import os
import pathlib
import subprocess
import sys

import floats
import ml_dtypes
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _next_up(x: np.ndarray, ulps: int = 1) -> np.ndarray:
    out = np.array(x)
    for _ in range(ulps):
        out = np.nextafter(out, np.inf, dtype=out.dtype)
    return out


def test_identical_is_to_the_bit_and_says_why():
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    floats.identical({"a": x, "b": [x * 2]}, {"a": x.copy(), "b": [x * 2]}, why=floats.SAME_PROGRAM)
    with pytest.raises(AssertionError, match="values moved"):
        floats.identical(x, _next_up(x), why=floats.MOVED)
    with pytest.raises(AssertionError):  # the dtype too: a float64 copy is not the float32 it came from
        floats.identical(x, x.astype(np.float64), why=floats.MOVED)
    with pytest.raises(AssertionError, match="why must be"):
        floats.identical(x, x, why="close enough")
    with pytest.raises(AssertionError, match="the trees differ"):
        floats.identical({"a": x}, {"b": x}, why=floats.MOVED)


def test_close_allows_ulps_of_the_values_scale_and_no_more():
    x = np.linspace(-3, 3, 101, dtype=np.float32)
    floats.close(_next_up(x, 8), x)  # every element 8 ulps of itself: within 8 of the scale (3)
    small = x.copy()
    small[50] = 3 * 7 * np.finfo(np.float32).eps  # near zero, off by 7 ulps of the scale: a reordered sum's error
    floats.close(small, x)
    with pytest.raises(AssertionError, match="within 8 ulps"):
        floats.close(x * (1 + 1e-5), x)  # 84 ulps: beyond what a reordering makes
    wrong = x.copy()
    wrong[7] = -wrong[7]  # a sign (a mask, an axis) wrong in one element
    with pytest.raises(AssertionError):
        floats.close(wrong, x)
    with pytest.raises(AssertionError, match="shape"):
        floats.close(x[:-1], x)
    bf16 = x.astype(ml_dtypes.bfloat16)  # the tolerance is in the expected dtype's ulps
    floats.close(bf16.astype(np.float32) + 0.02, bf16)
    with pytest.raises(AssertionError):
        floats.close(bf16.astype(np.float32) + 0.2, bf16)
    floats.close(np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(AssertionError):  # zero has no scale: exactly zero
        floats.close(np.full(3, 1e-30, np.float32), np.zeros(3, np.float32))


def test_numpy_testing_refuses_exact_floats_outside_floats_py():
    x = np.ones(4, np.float32)
    for assertion in (np.testing.assert_array_equal, np.testing.assert_equal):
        with pytest.raises(AssertionError, match="floats.identical"):
            assertion(x, x)
        with pytest.raises(AssertionError, match="floats.close"):
            assertion({"loss": 1.5}, {"loss": 1.5})
        assertion(np.arange(4), np.arange(4))  # integers, booleans and strings compare exactly as before
        assertion(np.ones(3, bool), np.ones(3, bool))
        assertion({"step": 3, "name": "x"}, {"step": 3, "name": "x"})
    with floats.exact_allowed():
        np.testing.assert_array_equal(x, x)
    with pytest.raises(AssertionError, match="floats.identical"):
        np.testing.assert_array_equal(ml_dtypes.bfloat16(1), ml_dtypes.bfloat16(1))


def test_the_machine_record_holds_what_changes_xla_cpus_floats():
    plain = floats.machine("--xla_force_host_platform_device_count=8")
    avx2 = floats.machine("--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2")
    assert plain["xla_flags"] == [] and avx2["xla_flags"] == ["--xla_cpu_max_isa=AVX2"]
    assert avx2["cpu"] == plain["cpu"] and avx2["features"] == plain["features"] and plain["jaxlib"]
    assert floats.machine("--xla_backend_optimization_level=0")["xla_flags"] == ["--xla_backend_optimization_level=0"]
    assert "--xla_cpu_max_isa=AVX2" in floats.describe(avx2)


def test_a_reference_is_compared_to_the_bit_on_its_machine_and_within_ulps_elsewhere():
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    here = floats.machine()
    assert floats.matches_reference(x, x.copy(), here).startswith("bit-exact")
    with pytest.raises(AssertionError):  # made here: one ulp is a change
        floats.matches_reference(_next_up(x), x, here)
    elsewhere = {**here, "features": ["sse4_2"], "xla_flags": ["--xla_cpu_max_isa=SSE4_2"]}
    said = floats.matches_reference(_next_up(x), x, elsewhere, err_msg="x")
    assert said.startswith("x: within 8 ulps") and "SSE4_2" in said
    with pytest.raises(AssertionError):
        floats.matches_reference(x + 1e-3, x, elsewhere)


def test_what_a_reference_comparison_did_is_printed(capsys):
    x = np.ones(2, np.float32)
    said = floats.matches_reference(x, x, {**floats.machine(), "jaxlib": "0.0.1"})
    assert said.startswith("within") and "jaxlib 0.0.1" in said
    assert floats.REFERENCE_PREFIX + said in capsys.readouterr().out


def test_make_test_lists_what_each_reference_comparison_did_and_marks_the_files_that_compare_floats():
    """The line `matches_reference` prints reaches the summary of a run (through xdist's reports too), and the
    tests of a file that imports floats are selected by `-m floats` (what `make test-isa` runs)."""
    test = "tests/test_floats.py::test_a_reference_is_compared_to_the_bit_on_its_machine_and_within_ulps_elsewhere"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["XLA_FLAGS"] = os.environ["JAXLM_TEST_XLA_FLAGS_GIVEN"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1", "-m", "floats",
                             test], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "XLA:CPU's floats here:" in result.stdout
    summary = result.stdout.split("floats compared with values stored from a machine")[1]
    assert f"{test}: bit-exact: made on this machine" in summary and f"{test}: x: within 8 ulps" in summary
