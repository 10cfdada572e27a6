"""Prompts with reference answers, for GRPO: JSONL rows of {prompt, answer} -> token ids and texts.

A row is plain text, `{"prompt": str, "answer": str}`, prompted as a `prompt_completion` SFT row
begins (BOS + the prompt's tokens; the model continues it, as after SFT on such rows), or a
conversation, `{"prompt": [{"role", "content"}, ...], "answer": str}`, rendered by the chat template
(`data.chat_template`, as SFT's chat rows: `jaxlm.data.sft`) with its generation prompt, a completion
ending at EOS or the template's end of turn (`sft.Encoder.stop_ids`). `answer` (a string, or a number
written as one) is what the rewards compare a completion with (`jaxlm.post_training.rewards`); other
fields are ignored. `data.corpus=builtin_addition` is the built-in two-digit addition task
(`jaxlm.data.builtin_addition`).

Which prompts a rollout takes (`PromptOrder`) is a function of the rollout's index alone, a fresh
seeded permutation of the training prompts per pass, so that a checkpoint needs no iterator position.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence

import numpy as np

from jaxlm.data import sft, sources
from jaxlm.errors import UserError

BUILTIN = sources.BUILTIN_ADDITION
SHAPE = ('each row must be {"prompt": str or a list of {"role", "content"} messages, "answer": str} '
         '(the reference answer the rewards compare with)')


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One checked row: `where` it came from ('file:line'), the prompt (text, or messages) and the answer."""

    where: str
    prompt: str | tuple[tuple[str, str], ...]
    answer: str
    row_key: str = ""  # the row's JSON, as SFT's rows hash it: a row held out here is held out of SFT too

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)

    @property
    def text(self) -> str:
        """The prompt as a reward reads it: the text, or the last message's content."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[-1][1]

    @property
    def key(self) -> str:
        """What the validation split hashes (`sources.is_validation`): the row's content, not its place, as
        `sft.Example.key` (so SFT on the same file with the same data.val_fraction and seed holds out the
        same rows)."""
        return self.row_key or json.dumps([self.prompt, self.answer], ensure_ascii=False)


def check_prompt(row, where: str) -> Prompt:
    """The prompt of one row, or one `UserError` line naming `where` and what to change."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: a JSON {type(row).__name__}, not an object; {SHAPE}")
    for field in ("prompt", "answer"):
        if field not in row:
            raise UserError(f"{where}: no field {field!r} (found: {', '.join(sorted(row)) or 'none'}); {SHAPE}")
    row_key = json.dumps(row, sort_keys=True, ensure_ascii=False)
    answer = row["answer"]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise UserError(f"{where}: 'answer' is a {type(answer).__name__}, not a string; {SHAPE}")
    prompt = row["prompt"]
    if isinstance(prompt, list):
        messages = sft._check_messages({"messages": [*prompt, {"role": "assistant", "content": "?"}]}, where)
        return Prompt(where, tuple((m["role"], m["content"]) for m in messages[:-1]), answer, row_key)
    if not isinstance(prompt, str):
        raise UserError(f"{where}: 'prompt' is a {type(prompt).__name__}, not a string or a list of messages; {SHAPE}")
    if not prompt:
        raise UserError(f"{where}: the prompt is empty; give it text or drop the row")
    return Prompt(where, prompt, answer, row_key)


def iter_prompts(corpus: str) -> Iterator[Prompt]:
    """Every prompt of `data.corpus` (JSONL files, or `builtin_addition`), in order, checked."""
    spec = sources.SourceSpec(corpus, "auto", "text", "")
    for path in sources.resolve_files(spec):
        for where, row in sources.read_file_records(path):
            yield check_prompt(row, where)


def tokenizer_texts(rows: Sequence[Prompt]) -> list[str]:
    """The text a tokenizer for these prompts is trained on: each prompt and its answer."""
    out = []
    for p in rows:
        if p.chat:
            out.extend(c for _, c in p.prompt)
            out.append(p.answer)
        else:
            out.append(p.prompt + p.answer)
    return out


class PromptEncoder:
    """Prompt -> the ids the model is prompted with; and the ids a completion stops at."""

    def __init__(self, tok, chat_template: str, chat: bool):
        self.tok = tok
        self.template = sft.Encoder.make(sft.Spec("chat", chat_template), tok) if chat else None

    def __call__(self, prompt: Prompt) -> list[int]:
        tok = self.tok
        if not prompt.chat:
            ids = tok.encode([prompt.prompt], add_bos=False, add_eos=False, num_threads=1)[0]
            return ([tok.bos_id] if tok.bos_id >= 0 else []) + list(ids)
        if self.template is None:
            raise UserError(f"{prompt.where}: a chat prompt among plain ones; give one kind in a corpus")
        return list(self.template.prompt_ids(tok, [{"role": r, "content": c} for r, c in prompt.prompt]))

    def stop_ids(self) -> tuple[int, ...]:
        if self.template is not None:
            return self.template.stop_ids(self.tok)
        return (self.tok.eos_id,) if self.tok.eos_id >= 0 else ()


def encode(rows: Sequence[Prompt], tok, chat_template: str, max_prompt_len: int) -> tuple[list[list[int]], tuple]:
    """(each prompt's ids, the stop ids). A prompt longer than `max_prompt_len` is refused (never cut),
    with the length that fits every prompt."""
    encoder = PromptEncoder(tok, chat_template, any(p.chat for p in rows))
    ids = [encoder(p) for p in rows]
    long = [i for i, x in enumerate(ids) if len(x) > max_prompt_len]
    if long:
        first = rows[long[0]]
        raise UserError(f"{first.where}: the prompt is {len(ids[long[0]])} tokens, longer than grpo.max_prompt_len="
                        f"{max_prompt_len} ({len(long)} such prompts); set grpo.max_prompt_len="
                        f"{max(len(x) for x in ids)} (and data.seq_len with it) or shorten them")
    return ids, encoder.stop_ids()


@dataclasses.dataclass(frozen=True)
class PromptOrder:
    """Which training prompts each rollout takes: `count` per rollout, through a seeded permutation of
    the `n` prompts per pass (pass e: `np.random.default_rng([seed, e])`), a function of the rollout's
    index alone, so that a resumed run takes the same prompts without an iterator's saved position."""

    n: int
    count: int
    seed: int

    def take(self, rollout: int) -> tuple[list[int], int]:
        """(the prompt indices of 0-based `rollout`, the pass its first prompt belongs to)."""
        start = rollout * self.count
        out, epochs = [], {}
        for k in range(start, start + self.count):
            epoch = k // self.n
            if epoch not in epochs:
                epochs[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            out.append(int(epochs[epoch][k % self.n]))
        return out, start // self.n
