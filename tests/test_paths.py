"""Every path a command line or a config names, by class (`jaxlm.paths`): generated from the commands'
own parsers (`Parser.add_path`) and the sections' declared keys (`setting(path=...)`), so a new path
flag or key is covered the day it is declared. Each class of bad path (not UTF-8, a name too long, a
missing input, a file where a directory is expected and the reverse, an output under a file or inside a
run's checkpoints, an input that cannot be read, an output that cannot be written) is one line naming
the flag or key, exit 2 (74 for permissions), and nothing written. The real commands are run on a
sample in tests/test_bad_inputs.py."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import re
import shutil
import tempfile

import pytest

from jaxlm import config, paths
from jaxlm.errors import EnvironmentFailure, UserError

COMMANDS = ("evaluate", "generate", "hf", "compress.cli", "data.prepare", "data.tokenizer", "doctor", "plan",
            "experiment")
# Text flags that name paths but are not one path, each checked where it is read: lists and globs of
# inputs (`data.sources`), names that may be a file or a built-in (a chat template, a corpus split), and a
# name written for another program, never opened here (hf export's --base_model: a directory or a hub id)
NOT_ONE_PATH = {"--corpus", "--input", "--tasks", "--chat_template", "--base_model"}
PATH_LIKE = re.compile(r"(dir|output|file|path|model|tokenizer|experiment)$")


def _actions(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, (*prefix, name))
        else:
            yield prefix, action


def _flag(action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


FLAGS = [(command, words, _flag(action), *action.jaxlm_path) for command in COMMANDS
         for words, action in _actions(importlib.import_module(f"jaxlm.{command}").make_parser())
         if hasattr(action, "jaxlm_path")]
KEYS = [(f"config.{name}.{field.name}", *field.metadata["path"]) for name, cls in config.SECTIONS.items()
        for field in dataclasses.fields(cls) if field.metadata.get("path")]


def test_every_path_flag_and_key_is_declared_as_one():
    """The enumeration finds them, and no flag that looks like a path escapes it."""
    assert len(FLAGS) >= 18 and len(KEYS) >= 3, (FLAGS, KEYS)
    for command in COMMANDS:
        for words, action in _actions(importlib.import_module(f"jaxlm.{command}").make_parser()):
            flag = _flag(action)
            looks = action.type is None and action.nargs != 0 and PATH_LIKE.search(action.dest.rstrip("s"))
            if looks and flag not in NOT_ONE_PATH and action.choices is None:
                assert hasattr(action, "jaxlm_path"), f"jaxlm.{command} {' '.join(words)} {flag}: declare it with add_path"


def _world(root: pathlib.Path) -> dict[str, str]:
    """A file, a directory, a run with a checkpoint: what the classes' values point at."""
    (root / "a_dir").mkdir()
    (root / "a_file").write_text("x")
    run = root / "run"
    (run / "checkpoints" / "20").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"run": {}, "model": {}}))
    return {"root": str(root), "dir": str(root / "a_dir"), "file": str(root / "a_file"), "run": str(run)}


def _classes(kind: str, io: str, w: dict[str, str]) -> list[tuple[str, str, type]]:
    """(class, value, the error) of every class of bad path that applies to a `kind` read or written."""
    out = [("not UTF-8", os.path.join(w["root"], "r\udcff"), UserError),
           ("name too long", os.path.join(w["root"], "n" * 300), UserError),
           ("path too long", os.path.join(w["root"], *["d" * 200] * 25), UserError)]
    if kind == "file":
        out.append(("a directory where a file is expected", w["dir"], UserError))
    if kind == "dir":
        out.append(("a file where a directory is expected", w["file"], UserError))
    if io == "in":
        out.append(("missing", os.path.join(w["root"], "missing", "x"), UserError))
    else:
        out += [("under a file", os.path.join(w["file"], "x"), UserError),
                ("inside a run's checkpoints", os.path.join(w["run"], "checkpoints", "99"), UserError)]
    return out


def _snapshot(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"") for p in sorted(root.rglob("*"))}


def _good(action, root: pathlib.Path) -> str:
    """A value a required argument can take: a path of its kind, a number, a choice, a word."""
    if hasattr(action, "jaxlm_path"):
        kind, io = action.jaxlm_path
        return str(root / "new") if io == "out" else __file__ if kind == "file" else str(root)
    if getattr(action.type, "__name__", "") in ("int", "float"):
        return "1"
    return str(next(iter(action.choices))) if action.choices else "x"


