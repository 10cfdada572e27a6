"""The config's data section -> a ready training stream and held-out batches.

The corpus is read, its tokenizer trained (or loaded) and the corpus tokenized into prepared
shards on first use; both are cached in `data.cache_dir` keyed by their inputs, so the next run
starts at once. Then the grain pipeline packs, shuffles and shards them for this process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from typing import Any

import jax
import ml_collections
import numpy as np

from jaxlm.console import console
from jaxlm.data import pipeline, prepare, sources, tokenizer
from jaxlm.errors import UserError


@dataclasses.dataclass
class Data:
    train: pipeline.TrainIterator  # this process's rows of each global batch; knows its epoch
    eval_batches: list[dict[str, np.ndarray]]
    tokenizer: Any
    train_tokens: int | None  # None when tokenized on the fly (unknown until read)
    train_documents: int | None = None

    @property
    def eval_target_bytes(self) -> int:
        """UTF-8 bytes that the held-out batches' target tokens stand for, over all processes."""
        lengths = self.tokenizer.byte_lengths()
        local = sum(int(lengths[b["targets"]][b["segment_ids"] > 0].sum()) for b in self.eval_batches)
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return int(np.sum(multihost_utils.process_allgather(np.array([local], np.int64))))


def source_spec(cfg: ml_collections.ConfigDict) -> sources.SourceSpec:
    d = cfg.data
    return sources.SourceSpec(d.corpus, d.format, d.text_field, d.separator, max_bytes=d.builtin_max_bytes)


def inputs_key(cfg: ml_collections.ConfigDict) -> str:
    """A cheap identity of the corpus (its files' sizes and times, or the interpreter for the built-in
    one) and of how it is read: the cache key of its tokenizer and prepared shards."""
    spec = source_spec(cfg)
    if spec.paths == "builtin":
        files = [sys.version, sysconfig.get_paths()["stdlib"]]
    else:
        files = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in sources.resolve_files(spec)]
    identity = {"spec": dataclasses.asdict(spec), "files": files, "val_fraction": cfg.data.val_fraction,
                "seed": cfg.data.seed}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_tokenizer(cfg: ml_collections.ConfigDict, key: str) -> tokenizer.Tokenizer:
    """The configured .model file, or one trained on the corpus's training documents (cached)."""
    d = cfg.data
    if d.tokenizer_path:
        return tokenizer.Tokenizer.load(d.tokenizer_path)
    path = pathlib.Path(d.cache_dir) / f"tokenizer-{key}-{d.tokenizer_type}-{d.tokenizer_vocab_size}.model"
    if path.exists():
        return tokenizer.Tokenizer.load(path)
    console(f"jaxlm: training a {d.tokenizer_type} tokenizer ({d.tokenizer_vocab_size} tokens) on {d.corpus}")
    docs, total = [], 0
    for doc in sources.iter_documents(source_spec(cfg)):
        if not sources.is_validation(doc, d.val_fraction, d.seed):
            docs.append(doc)
            total += len(doc.encode("utf-8"))
            if total >= d.tokenizer_train_bytes:
                break
    if not docs:
        raise UserError(f"the corpus {d.corpus!r} holds no training documents; give non-empty text")
    tok = tokenizer.Tokenizer.train(docs, d.tokenizer_vocab_size, d.tokenizer_type)
    tok.save(path)
    return tok


def prepared_dir(cfg: ml_collections.ConfigDict) -> pathlib.Path:
    """The corpus as prepared shards: a prepared directory given as the corpus, or the cached one
    for these inputs and tokenizer, built on first use (resumably) with every core."""
    d = cfg.data
    given = pathlib.Path(d.corpus)
    if (given / prepare.MANIFEST).is_file():
        return given
    key = inputs_key(cfg)
    tok = load_tokenizer(cfg, key)
    out = pathlib.Path(d.cache_dir) / f"prepared-{key}-{tok.sha256[:16]}"
    if not ((out / prepare.MANIFEST).is_file() and prepare.read_manifest(out)["complete"]):
        console(f"jaxlm: preparing {d.corpus} into {out}")
        prepare.prepare(source_spec(cfg), tok, out, val_fraction=d.val_fraction, seed=d.seed,
                        workers=os.cpu_count() or 1, progress=jax.process_index() == 0)
    return out


