"""The grain input pipeline: tokenized documents -> shuffled chunks -> packed rows -> batches.

Every batch is a dict of numpy arrays of shape [batch_size, seq_len]:
  inputs       int32 token ids (0 on padding)
  targets      int32, the next token of each input (0 on padding)
  segment_ids  int32, 1, 2, ... for the documents packed in a row, 0 on padding
  positions    int32, position within the document's chunk, restarting at 0 for each segment
  weights      float32, each target's weight in the loss: 1 for text, 0 on padding; for weighted
               documents (SFT examples) the weight of the target token itself, 0 on padding
A model masks attention across segments; the loss is the weighted mean over targets. The weights
are added last (`add_loss_weights`), outside the stages whose state a checkpoint holds.

Documents come as a list of token arrays or as `FlatDocuments` (memory-mapped prepared shards from
`jaxlm.data.prepare.open_prepared`); the two give the same batches. `FlatDocuments` may also hold a
0/1 weight per token (`jaxlm.data.sft`: 1 on the assistant's tokens): such a document is one
example, trained on as one chunk (its first seq_len + 1 tokens; the rest is cut), and target t of a
chunk weighs what its token, t + 1 of the chunk, weighs. A training iterator (`TrainIterator`) also
says how far it has read: the epoch and the real tokens seen.
"""

import functools
from collections.abc import Sequence

import grain
import numpy as np
from absl import flags

from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError

# Chunks are read in the consuming thread: each is a slice of an in-memory or memory-mapped array, and
# grain's default (16 threads, 500 elements read ahead) spent more time handing elements between
# threads than reading them: 3.5 -> 1.2 ms per 16 x 128 batch, 7.8 -> 1.9 ms per 16 x 2048
# (benchmarks/BENCHMARKS.md, data throughput). Iterator states are the same ({'next_index'}), so
# checkpoints resume across the change. Worker processes (`data.num_workers`) read ahead instead.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

Batch = dict[str, np.ndarray]


def tokenize_documents(tok: Tokenizer, docs: Sequence[str]) -> list[np.ndarray]:
    """Each document as int32 ids: BOS, the text, EOS."""
    return [np.asarray(ids, dtype=np.int32) for ids in tok.encode(docs, add_bos=True, add_eos=True)]


