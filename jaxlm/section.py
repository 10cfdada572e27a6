"""Typed config sections: a component's settings as a frozen dataclass that it owns.

A section names its config section (`section`: `checkpoint` for `config.checkpoint`), declares each key
with its default and a one-line doc (`setting`), checks its own values (`validate`, raising the one
`jaxlm: error:` line through `check`), and is built from the config's section (`from_config`), the
ml_collections ConfigDict that recipes and `--config.<section>.<key>=` overrides write and that a
run's `config.json` stores. `jaxlm.config.base_config` takes the section's defaults from it
(`defaults`) and the configuration reference its docs (`docs`), so each lives in one place.

ml_collections stays the container users write (recipes as Python, the `--config.a.b=value` syntax,
locked keys with did-you-mean, every earlier `config.json`); draccus, Levanter's choice, would replace
the recipes and the command line users know, for the typing these dataclasses already give.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from jaxlm import paths
from jaxlm.errors import UserError, is_utf8

# The largest integer a key takes unless it declares another `limit`: the train step counts steps in
# int32, JAX folds a seed into 32 bits, and no size of a model or a batch comes near it, so a larger
# value is a typo (or an absurd size the planner need not trace to refuse).
INT_LIMIT = 2**31 - 1


def setting(default: Any, doc: str, *, limit: int = INT_LIMIT, path: tuple[str, str] | None = None) -> Any:
    """A section's key: its default and what it means, in one line; an int key's magnitude is at most
    `limit` (a byte count may declare a larger one); a path a run writes or reads declares `path`,
    (kind, io) as `jaxlm.paths.check` takes them, checked by `Section.check_paths` when a command
    starts (never by `validate`: a stored config names paths of another time or machine)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "limit": limit, "path": path})


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    """One line naming the key (`section.key`), its value and what is allowed, unless `ok`."""
    if not ok:
        raise UserError(f"config.{key}={value!r} is not allowed: {allowed}")


def check_choice(key: str, value: Any, choices: Sequence[str], allow_empty: bool = False) -> None:
    ok = value in choices or (allow_empty and value == "")
    check(ok, key, value, "one of " + ", ".join(repr(c) for c in choices) + (" or ''" if allow_empty else ""))


# A field's declared type (a name under `from __future__ import annotations`) -> what `check_values` checks
_TYPES = {"float": float, "int": int, "bool": bool, "str": str, "dict": dict}


def _plain(value: Any) -> Any:
    """A group of keys (a ConfigDict) as a plain dict; any other value as it is."""
    return value.to_dict() if hasattr(value, "to_dict") else value


@dataclasses.dataclass(frozen=True)
class Section:
    """The base of every typed section (a frozen dataclass of `setting`s)."""

    section: ClassVar[str]  # the config section it is: `checkpoint` for `config.checkpoint`

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """{key: default}, in declaration order: the section of `base_config`."""
        return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}

    @classmethod
    def docs(cls) -> dict[str, str]:
        """{key: its one-line doc}."""
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

    @classmethod
    def from_config(cls, values: Mapping[str, Any]):
        """The section from the config's (a ConfigDict or a dict holding every key)."""
        return cls(**{f.name: _plain(values[f.name]) for f in dataclasses.fields(cls)})

    def key(self, field: str) -> str:
        return f"{self.section}.{field}"

    def check_values(self) -> None:
        """What every key gets by its declared type, in every section, before its own `validate`: a
        number of that type (an integer for an int, at most its `limit` in magnitude; an int or a float
        for a float, and finite: never nan or inf), a bool, a string (UTF-8), a group of string values.
        One line naming the first that is not."""
        for field in dataclasses.fields(self):
            kind = _TYPES.get(field.type if isinstance(field.type, str) else getattr(field.type, "__name__", ""))
            value, key = getattr(self, field.name), self.key(field.name)
            if kind is float:
                check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                      key, value, "a finite number")
            elif kind is int:
                check(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
                limit = field.metadata.get("limit", INT_LIMIT)
                check(abs(value) <= limit, key, value, f"an integer of at most {limit:,} in magnitude")
            elif kind is bool:
                check(isinstance(value, bool), key, value, "true or false")
            elif kind is str:
                check(isinstance(value, str), key, value, "a string")
                check(is_utf8(value), key, value, "UTF-8 text (rename the file, or type the value in UTF-8)")
            elif kind is dict:
                check(isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values()), key, value,
                      "a group of keys with string values")
                check(all(is_utf8(v) for v in value.values()), key, value, "UTF-8 text")

    def check_paths(self) -> None:
        """Every `path` key that is set, checked as the command that is starting will use it
        (`jaxlm.paths.check`: one line naming the key)."""
        for field in dataclasses.fields(self):
            declared, value = field.metadata.get("path"), getattr(self, field.name)
            if declared and value:
                paths.check(value, kind=declared[0], io=declared[1], name=f"config.{self.key(field.name)}")

    def validate(self) -> None:
        """Check what needs no other section (a check across sections belongs to `jaxlm.config`)."""
