"""The grain input pipeline: tokenized documents -> shuffled chunks -> packed rows -> batches.

Every batch is a dict of int32 numpy arrays of shape [batch_size, seq_len]:
  inputs       token ids
  targets      the next token of each input (0 on padding)
  segment_ids  1, 2, ... for the documents packed in a row, 0 on padding
  positions    position within the document's chunk, restarting at 0 for each segment
A model masks attention across segments and the loss on segment 0.
"""

import hashlib
import io
import os
from collections.abc import Sequence

import grain
import numpy as np
from absl import flags

from jaxlm.data.sources import corpus_fingerprint
from jaxlm.data.tokenizer import Tokenizer, write_bytes_atomically
from jaxlm.errors import UserError

Batch = dict[str, np.ndarray]

# Bump when tokenization or the cache layout changes, so cached token files are rebuilt.
_FORMAT_VERSION = 1


def tokenize_documents(tok: Tokenizer, docs: Sequence[str]) -> list[np.ndarray]:
    """Each document as int32 ids: BOS, the text, EOS."""
    return [np.asarray(ids, dtype=np.int32) for ids in tok.encode(docs, add_bos=True, add_eos=True)]


def get_or_tokenize(cache_dir: str | os.PathLike, tok: Tokenizer, docs: Sequence[str], key: str) -> list[np.ndarray]:
    """`tokenize_documents`, cached as one flat token array plus document offsets.

    `key` names the split (e.g. "train"); the file names also carry the tokenizer's and the
    corpus's hashes, so a changed tokenizer or corpus never reads stale tokens.
    """
    identity = hashlib.sha256(f"v{_FORMAT_VERSION}|{tok.sha256}|{corpus_fingerprint(docs)}".encode()).hexdigest()[:16]
    stem = os.path.join(cache_dir, f"tokens-{key}-{identity}")
    tokens_path, offsets_path = f"{stem}.tokens.npy", f"{stem}.offsets.npy"
    if os.path.exists(offsets_path) and os.path.exists(tokens_path):
        tokens, offsets = np.load(tokens_path), np.load(offsets_path)
    else:
        doc_tokens = tokenize_documents(tok, docs)
        tokens = np.concatenate(doc_tokens) if doc_tokens else np.zeros(0, np.int32)
        offsets = np.cumsum([0] + [len(d) for d in doc_tokens], dtype=np.int64)
        # Offsets are written last: their presence means the tokens file is complete.
        _save_npy_atomically(tokens_path, tokens)
        _save_npy_atomically(offsets_path, offsets)
    return [tokens[start:end] for start, end in zip(offsets[:-1], offsets[1:])]


def _save_npy_atomically(path: str, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    write_bytes_atomically(path, buffer.getvalue())


class _Chunks:
    """Random access to (inputs, targets) pairs of document chunks: a grain data source.

    A document of n tokens yields chunks of at most seq_len + 1 tokens starting every seq_len
    tokens, so consecutive chunks share one token and each of the n - 1 next-token pairs of the
    document appears in exactly one chunk. Documents are stored flat so that the source pickles
    cheaply into mp_prefetch workers.
    """

    def __init__(self, doc_tokens: Sequence[np.ndarray], seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        lengths = np.array([len(d) for d in doc_tokens], dtype=np.int64)
        doc_starts = np.cumsum(lengths) - lengths
        num_chunks = np.maximum(lengths - 2, -1) // seq_len + 1  # ceil((n - 1) / seq_len); 0 when n < 2
        doc_of_chunk = np.repeat(np.arange(len(lengths)), num_chunks)
        first_chunk_of_doc = np.cumsum(num_chunks) - num_chunks
        offsets_in_doc = (np.arange(len(doc_of_chunk)) - first_chunk_of_doc[doc_of_chunk]) * seq_len
        self._starts = doc_starts[doc_of_chunk] + offsets_in_doc
        self._ends = doc_starts[doc_of_chunk] + np.minimum(offsets_in_doc + seq_len + 1, lengths[doc_of_chunk])
        self._tokens = np.concatenate(doc_tokens).astype(np.int32) if len(doc_tokens) else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> Batch:
        chunk = self._tokens[self._starts[index] : self._ends[index]]
        return {"inputs": chunk[:-1], "targets": chunk[1:]}


def _pack_and_batch(ds: grain.IterDataset, seq_len: int, batch_size: int, drop_remainder: bool) -> grain.IterDataset:
    """Pack chunks first-fit into rows of seq_len, then stack rows into batches."""
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=batch_size, shuffle_bins=False
    )
    return ds.map(_to_batch_row).batch(batch_size, drop_remainder=drop_remainder)


def _to_batch_row(packed: Batch) -> Batch:
    # inputs and targets are packed identically (same lengths), so their segment ids and positions agree.
    return {
        "inputs": packed["inputs"],
        "targets": packed["targets"],
        "segment_ids": packed["inputs_segment_ids"],
        "positions": packed["inputs_positions"],
    }


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

    `iter()` of the result supports `get_state()`/`set_state()` for exact resumption. The
    stream depends on `num_workers` (each worker packs its own slice), so a saved iterator
    state only resumes with the same `num_workers`; close an iterator with workers after use.
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
    chunks = _Chunks(doc_tokens, seq_len)
    if len(chunks) == 0:
        raise UserError("no training examples: every document has fewer than 2 tokens; give more text")
    ds = grain.MapDataset.source(chunks).seed(seed).shuffle().repeat(num_epochs)[shard_index::shard_count]
    ds = _pack_and_batch(ds.to_iter_dataset(), seq_len, batch_size, drop_remainder=True)
    if num_workers > 0:
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags, which raise when unparsed
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return ds


def make_eval_batches(
    doc_tokens: Sequence[np.ndarray], *, seq_len: int, batch_size: int, max_batches: int
) -> list[Batch]:
    """The first `max_batches` packed batches of the documents in order, no shuffling.

    A short last batch is filled with all-padding rows (segment 0), so every batch has the same
    shape and no evaluation token is dropped.
    """
    chunks = _Chunks(doc_tokens, seq_len)
    ds = _pack_and_batch(grain.MapDataset.source(chunks).to_iter_dataset(), seq_len, batch_size, drop_remainder=False)
    batches = []
    for batch in ds:
        if len(batches) == max_batches:
            break
        short = batch_size - len(batch["inputs"])
        batches.append({k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()})
    return batches
