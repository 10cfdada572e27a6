"""The configuration reference (docs/config-reference.md), generated from `jaxlm.config.base_config`.

Every key, its default and its meaning, by section. The keys and defaults come from the config itself;
the meanings from a typed section's own docs (`jaxlm.section`, `config.SECTIONS`), or, for a section
not yet typed, from the source of `base_config` and `default_rules`: a key's comment is the one at the
end of its line, or the comment lines right above it. `tests/test_docs.py` fails when the file is out
of date; `python -m jaxlm.config_reference` rewrites it.
"""

from __future__ import annotations

import ast
import inspect
import io
import pathlib
import sys
import textwrap
import tokenize
from collections.abc import Sequence

from jaxlm import config as config_lib

OUTPUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "config-reference.md"


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _comment_for(line: int, lines: list[str], comments: dict[int, str]) -> str:
    """The comment at the end of `line`, else the full-line comments right above it."""
    if line in comments and lines[line - 1].strip()[:1] != "#":
        return comments[line]
    above, i = [], line - 1
    while i >= 1 and lines[i - 1].strip().startswith("#"):
        above.insert(0, comments[i])
        i -= 1
    return " ".join(above)


def _documented(fn) -> tuple[dict[tuple[str, ...], str], dict[str, str]]:
    """(key path -> comment, section -> comment) from the source of `fn` (base_config, default_rules)."""
    source = textwrap.dedent(inspect.getsource(fn))
    lines, comments = source.splitlines(), _comments(source)
    keys: dict[tuple[str, ...], str] = {}
    sections: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target = ast.unparse(node.targets[0]).split(".")[1:]  # c.model -> ["model"], c.mesh.hybrid -> [...]
            doc = _comment_for(node.lineno, lines, comments)
            if len(target) == 1:
                sections[target[0]] = doc
                value = node.value
                if isinstance(value, ast.Call):  # c.section = dict(key=value, ...)
                    for kw in value.keywords:
                        keys[(target[0], kw.arg)] = _comment_for(kw.value.lineno, lines, comments)
            else:
                keys[tuple(target)] = doc
        elif isinstance(node, ast.Dict):  # default_rules: {"name": "axes", ...}
            for key in node.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    keys[("rules", key.value)] = _comment_for(key.lineno, lines, comments)
    return keys, sections


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _value(value) -> str:
    return f"`{value!r}`"


def render() -> str:
    cfg = config_lib.base_config()
    keys, sections = _documented(config_lib.base_config)
    rules, _ = _documented(config_lib.default_rules)
    out = [
        "# Configuration reference",
        "",
        "Generated from `jaxlm/config.py` (`base_config`) by `python -m jaxlm.config_reference`; do not edit.",
        "Every key is set as `--config.<section>.<key>=<value>` or in a recipe (`configs/`), whose values",
        "replace these defaults. A `-1`, `0` or `\"\"` that means \"auto\" or \"the default\" says so.",
        "",
    ]
    for section, values in cfg.items():
        out += [f"## {section}", ""]
        typed = config_lib.SECTIONS.get(section)
        if typed is not None:
            keys.update({(section, key): doc for key, doc in typed.docs().items()})
            sections[section] = " ".join(typed.__doc__.split())
        if sections.get(section):
            out += [sections[section], ""]
        out += ["| key | default | meaning |", "|---|---|---|"]
        for key, value in values.items():
            if key == "rules":
                continue
            doc = keys.get((section, key), "")
            if section == "mesh" and key in config_lib.MESH_AXES:
                doc = f"devices along the {key} axis; {sections.get('mesh', '')}"
            out.append(f"| `{key}` | {_value(value)} | {_cell(doc)} |")
        out.append("")
        if section == "mesh":
            out += ["### mesh.rules", "",
                    "Logical axis name -> the mesh axes it is split over (`\"\"` = replicated, `\"a,b\"` = both).", "",
                    "| name | default | meaning |", "|---|---|---|"]
            for name, axes in values["rules"].items():
                out.append(f"| `{name}` | {_value(axes)} | {_cell(rules.get(('rules', name), ''))} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write docs/config-reference.md (or the path given)."""
    argv = sys.argv[1:] if argv is None else argv
    path = pathlib.Path(argv[0]) if argv else OUTPUT
    path.write_text(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
