"""Tests run on CPU with 8 fake devices so every sharding path is exercised."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session's in-process tests and the CLI runs they start
# (the CLI's default `run.compile_cache_dir`): tests that build the same program compile it once.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".cache", "jaxlm", "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def facts_run(tmp_path_factory):
    """A small run trained once by the CLI (tests/tiny_run.py), shared by the tests that read one."""
    from tiny_run import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("facts"))