def _parse(command: str, words: tuple[str, ...], flag: str, value: str, root: pathlib.Path):
    """Parse a command line giving `flag` the value and every other required argument a good one."""
    top = importlib.import_module(f"jaxlm.{command}").make_parser()
    sub = top
    for word in words:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    argv = list(words)
    for action in sub._actions:
        if isinstance(action, argparse._SubParsersAction) or _flag(action) == flag:
            continue
        if not action.option_strings and action.nargs not in ("?", "*"):
            argv.append(_good(action, root))
        elif action.option_strings and action.required:
            argv.append(f"{action.option_strings[0]}={_good(action, root)}")
    argv.append(f"{flag}={value}" if flag.startswith("-") else value)
    return top.parse_args(argv)


@pytest.mark.parametrize("command, words, flag, kind, io", FLAGS,
                         ids=[f"{c}:{'.'.join(w)}:{f}" for c, w, f, _, _ in FLAGS])
def test_a_path_flag_refuses_every_class_of_bad_path_in_one_line(command, words, flag, kind, io, tmp_path):
    w = _world(tmp_path)
    before = _snapshot(tmp_path)
    for name, value, error in _classes(kind, io, w):
        with pytest.raises(error) as raised:
            _parse(command, words, flag, value, pathlib.Path(w["dir"]))
        message = str(raised.value)
        assert "\n" not in message and flag in message, (name, message)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("key, kind, io", KEYS, ids=[k for k, _, _ in KEYS])
def test_a_path_key_refuses_every_class_of_bad_path_in_one_line(key, kind, io, tmp_path):
    w = _world(tmp_path)
    before = _snapshot(tmp_path)
    for name, value, error in _classes(kind, io, w):
        cfg = config.load_recipe("tiny")
        with pytest.raises(error) as raised:
            config.apply_overrides(cfg, [(key.removeprefix("config."), value)])
            config.validate(cfg)
            config.check_paths(cfg)
        message = str(raised.value)
        assert "\n" not in message and (key in message or "config.run.name" in message), (name, message)
    assert _snapshot(tmp_path) == before


def _checked_as_unprivileged(cases: list[tuple[str, str, str]]) -> list[str | None]:
    """`paths.check` of each (path, kind, io), in a child process that, when the tests run as root (who
    may read and write anything), drops to an unprivileged user first: each EnvironmentFailure's line,
    or None where the path was accepted."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # (only os calls run in the child: nothing of JAX's threads is needed)
        try:
            os.close(read)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            out = []
            for text, kind, io in cases:
                try:
                    paths.check(text, kind=kind, io=io, name="--x")
                    out.append(None)
                except EnvironmentFailure as e:
                    out.append(str(e))
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(child, 0)
    return json.loads(text)


def test_paths_that_cannot_be_read_or_written_are_the_environment_s_one_line():
    root = pathlib.Path(tempfile.mkdtemp())
    try:
        root.chmod(0o755)
        (root / "locked").mkdir()
        (root / "unreadable_file").write_text("x")
        (root / "unreadable_file").chmod(0o000)
        (root / "locked").chmod(0o000)
        (root / "read_only").mkdir()
        (root / "read_only").chmod(0o555)
        cases = [(str(root / "unreadable_file"), "file", "in"), (str(root / "locked"), "dir", "in"),
                 (str(root / "read_only" / "new"), "dir", "out"), (str(root / "read_only" / "f.json"), "file", "out"),
                 (str(root / "read_only"), "dir", "out")]
        for (text, _, _), line in zip(cases, _checked_as_unprivileged(cases), strict=True):
            assert line and "--x=" in line and "permission denied" in line and "\n" not in line, (text, line)
    finally:
        for p in (root / "locked", root / "read_only", root / "unreadable_file"):
            p.chmod(0o755)
        shutil.rmtree(root)


def test_a_good_path_passes_every_check(tmp_path):
    w = _world(tmp_path)
    paths.check(w["file"], kind="file", io="in", name="--x")
    paths.check(w["dir"], kind="dir", io="in", name="--x")
    paths.check(w["dir"], kind="any", io="in", name="--x")
    paths.check(os.path.join(w["dir"], "new", "deeper"), kind="dir", io="out", name="--x")
    paths.check(os.path.join(w["run"], "hf"), kind="dir", io="out", name="--x")  # beside a run's files: allowed
    paths.check(os.path.join(w["run"], "eval-20.json"), kind="file", io="out", name="--x")
    paths.check("gs://bucket/runs/a", kind="dir", io="in", name="--x")  # remote: left to the library opening it
