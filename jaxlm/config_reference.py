"""The configuration reference (docs/config-reference.md), generated from the typed sections.

Every key, its default and its meaning, by section: the keys and defaults from `jaxlm.config.base_config`,
the meanings from each section's own docs (`jaxlm.section`, `config.SECTIONS`), and the mesh rules' from
the source of `jaxlm.mesh.default_rules` (a rule's comment is the one at the end of its line, or the
comment lines right above it). `tests/test_docs.py` fails when the file is out of date;
`python -m jaxlm.config_reference` rewrites it, and with it the keys file that `python -m jaxlm.train`
checks its overrides against before importing JAX (`jaxlm.overrides.KEYS_FILE`).
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import pathlib
import sys
import textwrap
import tokenize
from collections.abc import Sequence

from jaxlm import config as config_lib
from jaxlm import mesh as mesh_lib
from jaxlm import overrides

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


def rule_docs() -> dict[str, str]:
    """Rule name -> its comment in the source of `jaxlm.mesh.default_rules`."""
    source = textwrap.dedent(inspect.getsource(mesh_lib.default_rules))
    lines, comments = source.splitlines(), _comments(source)
    return {key.value: _comment_for(key.lineno, lines, comments)
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Dict)
            for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _value(value) -> str:
    return f"`{value!r}`"


def render() -> str:
    cfg = config_lib.base_config()
    out = [
        "# Configuration reference",
        "",
        "Generated from the typed config sections (`jaxlm.config.SECTIONS`) by `python -m jaxlm.config_reference`;",
        "do not edit. Every key is set as `--config.<section>.<key>=<value>` or in a recipe (`configs/`), whose",
        "values replace these defaults. A `-1`, `0` or `\"\"` that means \"auto\" or \"the default\" says so.",
        "",
    ]
    for section, cls in config_lib.SECTIONS.items():
        values, docs = cfg[section], cls.docs()
        out += [f"## {section}", "", f"`{cls.__module__}.{cls.__name__}`: " + " ".join(cls.__doc__.split()), ""]
        out += ["| key | default | meaning |", "|---|---|---|"]
        for key in docs:
            if key != "rules":
                out.append(f"| `{key}` | {_value(values[key])} | {_cell(docs[key])} |")
        out.append("")
        if "rules" in docs:
            out += [f"### {section}.rules", "",
                    "Logical axis name -> the mesh axes it is split over (`\"\"` = replicated, `\"a,b\"` = both).", "",
                    "| name | default | meaning |", "|---|---|---|"]
            rules = rule_docs()
            for name, axes in values["rules"].items():
                out.append(f"| `{name}` | {_value(axes)} | {_cell(rules.get(name, ''))} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def render_keys() -> str:
    """Every key with its default, as JSON (`overrides.KEYS_FILE`)."""
    return json.dumps(config_lib.base_config().to_dict(), indent=1) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write docs/config-reference.md (or the path given) and jaxlm/config_keys.json."""
    argv = sys.argv[1:] if argv is None else argv
    path = pathlib.Path(argv[0]) if argv else OUTPUT
    path.write_text(render())
    overrides.KEYS_FILE.write_text(render_keys())
    print(f"wrote {path} and {overrides.KEYS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
