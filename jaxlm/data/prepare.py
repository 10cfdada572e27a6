"""Tokenize a corpus once into memory-mappable shards, in parallel and resumably.

    python -m jaxlm.data.prepare --input 'data/*.jsonl' --tokenizer tok.model --output data/prepared

(`--tokenizer` may also be a Hugging Face tokenizer.json, or the checkpoint directory holding it.)

The output directory holds:
  manifest.json       what went in (tokenizer, source files with size and sha256, options) and, once
                      complete, each split's documents and tokens and each shard's bytes and sha256
  tokenizer.model     the tokenizer the shards were made with (a Hugging Face one: tokenizer.json
                      and tokenizer_config.json; `tokenizer_file` finds either)
  train-00000.tokens  the shards: two .npy arrays back to back, int64 document offsets [D + 1],
  val-00000.tokens    then the tokens [offsets[-1]] (uint16, or uint32 for vocabularies over 65536);
                      SFT data (`--format chat|sharegpt|alpaca|prompt_completion`) adds a third,
                      the uint8 0/1 loss weight of each token (`jaxlm.data.sft`)

Format versions: 1 is the two-array shard; 2 adds the manifest's "sft" section and the weights
array. A text corpus is still written as version 1 (the same bytes as before, readable by older
jaxlm), SFT data as version 2 (which older jaxlm refuses in one line rather than train on every
token); this jaxlm reads both.

A flat token file per shard, not array_record with a record per document: a random chunk read from a
memory map was measured 5x faster than from an uncompressed record (15x than a zstd one), it writes
faster, is read without a copy, and leaves seq_len a training choice (benchmarks/BENCHMARKS.md).

Each document is BOS + text + EOS, as in `pipeline.tokenize_documents`, and goes to validation by a hash
of its text (`sources.is_validation`); an SFT example is its rendered tokens (`sft.Encoder`) and goes
by a hash of its row's content. Shard k of a split holds that split's documents
[k * shard_docs, (k + 1) * shard_docs) in input order, so the plan depends on the inputs alone: a
re-run after a kill re-reads the inputs, skips the shards already on disk (each written
atomically) and ends with the same bytes as a run that was never interrupted.
"""

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import logging
import multiprocessing
import os
import pathlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import tqdm

from jaxlm import cli
from jaxlm.data import sft, sources
from jaxlm.data.tokenizer import FILE_NAMES, HF_CONFIG_FILE, Tokenizer, find_in, write_bytes_atomically
from jaxlm.errors import Terminated, UserError, report_error, run_command

if TYPE_CHECKING:
    from jaxlm.data.pipeline import FlatDocuments

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # what a text corpus is written as
SFT_FORMAT_VERSION = 2  # SFT data: the weights array and the manifest's "sft" section (see the docstring)
READABLE_VERSIONS = (FORMAT_VERSION, SFT_FORMAT_VERSION)
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"  # the tokenizer file where it is a SentencePiece model; in general see tokenizer_file
SPLITS = ("train", "val")
# The trainer's `prepare(in_process_bytes=)`: a corpus smaller than this is tokenized in the trainer's process,
# on the tokenizer's own threads. Worker processes start by importing the caller's main module (the trainer's:
# JAX, Flax, Orbax), which took longer than tokenizing the built-in corpus (benchmarks/BENCHMARKS.md, "Start-up")
IN_PROCESS_BYTES = 32 * 2**20

