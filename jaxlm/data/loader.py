"""The config's data section -> a ready training stream and held-out batches.

The corpus is read, its tokenizer trained (or loaded) and the corpus tokenized into prepared
shards on first use; both are cached in `data.cache_dir` keyed by their inputs, so the next run
starts at once. Then the grain pipeline packs, shuffles and shards them for this process.

SFT data (data.format=chat, sharegpt, alpaca or prompt_completion, `jaxlm.data.sft`) takes the same
path with a loss weight per token. It is rendered and tokenized before the first step either way: into
the cached prepared shards, or with data.tokenize_on_the_fly into host memory (not in the pipeline's
workers), so that a bad row stops the run before any device work and the start-of-run line can count
every token trained on. A cached preparation that fails (a bad row) leaves nothing in data.cache_dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import sys
import sysconfig
from typing import Any, ClassVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxlm import lazy
from jaxlm.console import console
from jaxlm.data import mixture, prepare, sft, sources, tokenizer
from jaxlm.errors import UserError
from jaxlm.section import Section, check, setting

pipeline = lazy.module("jaxlm.data.pipeline")  # (grain's, imported by the first run that reads data)
streams = lazy.module("jaxlm.data.streams")


def __getattr__(name: str):
    if name == "ShardedStream":  # (defined beside the other grain iterators, `jaxlm.data.streams`)
        return streams.ShardedStream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """The training data: the corpus and its format, the tokenizer, the rows and the batch (`load_data`)."""

    section: ClassVar[str] = "data"
    corpus: str = setting(
        "builtin",
        "'builtin' (the Python standard library's source files, read at run time, never downloaded), "
        "'builtin_chat' (600 short conversations shipped in the package, for SFT: "
        "jaxlm/data/builtin_chat.py), or files, directories and globs, comma-separated: .txt/.md (text), "
        ".jsonl[.gz], .parquet.")
    sources: str = setting(
        "",
        "a data mixture, in place of data.corpus: named sources with weights, comma-separated name=paths:weight "
        "(paths as data.corpus takes them, several joined by '|'; weight 1 when left out), e.g. "
        "'web=data/web/*.jsonl:0.7,code=builtin:0.3'. Each row of a batch is drawn from a source by the weights; "
        "loss/<name> and tokens/<name> are logged per source. One source is data.corpus. docs/data.md")
    stages: str = setting(
        "",
        "data.sources: other weights from a step on, e.g. '8000:web=0.3,hq=0.7' (a source a stage does not name "
        "weighs 0 there); several joined by ';'. A resumed run may change these and the weights: they act from "
        "its first step")
    format: str = setting(
        "auto",
        'auto (by extension; chat for builtin_chat) | text | jsonl | parquet | hf, or supervised fine-tuning '
        'rows of JSONL / Parquet files: chat ({"messages": [{"role", "content"}, ...]}, or ShareGPT and '
        'Alpaca rows told by their fields; loss on the assistant\'s turns) | sharegpt ({"conversations": '
        '[{"from", "value"}, ...]}) | alpaca ({"instruction", "input", "output"}) | prompt_completion '
        '({"prompt", "completion"}, loss on the completion and EOS)')
    chat_template: str = setting(
        "",
        'data.format=chat: the Jinja template conversations are rendered with. "" = the tokenizer\'s own (a '
        'Hugging Face tokenizer_config.json\'s), chatml, simple ("### User:" headers, EOS after each answer: '
        'for tokenizers without chat tokens, such as one trained here), or a .jinja file')
    text_field: str = setting("text", "jsonl field / parquet column with the text")
    separator: str = setting("", 'text files: "" = one document per file, else split on it (e.g. "\\n\\n")')
    builtin_max_bytes: int = setting(8000000, "corpus=builtin: read at most this many bytes of the files",
                                     limit=2**62)
    tokenizer_path: str = setting("", '"" = train one on the corpus (cached in cache_dir), else a .model file')
    tokenizer_train_bytes: int = setting(100000000, "train the tokenizer on the corpus's first this-many bytes",
                                         limit=2**62)
    val_fraction: float = setting(0.01, "documents held out (by a hash of their text) for validation")
    val_tokens: int = setting(65536, "the fixed held-out set: the first this-many validation tokens")
    seq_len: int = setting(256, "tokens per training row; linked to model.max_seq_len")
    global_batch_size: int = setting(32, "sequences per optimizer step, over all devices")
    tokenizer_type: str = setting("bpe", "bpe | unigram | char | byte")
    tokenizer_vocab_size: int = setting(2048, "the trained tokenizer's vocabulary; linked to model.vocab_size")
    cache_dir: str = setting(".cache/jaxlm", "the tokenizer and the prepared (tokenized) corpus, keyed by their inputs",
                             path=("dir", "out"))
    num_workers: int = setting(0, "grain worker processes (0 = in the main process)")
    shards: int = setting(
        0,
        "The global batch is read as this many independent streams (each a slice of the documents and "
        "global_batch_size / shards rows of every batch); each process reads the streams its rows come from. "
        "0 = one per process when the run starts (so the batches follow the process count); a resumed run "
        "keeps its count whatever its process count. Any fixed count gives the same batches on 1 process or "
        "many; a multiple of every process count you will use (e.g. 8) also spares each process reading rows "
        "it drops.")
    tokenize_on_the_fly: bool = setting(
        False,
        "false: tokenize the corpus once into cached token shards (any size; the fastest reads). true: keep "
        "the raw documents in host memory and tokenize them in the pipeline (in the workers), with no prepare"
        " step: for small corpora and tokenizer ablations.")
    verify_shards: bool = setting(
        False,
        "check every prepared shard's sha256 at start (reads all data); sizes are always checked")
    on_damaged_shard: str = setting(
        "stop",
        "a truncated or corrupt shard: 'stop' with its name, or 'skip' it with a warning")
    seed: int = setting(0, "the order of the documents (shuffling) and of the train/validation split's hash")

    def validate(self) -> None:
        key = self.key
        check(self.seq_len > 0, key("seq_len"), self.seq_len, "a positive integer")
        check(self.global_batch_size > 0, key("global_batch_size"), self.global_batch_size, "a positive integer")
        check(0.0 <= self.val_fraction < 1.0, key("val_fraction"), self.val_fraction, "a number in [0, 1)")
        check(self.num_workers >= 0, key("num_workers"), self.num_workers, "0 or more")
        check(self.shards >= 0 and (self.shards == 0 or self.global_batch_size % self.shards == 0), key("shards"),
              self.shards, f"0 (one per process) or a divisor of data.global_batch_size={self.global_batch_size}")
        formats = sources.FORMATS + sft.FORMATS
        check(self.format in formats, key("format"), self.format, "one of " + ", ".join(formats))
        if self.format in sft.FORMATS or self.corpus == sources.BUILTIN_CHAT:
            check(self.corpus != "builtin", key("corpus"), self.corpus,
                  f"SFT rows (data.format={self.format}): builtin_chat, or JSONL / Parquet files")
            check(self.format in sft.FORMATS + ("auto",), key("format"), self.format,
                  f"chat (or auto) for data.corpus={sources.BUILTIN_CHAT}")
        check(self.chat_template in ("", *sft.TEMPLATES) or self.chat_template.endswith(".jinja"),
              key("chat_template"), self.chat_template,
              "'' (the tokenizer's own), " + ", ".join(sft.TEMPLATES) + " or a .jinja file")
        check(self.tokenizer_type in tokenizer.MODEL_TYPES, key("tokenizer_type"), self.tokenizer_type,
              "one of " + ", ".join(tokenizer.MODEL_TYPES))
        check(self.tokenizer_train_bytes > 0, key("tokenizer_train_bytes"), self.tokenizer_train_bytes,
              "a positive integer")
        check(self.on_damaged_shard in ("stop", "skip"), key("on_damaged_shard"), self.on_damaged_shard,
              "'stop' or 'skip'")
        check(self.val_tokens >= 0, key("val_tokens"), self.val_tokens, "0 (no evaluation) or more")
        if self.sources or self.stages:
            mix = mixture.parse_sources(self.sources)
            check(bool(mix), key("stages"), self.stages, "'' without data.sources (stages change the sources' weights)")
            mixture.parse_stages(self.stages, [s.name for s in mix])
            check(self.format in sources.FORMATS, key("format"), self.format,
                  f"a text format with data.sources ({', '.join(sources.FORMATS)}): mixtures of fine-tuning rows are "
                  f"not supported")
            for s in mix:
                check(s.paths not in sources.BUILTIN_FILES, key("sources"), self.sources,
                      f"text sources: {s.paths} (source {s.name!r}) holds fine-tuning rows, which mixtures do not mix")


@dataclasses.dataclass
class Data:
    train: streams.ShardedStream  # this process's rows of each global batch; knows its epoch
    eval_batches: list[dict[str, np.ndarray]]  # this process's rows of the fixed held-out batches
    tokenizer: Any
    train_tokens: int | None  # None when tokenized on the fly (unknown until read)
    train_documents: int | None = None
    shards: int = 1  # the streams the global batch is read as (data.shards, resolved)
    sft_report: str | None = None  # SFT data: the start-of-run line (examples, tokens, trained on, truncated)
    mixture: mixture.Mixture | None = None  # data.sources of two or more: the sources and their weights' schedule

    @property
    def eval_target_bytes(self) -> int:
        """UTF-8 bytes that the held-out batches' target tokens stand for, over all processes."""
        lengths = self.tokenizer.byte_lengths()
        local = sum(int(lengths[b["targets"]][b["weights"] > 0].sum()) for b in self.eval_batches)
        if jax.process_count() == 1:
            return local
        total = int(np.sum(multihost_utils.process_allgather(np.array([local], np.int64))))
        # processes that share rows (the batch replicated over stages or tensor parallelism) hold them alike
        held = self.train.rows.stop - self.train.rows.start
        return total * self.train.per_shard * self.train.shards // (jax.process_count() * held)


