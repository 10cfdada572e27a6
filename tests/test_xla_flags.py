"""run.xla_flags: merged into XLA_FLAGS, checked by XLA itself before this process starts JAX."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jaxlm import xla_flags
from jaxlm.errors import UserError


def test_merge_replaces_flags_of_the_same_name():
    current = "--xla_force_host_platform_device_count=8 --xla_cpu_use_thunk_runtime=true"
    merged = xla_flags.merge(current, "--xla_force_host_platform_device_count=3  --xla_gpu_enable_triton_gemm=false")
    assert merged == ("--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=3 "
                      "--xla_gpu_enable_triton_gemm=false")
    assert xla_flags.merge("", "--xla_a=1") == "--xla_a=1"


def test_empty_is_a_no_op_and_non_xla_words_are_refused(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xla_flags.apply("  ") == "--xla_force_host_platform_device_count=8"
    with pytest.raises(UserError, match="'-O3' is not an XLA flag"):
        xla_flags.apply("--xla_gpu_enable_triton_gemm=false -O3")


def test_flags_reach_xla_and_only_before_jax_starts():
    """A fresh process: the flag takes effect (3 CPU devices instead of conftest's 8), and once JAX
    has started, a different flag is refused rather than silently ignored."""
    script = textwrap.dedent("""
        import os, jax
        from jaxlm import xla_flags
        from jaxlm.errors import UserError
        flags = xla_flags.apply("--xla_force_host_platform_device_count=3 --xla_gpu_enable_latency_hiding_scheduler=true")
        print(jax.device_count(), os.environ["XLA_FLAGS"] == flags)
        assert xla_flags.apply("--xla_force_host_platform_device_count=3") == flags  # already in effect: fine
        try:
            xla_flags.apply("--xla_force_host_platform_device_count=2")
        except UserError as e:
            print("refused:", e)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "3 True"
    assert lines[1].startswith("refused: run.xla_flags can only be set before JAX starts")


def test_a_notebook_build_refuses_flags_once_jax_has_started():
    from jaxlm import explore

    jax_devices = jax.devices()  # JAX has started in this process (8 CPU devices)
    with pytest.raises(UserError, match="only be set before JAX starts"):
        explore.build("tiny", devices=1, abstract=True, run__xla_flags="--xla_force_host_platform_device_count=3")
    assert len(jax_devices) == 8


def test_libtpu_flags_are_merged_into_libtpu_init_args_and_words_that_are_not_flags_refused(monkeypatch):
    """run.libtpu_flags: XLA:TPU's own flags, merged into LIBTPU_INIT_ARGS (a flag of the same name replaced);
    inert where libtpu is not loaded (this process: CPUs), so the default applies to every run."""
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_a=1 --xla_jf_spmd_threshold_for_windowed_einsum_mib=5")
    merged = xla_flags.apply_libtpu(xla_flags.LIBTPU_DEFAULT)
    assert merged == os.environ["LIBTPU_INIT_ARGS"] == "--xla_tpu_a=1 " + xla_flags.LIBTPU_DEFAULT
    assert xla_flags.apply_libtpu("") == merged
    with pytest.raises(UserError, match="'-O3' is not an XLA flag"):
        xla_flags.apply_libtpu("-O3")
    from jaxlm import config

    assert config.recipe("1b").run.libtpu_flags == xla_flags.LIBTPU_DEFAULT


TPU_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-tpu", "bin", "python")


@pytest.mark.skipif(not os.path.exists(TPU_PYTHON), reason="libtpu's environment is not installed (make tpu-env)")
def test_libtpu_checks_its_flags_in_a_throwaway_process_and_a_loaded_libtpu_refuses_new_ones():
    """Where libtpu is installed: a flag it does not know is one UserError naming it (libtpu itself would end the
    process), the default is accepted, and once this process has loaded libtpu a new flag is refused."""
    script = textwrap.dedent("""
        import os
        from jaxlm import roofline, xla_flags
        from jaxlm.errors import UserError
        try:
            xla_flags.apply_libtpu("--xla_tpu_no_such_flag=1")
        except UserError as e:
            print("unknown:", e)
        print("default:", xla_flags.apply_libtpu(xla_flags.LIBTPU_DEFAULT) == os.environ["LIBTPU_INIT_ARGS"])
        roofline.quiet_libtpu()
        roofline.tpu_devices(roofline.TPU_V5P, 4, "v5p:2x2x1")  # loads libtpu, which reads them now
        try:
            xla_flags.apply_libtpu("--xla_jf_spmd_threshold_for_windowed_einsum_mib=7")
        except UserError as e:
            print("late:", e)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", LIBTPU_INIT_ARGS="")
    out = subprocess.run([TPU_PYTHON, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "unknown: run.libtpu_flags: libtpu does not know --xla_tpu_no_such_flag; remove or rename " \
                       "it (run.libtpu_flags=\"\" leaves XLA:TPU's defaults)"
    assert lines[1] == "default: True"
    assert lines[2].startswith("late: run.libtpu_flags can only be set before libtpu loads")
