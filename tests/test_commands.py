"""`python -m jaxlm.<command>` answers --help and a bad flag before it imports JAX (`jaxlm.commands`,
called from the package's `__init__`): checked by the modules the process imported (`-X importtime`),
never by its wall time (benchmarks/cli_startup.py measures that)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxlm import commands, distributed
from tiny_run import ROOT

# (the module, a bad flag of it): every command answered early, and train's --help
BAD_FLAGS = {
    "jaxlm.evaluate": ["--run_dir=.", "--batch_size=-1"],
    "jaxlm.generate": ["--run_dir=.", "--temperature=nan"],
    "jaxlm.hf": ["export", "--run_dir=.", "--output=x", "--max_shard_gb=nan"],
    "jaxlm.compress": ["--run_dir=.", "--output=x", "--step=-1"],
    "jaxlm.plan": ["--config=configs/tiny.py", "--devices=0"],
    "jaxlm.experiment": ["missing.py"],
    "jaxlm.doctor": ["--matmul_size=0"],
}


def _run(module: str, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, imported


def _messages(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if not line.startswith("import time:")]


def test_every_command_with_a_parser_is_answered_early():
    assert set(BAD_FLAGS) <= set(commands.EARLY)
    assert {m.removesuffix(".cli") for m in commands.EARLY} == set(BAD_FLAGS)


@pytest.mark.parametrize("module", sorted(BAD_FLAGS))
def test_help_and_a_bad_flag_are_answered_before_jax_is_imported(module):
    done, imported = _run(module, "--help")
    assert done.returncode == 0 and "usage:" in done.stdout and "jax" not in imported, _messages(done)[-5:]
    done, imported = _run(module, *BAD_FLAGS[module])
    lines = _messages(done)
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("jaxlm: error:"), lines
    assert "jax" not in imported


def test_train_help_lists_the_recipes_before_jax_is_imported():
    done, imported = _run("jaxlm.train", "--help")
    assert done.returncode == 0 and "jax" not in imported
    assert "--config=configs/<recipe>.py" in done.stdout and "sft_lora" in done.stdout and "tiny" in done.stdout


def test_a_good_command_line_goes_on_to_the_command():
    """Parsed early and again by the command, which then runs (here: doctor's report, on this CPU)."""
    done, imported = _run("jaxlm.doctor", "--expect=cpu", "--json")
    assert done.returncode == 0 and "jax" in imported, _messages(done)[-5:]


def test_the_light_defaults_equal_the_ones_they_stand_for():
    assert commands.DISTRIBUTED_TIMEOUT_S == distributed.DEFAULT_TIMEOUT_S
    assert set(commands.LAYOUT_FLAGS) == set(distributed.FLAGS)


def test_a_multi_process_launchs_flags_pass_the_early_parse():
    """hf takes --coordinator, --num_processes, --process_id off its command line itself."""
    done, imported = _run("jaxlm.hf", "export", "--run_dir=.", "--output=x", "--max_shard_gb=nan",
                          "--coordinator=127.0.0.1:1234", "--num_processes=2", "--process_id=0")
    lines = _messages(done)
    assert done.returncode == 2 and len(lines) == 1 and "--max_shard_gb" in lines[0], lines
    assert "jax" not in imported


def test_ctrl_c_while_a_command_starts_is_one_line_and_130(capsys):
    """Between the package's import and the command's `run_command` (JAX loading), Ctrl-C exits 130 with
    one line (a traceback from inside an import before); `run_command` restores Python's handler."""
    import signal

    import jaxlm
    from jaxlm.errors import run_command

    with pytest.raises(SystemExit) as raised:
        jaxlm._interrupted_while_starting(signal.SIGINT, None)
    assert raised.value.code == 130
    assert capsys.readouterr().err.splitlines() == [
        "jaxlm: interrupted while starting, before anything was written; run the same command again"]
    previous = signal.signal(signal.SIGINT, jaxlm._interrupted_while_starting)
    try:
        assert run_command(lambda: 0) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_only_python_dash_m_jaxlm_is_a_command_line():
    import jaxlm

    assert jaxlm._command_line(["python", "-X", "importtime", "-u", "-m", "jaxlm.hf", "export", "--help"]) == (
        "jaxlm.hf", ["export", "--help"])
    for argv in (["python", "-m", "pytest", "-m", "jaxlm.slow"], ["python", "script.py", "-m", "jaxlm.hf"],
                 ["python", "-c", "import jaxlm", "-m", "jaxlm.hf"], ["python"], ["python", "-m"]):
        assert jaxlm._command_line(argv) is None, argv