Manifest = dict[str, Any]  # the contents of manifest.json


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def prepare(
    source: sources.SourceSpec,
    tokenizer: Tokenizer,
    output_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.01,
    seed: int = 0,
    shard_docs: int = 4096,
    workers: int = 1,
    progress: bool = True,
    sft_spec: sft.Spec | None = None,
    in_process_bytes: int = 0,
) -> Manifest:
    """Tokenize every document of `source` into train and val shards under `output_dir`; with
    `sft_spec`, its rows as SFT examples (tokens and weights). `workers` processes tokenize the shards,
    except that inputs of fewer than `in_process_bytes` are tokenized in this process on `workers` of
    the tokenizer's threads (the same bytes either way).

    Continues an interrupted run of the same inputs and tokenizer (and rewrites shards that no
    longer match a complete manifest); refuses a directory prepared from anything else. A run that
    stops at bad data (a bad row) in a directory it began removes what it wrote there (and the
    directory, if it made it), so that the corrected data can go to the same place; one interrupted
    (Ctrl-C, SIGTERM) or stopped by the machine (a full disk), or continuing an earlier run's
    directory, leaves it to be continued.
    """
    if shard_docs < 1 or workers < 1:
        raise UserError(f"shard_docs and workers must be at least 1; got {shard_docs} and {workers}")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1); got {val_fraction}")
    out = pathlib.Path(output_dir)
    encoder = sft.Encoder.make(sft_spec, tokenizer) if sft_spec else None  # a missing template fails here
    manifest: Manifest = {
        "format_version": SFT_FORMAT_VERSION if encoder else FORMAT_VERSION,
        "tokenizer": {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size},
        "token_dtype": token_dtype(tokenizer.vocab_size).name,
        "input": dataclasses.asdict(source),
        "options": {"val_fraction": val_fraction, "seed": seed, "shard_docs": shard_docs},
        "sources": _describe_sources(source),
        "complete": False,
    }
    if encoder:
        manifest["sft"] = {**dataclasses.asdict(sft_spec), "template_sha256": encoder.template_sha256}
    begun = not is_prepared(out)  # this run begins the directory (else it continues or mends an earlier one)
    if not begun:
        previous = read_manifest(out)
        _check_same_inputs(out, previous, manifest)
        if previous["complete"] and not _remove_damaged_shards(out, previous) and not _tokenizer_damage(out, previous):
            return previous
    elif out.exists() and (not out.is_dir() or any(p.suffix != ".tmp" for p in out.iterdir())):
        raise UserError(f"{out} is not an empty directory and holds no {MANIFEST}; give a new --output directory")
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _remove_partial_writes(out)
        _write_manifest(out, manifest)  # first: from now on the directory is recognised as ours
        tokenizer.save(out / tokenizer.file_name)
        manifest["splits"] = _write_shards(source, out, manifest, workers, progress, encoder, in_process_bytes)
    except UserError:  # bad data: the corrected data is another input, which this directory would refuse
        if begun:
            remove_begun(out, made)
        raise  # (interrupted, or the machine failing, as a full disk: what is written stays, to be continued)
    _remove_partial_writes(out)  # of workers that outlived a killed run by a moment
    manifest["complete"] = True
    _write_manifest(out, manifest)
    return manifest


def remove_begun(out: pathlib.Path, made: bool) -> None:
    """Remove what a failed `prepare` wrote into `out`, a directory that held nothing but partial
    writes before it: the whole directory if `made` (prepare created it), else the files prepare
    writes (a user's empty directory stays)."""
    if made:
        shutil.rmtree(out, ignore_errors=True)
        return
    for path in out.iterdir():
        if path.name in (MANIFEST, *FILE_NAMES, HF_CONFIG_FILE) or path.suffix in (".tokens", ".tmp"):
            path.unlink(missing_ok=True)


def _remove_partial_writes(out: pathlib.Path) -> None:
    for path in out.glob("*.tmp"):
        path.unlink(missing_ok=True)


def _describe_sources(source: sources.SourceSpec) -> list[dict[str, Any]]:
    """Each input file with its size and sha256: the identity of the inputs."""
    if source.paths == "builtin":
        h, size = hashlib.sha256(), 0
        for doc in sources.iter_documents(source):
            data = doc.encode("utf-8")
            h.update(len(data).to_bytes(8, "little") + data)
            size += len(data)
        return [{"path": "builtin", "bytes": size, "sha256": h.hexdigest()}]
    described = []
    for path in (f for given in sources.resolve_files(source) for f in sources.input_files(given)):
        try:
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            raise UserError(f"cannot read input file {path}: {e.strerror}") from None
        described.append({"path": path, "bytes": os.path.getsize(path), "sha256": digest})
    return described


