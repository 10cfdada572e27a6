"""`python -m jaxlm.<command>` answers --help and a bad flag before it imports JAX (`jaxlm.commands`,
called from the package's `__init__`): checked by the modules the process imported (`-X importtime`),
never by its wall time (benchmarks/cli_startup.py measures that)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from jaxlm import commands, config, distributed, overrides
from jaxlm.errors import UserError
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


@pytest.mark.parametrize("module", sorted({*BAD_FLAGS, "jaxlm.train", "jaxlm.data.prepare", "jaxlm.data.tokenizer"}))
def test_every_commands_help_prints_nothing_else(module):
    """Not a warning either: runpy's, when the package's early parse had imported the command's own module
    (it then runs twice, `jaxlm.data.tokenizer` by way of the SFT formats once did)."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0 and "usage:" in done.stdout and done.stderr == "", done.stderr[-2000:]


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


def test_trains_bad_config_key_is_answered_before_jax_is_imported():
    done, imported = _run("jaxlm.train", "--config=configs/tiny.py", "--config.model.d_modle=3",
                          "--coordinator=127.0.0.1:1234", "--num_processes=2", "--process_id=0")
    lines = _messages(done)
    assert done.returncode == 2 and lines == [lines[0]] and "did you mean 'model.d_model'?" in lines[0], lines
    assert "jax" not in imported


def _scalar_keys() -> list[tuple[str, object]]:
    """Every config key whose default is a bool, int or float, with that default."""
    def walk(tree, prefix=""):
        for name, value in tree.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{name}.")
            elif type(value) in (bool, int, float):
                yield prefix + name, value
    return list(walk(json.loads(overrides.KEYS_FILE.read_text())))


def _early_and_late(argv: list[str]) -> tuple[str | None, str | None]:
    """The line `check_early` refuses `argv` with, and the one the config's own parse gives (None: accepted)."""
    lines = []
    for check in (overrides.check_early, config.parse_cli):
        try:
            check(argv)
            lines.append(None)
        except UserError as e:
            lines.append(re.sub(r" \(e\.g\. [^)]*\)", "", str(e)))  # (the example: the base's value, the recipe's)
    return tuple(lines)


def test_every_override_is_refused_early_exactly_when_and_as_the_config_refuses_it():
    """The class: for every scalar key, its default accepted, a misspelling and a value of the wrong
    type refused; an unknown section, a value used as a group, a group used as a value, a missing
    recipe, a stray argument. The early check (no JAX) and the config's own parse give the same line."""
    argvs = []
    for key, default in _scalar_keys():
        section, _, leaf = key.rpartition(".")
        argvs += [[f"--config.{key}={str(default).lower() if type(default) is bool else default}"],
                  [f"--config.{section}.{leaf}x=1"],
                  [f"--config.{key}={'maybe' if type(default) is bool else 'ten'}"]]
    argvs += [["--config.modle.d_model=1"], ["--config.model.d_model.x=1"], ["--config.mesh.rules=1"],
              ["--config.model=1"], ["--bogus"], ["--config=configs/nope.py"], ["--config.model.n_layers=2.5"]]
    assert len(argvs) > 250
    for argv in argvs:
        early, late = _early_and_late(["--config=configs/tiny.py", *argv] if argv[0].startswith("--config.") else argv)
        assert early == late, (argv, early, late)
        if argv[0].startswith("--config.") and "x=1" not in argv[0] and argv[0].split("=")[1] not in ("ten", "maybe"):
            continue
        assert early is not None, argv


def test_a_recipe_that_adds_a_key_is_refused_naming_the_key_it_meant(tmp_path):
    recipe = tmp_path / "typo.py"
    recipe.write_text("from jaxlm.config import base_config\n\n\ndef get_config():\n"
                      "    c = base_config()\n    c.optim.weight_decya = 0.0\n    return c\n")
    with pytest.raises(UserError, match=r"unknown config key 'optim.weight_decya' \(did you mean 'optim.weight_decay'"):
        config.validate(config.load_recipe(str(recipe)))


@pytest.mark.parametrize("command", [["jaxlm.plan", "--devices=8", "--config=configs/tiny.py", "--config.model.n_layerz=2"],
                                     ["jaxlm.experiment", "experiments/lr_warmup.py", "--set", "run.stepz=3"]])
def test_plans_and_experiments_config_keys_are_checked_before_jax_is_imported(command):
    done, imported = _run(*command)
    lines = _messages(done)
    assert done.returncode == 2 and lines == [lines[0]] and "unknown config key" in lines[0], lines
    assert "jax" not in imported