def load_data(cfg: ml_collections.ConfigDict) -> Data:
    """Corpus -> prepared shards (cached) or raw documents -> packed grain batches, and the fixed
    held-out batches."""
    d = cfg.data
    if d.tokenize_on_the_fly:
        return _load_on_the_fly(cfg)
    directory = prepared_dir(cfg)
    tok = tokenizer.Tokenizer.load(directory / prepare.TOKENIZER)
    if d.tokenizer_path and tokenizer.Tokenizer.load(d.tokenizer_path).sha256 != tok.sha256:
        raise UserError(
            f"{directory} was prepared with another tokenizer than data.tokenizer_path={d.tokenizer_path}; "
            f"prepare it again with that tokenizer, or leave data.tokenizer_path empty"
        )
    _check_vocab(cfg, tok, str(directory))
    skip = d.on_damaged_shard == "skip"
    train_docs = prepare.open_prepared(directory, "train", verify=d.verify_shards, skip_damaged=skip)
    val_docs = prepare.open_prepared(directory, "val", verify=d.verify_shards, skip_damaged=skip)
    train_ds = pipeline.make_train_dataset(train_docs, **_stream_options(cfg))
    return Data(train=iter(train_ds), eval_batches=_eval_batches(cfg, val_docs, str(directory)), tokenizer=tok,
                train_tokens=train_docs.num_tokens)


def _load_on_the_fly(cfg: ml_collections.ConfigDict) -> Data:
    """The raw training documents in memory, tokenized inside the pipeline; the held-out set is
    tokenized here, once."""
    d = cfg.data
    if (pathlib.Path(d.corpus) / prepare.MANIFEST).is_file():
        raise UserError(f"{d.corpus} is a prepared (tokenized) corpus; set config.data.tokenize_on_the_fly=false")
    tok = load_tokenizer(cfg, inputs_key(cfg))
    _check_vocab(cfg, tok, "data.tokenizer_path" if d.tokenizer_path else "the corpus")
    train_texts, val_texts = [], []
    for doc in sources.iter_documents(source_spec(cfg)):
        (val_texts if sources.is_validation(doc, d.val_fraction, d.seed) else train_texts).append(doc)
    val_docs, val_tokens = [], 0
    for doc in val_texts:  # the held-out set is the first val_tokens tokens: tokenize only those
        if val_tokens >= d.val_tokens:
            break
        val_docs.extend(pipeline.tokenize_documents(tok, [doc]))
        val_tokens += len(val_docs[-1])
    train_ds = pipeline.make_text_train_dataset(train_texts, tok, **_stream_options(cfg))
    return Data(train=iter(train_ds), eval_batches=_eval_batches(cfg, val_docs, d.corpus), tokenizer=tok,
                train_tokens=None, train_documents=len(train_texts))


def _check_vocab(cfg: ml_collections.ConfigDict, tok: tokenizer.Tokenizer, where: str) -> None:
    if tok.vocab_size != cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer of {where} has {tok.vocab_size} tokens but config.model.vocab_size="
            f"{cfg.model.vocab_size}; set config.model.vocab_size={tok.vocab_size}"
        )


def _stream_options(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """This process's slice of the global batch stream."""
    d = cfg.data
    return dict(seq_len=d.seq_len, batch_size=d.global_batch_size // jax.process_count(), seed=d.seed,
                shard_index=jax.process_index(), shard_count=jax.process_count(), num_workers=d.num_workers)


def _eval_batches(cfg: ml_collections.ConfigDict, val_docs, where: str) -> list[dict[str, np.ndarray]]:
    d = cfg.data
    if d.val_tokens and not len(val_docs):
        console(f"jaxlm: warning: {where} has no validation documents; raise data.val_fraction to evaluate")
    if not (len(val_docs) and d.val_tokens):
        return []
    max_batches = -(-d.val_tokens // (d.global_batch_size * d.seq_len))  # ceil
    return pipeline.make_eval_batches(val_docs, seq_len=d.seq_len, batch_size=d.global_batch_size // jax.process_count(),
                                      max_batches=max_batches)
