"""A table for the eye: aligned plain text in a terminal, Markdown in a notebook or a report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Table:
    """Rows for the eye: plain text in a terminal (`print`), Markdown in a notebook."""

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], footer: str = ""):
        self.columns, self.rows, self.footer = list(columns), [list(r) for r in rows], footer

    def _cells(self) -> list[list[str]]:
        return [[_cell(v) for v in row] for row in self.rows]

    def __str__(self) -> str:
        cells = [self.columns, *self._cells()]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + ([self.footer] if self.footer else []))

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self._cells()]
        return "\n".join(lines + (["", self.footer] if self.footer else []))

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def __repr__(self) -> str:
        return str(self)

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, tuple):
        return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)