def _identity(manifest: Manifest) -> dict[str, Any]:
    """What must match to continue into a directory: contents, not the paths they were read from."""
    return {
        "format_version": manifest["format_version"],
        "tokenizer": manifest["tokenizer"],
        "sources": [[s["bytes"], s["sha256"]] for s in manifest["sources"]],
        "input": {k: v for k, v in manifest["input"].items() if k != "paths"},
        "options": manifest["options"],
        "sft": manifest.get("sft"),
    }


def _check_same_inputs(out: pathlib.Path, previous: Manifest, current: Manifest) -> None:
    old, new = _identity(previous), _identity(current)
    what = {
        "format_version": "another format version",
        "tokenizer": f"another tokenizer (sha256 {old['tokenizer']['sha256'][:12]}, this one is"
        f" {new['tokenizer']['sha256'][:12]})",
        "sources": "other input files",
        "input": "other input options",
        "options": "other options",
        "sft": "other SFT settings (data format or chat template)",
    }
    for key in old:
        if old[key] != new[key]:
            raise UserError(f"{out} was prepared with {what[key]}; give a new --output directory or delete it")


def _write_manifest(out: pathlib.Path, manifest: Manifest) -> None:
    write_bytes_atomically(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def is_prepared(directory: str | os.PathLike, *, complete: bool = False) -> bool:
    """Whether `directory` holds prepared data (a manifest); with `complete`, only once fully written."""
    if not (pathlib.Path(directory) / MANIFEST).is_file():
        return False
    return not complete or read_manifest(directory)["complete"]


def damage(directory: str | os.PathLike) -> str | None:
    """What a cut or damaged file leaves wrong in the prepared `directory`, or None when it is whole (or
    holds no manifest): its manifest not whole JSON, or, once complete, its tokenizer file or a shard
    not what the manifest records. Cheap: shards are checked by size (`open_prepared(verify=True)`
    hashes them). `prepare` into the directory again mends the tokenizer and the shards."""
    out = pathlib.Path(directory)
    if not (out / MANIFEST).is_file():
        return None
    try:
        manifest = read_manifest(out)
    except UserError:
        return f"{out / MANIFEST} is not a whole manifest"
    if not manifest.get("complete"):
        return None
    problem = _tokenizer_damage(out, manifest)
    if problem:
        return problem
    for split in SPLITS:
        for entry in manifest["splits"][split]["shards"]:
            if problem := _shard_damage(out / entry["file"], entry, verify=False):
                return f"shard {out / entry['file']} {problem}"
    return None


def _tokenizer_damage(out: pathlib.Path, manifest: Manifest) -> str | None:
    """Why the tokenizer file of the complete prepared directory `out` is not the one its manifest names, or None."""
    try:
        sha256 = Tokenizer.load(tokenizer_file(out)).sha256
    except UserError as e:
        return str(e)
    if sha256 != manifest["tokenizer"]["sha256"]:
        return f"the tokenizer file of {out} is not the one its shards were made with (sha256)"
    return None


def tokenizer_file(directory: str | os.PathLike) -> pathlib.Path:
    """The tokenizer file a prepared directory was made with: its tokenizer.model or tokenizer.json."""
    path = find_in(directory)
    if path is None:
        raise UserError(f"{directory} holds no tokenizer ({' or '.join(FILE_NAMES)}); run jaxlm.data.prepare again "
                        f"into a new directory")
    return path


def read_manifest(output_dir: str | os.PathLike) -> Manifest:
    path = pathlib.Path(output_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{output_dir} holds no prepared data ({MANIFEST} not found); run jaxlm.data.prepare") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is corrupt; run jaxlm.data.prepare again into a new directory") from None
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise UserError(
            f"{output_dir} was prepared in format version {manifest.get('format_version')}; this jaxlm reads"
            f" versions {', '.join(map(str, READABLE_VERSIONS))}; prepare it again into a new directory"
        )
    return manifest


# ----------------------------------------------------------------------------- writing shards


def _plan(
    source: sources.SourceSpec, options: dict[str, Any], sft_format: str | None = None
) -> Iterator[tuple[str, str, list]]:
    """(split, shard file name, documents) in a fixed order, from the inputs alone; with
    `sft_format`, the documents are `sft.Example`s."""
    groups: dict[str, list] = {split: [] for split in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)

    def shard(split: str) -> tuple[str, str, list]:
        docs, groups[split] = groups[split], []
        counts[split] += 1
        return split, f"{split}-{counts[split] - 1:05d}.tokens", docs

    documents = sft.iter_examples(source, sft_format) if sft_format else sources.iter_documents(source)
    for doc in documents:
        key = doc.key if sft_format else doc
        split = "val" if sources.is_validation(key, options["val_fraction"], options["seed"]) else "train"
        groups[split].append(doc)
        if len(groups[split]) == options["shard_docs"]:
            yield shard(split)
    for split in SPLITS:
        if groups[split]:
            yield shard(split)


_worker_tokenizer: Tokenizer | None = None  # each worker process's own, loaded from the output directory
_worker_threads = 1  # the tokenizer's threads per shard: 1 in a worker process, every worker's in this one


def _load_tokenizer(path: str, threads: int = 1) -> None:
    global _worker_tokenizer, _worker_threads
    _worker_tokenizer, _worker_threads = Tokenizer.load(path), threads


def _start_worker(tokenizer_path: str, parent_pid: int) -> None:
    """Load the tokenizer; leave Ctrl-C to the parent, which lets running shards finish; and exit
    when the parent dies (killed, a worker would otherwise wait for work forever)."""
    _load_tokenizer(tokenizer_path)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    os._exit(1)


def _write_shard(path: str, docs: list, dtype: str, encoder: sft.Encoder | None = None) -> dict[str, Any]:
    """Tokenize one shard's documents (on one core in a worker process, on `_worker_threads` in this
    one) and write it atomically; its manifest entry. With `encoder`, the documents are SFT examples
    and their weights are the third array."""
    if encoder is None:
        encoded = _worker_tokenizer.encode(docs, add_bos=True, add_eos=True, num_threads=_worker_threads)
        weights = None
    else:
        encoded, weights = sft.encode_examples(encoder, _worker_tokenizer, docs)
    offsets = np.cumsum([0] + [len(ids) for ids in encoded], dtype=np.int64)
    arrays = [offsets, np.concatenate([np.asarray(ids, dtype) for ids in encoded])]
    if weights is not None:
        arrays.append(np.concatenate(weights).astype(np.uint8))
    buffer = io.BytesIO()
    for array in arrays:
        np.lib.format.write_array(buffer, array, version=(1, 0))
    data = buffer.getvalue()
    write_bytes_atomically(path, data)
    return _shard_entry(path, len(docs), int(offsets[-1]), data, arrays[2] if weights is not None else None)


def _shard_entry(path: str | os.PathLike, documents: int, tokens: int, data: bytes,
                 weights: np.ndarray | None = None) -> dict[str, Any]:
    name = os.path.basename(path)
    entry = {"file": name, "documents": documents, "tokens": tokens, "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest()}
    if weights is not None:
        entry["weighted_tokens"] = int(weights.sum(dtype=np.int64))  # tokens of weight 1, before any truncation
    return entry


def _existing_shard(path: pathlib.Path, num_docs: int, arrays: int = 2) -> dict[str, Any] | None:
    """The manifest entry of a shard a previous run completed, or None if it must be written."""
    layout = _shard_layout(path, arrays)
    if layout is None or layout[0][1] != num_docs + 1:
        return None
    weights = None
    if arrays == 3:
        dtype, length, offset = layout[2]
        weights = np.memmap(path, dtype, "r", offset, (length,))
    return _shard_entry(path, num_docs, layout[1][1], path.read_bytes(), weights)


class _InProcess(concurrent.futures.Executor):
    """One worker: run each task at once, in this process (no process to start)."""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future


class _SignalsBetweenShards:
    """While shards are written: SIGTERM and Ctrl-C noted, then raised (as `Terminated` and
    `KeyboardInterrupt`, what `run_command` turns into exit codes 75 and 130) between two shards by
    `check`, never from inside the process pool's own code, where an exception raised by a signal
    handler can leave the pool's shutdown waiting for ever (a SIGTERM once hung the command there, in
    the test suite). Shards are written atomically, so the running ones finish and the rest are left."""

    def __enter__(self):
        self.received, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._note) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _note(self, signum, frame) -> None:
        self.received = self.received or signum

    def check(self) -> None:
        if self.received == signal.SIGTERM:
            raise Terminated(signal.SIGTERM.name)
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt

    def result(self, task: concurrent.futures.Future) -> Any:
        """`task.result()`, checking for a signal every 0.1 s while it runs."""
        while True:
            try:
                return task.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                self.check()

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _write_shards(
    source: sources.SourceSpec, out: pathlib.Path, manifest: Manifest, workers: int, progress: bool,
    encoder: sft.Encoder | None = None, in_process_bytes: int = 0,
) -> dict[str, dict[str, Any]]:
    """Write every planned shard not already on disk, `workers` at a time (below `in_process_bytes` of
    input, one at a time in this process on `workers` of the tokenizer's threads); the manifest's splits."""
    tokenizer_path = str(tokenizer_file(out))
    if workers == 1 or sum(s["bytes"] for s in manifest["sources"]) < in_process_bytes:
        _load_tokenizer(tokenizer_path, threads=workers)  # the tokenizer's own threads, no process to start
        executor: concurrent.futures.Executor = _InProcess()
    else:  # spawn, not fork: the caller may hold threads (JAX, grain) that a fork would copy mid-flight
        executor = concurrent.futures.ProcessPoolExecutor(
            workers, multiprocessing.get_context("spawn"), _start_worker, (tokenizer_path, os.getpid())
        )
    splits: dict[str, dict[str, Any]] = {split: {"documents": 0, "tokens": 0, "shards": []} for split in SPLITS}
    if encoder:
        for split in SPLITS:
            splits[split]["weighted_tokens"] = 0
    # The bar starts with the first shard done, so that a bad row among the first shard's (the most
    # common: a whole file in another format) is the only line printed; one found later clears it on a
    # terminal (in a log, the bar's lines stay above the error's).
    bar: tqdm.tqdm | None = None
    start, written, new_tokens = time.perf_counter(), 0, 0

    def collect(split: str, task: concurrent.futures.Future | dict[str, Any]) -> None:
        nonlocal bar, written, new_tokens
        is_new = isinstance(task, concurrent.futures.Future)
        entry = signals.result(task) if is_new else task
        if bar is None:
            bar = tqdm.tqdm(desc="prepare", unit=" docs", file=sys.stderr, disable=not progress)
        splits[split]["shards"].append(entry)
        splits[split]["documents"] += entry["documents"]
        splits[split]["tokens"] += entry["tokens"]
        if encoder:
            splits[split]["weighted_tokens"] += entry["weighted_tokens"]
        bar.update(entry["documents"])
        if is_new:
            written, new_tokens = written + 1, new_tokens + entry["tokens"]
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):,.0f} tokens/s")

    try:
        with _SignalsBetweenShards() as signals, executor:
            pending: collections.deque = collections.deque()
            try:
                for split, name, docs in _plan(source, manifest["options"], encoder.format if encoder else None):
                    signals.check()
                    task = _existing_shard(out / name, len(docs), 3 if encoder else 2)
                    if task is None:
                        task = executor.submit(_write_shard, str(out / name), docs, manifest["token_dtype"], encoder)
                    pending.append((split, task))
                    while len(pending) > 2 * workers:  # bound the documents held in memory
                        collect(*pending.popleft())
                while pending:
                    collect(*pending.popleft())
            except (Terminated, KeyboardInterrupt):
                executor.shutdown(wait=True, cancel_futures=True)  # the running shards finish, the queued ones go
                raise
    except BaseException:
        if bar is not None and sys.stderr.isatty():
            bar.leave = False  # cleared: the error's line is what the terminal shows
        raise
    finally:
        if bar is not None:
            bar.close()
    if not splits["train"]["documents"] + splits["val"]["documents"]:
        raise UserError(f"the corpus {source.paths!r} holds no documents (every file is empty); give non-empty text")
    if not splits["train"]["documents"]:
        raise UserError(f"all {splits['val']['documents']} documents fell in the validation split; lower val_fraction")
    return splits


