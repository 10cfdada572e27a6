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
