"""A training command line's config arguments, read without JAX: `--config=<recipe>[:arg]` and
`--config.<section>.<key>=<value>` overrides, each key found in a tree of keys and each value parsed to
its key's type.

`jaxlm.config` applies them to a recipe's ConfigDict; `check_early` checks them against the base
config's keys and types (`KEYS_FILE`, written with the configuration reference by `python -m
jaxlm.config_reference` and tested equal to `config.base_config()`), so that `python -m jaxlm.train`
(and plan's `--config` arguments, experiment's `--set`) refuses a bad key or value in a fraction of a
second, before JAX is imported. Both give the same line.
"""

from __future__ import annotations

import ast
import difflib
import json
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from jaxlm.errors import UserError, is_utf8

# Where the recipes live (configs/ beside the package, in an editable install or a checkout)
RECIPES_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"

# Every config key with its default (`config.base_config().to_dict()`), as JSON
KEYS_FILE = pathlib.Path(__file__).resolve().parent / "config_keys.json"

_FLAG = re.compile(r"^--config(\.(?P<key>[A-Za-z0-9_.]+))?=(?P<value>.*)$", re.S)


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))


def split_cli(argv: Sequence[str], default_recipe: str | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(the recipe, the (key, value) overrides) of `--config=path[:arg]` and any number of
    `--config.a.b=value`; anything else is an error."""
    recipe_arg = default_recipe
    overrides = []
    for arg in argv:
        m = _FLAG.match(arg)
        if not m:
            raise UserError(
                f"unrecognised argument {arg!r}; use --config=configs/<recipe>.py and --config.<key>=<value>"
            )
        if m.group("key") is None:
            recipe_arg = m.group("value")
        else:
            overrides.append((m.group("key"), m.group("value")))
    if recipe_arg is not None and not is_utf8(recipe_arg):
        raise UserError(f"--config={recipe_arg!r} is not UTF-8 text: rename the file, or type the path in UTF-8")
    if recipe_arg is None:
        raise UserError(f"--config is required: --config=configs/<recipe>.py, recipes: {', '.join(recipe_names())}")
    return recipe_arg, overrides


def recipe_file(name_or_path: str) -> tuple[pathlib.Path, str]:
    """(the recipe's file, its argument) of `--config=<name or path>[:arg]`; a name without a suffix is
    `configs/<name>.py`. One line when there is no such file."""
    name, _, arg = str(name_or_path).partition(":")
    path = pathlib.Path(name)
    if not path.suffix:
        path = RECIPES_DIR / f"{name}.py"
    if not path.is_file():
        raise UserError(
            f"--config: no recipe file {str(path)!r}; give a path to a .py file or one of: {', '.join(recipe_names())}"
        )
    return path, arg


def parse_value(key: str, value: Any, current: Any) -> Any:
    """Parse a command-line string to the type of the field it overrides (`1e3` is a fine int)."""
    expected = type(current)
    if isinstance(value, str) and expected is not str:
        if expected is bool:
            value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
                value.lower(), value
            )
        elif expected in (int, float):
            text = value.replace("_", "")
            try:  # an int exactly as written (a float would round one past 2**53)
                value = int(text) if expected is int else float(text)
            except ValueError:
                try:
                    number = float(text)
                    value = int(number) if expected is int and number.is_integer() else number
                except ValueError:
                    pass
        else:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                pass
    if expected is float and type(value) is int:
        value = float(value)
    if type(value) is not expected:
        names = {bool: "a bool (true or false)", int: f"an integer (e.g. {current})", float: f"a number (e.g. {current})"}
        raise UserError(f"--config.{key}={value}: expected {names.get(expected, 'a ' + expected.__name__)}")
    return value


def _is_group(node: Any) -> bool:
    """A group of keys: a ConfigDict or a dict (the keys file's)."""
    return hasattr(node, "keys") and hasattr(node, "__getitem__")


def unknown_key(key: str, leaf: str, keys: Sequence[str], prefix: str) -> UserError:
    """`leaf` is the part of `key` that the group at `prefix` (holding `keys`) does not have."""
    keys = sorted(keys)
    close = difflib.get_close_matches(leaf, keys, n=1) or sorted(
        (k for k in keys if leaf.strip("_") in k), key=lambda k: -difflib.SequenceMatcher(None, leaf, k).ratio()
    )[:1]
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    where = f"keys under {prefix[:-1]!r}" if prefix else "top-level keys"
    return UserError(f"unknown config key {key!r}{hint}; {where}: {', '.join(keys)}")


def find(tree: Any, key: str) -> tuple[Any, str]:
    """(the group holding the dotted `key`, its last part) in a tree of groups; one line when a part
    is missing, a value is used as a group or a group as a value."""
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth]) + ("." if depth else "")
        if not _is_group(node):
            raise UserError(f"--config.{key}: {prefix[:-1]!r} is a value, not a group of keys")
        if part not in node:
            raise unknown_key(key, part, list(node.keys()), prefix)
        if depth < len(parts) - 1:
            node = node[part]
    if _is_group(node[parts[-1]]):
        raise UserError(f"--config.{key}: {key!r} is a group of keys, set one of: {', '.join(sorted(node[parts[-1]]))}")
    return node, parts[-1]


def check_pairs(pairs: Sequence[tuple[str, str]]) -> None:
    """Each (dotted key, text) override's key and its value's type against the base config's keys
    (`KEYS_FILE`); a key whose default is a string, a group or None is parsed later, against the recipe."""
    keys = json.loads(KEYS_FILE.read_text())
    for key, text in pairs:
        group, leaf = find(keys, key)
        if type(group[leaf]) in (bool, int, float):
            parse_value(key, text, group[leaf])


def check_early(argv: Sequence[str], default_recipe: str | None = None) -> None:
    """`python -m jaxlm.train`'s arguments (a multi-process launch's taken off), checked before JAX is
    imported: the form of each, the recipe's file, every override's key and its value's type
    (`check_pairs`). The same lines
    as `config.parse_cli` and `config.apply_overrides` give later (a wrong type's example value is the
    base config's, not the recipe's)."""
    recipe, overrides = split_cli(argv, default_recipe)
    recipe_file(recipe)
    check_pairs(overrides)
