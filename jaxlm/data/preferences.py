"""Preference pairs for DPO: JSONL rows of {prompt, chosen, rejected} -> one batch row per pair.

A row (TRL's field names) is either plain text,
  {"prompt": str, "chosen": str, "rejected": str}
encoded as `prompt_completion` SFT rows are (BOS + prompt + completion + EOS, the completion and EOS
weighing 1: write the separator between prompt and completion into the data), or a conversation,
  {"prompt": [{"role", "content"}, ...], "chosen": str | [{"role": "assistant", ...}], "rejected": ...}
rendered by the chat template (`data.chat_template`, as SFT's chat rows: `jaxlm.data.sft`), the weights
on the final assistant turn alone (its content and end-of-turn marker). Other fields are ignored.

Each pair becomes one row of `seq_len` targets: the chosen sequence as segment 1 from position 0, the
rejected one as segment 2 right after it, padding (segment 0) after both. Attention never crosses a
segment, each restarts its positions at 0, so each sequence is scored as if alone; and a pair lives
in one row, so it is never split between micro-batches or devices. A pair that does not fit is
refused (never cut: a cut completion would be compared unfairly), with the seq_len that fits every
pair. `data.corpus=builtin_preferences` is a small set made from the built-in chat set
(`builtin_pairs`), for the recipe and the tests.

Batches carry `ref_logps` [B, T] when the reference's log-probs are precomputed
(`jaxlm.objectives.dpo`): each sequence's summed reference log-prob at its first position (0
elsewhere), so that they shard and split as the tokens do.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxlm import lazy
from jaxlm.data import sft, sources
from jaxlm.errors import UserError

grain = lazy.module("grain")  # (imported by the first run that reads preference pairs)
pipeline = lazy.module("jaxlm.data.pipeline")

BUILTIN = "builtin_preferences"  # data.corpus: pairs made from the built-in chat set (`builtin_pairs`)
SHAPE = ('each row must be {"prompt": str or a list of {"role", "content"} messages, "chosen": str, '
         '"rejected": str} (a chosen or rejected conversation: a list of one assistant message)')


@dataclasses.dataclass(frozen=True)
class Pair:
    """One checked row: `where` it came from ('file:line'), the prompt (text, or messages) and the two
    completions' text."""

    where: str
    prompt: str | tuple[tuple[str, str], ...]
    chosen: str
    rejected: str

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)

    @property
    def key(self) -> str:
        """What the validation split hashes (`sources.is_validation`): the content, not its place."""
        return json.dumps([self.prompt, self.chosen, self.rejected], ensure_ascii=False)


def _completion(row: dict, field: str, where: str) -> str:
    value = row[field]
    if isinstance(value, list):  # a conversational completion: one assistant message
        if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant" or \
                not isinstance(value[0].get("content"), str):
            raise UserError(f"{where}: {field!r} must be a string or a list of one assistant message; {SHAPE}")
        value = value[0]["content"]
    if not isinstance(value, str):
        raise UserError(f"{where}: {field!r} is a {type(value).__name__}, not a string; {SHAPE}")
    if not value.strip():
        raise UserError(f"{where}: the {field} completion is empty: nothing to compare; give it text or drop the row")
    return value