class FlatDocuments(Sequence[np.ndarray]):
    """Tokenized documents stored flat, in shards of tokens [N] plus document offsets [D + 1], and
    optionally a weight per token [N] (uint8 0/1: SFT examples, see the module's docstring).

    A document is a view into its shard, so memory-mapped (prepared) shards are read only where
    used and never copied. Memory maps pickle as their file, offset and shape, so grain workers
    map the files again instead of receiving a copy of the corpus.
    """

    def __init__(self, shards: Sequence[tuple[np.ndarray, ...]]):
        """`shards`: (tokens, offsets) each, or (tokens, offsets, weights) each for weighted documents."""
        self.shards = [tuple(shard) for shard in shards]
        if len({len(shard) for shard in self.shards}) > 1:
            raise ValueError("either every shard of FlatDocuments has weights or none has")
        self.has_weights = bool(self.shards) and len(self.shards[0]) == 3
        self._first_doc = np.cumsum([0] + [len(shard[1]) - 1 for shard in self.shards])

    @classmethod
    def from_arrays(
        cls, doc_tokens: Sequence[np.ndarray], doc_weights: Sequence[np.ndarray] | None = None
    ) -> "FlatDocuments":
        """One in-memory int32 shard holding `doc_tokens` back to back (and their uint8 weights)."""
        tokens = np.concatenate(doc_tokens).astype(np.int32) if len(doc_tokens) else np.zeros(0, np.int32)
        shard: tuple[np.ndarray, ...] = (tokens, np.cumsum([0] + [len(d) for d in doc_tokens], dtype=np.int64))
        if doc_weights is not None:
            if [len(w) for w in doc_weights] != [len(d) for d in doc_tokens]:
                raise ValueError("each document needs one weight per token")
            weights = np.concatenate(doc_weights).astype(np.uint8) if len(doc_weights) else np.zeros(0, np.uint8)
            shard += (weights,)
        return cls([shard])

    def __len__(self) -> int:
        return int(self._first_doc[-1])

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        shard, doc = self._locate(index)
        tokens, offsets = self.shards[shard][:2]
        return tokens[offsets[doc] : offsets[doc + 1]]

    def weights(self, index: int) -> np.ndarray:
        """The weight of each token of document `index` (weighted documents only)."""
        if not self.has_weights:
            raise ValueError("these documents have no weights")
        shard, doc = self._locate(index)
        _, offsets, weights = self.shards[shard]
        return weights[offsets[doc] : offsets[doc + 1]]

    def _locate(self, index: int) -> tuple[int, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        index %= len(self)
        shard = int(np.searchsorted(self._first_doc, index, side="right")) - 1
        return shard, int(index - self._first_doc[shard])

    @property
    def num_tokens(self) -> int:
        return int(sum(int(shard[1][-1]) for shard in self.shards))

    def __getstate__(self) -> dict:
        return {"shards": [tuple(map(_picklable_array, shard)) for shard in self.shards]}

    def __setstate__(self, state: dict) -> None:
        self.__init__([tuple(map(_unpickled_array, shard)) for shard in state["shards"]])


def _picklable_array(array: np.ndarray) -> np.ndarray | tuple:
    if isinstance(array, np.memmap) and array.filename:
        return ("memmap", array.filename, array.dtype.str, array.offset, array.shape)
    return array


def _unpickled_array(value: np.ndarray | tuple) -> np.ndarray:
    if isinstance(value, tuple):
        _, filename, dtype, offset, shape = value
        return np.memmap(filename, np.dtype(dtype), mode="r", offset=offset, shape=shape)
    return value


class _Chunks:
    """Random access to (inputs, targets) pairs of document chunks: a grain data source.

    A document of n tokens yields chunks of at most seq_len + 1 tokens starting every seq_len
    tokens, so consecutive chunks share one token and each of the n - 1 next-token pairs of the
    document appears in exactly one chunk. Weighted documents (SFT examples) yield their first
    chunk only, with the `weights` of its targets: a continuation would train on an answer without
    its prompt. The chunk table is rebuilt rather than pickled, so grain workers receive only the
    documents (and those as file references when memory-mapped).
    """

    def __init__(self, docs: Sequence[np.ndarray], seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self._docs = docs if isinstance(docs, FlatDocuments) else FlatDocuments.from_arrays(docs)
        self._seq_len = seq_len
        shard_of_chunk, starts, ends = [], [], []
        for shard, (_, offsets, *_) in enumerate(self._docs.shards):
            offsets = np.asarray(offsets, dtype=np.int64)
            lengths = np.diff(offsets)
            num_chunks = np.maximum(lengths - 2, -1) // seq_len + 1  # ceil((n - 1) / seq_len); 0 when n < 2
            if self._docs.has_weights:
                num_chunks = np.minimum(num_chunks, 1)  # an example is truncated to its first chunk
            doc_of_chunk = np.repeat(np.arange(len(lengths)), num_chunks)
            first_chunk_of_doc = np.cumsum(num_chunks) - num_chunks
            offsets_in_doc = (np.arange(len(doc_of_chunk)) - first_chunk_of_doc[doc_of_chunk]) * seq_len
            shard_of_chunk.append(np.full(len(doc_of_chunk), shard, np.int32))
            starts.append(offsets[doc_of_chunk] + offsets_in_doc)
            ends.append(offsets[doc_of_chunk] + np.minimum(offsets_in_doc + seq_len + 1, lengths[doc_of_chunk]))
        self._shard_of_chunk = np.concatenate(shard_of_chunk) if shard_of_chunk else np.zeros(0, np.int32)
        self._starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self._ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def has_weights(self) -> bool:
        return self._docs.has_weights

    def __getitem__(self, index: int) -> Batch:
        shard = self._docs.shards[self._shard_of_chunk[index]]
        start, end = self._starts[index], self._ends[index]
        chunk = shard[0][start:end].astype(np.int32, copy=False)
        if len(shard) == 3:  # target t is token t + 1 of the chunk: it weighs what that token weighs
            return {"inputs": chunk[:-1], "targets": chunk[1:], "weights": shard[2][start + 1 : end].astype(np.float32)}
        return {"inputs": chunk[:-1], "targets": chunk[1:]}

    def __getstate__(self) -> tuple[FlatDocuments, int]:
        return self._docs, self._seq_len

    def __setstate__(self, state: tuple[FlatDocuments, int]) -> None:
        self.__init__(*state)


def _pack_and_batch(
    ds: grain.IterDataset, seq_len: int, batch_size: int, drop_remainder: bool, with_epoch: bool = False,
    with_weights: bool = False,
) -> grain.IterDataset:
    """Pack chunks first-fit into rows of seq_len, then stack rows into batches.

    The optional `epoch` feature holds one entry per chunk; a row holds at most seq_len chunks
    (each has an input token), so it never changes how chunks are packed. `weights` (of weighted
    documents) are packed like the targets, zero on padding.
    """
    features = ("inputs", "targets") + (("weights",) if with_weights else ()) + (("epoch",) if with_epoch else ())
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={k: seq_len for k in features}, num_packing_bins=batch_size, shuffle_bins=False
    )
    return ds.map(_to_batch_row).batch(batch_size, drop_remainder=drop_remainder)


def _to_batch_row(packed: Batch) -> Batch:
    # inputs and targets are packed identically (same lengths), so their segment ids and positions agree.
    row = {
        "inputs": packed["inputs"],
        "targets": packed["targets"],
        "segment_ids": packed["inputs_segment_ids"],
        "positions": packed["inputs_positions"],
    }
    if "weights" in packed:
        row["weights"] = packed["weights"]
    if "epoch" in packed:
        row["epoch"] = packed["epoch"].max()  # the latest pass over the data this row draws from
    return row


def add_loss_weights(batch: Batch) -> Batch:
    """The batch with its loss weights: packing padding (segment 0) weighs 0, every real target 1,
    or, for weighted documents, its own weight. Always last in the batch's keys."""
    real = (batch["segment_ids"] > 0).astype(np.float32)
    weights = real * batch["weights"] if "weights" in batch else real
    return {**{k: v for k, v in batch.items() if k != "weights"}, "weights": weights}


def _with_epoch(num_chunks: int, index: int, chunk: Batch) -> Batch:
    """Tag a chunk of the repeated, shuffled stream with its pass over the data."""
    return {**chunk, "epoch": np.array([index // num_chunks], np.int32)}


def _with_text_epoch(num_docs: int, index: int, text: str) -> tuple[int, str]:
    return index // num_docs, text


class TrainIterator(grain.DatasetIterator):
    """Model batches (the five keys) plus how far this process has read, for logging and stopping.

    After each `next()`, `epoch` is the latest 0-based pass over the data that a batch has drawn
    from, and `tokens_seen` counts this process's real (non-padding) target tokens so far; both are
    part of `get_state()`, so they resume exactly with the stream.
    """

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)
        self.epoch = 0
        self.tokens_seen = 0

    def __next__(self) -> Batch:
        batch = next(self._parent)
        self.epoch = max(self.epoch, int(batch.pop("epoch").max()))  # grain workers may straddle a boundary
        self.tokens_seen += int(np.count_nonzero(batch["segment_ids"]))
        return add_loss_weights(batch)

    def get_state(self) -> dict:
        return {"parent": self._parent.get_state(), "epoch": self.epoch, "tokens_seen": self.tokens_seen}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self.epoch, self.tokens_seen = int(state["epoch"]), int(state["tokens_seen"])


class _TrainDataset(grain.IterDataset):
    """The batch stream whose iterators are `TrainIterator`s (the epoch key is popped in this process)."""

    def __iter__(self) -> TrainIterator:
        return TrainIterator(self._parent.__iter__())


def make_train_dataset(
    doc_tokens: Sequence[np.ndarray],
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_workers: int = 0,
    num_epochs: int | None = None,
) -> grain.IterDataset:
    """Shuffled, packed training batches for one process: its slice of the global stream.

    `doc_tokens` is a list of token arrays or a `FlatDocuments` (e.g. memory-mapped prepared
    shards). `iter()` of the result is a `TrainIterator`: exact resumption with `get_state()` /
    `set_state()`, plus `epoch` and `tokens_seen`. The stream depends on `num_workers` (each worker
    packs its own slice), so a saved state only resumes with the same `num_workers`; close an
    iterator with workers after use.
    """
    chunks, has_weights = _chunk_stream(doc_tokens, seq_len, seed, shard_index, shard_count, num_epochs)
    return _packed_stream(chunks, seq_len, batch_size, num_workers, has_weights)


def _chunk_stream(doc_tokens: Sequence[np.ndarray], seq_len: int, seed: int, shard_index: int, shard_count: int,
                  num_epochs: int | None) -> tuple[grain.IterDataset, bool]:
    """(the shuffled, repeated, epoch-tagged chunks of this slice of the documents, whether they carry weights)."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
    chunks = _Chunks(doc_tokens, seq_len)
    if len(chunks) == 0:
        raise UserError("no training examples: every document has fewer than 2 tokens; give more text")
    ds = grain.MapDataset.source(chunks).seed(seed).shuffle().repeat(num_epochs)
    ds = ds.map_with_index(functools.partial(_with_epoch, len(chunks)))[shard_index::shard_count]
    return ds.to_iter_dataset(READ_OPTIONS), chunks.has_weights


class _TokenizeAndChunk(grain.experimental.FlatMapTransform):
    """One raw document -> its chunks, cut exactly as `_Chunks` cuts a tokenized document."""

    max_fan_out = 1  # grain's MapDataset flat map needs it; the IterDataset flat map used here does not

    def __init__(self, tok: Tokenizer, seq_len: int):
        self.tok, self.seq_len = tok, seq_len

    def flat_map(self, element: tuple[int, str]) -> list[Batch]:
        epoch, text = element
        ids = np.asarray(self.tok.encode([text], num_threads=1)[0], np.int32)  # BOS, text, EOS
        tag = np.array([epoch], np.int32)
        chunks = (ids[start : start + self.seq_len + 1] for start in range(0, len(ids) - 1, self.seq_len))
        return [{"inputs": chunk[:-1], "targets": chunk[1:], "epoch": tag} for chunk in chunks]


def make_text_train_dataset(
    texts: Sequence[str],
    tok: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_workers: int = 0,
    num_epochs: int | None = None,
) -> grain.IterDataset:
    """Like `make_train_dataset`, but from raw texts tokenized on the fly (in the worker processes
    when `num_workers > 0`), with no prepare step: for corpora that fit in host memory and for
    tokenizer ablations.

    Documents (not chunks) are shuffled; each is tokenized and cut into the same chunks a prepared
    corpus gives, in order, then packed. Resumption is exact: a restored iterator tokenizes the
    current document again and continues at its next chunk.
    """
    chunks = _text_chunk_stream(texts, tok, seq_len, seed, shard_index, shard_count, num_epochs)
    return _packed_stream(chunks, seq_len, batch_size, num_workers)


def _text_chunk_stream(texts: Sequence[str], tok: Tokenizer, seq_len: int, seed: int, shard_index: int,
                       shard_count: int, num_epochs: int | None) -> grain.IterDataset:
    """The epoch-tagged chunks of this slice of the shuffled, repeated texts, tokenized as they are read."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
    if not len(texts):
        raise UserError("no training documents: the corpus is empty; give non-empty text")
    ds = grain.MapDataset.source(list(texts)).seed(seed).shuffle().repeat(num_epochs)
    ds = ds.map_with_index(functools.partial(_with_text_epoch, len(texts)))[shard_index::shard_count]
    return grain.experimental.FlatMapIterDataset(ds.to_iter_dataset(READ_OPTIONS), _TokenizeAndChunk(tok, seq_len))


def make_row_stream(
    docs: Sequence[np.ndarray] | Sequence[str],
    *,
    seq_len: int,
    bins: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_workers: int = 0,
    tok: Tokenizer | None = None,
) -> grain.IterDataset:
    """One source of a data mixture (`jaxlm.data.mixture`): its packed rows one at a time, each with the
    five row keys but `weights` (`_to_batch_row`) and its `epoch`. The documents are token arrays (or
    `FlatDocuments`), or raw texts tokenized on the fly with `tok`; shuffled, repeated, sliced and cut
    into chunks as a single corpus's (`make_train_dataset`, `make_text_train_dataset`), packed first-fit
    into `bins` rows at a time, read ahead by `num_workers` processes. Exact resumption through grain's
    iterator state."""
    if tok is not None:
        chunks = _text_chunk_stream(docs, tok, seq_len, seed, shard_index, shard_count, None)
    else:
        chunks, has_weights = _chunk_stream(docs, seq_len, seed, shard_index, shard_count, None)
        if has_weights:
            raise ValueError("a mixture's sources are text: weighted (SFT) documents are not mixed")
    features = ("inputs", "targets", "epoch")
    ds = grain.experimental.FirstFitPackIterDataset(
        chunks, length_struct={k: seq_len for k in features}, num_packing_bins=bins, shuffle_bins=False
    ).map(_to_batch_row)
    return _prefetched(ds, num_workers)


def _packed_stream(chunks: grain.IterDataset, seq_len: int, batch_size: int, num_workers: int,
                   with_weights: bool = False) -> grain.IterDataset:
    """Epoch-tagged chunks -> packed batches, prefetched by `num_workers` processes -> `TrainIterator`s."""
    ds = _pack_and_batch(chunks, seq_len, batch_size, drop_remainder=True, with_epoch=True, with_weights=with_weights)
    return _TrainDataset(_prefetched(ds, num_workers))


def _prefetched(ds: grain.IterDataset, num_workers: int) -> grain.IterDataset:
    """`ds` read ahead by `num_workers` processes (0: read in this one)."""
    if num_workers > 0:
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags, which raise when unparsed
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return ds


def make_eval_batches(
    doc_tokens: Sequence[np.ndarray], *, seq_len: int, batch_size: int, max_batches: int
) -> list[Batch]:
    """The first `max_batches` packed batches of the documents in order, no shuffling.

    A short last batch is filled with all-padding rows (segment 0, weight 0), so every batch has
    the same shape and no evaluation token is dropped.
    """
    chunks = _Chunks(doc_tokens, seq_len)
    ds = _pack_and_batch(grain.MapDataset.source(chunks).to_iter_dataset(READ_OPTIONS), seq_len, batch_size,
                         drop_remainder=False, with_weights=chunks.has_weights)
    batches = []
    for batch in ds:
        if len(batches) == max_batches:
            break
        short = batch_size - len(batch["inputs"])
        batches.append(add_loss_weights({k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}))
    return batches
