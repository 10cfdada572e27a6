"""Reward functions for GRPO, named in the config: built-ins by name, a user's own by `module:function`.

A reward function scores one completion: `fn(prompt: str, completion: str, answer: str) -> float`, with
the prompt and the completion as text (the completion decoded without its stop token) and `answer` the
reference answer the prompt came with ("" when the data has none). Per completion rather than per batch,
so that a function that fails names the completion it failed on, and a user's function is three lines.

Built-ins (`REWARDS`):

- `exact_match`: 1.0 when the completion's final answer equals the reference answer's, else 0.0. The
  final answer (`final_answer`) is the text after the last "####" (GSM8K's marker) or, without one, after
  the last "=" (an equation's result), or, with neither, the whole text; of that, the first non-blank line,
  stripped of spaces and of a trailing period. The reference answer is read by the same rule (so a GSM8K
  solution "...#### 72" gives 72). Two answers that both read as numbers (`as_number`: commas, a leading
  "$" and a trailing "%" dropped; "72", "72.0" and "7.2e1" alike) are equal when their values are;
  otherwise their texts are, with runs of spaces as one space.
- `format`: 1.0 when the completion states a final answer in the marked form, "####" or "=" followed by
  a number and nothing after it but spaces and a period, else 0.0: it rewards the form whether or not the
  number is right.

A user's function is `module:function` (a module on the Python path, `mypkg.rewards:brevity`) or
`path/to/file.py:function`. A reward that does not import, is not a function of (prompt, completion,
answer), raises, or returns anything but a finite number (int, float, NumPy number; not a bool) stops
the run with one line naming it (`UserError`): `resolve` checks the first three before any device work,
`score` the rest on the completions.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
import pathlib
import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation

import numpy as np

from jaxlm.errors import UserError, run_user_file

RewardFn = Callable[[str, str, str], float]

_MARKERS = ("####", "=")


def final_answer(text: str) -> str:
    """The final answer a text states (the module's rule): after the last "####", else after the last "=",
    else the whole text; its first non-blank line, stripped of spaces and a trailing period."""
    for marker in _MARKERS:
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            break
    line = next((line for line in text.splitlines() if line.strip()), "")
    line = " ".join(line.split())
    return line[:-1].rstrip() if line.endswith(".") else line


def as_number(text: str) -> Decimal | None:
    """The number a final answer reads as (commas, a leading "$", a trailing "%" dropped), or None."""
    cleaned = text.replace(",", "").strip()
    cleaned = cleaned.removeprefix("$").removesuffix("%").strip()
    if not cleaned or not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", cleaned):
        return None
    try:
        return Decimal(cleaned)
    except InvalidOperation:  # pragma: no cover -- the pattern admits only what Decimal reads
        return None


def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference's (numbers by value), else 0.0."""
    got, want = final_answer(completion), final_answer(answer)
    a, b = as_number(got), as_number(want)
    if a is not None and b is not None:
        return float(a == b)
    return float(got != "" and got == want)


_FORMAT = re.compile(r"(####|=)\s*[-+]?\$?[\d,]*\.?\d+([eE][-+]?\d+)?%?\s*\.?\s*$")


def format_check(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion ends in "####" or "=" and a number (then only spaces or a period), else 0.0."""
    return float(_FORMAT.search(completion) is not None)


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "format": format_check}


@dataclasses.dataclass(frozen=True)
class Reward:
    """A resolved reward: its name as the config gives it (the metric's name), the function and its weight."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def _load(spec: str) -> RewardFn:
    """The function a reward name stands for: a built-in, `module:function` or `file.py:function`."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise UserError(f"reward {spec!r} is not a built-in ({', '.join(REWARDS)}) nor module:function; "
                        f"name one of those or your own as mypkg.rewards:my_reward")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not pathlib.Path(where).is_file():
            raise UserError(f"reward {spec!r}: no file {where}")
        module = run_user_file(where, f"jaxlm_user_reward_{pathlib.Path(where).stem}")
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001 -- whatever importing the user's module does wrong
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"reward {spec!r}: module {where!r} does not import ({type(e).__name__}: {first}); "
                            f"put it on PYTHONPATH or fix it") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise UserError(f"reward {spec!r}: {where} has no {name!r}")
    if not callable(fn):
        raise UserError(f"reward {spec!r}: {where}.{name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer")
    except TypeError:
        raise UserError(f"reward {spec!r}: takes {inspect.signature(fn)}; a reward takes (prompt, completion, "
                        f"answer) and returns a number") from None
    except ValueError:  # no signature to read (a builtin): let the call say
        pass
    return fn


def resolve(names: str | Sequence[str], weights: str | Sequence[float] = "") -> list[Reward]:
    """The rewards a config names: comma-separated (or a list) of built-ins and `module:function`s, with
    their weights (comma-separated or a list, as many; empty = 1 each). One line for the first bad one."""
    specs = [s.strip() for s in (names.split(",") if isinstance(names, str) else names)]
    specs = [s for s in specs if s]
    if not specs:
        raise UserError("no reward named: give at least one, e.g. rewards='exact_match,format'")
    if len(set(specs)) != len(specs):
        raise UserError(f"rewards={','.join(specs)!r} names one twice; give each once (weigh it instead)")
    if isinstance(weights, str):
        try:
            values = [float(w) for w in weights.split(",") if w.strip()]
        except ValueError:
            raise UserError(f"reward_weights={weights!r}: give comma-separated numbers, one per reward") from None
    else:
        values = [float(w) for w in weights]
    if not values:
        values = [1.0] * len(specs)
    if len(values) != len(specs) or not all(math.isfinite(w) for w in values):
        raise UserError(f"reward_weights={weights!r}: give {len(specs)} finite numbers, one per reward "
                        f"({', '.join(specs)})")
    return [Reward(spec, _load(spec), weight) for spec, weight in zip(specs, values)]


def _number(value, reward: Reward, row: int) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise UserError(f"reward {reward.name!r} returned {type(value).__name__} {value!r:.60} for completion "
                        f"#{row}; return a number")
    value = float(value)
    if not math.isfinite(value):
        raise UserError(f"reward {reward.name!r} returned {value} for completion #{row}; return a finite number")
    return value


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          answers: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(the weighted sum of the rewards [N] float32, each reward's own values {name: [N]}) for N
    completions, each with its prompt and reference answer. A reward that raises or returns a non-number
    stops with one line naming it and the completion (its index)."""
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers")
    per: dict[str, np.ndarray] = {}
    for reward in rewards:
        values = np.zeros(len(completions), np.float32)
        for row, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers)):
            try:
                value = reward.fn(prompt, completion, answer)
            except Exception as e:  # noqa: BLE001 -- whatever the user's function does wrong
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise UserError(f"reward {reward.name!r} raised {type(e).__name__}{': ' + first if first else ''} "
                                f"on completion #{row}; fix the function") from None
            values[row] = _number(value, reward, row)
        per[reward.name] = values
    total = np.zeros(len(completions), np.float32)
    for reward in rewards:
        total += np.float32(reward.weight) * per[reward.name]
    return total, per