def source_spec(data: DataConfig) -> sources.SourceSpec:
    d = data
    fmt = "auto" if sft_spec(data) else d.format  # SFT rows: JSONL or Parquet, told by the extension
    return sources.SourceSpec(d.corpus, fmt, d.text_field, sources.unescape(d.separator), max_bytes=d.builtin_max_bytes)


def sft_spec(data: DataConfig) -> sft.Spec | None:
    """The SFT format and chat template of the data section (data.corpus=builtin_chat is chat), or None for text."""
    d = data
    fmt = "chat" if d.format == "auto" and d.corpus == sources.BUILTIN_CHAT else d.format
    return sft.Spec(fmt, d.chat_template) if fmt in sft.FORMATS else None


def inputs_key(data: DataConfig) -> str:
    """A cheap identity of the corpus (its files' sizes and times, or the interpreter for the built-in
    one) and of how it is read: the cache key of its tokenizer and prepared shards."""
    source = source_spec(data)
    if source.paths == "builtin":
        files = [sys.version, sysconfig.get_paths()["stdlib"]]
    else:
        files = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns)
                 for given in sources.resolve_files(source) for f in sources.input_files(given)]
    identity = {"spec": dataclasses.asdict(source), "files": files, "val_fraction": data.val_fraction,
                "seed": data.seed}
    spec = sft_spec(data)
    if spec:  # (text corpora keep the keys they had before SFT existed)
        identity["sft"] = {**dataclasses.asdict(spec), "template": sft.template_identity(spec.chat_template)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _cache_lock(data: DataConfig):
    """Hold `data.cache_dir`'s lock: of several processes (one node or a shared filesystem), the
    first trains the tokenizer and prepares the corpus while the others wait, then find them cached."""
    directory = pathlib.Path(data.cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_tokenizer(data: DataConfig, key: str) -> tokenizer.Tokenizer:
    """The configured tokenizer file (.model or tokenizer.json), or one trained on the corpus's
    training documents (cached)."""
    d = data
    if d.tokenizer_path:
        return tokenizer.Tokenizer.load(d.tokenizer_path)
    with _cache_lock(data):
        return _cached_tokenizer(data, key)


def _cached_tokenizer(data: DataConfig, key: str, mix: list[mixture.Source] | None = None) -> tokenizer.Tokenizer:
    """The tokenizer cached for inputs `key`, else trained on the corpus's training documents (the first
    data.tokenizer_train_bytes of them); for a mixture `mix`, on an equal share of those bytes from each
    source, whatever their weights (which a resumed run may change, and its tokenizer may not)."""
    d = data
    path = pathlib.Path(d.cache_dir) / f"tokenizer-{key}-{d.tokenizer_type}-{d.tokenizer_vocab_size}.model"
    if path.exists():
        try:
            return tokenizer.Tokenizer.load(path)
        except UserError as e:  # cut by a killed process or a lost disk: trained again, the same (a resume checks)
            console(f"jaxlm: warning: {e} (data.cache_dir); training it again")
    what = ", ".join(s.name for s in mix) if mix else d.corpus
    console(f"jaxlm: training a {d.tokenizer_type} tokenizer ({d.tokenizer_vocab_size} tokens) on {what}")
    docs = []
    if not mix:
        docs = _tokenizer_texts(data, d.tokenizer_train_bytes)
    for s in mix or ():
        with source_errors(s):
            docs += _tokenizer_texts(source_config(data, s), d.tokenizer_train_bytes // len(mix))
    if not docs:
        raise UserError(f"the corpus {what!r} holds no training documents; give non-empty text")
    tok = tokenizer.SentencePieceTokenizer.train(docs, d.tokenizer_vocab_size, d.tokenizer_type)
    tok.save(path)
    return tok


def _tokenizer_texts(data: DataConfig, max_bytes: int) -> list[str]:
    """The corpus's first training documents (SFT rows as rendered) up to `max_bytes` UTF-8 bytes."""
    d = data
    spec = sft_spec(data)
    if spec:  # the training examples as rendered (the template must be named: a new tokenizer has none)
        encoder = sft.Encoder.make(spec, None)
        examples = sft.iter_examples(source_spec(data), spec.format)
        texts = sft.tokenizer_texts((e for e in examples if not sources.is_validation(e.key, d.val_fraction, d.seed)),
                                    encoder)
    else:
        texts = (doc for doc in sources.iter_documents(source_spec(data))
                 if not sources.is_validation(doc, d.val_fraction, d.seed))
    docs, total = [], 0
    for doc in texts:
        docs.append(doc)
        total += len(doc.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def prepared_dir(data: DataConfig, tok: tokenizer.Tokenizer | None = None) -> pathlib.Path:
    """The corpus as prepared shards: a prepared directory given as the corpus, or the cached one
    for these inputs and tokenizer, built on first use (resumably) with every core. `tok`: the tokenizer
    to prepare with (a mixture's); by default data.tokenizer_path's, or one trained on the corpus."""
    d = data
    given = pathlib.Path(d.corpus)
    if prepare.is_prepared(given):
        if sft_spec(data) and not prepare.read_manifest(given).get("sft"):
            raise UserError(f"{given} holds prepared text, not SFT data; prepare the rows with "
                            f"`python -m jaxlm.data.prepare --format {sft_spec(data).format} ...`, or set data.format=auto")
        return given
    key = inputs_key(data)
    with _cache_lock(data):
        if tok is None:
            tok = tokenizer.Tokenizer.load(d.tokenizer_path) if d.tokenizer_path else _cached_tokenizer(data, key)
        out = cached_prepared_dir(data, tok.sha256, key)
        damage = prepare.damage(out)  # a file cut by a killed process or a lost disk: the cache mends itself
        if damage:
            console(f"jaxlm: warning: {damage}; preparing {d.corpus} again into data.cache_dir")
            if _unreadable_manifest(out):
                shutil.rmtree(out)  # (only the cache: derived from the corpus, made again the same)
        if damage or not prepare.is_prepared(out, complete=True):
            console(f"jaxlm: preparing {d.corpus} into {out}")
            try:
                prepare.prepare(source_spec(data), tok, out, val_fraction=d.val_fraction, seed=d.seed,
                                workers=os.cpu_count() or 1, progress=jax.process_index() == 0,
                                sft_spec=sft_spec(data), in_process_bytes=prepare.IN_PROCESS_BYTES)
            except UserError:  # bad data: once fixed, the corpus has another key and this would never be read
                shutil.rmtree(out, ignore_errors=True)
                raise  # (interrupted, or a full disk: the next run continues what is written)
    return out


def _unreadable_manifest(directory: pathlib.Path) -> bool:
    try:
        prepare.read_manifest(directory)
    except UserError:
        return True
    return False


def cached_prepared_dir(data: DataConfig, tokenizer_sha256: str, key: str | None = None) -> pathlib.Path:
    """Where `data.cache_dir` keeps the corpus prepared with this tokenizer (`key`: `inputs_key(data)`)."""
    return pathlib.Path(data.cache_dir) / f"prepared-{key or inputs_key(data)}-{tokenizer_sha256[:16]}"


def load_data(data: DataConfig, shards: int | None = None, rows: slice | None = None) -> Data:
    """Corpus -> prepared shards (cached) or raw documents -> packed grain batches, and the fixed
    held-out batches. `shards`: the resumed run's stream count (data.shards=0 keeps it). `rows`: the
    rows of each global batch this process's devices hold (`rows_held` of the run's batch sharding);
    None, every row, which only one process may ask for."""
    rows = all_rows(data, rows)
    mix = mixture.parse_sources(data.sources)
    if len(mix) > 1:
        return _load_mixture(data, mix, shards, rows)
    if mix:  # one source: the corpus, read as data.corpus reads it (the same batches, bit for bit)
        data = source_config(data, mix[0])
    d = data
    if d.tokenize_on_the_fly:
        return _load_on_the_fly(data, shards, rows)
    directory = prepared_dir(data)
    try:
        tok = tokenizer.Tokenizer.load(prepare.tokenizer_file(directory))
    except UserError as e:  # a prepared corpus given as data.corpus (the cache mends itself in prepared_dir)
        raise UserError(f"{e}; run jaxlm.data.prepare into {directory} again with the same arguments to write it "
                        f"again") from None
    if d.tokenizer_path and tokenizer.Tokenizer.load(d.tokenizer_path).sha256 != tok.sha256:
        raise UserError(
            f"{directory} was prepared with another tokenizer than data.tokenizer_path={d.tokenizer_path}; "
            f"prepare it again with that tokenizer, or leave data.tokenizer_path empty"
        )
    _check_vocab(data, tok, str(directory))
    skip = d.on_damaged_shard == "skip"
    train_docs = prepare.open_prepared(directory, "train", verify=d.verify_shards, skip_damaged=skip)
    val_docs = prepare.open_prepared(directory, "val", verify=d.verify_shards, skip_damaged=skip)
    recorded = prepare.read_manifest(directory).get("sft")
    spec = sft.Spec(recorded["format"], recorded["chat_template"]) if recorded else None
    return _data(data, tok, train_docs, val_docs, str(directory), shards, spec, rows)


def _data(data: DataConfig, tok: tokenizer.Tokenizer, train_docs: pipeline.FlatDocuments, val_docs,
          where: str, shards: int | None, spec: sft.Spec | None, rows: slice) -> Data:
    """Tokenized documents (prepared shards, or SFT examples encoded in memory) -> `Data`; prints the
    SFT line for weighted ones."""
    d = data
    report = None
    if spec:
        report = sft.report(spec, train_docs, val_docs, d.seq_len)
        console(f"jaxlm: {report}")
    count = resolve_shards(data, rows, shards)
    train = streams.ShardedStream(lambda j: iter(pipeline.make_train_dataset(train_docs, **_stream_options(data, j, count))),
                          count, rows, d.global_batch_size)
    return Data(train=train, eval_batches=_eval_batches(data, val_docs, where, rows), tokenizer=tok,
                train_tokens=train_docs.num_tokens, train_documents=len(train_docs), shards=count, sft_report=report)


def _load_on_the_fly(data: DataConfig, shards: int | None, rows: slice) -> Data:
    """The raw training documents in memory, tokenized inside the pipeline; the held-out set is
    tokenized here, once."""
    d = data
    if prepare.is_prepared(d.corpus):
        raise UserError(f"{d.corpus} is a prepared (tokenized) corpus; set config.data.tokenize_on_the_fly=false")
    tok = load_tokenizer(data, inputs_key(data))
    _check_vocab(data, tok, "data.tokenizer_path" if d.tokenizer_path else "the corpus")
    spec = sft_spec(data)
    if spec:
        train_docs, val_docs = sft_documents(data, tok, spec)
        if not len(train_docs):
            raise UserError(f"all {len(val_docs)} rows of {d.corpus} fell in the validation split; lower "
                            f"data.val_fraction={d.val_fraction}")
        return _data(data, tok, train_docs, val_docs, d.corpus, shards, spec, rows)
    train_texts, val_docs = _texts_and_held_out(data, tok)
    count = resolve_shards(data, rows, shards)
    train = streams.ShardedStream(
        lambda j: iter(pipeline.make_text_train_dataset(train_texts, tok, **_stream_options(data, j, count))),
        count, rows, d.global_batch_size)
    return Data(train=train, eval_batches=_eval_batches(data, val_docs, d.corpus, rows), tokenizer=tok,
                train_tokens=None, train_documents=len(train_texts), shards=count)


def _texts_and_held_out(data: DataConfig, tok: tokenizer.Tokenizer) -> tuple[list[str], list[np.ndarray]]:
    """(the corpus's training documents as text, its held-out set tokenized: the first data.val_tokens tokens
    of the validation documents)."""
    d = data
    train_texts, val_texts = [], []
    for doc in sources.iter_documents(source_spec(data)):
        (val_texts if sources.is_validation(doc, d.val_fraction, d.seed) else train_texts).append(doc)
    val_docs, val_tokens = [], 0
    for doc in val_texts:  # the held-out set is the first val_tokens tokens: tokenize only those
        if val_tokens >= d.val_tokens:
            break
        val_docs.extend(pipeline.tokenize_documents(tok, [doc]))
        val_tokens += len(val_docs[-1])
    return train_texts, val_docs


def source_config(data: DataConfig, source: mixture.Source) -> DataConfig:
    """One source of a mixture as a corpus of its own: data.corpus its paths, every other setting the mixture's."""
    return dataclasses.replace(data, corpus=source.paths, sources="", stages="")


@contextlib.contextmanager
def source_errors(source: mixture.Source):
    """A bad input of one source of a mixture: its line says which source."""
    try:
        yield
    except UserError as e:
        raise UserError(f"data.sources: source {source.name!r}: {e}") from None


def _mixture_tokenizer(data: DataConfig, mix: list[mixture.Source]) -> tokenizer.Tokenizer:
    """The tokenizer every source of a mixture is read with: data.tokenizer_path's, else that of the
    sources given prepared (all one), else one trained on the sources (cached, keyed by their inputs)."""
    d = data
    tok = tokenizer.Tokenizer.load(d.tokenizer_path) if d.tokenizer_path else None
    first = "data.tokenizer_path" if tok else ""
    for s in mix:
        if prepare.is_prepared(s.paths):
            with source_errors(s):
                own = tokenizer.Tokenizer.load(prepare.tokenizer_file(pathlib.Path(s.paths)))
            if tok is None:
                tok, first = own, f"source {s.name!r}"
            elif own.sha256 != tok.sha256:
                raise UserError(f"data.sources: source {s.name!r} ({s.paths}) was prepared with another tokenizer than "
                                f"{first}; prepare every source of a mixture with one tokenizer")
    if tok is not None:
        return tok
    keys = []  # the inputs, not the weights (which may change)
    for s in mix:
        with source_errors(s):
            keys.append(inputs_key(source_config(data, s)))
    key = hashlib.sha256(json.dumps(["mixture", keys]).encode()).hexdigest()[:16]
    with _cache_lock(data):
        return _cached_tokenizer(data, key, mix)


def _load_mixture(data: DataConfig, mix: list[mixture.Source], shards: int | None, rows: slice) -> Data:
    """A mixture (`jaxlm.data.mixture`): each source read, prepared (cached) or held as text to tokenize on
    the fly, as a corpus of its own with the mixture's tokenizer; one stream drawing each row of a batch
    from a source by the step's weights; each source's held-out set (an equal share of data.val_tokens),
    its batches marked with the source (`source_ids`), for a validation loss per source."""
    d = data
    tok = _mixture_tokenizer(data, mix)
    _check_vocab(data, tok, "data.tokenizer_path" if d.tokenizer_path else "the mixture")
    share = -(-d.val_tokens // len(mix))  # ceil: each source's held-out tokens
    train: dict[str, Any] = {}
    facts, eval_batches = [], []
    for index, s in enumerate(mix):
        part = dataclasses.replace(source_config(data, s), val_tokens=share)
        with source_errors(s):
            if d.tokenize_on_the_fly:
                if prepare.is_prepared(s.paths):
                    raise UserError(f"{s.paths} is a prepared (tokenized) corpus; set "
                                    f"config.data.tokenize_on_the_fly=false")
                train[s.name], val = _texts_and_held_out(part, tok)
            else:
                directory = prepared_dir(part, tok)
                skip = d.on_damaged_shard == "skip"
                train[s.name] = prepare.open_prepared(directory, "train", verify=d.verify_shards, skip_damaged=skip)
                val = prepare.open_prepared(directory, "val", verify=d.verify_shards, skip_damaged=skip)
            if not len(train[s.name]):
                raise UserError(f"{s.paths} holds no training documents; give non-empty text (or lower "
                                f"data.val_fraction={d.val_fraction})")
            held = _eval_batches(part, val, f"source {s.name!r} ({s.paths})", rows)
        tokens = None if d.tokenize_on_the_fly else train[s.name].num_tokens
        facts.append(mixture.SourceFacts(s.name, s.paths, len(train[s.name]), tokens))
        for batch in held:
            ids = np.full_like(batch["inputs"], index)
            eval_batches.append({**{k: v for k, v in batch.items() if k != "weights"}, "source_ids": ids,
                                 "weights": batch["weights"]})
    count = resolve_shards(data, rows, shards)
    schedule = mixture.Schedule.parse(d.sources, d.stages)
    workers = -(-d.num_workers // len(mix))  # ceil: each source reads with its own processes

    def open_shard(j: int) -> mixture.MixtureIterator:
        return mixture.open_shard(train, schedule, seq_len=d.seq_len, rows=d.global_batch_size // count, seed=d.seed,
                                  shard=j, shards=count, num_workers=workers,
                                  tok=tok if d.tokenize_on_the_fly else None)

    documents = sum(f.documents for f in facts)
    tokens = None if d.tokenize_on_the_fly else sum(f.tokens for f in facts)
    return Data(train=streams.ShardedStream(open_shard, count, rows, d.global_batch_size), eval_batches=eval_batches,
                tokenizer=tok, train_tokens=tokens, train_documents=documents, shards=count,
                mixture=mixture.Mixture(tuple(facts), schedule))


def sft_documents(data: DataConfig, tok: tokenizer.Tokenizer, spec: sft.Spec,
                  train: bool = True) -> tuple[pipeline.FlatDocuments, pipeline.FlatDocuments]:
    """The corpus's rows as weighted train and validation documents, split as prepare splits them,
    encoded here (`train=False`: the validation ones alone; the train ones come back empty)."""
    d = data
    encoder = sft.Encoder.make(spec, tok)
    split: dict[bool, list[sft.Example]] = {False: [], True: []}
    rows = 0
    for example in sft.iter_examples(source_spec(data), spec.format):
        rows += 1
        held_out = sources.is_validation(example.key, d.val_fraction, d.seed)
        if train or held_out:
            split[held_out].append(example)
    if not rows:
        raise UserError(f"the corpus {d.corpus!r} holds no rows; give non-empty files")
    return tuple(pipeline.FlatDocuments.from_arrays(*sft.encode_examples(encoder, tok, split[held_out]))
                 for held_out in (False, True))


def _check_vocab(data: DataConfig, tok: tokenizer.Tokenizer, where: str) -> None:
    """The model must have a row for every token id; more rows are allowed (a vocabulary padded to a
    round size, as Qwen2's 151,936 rows for 151,665 tokens), never fewer."""
    if tok.vocab_size > data.tokenizer_vocab_size:  # linked to model.vocab_size, the name users know
        raise UserError(
            f"the tokenizer of {where} has {tok.vocab_size} tokens but config.model.vocab_size="
            f"{data.tokenizer_vocab_size}; set config.model.vocab_size={tok.vocab_size}"
        )


def resolve_shards(data: DataConfig, rows: slice, resumed: int | None = None) -> int:
    """data.shards, or the resumed run's count, or one per block of rows a process holds (one per process,
    unless processes share rows: the batch is replicated over pipeline stages and tensor parallelism);
    checked against the batch."""
    d = data
    blocks = d.global_batch_size // (rows.stop - rows.start)
    count = d.shards or resumed or blocks
    if d.global_batch_size % count or d.global_batch_size % blocks:
        raise UserError(
            f"config.data.global_batch_size={d.global_batch_size} does not divide into {count} data shards and "
            f"{blocks} processes' blocks of rows; use a batch that is a multiple of both (or set data.shards)"
        )
    return count


def all_rows(data: DataConfig, rows: slice | None) -> slice:
    """`rows`, or every row of the global batch in a single process (several processes read only the
    rows their devices hold: the caller gives them, `rows_held`)."""
    if rows is not None:
        return rows
    if jax.process_count() > 1:
        raise ValueError("several processes: give load_data the rows this process's devices hold "
                         "(loader.rows_held of the run's batch sharding)")
    return slice(0, data.global_batch_size)


def rows_held(sharding: jax.sharding.Sharding, shape: tuple[int, int]) -> slice:
    """The block of a [B, T] batch's rows that this process's devices hold under `sharding`; one line
    when they are not one contiguous block."""
    held = {(index[0].start or 0, index[0].stop or shape[0])
            for index in sharding.addressable_devices_indices_map(shape).values()}
    lo, hi = min(a for a, _ in held), max(b for _, b in held)
    if sum(b - a for a, b in held) != hi - lo or shape[0] % (hi - lo):
        raise UserError(
            f"process {jax.process_index()}'s devices hold batch rows {sorted(held)} of the global batch, not one "
            f"contiguous block; order config.mesh so that each process's devices are contiguous along the batch "
            f"axes, mesh.rules.act_batch (e.g. mesh.hybrid)"
        )
    return slice(lo, hi)


def _stream_options(data: DataConfig, shard: int, count: int) -> dict[str, Any]:
    """Data shard `shard` of `count`: a slice of the documents, batch_size / count rows per batch."""
    d = data
    return dict(seq_len=d.seq_len, batch_size=d.global_batch_size // count, seed=d.seed,
                shard_index=shard, shard_count=count, num_workers=d.num_workers)


def _eval_batches(data: DataConfig, val_docs, where: str, rows: slice) -> list[dict[str, np.ndarray]]:
    d = data
    if d.val_tokens and not len(val_docs):
        console(f"jaxlm: warning: {where} has no validation documents; raise data.val_fraction to evaluate")
    if not (len(val_docs) and d.val_tokens):
        return []
    max_batches = -(-d.val_tokens // (d.global_batch_size * d.seq_len))  # ceil
    # The global batches, the same on every process count; each process keeps its rows.
    batches = pipeline.make_eval_batches(val_docs, seq_len=d.seq_len, batch_size=d.global_batch_size,
                                         max_batches=max_batches)
    if sft_spec(data) is not None:  # the loss is on the answers only: they are what the held-out set measures
        answers = sum(int((b["weights"] > 0).sum()) for b in batches)
        if answers < SFT_MIN_VAL_TOKENS:
            console(f"jaxlm: warning: the held-out set holds {answers:,} answer tokens in {len(val_docs):,} "
                    f"conversations, fewer than the {SFT_MIN_VAL_TOKENS:,} a validation loss needs to mean much: raise "
                    f"data.val_fraction (now {d.val_fraction}) and data.val_tokens (now {d.val_tokens:,})")
    return [{k: v[rows] for k, v in batch.items()} for batch in batches]


# SFT: fewer answer tokens than this in the held-out set get a warning (its loss's noise then hides the
# differences a fine-tune is compared by; the SFT recipes hold out enough of the built-in chat corpus)
SFT_MIN_VAL_TOKENS = 1024
