"""A broken recipe or experiment file, and linked config keys set to disagree, are each one line.

The catalogue (tests/test_bad_inputs.py) runs the common cases through the CLIs; here: the line
number of the innermost frame inside the user's file, an error in a module it imports, the exact
one line on stderr, and every pair of linked keys (found from the configs themselves).
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import ml_collections
import pytest
from command_forks import run_command

from jaxlm import config as config_lib
from jaxlm import experiment
from jaxlm.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m jaxlm.<module> args`, forked (tests/command_forks.py: the same process a real start makes)."""
    return run_command(module, args, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=300)


# ----------------------------------------------------------------------------- recipe and experiment files

RECIPE_WITH_A_BAD_HELPER = """\
from jaxlm import config


def helper(c):
    return c.model["no_such_key"]


def get_config():
    c = config.base_config()
    helper(c)
    return c
"""


def test_a_recipe_error_names_the_innermost_line_in_the_recipe(tmp_path):
    recipe = tmp_path / "helper.py"
    recipe.write_text(RECIPE_WITH_A_BAD_HELPER)
    with pytest.raises(UserError) as e:
        config_lib.load_recipe(str(recipe))
    assert str(e.value).startswith(f"{recipe}:5: KeyError: ")  # the helper's line, not get_config's call


def test_an_error_in_a_module_the_recipe_imports_names_the_recipes_import_line(tmp_path, monkeypatch):
    (tmp_path / "shared_bits.py").write_text("x = 1\nraise RuntimeError('shared bits are broken')\n")
    recipe = tmp_path / "uses_shared.py"
    recipe.write_text("import sys\nimport shared_bits\n\ndef get_config():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"uses_shared\.py:2: RuntimeError: shared bits are broken$"):
        config_lib.load_recipe(str(recipe))
    recipe.write_text("import no_such_module_for_jaxlm\n")
    with pytest.raises(UserError, match=r"uses_shared\.py:1: ModuleNotFoundError: No module named "
                                        r"'no_such_module_for_jaxlm'$"):
        config_lib.load_recipe(str(recipe))


def test_an_experiment_error_names_the_innermost_line_in_the_experiment(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text("from jaxlm.experiment import Experiment\n\n\ndef axis():\n    return 1 / 0\n\n\n"
                   "EXPERIMENT = Experiment(name='x', recipe='tiny', grid={'optim.peak_lr': [axis()]})\n")
    with pytest.raises(UserError, match=r"exp\.py:5: ZeroDivisionError: division by zero$"):
        experiment.load_experiment(exp)


@pytest.mark.parametrize("module, text, args, line", [
    ("train", "def get_config():\n    return (\n", ("--config={file}",), "{file}:2: SyntaxError: '(' was never closed"),
    ("train", "import os\n\nos.no_such_function()\n", ("--config={file}",),
     "{file}:3: AttributeError: module 'os' has no attribute 'no_such_function'"),
    ("train", "CONFIG = 1\n", ("--config={file}",),
     "--config: {file} defines no get_config(); a recipe must return a ConfigDict from it"),
    ("experiment", "from jaxlm.experiment import Experiment\nEXPERIMENT = Experiment(name=undefined)\n", ("{file}",),
     "{file}:2: NameError: name 'undefined' is not defined"),
], ids=["recipe-syntax", "recipe-attribute", "recipe-no-get-config", "experiment-name"])
def test_a_broken_file_is_exactly_one_line_through_the_cli(tmp_path, module, text, args, line):
    file = tmp_path / "broken.py"
    file.write_text(text)
    result = run_module(module, *(a.format(file=file) for a in args))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"jaxlm: error: {line.format(file=file)}"], result.stderr[-2000:]


# ----------------------------------------------------------------------------- linked keys


def _leaves(cfg: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _changed(value):
    return {bool: lambda v: not v, int: lambda v: v + 7, float: lambda v: v + 0.5, str: lambda v: v + "x"}[type(value)](
        value)


def linked_pairs(cfg_factory) -> set[tuple[str, str]]:
    """Pairs of keys that share one value: setting one changes the other (found by setting each, one after
    another on one config: one override at a time is applied whatever the others hold, and a shared value
    stays shared when set, so what setting a key changes is what it changes on a fresh config)."""
    pairs = set()
    cfg = cfg_factory()
    with cfg.unlocked():
        for key in _leaves(cfg):
            before = _leaves(cfg)
            if type(before[key]) not in (bool, int, float, str):
                continue
            config_lib.apply_overrides(cfg, [(key, _changed(before[key]))])
            after = _leaves(cfg)
            pairs |= {tuple(sorted((key, other))) for other in after if other != key and after[other] != before[other]}
    return pairs


BASE_PAIRS = sorted(linked_pairs(config_lib.base_config))


def test_the_linked_pairs_are_found_and_every_recipe_keeps_only_those():
    assert {("data.tokenizer_vocab_size", "model.vocab_size"), ("data.seq_len", "model.max_seq_len")} <= set(BASE_PAIRS)
    for name in config_lib.recipe_names():
        assert linked_pairs(lambda name=name: config_lib.load_recipe(name)) <= set(BASE_PAIRS), name


REFUSED_PAIRS = [p for p in BASE_PAIRS if set(p) != config_lib.SEPARABLE]


@pytest.mark.parametrize("pair", REFUSED_PAIRS, ids=["-".join(p) for p in REFUSED_PAIRS])
def test_linked_keys_set_to_disagree_are_refused_naming_both(pair):
    a, b = pair
    value = _leaves(config_lib.base_config())[a]
    one, two = _changed(value), _changed(_changed(value))
    for first, second in ((a, b), (b, a)):
        with pytest.raises(UserError) as e:
            config_lib.apply_overrides(config_lib.base_config(), [(first, str(one)), (second, str(two))])
        assert str(e.value) == (
            f"--config.{first}={one} and --config.{second}={two} contradict each other: the two keys are linked to "
            f"one value, which either sets; give only one of them (drop --config.{second}={two} to set both to {one!r})"
        )
    for overrides in ([(a, str(one))], [(b, str(one))], [(a, str(one)), (b, str(one))], [(b, str(one)), (a, str(one))],
                      [(a, str(two)), (a, str(one))]):  # one of them, both alike, or one key twice: the last wins
        cfg = config_lib.base_config()
        config_lib.apply_overrides(cfg, overrides)
        leaves = _leaves(cfg)
        assert leaves[a] == leaves[b] == one, overrides


def test_the_models_context_and_the_rows_length_given_apart_each_keep_their_own():
    """The one separable pair (`config.SEPARABLE`): given both, in either order, each keeps its value; given
    one, both take it; the rows longer than the context are the section check's one line."""
    assert config_lib.SEPARABLE in [set(p) for p in BASE_PAIRS]
    for overrides in ([("data.seq_len", "64"), ("model.max_seq_len", "512")],
                      [("model.max_seq_len", "512"), ("data.seq_len", "64")]):
        cfg = config_lib.base_config()
        config_lib.apply_overrides(cfg, overrides)
        config_lib.validate(cfg)
        assert (cfg.data.seq_len, cfg.model.max_seq_len) == (64, 512), overrides
    cfg = config_lib.base_config()
    config_lib.apply_overrides(cfg, [("data.seq_len", "64")])
    assert (cfg.data.seq_len, cfg.model.max_seq_len) == (64, 64)
    config_lib.apply_overrides(cfg, [("data.seq_len", "600"), ("model.max_seq_len", "512")])
    with pytest.raises(UserError, match=r"config.data.seq_len=600 is not allowed: at most model.max_seq_len=512"):
        config_lib.validate(cfg)


def test_linked_keys_that_disagree_on_the_command_line_stop_train_in_one_line():
    result = run_module("train", "--config=configs/tiny.py", "--config.model.vocab_size=512",
                        "--config.data.tokenizer_vocab_size=1024")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "jaxlm: error: --config.model.vocab_size=512 and --config.data.tokenizer_vocab_size=1024 contradict each "
        "other: the two keys are linked to one value, which either sets; give only one of them (drop "
        "--config.data.tokenizer_vocab_size=1024 to set both to 512)"]