def check_pair(row: Any, where: str) -> Pair:
    """The pair of one row, or one `UserError` line naming `where` and what to change."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: a JSON {type(row).__name__}, not an object; {SHAPE}")
    for field in ("prompt", "chosen", "rejected"):
        if field not in row:
            raise UserError(f"{where}: no field {field!r} (found: {', '.join(sorted(row)) or 'none'}); {SHAPE}")
    chosen, rejected = _completion(row, "chosen", where), _completion(row, "rejected", where)
    prompt = row["prompt"]
    if isinstance(prompt, list):
        messages = sft._check_messages({"messages": [*prompt, {"role": "assistant", "content": chosen}]}, where)
        return Pair(where, tuple((m["role"], m["content"]) for m in messages[:-1]), chosen, rejected)
    if not isinstance(prompt, str):
        raise UserError(f"{where}: 'prompt' is a {type(prompt).__name__}, not a string or a list of messages; {SHAPE}")
    return Pair(where, prompt, chosen, rejected)


def builtin_pairs() -> Iterator[Pair]:
    """The built-in set: each conversation of the built-in chat set (`jaxlm.data.builtin_chat`) whose
    answer is not a palindrome, its last answer chosen over the same answer written backwards (a
    preference a small model learns in a few steps; the words are all in the chat set's vocabulary)."""
    for where, row in sources.read_file_records(sources.BUILTIN_CHAT_FILE):
        messages = row["messages"]
        answer = messages[-1]["content"]
        if answer[::-1] != answer:
            yield check_pair({"prompt": messages[:-1], "chosen": answer, "rejected": answer[::-1]}, where)


def iter_pairs(corpus: str) -> Iterator[Pair]:
    """Every pair of `data.corpus` (JSONL files, or `builtin_preferences`), in order, checked."""
    if corpus == BUILTIN:
        yield from builtin_pairs()
        return
    spec = sources.SourceSpec(corpus, "auto", "text", "")
    for path in sources.resolve_files(spec):
        for where, row in sources.read_file_records(path):
            yield check_pair(row, where)


class PairEncoder:
    """Pair -> the (ids, weights) of its chosen and rejected sequences (`sft.Encoder`'s encodings)."""

    def __init__(self, plain: sft.Encoder, chat: sft.Encoder | None):
        self.plain, self.chat = plain, chat

    @classmethod
    def make(cls, chat_template: str, tok, chat: bool) -> PairEncoder:
        template = sft.Encoder.make(sft.Spec("chat", chat_template), tok) if chat else None
        return cls(sft.Encoder("prompt_completion"), template)

    def sequence(self, tok, pair: Pair, completion: str) -> tuple[np.ndarray, np.ndarray]:
        if not pair.chat:
            return self.plain(tok, sft.Example(pair.where, {"prompt": pair.prompt, "completion": completion}))
        messages = [{"role": r, "content": c} for r, c in pair.prompt] + [{"role": "assistant", "content": completion}]
        ids, weights = self.chat(tok, sft.Example(pair.where, {"messages": messages}))
        return ids, last_span(weights)

    def __call__(self, tok, pair: Pair) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (*self.sequence(tok, pair, pair.chosen), *self.sequence(tok, pair, pair.rejected))


def last_span(weights: np.ndarray) -> np.ndarray:
    """`weights` with only its last run of ones kept: the final assistant turn of a conversation (the
    earlier ones are the prompt)."""
    ones = np.flatnonzero(weights)
    if not len(ones):
        return weights
    end = ones[-1]
    start = end
    while start > 0 and weights[start - 1]:
        start -= 1
    out = np.zeros_like(weights)
    out[start : end + 1] = 1
    return out


def pair_row(ids_c: np.ndarray, w_c: np.ndarray, ids_r: np.ndarray, w_r: np.ndarray, seq_len: int,
             ref: tuple[float, float] | None = None) -> dict[str, np.ndarray]:
    """One batch row of a pair (see the module's docstring); `ref`: the reference's summed log-probs of
    the chosen and the rejected sequence, carried at each one's first position as `ref_logps`."""
    n_c, n_r = len(ids_c) - 1, len(ids_r) - 1
    pad = seq_len - n_c - n_r

    def row(*parts, dtype):
        return np.concatenate([*parts, np.zeros(pad, dtype)]).astype(dtype)

    out = {
        "inputs": row(ids_c[:-1], ids_r[:-1], dtype=np.int32),
        "targets": row(ids_c[1:], ids_r[1:], dtype=np.int32),
        "segment_ids": row(np.full(n_c, 1), np.full(n_r, 2), dtype=np.int32),
        "positions": row(np.arange(n_c), np.arange(n_r), dtype=np.int32),
        "weights": row(w_c[1:], w_r[1:], dtype=np.float32),
    }
    if ref is not None:
        r = np.zeros(seq_len, np.float32)
        r[0], r[n_c] = ref
        out["ref_logps"] = r
    return out


def empty_row(seq_len: int, with_ref: bool) -> dict[str, np.ndarray]:
    """A row with no pair (segment 0 throughout): the padding of a short last evaluation batch."""
    out = {k: np.zeros(seq_len, np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    out["weights"] = np.zeros(seq_len, np.float32)
    if with_ref:
        out["ref_logps"] = np.zeros(seq_len, np.float32)
    return out


class PairRows(Sequence):
    """Encoded pairs as batch rows, a grain data source. `ref` ([pairs, 2] float32, set once the
    reference model has scored them: `jaxlm.objectives.dpo`) adds `ref_logps` to every row."""

    def __init__(self, encoded: list[tuple[np.ndarray, ...]], seq_len: int):
        self.encoded, self.seq_len = encoded, seq_len
        self.ref: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:  # type: ignore[override]
        ref = None if self.ref is None else tuple(self.ref[index])
        return pair_row(*self.encoded[index], self.seq_len, ref)

    @property
    def tokens(self) -> int:
        return sum(len(e[0]) + len(e[2]) - 2 for e in self.encoded)

    @property
    def trained(self) -> int:
        return sum(int(e[1][1:].sum() + e[3][1:].sum()) for e in self.encoded)

    def sha256(self) -> str:
        """The identity of the rows (every id and weight): a key of the reference's log-probs."""
        h = hashlib.sha256(str(self.seq_len).encode())
        for parts in self.encoded:
            for a in parts:
                h.update(len(a).to_bytes(8, "little") + np.ascontiguousarray(a).tobytes())
        return h.hexdigest()


def encode_pairs(pairs: Sequence[Pair], tok, chat_template: str, seq_len: int) -> PairRows:
    """The pairs as rows; one `UserError` line when a pair does not fit in seq_len (with the length
    every pair fits in) or a completion has no token to score."""
    if not pairs:
        return PairRows([], seq_len)
    encoders: dict[bool, PairEncoder] = {}
    encoded, long, need = [], [], 0
    for pair in pairs:
        if pair.chat not in encoders:
            encoders[pair.chat] = PairEncoder.make(chat_template, tok, pair.chat)
        ids_c, w_c, ids_r, w_r = encoders[pair.chat](tok, pair)
        for name, w in (("chosen", w_c), ("rejected", w_r)):
            if not w[1:].any():
                raise UserError(f"{pair.where}: the {name} completion has no token to score; give it text")
        targets = len(ids_c) + len(ids_r) - 2
        need = max(need, targets)
        if targets > seq_len:
            long.append((pair.where, len(ids_c) - 1, len(ids_r) - 1))
        encoded.append((ids_c, w_c, ids_r, w_r))
    if long:
        where, c, r = long[0]
        raise UserError(
            f"{where}: the pair needs {c + r} tokens in a row (chosen {c} + rejected {r}), more than "
            f"data.seq_len={seq_len}, and {len(long)} of {len(pairs)} pairs are that long; a pair is never cut: "
            f"raise data.seq_len to {need} (every pair fits), or shorten or drop the long pairs")
    return PairRows(encoded, seq_len)


def _with_epoch(size: int, index: int, row: dict) -> dict:
    return {**row, "epoch": np.array(index // size, np.int32)}


def make_train_dataset(rows: PairRows, *, batch_size: int, seed: int, shard_index: int = 0,
                       shard_count: int = 1) -> grain.IterDataset:
    """Shuffled batches of pair rows, repeated; iterators are `pipeline.TrainIterator`s (epoch, tokens
    seen, exact resume). Rows are built in this process: the reference's log-probs are set on `rows`
    after the stream is made, before it is read."""
    if not len(rows):
        raise UserError("no training pairs: every pair fell in the validation split; lower data.val_fraction")
    ds = grain.MapDataset.source(rows).seed(seed).shuffle().repeat(None)
    ds = ds.map_with_index(functools.partial(_with_epoch, len(rows)))[shard_index::shard_count]
    ds = ds.to_iter_dataset(pipeline.READ_OPTIONS).batch(batch_size, drop_remainder=True)
    return pipeline._TrainDataset(ds)


def eval_batches(rows: PairRows, batch_size: int, max_batches: int) -> list[dict[str, np.ndarray]]:
    """The first `max_batches` batches of the held-out pairs in order, the last filled with empty rows."""
    batches = []
    for start in range(0, min(len(rows), batch_size * max_batches), batch_size):
        part = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
        part += [empty_row(rows.seq_len, rows.ref is not None)] * (batch_size - len(part))
        batches.append({k: np.stack([r[k] for r in part]) for k in part[0]})
    return batches
