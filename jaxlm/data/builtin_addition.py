"""The built-in addition task, `data.corpus=builtin_addition`: two-digit sums with a checkable answer.

Each row is `{"prompt": "12+34=", "completion": "46", "answer": "46"}`: a prompt_completion SFT row
(`data.format=prompt_completion`: learn to answer) and a GRPO prompt (`jaxlm.data.prompts`: its
`answer` checked by the `exact_match` reward), so that one file serves both stages of the recipe
`configs/grpo_tiny.py`: a tiny model supervised on part of the sums first, then GRPO with the
exact-match reward raising its held-out accuracy. Written by this script, deterministically (a fixed
seed, no download), into `builtin_addition.jsonl` beside it; `python -m jaxlm.data.builtin_addition`
writes it again (the tests check that it is unchanged).
"""

from __future__ import annotations

import json
import pathlib
import random

PATH = pathlib.Path(__file__).resolve().with_name("builtin_addition.jsonl")
ROWS = 2000  # of the 8,100 sums a + b with a, b in 10..99, chosen with a fixed seed
SEED = 0


def rows() -> list[dict[str, str]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    chosen = random.Random(SEED).sample(pairs, ROWS)
    return [{"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)} for a, b in chosen]


def text() -> str:
    return "".join(json.dumps(row) + "\n" for row in rows())


if __name__ == "__main__":
    PATH.write_text(text())
    print(f"wrote {ROWS} rows to {PATH}")
