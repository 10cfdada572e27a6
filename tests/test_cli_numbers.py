"""Every numeric flag of every command, by class (`jaxlm.cli`): nan, the infinities and text are refused
as one line naming the flag; a flag with a range refuses a value just outside it. Generated from the
commands' own parsers (`make_parser`), so a new flag is covered the day it is declared."""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile

import pytest

from jaxlm import cli
from jaxlm.errors import UserError

COMMANDS = ("evaluate", "generate", "hf", "compress.cli", "data.prepare", "data.tokenizer", "doctor", "plan",
            "experiment")


def _numeric(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(the subcommand's words, the parser, the action) for each numeric flag, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _numeric(sub, (*prefix, name))
        elif getattr(action.type, "__name__", "") in ("int", "float") and action.type not in (int, float):
            yield prefix, parser, action


def _required(parser: argparse.ArgumentParser, but: argparse.Action) -> list[str]:
    """Values for the parser's other required arguments (a path of its kind, 1 for a number, else a word)."""
    out = []
    for action in parser._actions:
        if action.dest == but.dest or isinstance(action, argparse._SubParsersAction):
            continue
        value = "1" if action.type is not None and getattr(action.type, "__name__", "") in ("int", "float") else "x"
        if hasattr(action, "jaxlm_path"):  # (jaxlm.paths checks it first)
            kind, io = action.jaxlm_path
            value = os.path.join(tempfile.gettempdir(), "jaxlm-new") if io == "out" else __file__ if kind == "file" \
                else tempfile.gettempdir()
        if action.option_strings and action.required:
            out.append(f"{action.option_strings[0]}={value}")
        elif not action.option_strings and action.nargs not in ("?", "*"):
            out.append(value)
    return out


CASES = [(command, words, action) for command in COMMANDS
         for words, _, action in _numeric(importlib.import_module(f"jaxlm.{command}").make_parser())]


def _outside(action) -> list[str]:
    """Values just outside the flag's range (none for a flag without one)."""
    minimum, above, maximum, below, _ = getattr(action, "jaxlm_range", (None,) * 5)
    limit = getattr(action, "jaxlm_limit", None)  # an int's ceiling, in magnitude
    return [str(v) for v in (minimum - 1 if minimum is not None else None, above, maximum + 1 if maximum is not None
                             else None, below, limit + 1 if limit is not None else None) if v is not None]


def test_every_command_declares_its_numbers_through_the_shared_parser():
    assert len(CASES) >= 25, [(c, a.dest) for c, _, a in CASES]
    for command in COMMANDS:
        parser = importlib.import_module(f"jaxlm.{command}").make_parser()
        plain = [a.dest for _, p, a in _all(parser) if a.type in (int, float)]
        assert not plain, f"jaxlm.{command}: numeric flags not declared with add_number or cli.number: {plain}"
        assert isinstance(parser, cli.Parser)


def _all(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all(sub, (*prefix, name))
        else:
            yield prefix, parser, action


@pytest.mark.parametrize("command, words, action", CASES, ids=[f"{c}:{'.'.join(w)}:{a.dest}" for c, w, a in CASES])
def test_a_numeric_flag_refuses_every_value_of_the_bad_classes_in_one_line(command, words, action):
    top = importlib.import_module(f"jaxlm.{command}").make_parser()
    sub = top
    for word in words:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    flag = action.option_strings[0] if action.option_strings else None
    for text in ("nan", "inf", "-inf", "many", *_outside(action)):
        argv = [*words, *_required(sub, action), *([f"{flag}={text}"] if flag else ["--", text])]
        with pytest.raises(UserError) as raised:
            top.parse_args(argv)
        message = str(raised.value)
        assert "\n" not in message and (flag or action.dest) in message, (argv, message)
