"""Paths checked by class, before any work: every path a command line or a config names is declared with
what it must be (`kind`: a file, a directory or either; `io`: read or written), and `check` refuses, in
one line naming the flag or key, whatever it cannot be: a name the filesystem cannot hold, text that is
not UTF-8, a missing input, a file where a directory is expected (or the reverse), an output inside a
run's checkpoints, an input that cannot be read (exit 74) or an output whose directory cannot be written
(exit 74).

What only the command knows (a run directory that is not a run, an output inside another run) stays the
command's check (`jaxlm.run_dir`); this is what is true of any path, so it is written once and tested
over every declared flag and key (tests/test_paths.py). A command's output file (`check_output_file`) is
checked here too, light to import, so that evaluate refuses its --output before JAX is imported.
"""

from __future__ import annotations

import json
import os
import pathlib

from jaxlm.errors import EnvironmentFailure, UserError, is_utf8

KINDS = ("file", "dir", "any")
IOS = ("in", "out")
NAME_MAX = 255  # bytes of one name (ext4, xfs, btrfs, tmpfs; what the filesystem says wins)
PATH_MAX = 4096  # bytes of a whole path (Linux)


def is_run(path: str | os.PathLike) -> bool:
    """Whether `path` is a run directory jaxlm wrote (`python -m jaxlm.train`, `hf import`, `compress`):
    its config.json is a jaxlm config, a JSON object with `run` and `model` sections. A Hugging Face
    model's config.json, or a user's own, is not."""
    try:
        saved = json.loads((pathlib.Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and isinstance(saved.get("run"), dict) and isinstance(saved.get("model"), dict)


def checkpoints_containing(path: str | os.PathLike) -> pathlib.Path | None:
    """The `checkpoints` directory of a run that `path` is in (or is), if any: what only training writes."""
    for p in (pathlib.Path(path).absolute(), *pathlib.Path(path).absolute().parents):
        if p.name == "checkpoints" and is_run(p.parent):
            return p
    return None


def run_containing(path: pathlib.Path) -> pathlib.Path | None:
    """The run directory `path` is in (or is), if any: the nearest of it and its parents that `is_run`."""
    path = pathlib.Path(path).absolute()
    return next((p for p in (path, *path.parents) if is_run(p)), None)


def check_output_file(path: pathlib.Path, flag: str = "--output") -> None:
    """A command's output file (`evaluate --output`): written only where nothing is lost, a new file or an
    earlier result of the same kind (a JSON object with `run_dir` and `step`), never inside a run's
    checkpoints nor over one of a run's own files."""
    path = pathlib.Path(path)
    named = f"{flag}={path}" if flag.startswith("--") else f"{flag} {path}"
    inside = run_containing(path.parent)
    if inside is not None and "checkpoints" in path.absolute().relative_to(inside.absolute()).parts:
        raise UserError(f"{named} is inside the checkpoints of {inside}; give a file outside them")
    if path.is_dir():
        raise UserError(f"{named} is a directory; give a file name")
    if path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and "run_dir" in earlier and "step" in earlier):
            raise UserError(f"{named} exists and is not an earlier result of this command; give a new file "
                            f"(it is left as it is)")


def _shown(text: str) -> str:
    """The path as the error line shows it: whole, unless it is longer than any path can be."""
    return repr(text if len(text) <= 400 else text[:300] + "..." + text[-40:])


def _existing_ancestor(path: pathlib.Path) -> pathlib.Path:
    """The nearest of `path`'s ancestors that exists (the current directory for a relative name)."""
    for parent in path.absolute().parents:
        if os.path.lexists(parent):
            return parent
    return pathlib.Path("/")


def _name_max(where: pathlib.Path) -> int:
    try:
        return os.pathconf(where, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


def _check_kind(path: pathlib.Path, kind: str, label: str, a_file: str) -> None:
    """One line when the existing `path` is a directory where a file is expected, or the reverse."""
    if kind == "file" and path.is_dir():
        raise UserError(f"{label} is a directory; give {a_file}")
    if kind == "dir" and not path.is_dir():
        raise UserError(f"{label} is a file; give a directory")


def check(text: str, *, kind: str, io: str, name: str) -> None:
    """Refuse `text` as the path `name` (a flag such as `--output`, or a config key) in one line unless
    it can be a `kind` ("file", "dir", "any") that the command reads (`io="in"`) or writes ("out").
    UserError (exit 2) for what the user gave; EnvironmentFailure (exit 74) for permissions."""
    assert kind in KINDS and io in IOS, (kind, io)
    label = f"{name}={_shown(text)}"
    if not is_utf8(text):
        raise UserError(f"{label} is not UTF-8 text (bytes in another encoding): give the name in UTF-8")
    if "://" in text:  # a remote location (gs://...): the library that opens it says what is wrong with it
        return
    path = pathlib.Path(text)
    encoded = os.fsencode(text)
    longest = max((len(os.fsencode(part)) for part in path.parts), default=0)
    limit = _name_max(_existing_ancestor(path))
    if longest > limit or len(encoded) > PATH_MAX:
        raise UserError(f"{label}: a name in it is {longest} bytes and the filesystem allows {limit} "
                        f"(and {PATH_MAX} for the whole path): give a shorter path")
    if io == "in":
        if not os.path.exists(path):
            missing = next((p for p in reversed(path.absolute().parents) if not os.path.exists(p)), None)
            if missing is not None and missing != path.absolute():
                raise UserError(f"{label} does not exist ({missing} is missing)")
            raise UserError(f"{label} does not exist")
        _check_kind(path, kind, label, "a file")
        if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            raise EnvironmentFailure(f"{label}: permission denied (it cannot be read)")
        return
    if (checkpoints := checkpoints_containing(path)) is not None:
        raise UserError(f"{label} is inside the checkpoints of {checkpoints.parent} (only training writes there); "
                        "give a path outside them")
    if os.path.lexists(path):
        _check_kind(path, kind, label, "the path of a file")
        if not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            raise EnvironmentFailure(f"{label}: permission denied (it cannot be written)")
        return
    ancestor = _existing_ancestor(path)
    if not ancestor.is_dir():
        raise UserError(f"{label}: {ancestor} is a file, so nothing can be written under it; give another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise EnvironmentFailure(f"{label}: permission denied ({ancestor} cannot be written)")