# ----------------------------------------------------------------------------- reading shards


def _shard_layout(path: str | os.PathLike, arrays: int = 2) -> list[tuple[np.dtype, int, int]] | None:
    """(dtype, length, byte offset) of a shard's offsets and tokens (and weights: `arrays=3`), or None
    if not a whole shard."""
    layout = []
    try:
        with open(path, "rb") as f:
            for _ in range(arrays):
                np.lib.format.read_magic(f)
                (length,), _, dtype = np.lib.format.read_array_header_1_0(f)
                layout.append((dtype, length, f.tell()))
                f.seek(length * dtype.itemsize, os.SEEK_CUR)
            whole = f.tell() == os.fstat(f.fileno()).st_size
    except (OSError, ValueError):
        return None
    return layout if whole else None


def _shard_damage(path: pathlib.Path, entry: dict[str, Any], verify: bool) -> str | None:
    """Why a shard does not match its manifest entry (size always, sha256 if `verify`), or None."""
    if not path.exists():
        return "is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"is truncated or corrupt ({size} bytes, the manifest says {entry['bytes']})"
    if verify and hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
        return "is corrupt (its sha256 differs from the manifest's)"
    return None


def _remove_damaged_shards(out: pathlib.Path, manifest: Manifest) -> int:
    """Delete the shards of a complete manifest that no longer match it, so that prepare rewrites them."""
    damaged = [
        out / entry["file"]
        for split in SPLITS
        for entry in manifest["splits"][split]["shards"]
        if _shard_damage(out / entry["file"], entry, verify=True)
    ]
    for path in damaged:
        path.unlink(missing_ok=True)
    return len(damaged)


