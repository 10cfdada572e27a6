"""Tests run on CPU with 8 fake devices so every sharding path is exercised."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def facts_run(tmp_path_factory):
    """A small run trained once by the CLI (tests/tiny_run.py), shared by the tests that read one."""
    from tiny_run import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("facts"))
