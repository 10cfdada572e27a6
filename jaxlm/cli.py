"""The commands' argument parser: a mistake on the command line is one line and exit code 2, as every
jaxlm user error, and numbers, text and paths are checked by class, in one place.

`Parser.add_number` declares a numeric flag with its kind (int or float) and its range; every number
is parsed finite (no nan or inf, for any flag), an int is a whole number of at most `section.INT_LIMIT`
(unless it declares more), and the range is checked after parsing, each failure one line naming the
flag and the value. `Parser.add_path` declares a path flag with what it must be (`jaxlm.paths.check`).
Every text value is checked to be UTF-8 (`errors.is_utf8`). A command's own code then never checks its
flags' numbers or the plain facts of its paths by hand.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from jaxlm import paths
from jaxlm.errors import UserError, is_utf8
from jaxlm.section import INT_LIMIT


def number(kind: type) -> Any:
    """The argparse `type` of a numeric flag: `kind` (int or float), finite."""
    def parse(text: str) -> int | float:
        if kind is int:
            try:
                return int(text.replace("_", ""))
            except ValueError:
                pass
        try:
            value = float(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if kind is int:
            if not value.is_integer():
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
            return int(value)
        return value

    parse.__name__ = kind.__name__
    return parse


def _range(minimum, above, maximum, below) -> str:
    parts = [f"at least {minimum}" if minimum is not None else "", f"above {above}" if above is not None else "",
             f"at most {maximum}" if maximum is not None else "", f"below {below}" if below is not None else ""]
    return " and ".join(p for p in parts if p)


class Parser(argparse.ArgumentParser):
    """argparse's parser, with one-line errors (`UserError`, which `errors.run_command` turns into exit
    code 2) and numeric flags declared with their range (`add_number`)."""

    def error(self, message: str):
        raise UserError(message)

    def add_number(self, *flags: str, kind: type = float, minimum: float | None = None, above: float | None = None,
                   maximum: float | None = None, below: float | None = None, allowed: str = "",
                   limit: int = INT_LIMIT, **kwargs: Any) -> argparse.Action:
        """A numeric flag: `kind`, finite, within [minimum, maximum] and (above, below) where given; `allowed`
        says the range in the error's words (e.g. "0 (greedy) or more"), else the bounds do. An int is at
        most `limit` in magnitude (`section.INT_LIMIT`, as every config key; a byte count declares more)."""
        action = self.add_argument(*flags, type=number(kind), **kwargs)
        action.jaxlm_range = (minimum, above, maximum, below, allowed or _range(minimum, above, maximum, below))
        action.jaxlm_limit = limit if kind is int else None
        return action

    def add_path(self, *flags: str, kind: str, io: str, **kwargs: Any) -> argparse.Action:
        """A path flag: a `kind` ("file", "dir", "any") the command reads (`io="in"`) or writes ("out"),
        checked after parsing by `jaxlm.paths.check` (what any path must be); an empty value is unset."""
        action = self.add_argument(*flags, **kwargs)
        action.jaxlm_path = (kind, io)
        return action

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        for action in _actions(self):
            value = getattr(parsed, action.dest, None)
            if value is None:
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest
            texts = [t for t in (value if isinstance(value, list) else [value]) if isinstance(t, str)]
            for text in texts:
                if not is_utf8(text):
                    self.error(f"{flag}={text!r} is not UTF-8 text (bytes in another encoding): give the name or "
                               "the text in UTF-8")
                if hasattr(action, "jaxlm_path") and text:
                    kind, io = action.jaxlm_path
                    paths.check(text, kind=kind, io=io, name=flag)
            if not hasattr(action, "jaxlm_range"):
                continue
            minimum, above, maximum, below, allowed = action.jaxlm_range
            if action.jaxlm_limit is not None and abs(value) > action.jaxlm_limit:
                self.error(f"{flag}={value!r} is not allowed: an integer of at most {action.jaxlm_limit:,} in magnitude")
            if ((minimum is not None and value < minimum) or (above is not None and value <= above)
                    or (maximum is not None and value > maximum) or (below is not None and value >= below)):
                self.error(f"{flag}={value!r} is not allowed: {allowed}")
        return parsed, rest


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's actions and its subcommands' (whose values land in the same namespace)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _actions(sub)
        else:
            out.append(action)
    return out