def open_prepared(
    output_dir: str | os.PathLike, split: str = "train", verify: bool = False, skip_damaged: bool = False
) -> "FlatDocuments":
    """A split's documents, memory-mapped (nothing is read until used), for the grain pipeline.

    Every shard's size is checked against the manifest; `verify` also checks its sha256 (reads it all).
    A damaged shard is an error naming it, or with `skip_damaged` a logged warning and the shard left out.
    """
    # local import: heavy (grain, 0.6 s: the worker processes import this module and never need it)
    from jaxlm.data.pipeline import FlatDocuments

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    out = pathlib.Path(output_dir)
    manifest = read_manifest(out)
    if not manifest["complete"]:
        raise UserError(f"{out}: prepare did not finish; re-run it with the same arguments to complete the data")
    shards = []
    arrays = 3 if manifest.get("sft") else 2  # SFT data: the weights too
    for entry in manifest["splits"][split]["shards"]:
        path = out / entry["file"]
        damage = _shard_damage(path, entry, verify)
        layout = _shard_layout(path, arrays) if damage is None else None
        if layout is None:
            problem = f"shard {path} {damage or 'is corrupt'}; re-run prepare with the same arguments to rewrite it"
            if not skip_damaged:
                raise UserError(problem)
            log.warning("skipping %s (%d documents)", problem, entry["documents"])
            continue
        offsets, tokens, *weights = (np.memmap(path, dtype, "r", offset, (length,)) for dtype, length, offset in layout)
        shards.append((tokens, offsets, *weights))
    listed = manifest["splits"][split]["shards"]
    if listed and not shards:
        raise UserError(f"every {split} shard of {out} is damaged ({len(listed)} skipped, warnings above); re-run "
                        f"prepare with the same arguments to rewrite them")
    if arrays == 3 and not shards:  # an empty split still says it is weighted
        shards.append((np.zeros(0, np.uint16), np.zeros(1, np.int64), np.zeros(0, np.uint8)))
    return FlatDocuments(shards)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """The command: `_main`, its errors, interrupts and environment failures as one line and an exit code."""
    return run_command(lambda: _main(argv), resume="run the same command again to continue")


def make_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.data.prepare` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True,
                        help="'builtin', 'builtin_chat', or files, directories and globs, comma-separated")
    parser.add_argument("--format", default="auto", choices=sources.FORMATS + sft.FORMATS,
                        help="of the files; chat (messages, ShareGPT or Alpaca rows, told by their fields), sharegpt,"
                        " alpaca or prompt_completion: SFT rows of JSONL / Parquet files")
    parser.add_argument("--chat_template", default="",
                        help="--format chat: '' (the tokenizer's own), chatml, simple, or a .jinja file")
    parser.add_argument("--text_field", default="text", help="jsonl / parquet: the field holding the text")
    parser.add_argument("--separator", default="",
                        help="text files: split documents on this string (escapes such as \\n\\n are decoded);"
                        " empty: one document per file")
    parser.add_number("--max_bytes", kind=int, minimum=0, limit=2**62, default=0,
                      help="builtin only: stop after this many bytes")
    parser.add_path("--tokenizer", kind="any", io="in", required=True,
                        help="a SentencePiece .model file or a Hugging Face tokenizer.json (or its directory)")
    parser.add_path("--output", kind="dir", io="out", required=True, help="the directory to write (or to continue)")
    # (shard_docs, val_fraction and workers: their ranges are `prepare`'s own checks, for its library callers too)
    parser.add_number("--shard_docs", kind=int, minimum=1, default=4096, help="documents per shard")
    parser.add_number("--val_fraction", default=0.01)
    parser.add_number("--seed", kind=int, minimum=0, default=0, help="seed of the train/validation split")
    parser.add_number("--workers", kind=int, minimum=1, default=len(os.sched_getaffinity(0)),
                      help="processes (default: all)")
    return parser


def _main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        sft_spec = sft.Spec(args.format, args.chat_template) if args.format in sft.FORMATS else None
        source = sources.SourceSpec(args.input, "auto" if sft_spec else args.format, args.text_field,
                                    sources.unescape(args.separator), args.max_bytes)
        manifest = prepare(
            source, Tokenizer.load(args.tokenizer), args.output, val_fraction=args.val_fraction, seed=args.seed,
            shard_docs=args.shard_docs, workers=args.workers, sft_spec=sft_spec,
        )
    except UserError as e:
        return report_error(e)
    except KeyboardInterrupt:
        print("jaxlm: interrupted (run the same command again to continue)", file=sys.stderr)
        return 130
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    trained = (lambda split: f", {split['weighted_tokens']:,} trained on") if manifest.get("sft") else (lambda split: "")
    print(f"prepared {train['documents']:,} train documents ({train['tokens']:,} tokens{trained(train)}) and "
          f"{val['documents']:,} validation documents ({val['tokens']:,} tokens{trained(val)}) in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
