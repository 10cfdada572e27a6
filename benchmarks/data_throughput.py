"""Data throughput on this host: the prepared format, `prepare`, and the packed grain pipeline.

    python benchmarks/data_throughput.py                 # the whole built-in corpus, vocab 32000
    python benchmarks/data_throughput.py --max_bytes 3000000 --vocab 8000

1. Format: a flat token file (memory-mapped) versus array_record with one record per document, on
   the prepared tokens repeated to --format_tokens: write speed, and random reads of the pipeline's
   access pattern (a random chunk of seq_len + 1 tokens of a random document).
2. prepare: tokens/s of `python -m jaxlm.data.prepare` (reading, hashing, tokenizing, writing) with
   1 and 2 worker processes, wall time of the command.
3. Pipeline: tokens/s of `make_train_dataset` over the memory-mapped shards (shuffle, pack, batch)
   and of `make_text_train_dataset` (raw documents tokenized on the fly, then the same) on the
   host, with 0 and 2 grain workers.
Next to it: the tokens/s that the 1b recipe consumes on one H100 at 50% MFU.
"""

import argparse
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxlm import config
from jaxlm.data import pipeline, prepare, sources, tokenizer
from jaxlm.models.transformer import ModelConfig, flops_per_token

H100_PEAK_BF16_FLOPS = 989e12


def bench_formats(
    docs: pipeline.FlatDocuments, workdir: str, seq_len: int, total_tokens: int, reads: int
) -> list[dict]:
    """Write, then randomly read chunks of, the same documents as a flat token file and as array_record."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    doc_list = [np.asarray(d, np.uint16) for d in docs] * -(-total_tokens // docs.num_tokens)  # repeated
    offsets = np.cumsum([0] + [len(d) for d in doc_list], dtype=np.int64)
    lengths = np.diff(offsets)
    num_chunks = (lengths - 2) // seq_len + 1  # the chunks of pipeline._Chunks
    doc_of_chunk = np.repeat(np.arange(len(lengths)), num_chunks)
    offset_in_doc = (np.arange(len(doc_of_chunk)) - (np.cumsum(num_chunks) - num_chunks)[doc_of_chunk]) * seq_len
    picks = np.random.default_rng(0).integers(0, len(doc_of_chunk), reads)
    starts = offsets[doc_of_chunk[picks]] + offset_in_doc[picks]
    ends = np.minimum(starts + seq_len + 1, offsets[doc_of_chunk[picks] + 1])

    path = os.path.join(workdir, "tokens.npy")
    write_s = timed(lambda: (np.save(path, np.concatenate(doc_list)), np.save(path + ".offsets.npy", offsets)))
    tokens = np.load(path, mmap_mode="r")
    flat = [lambda i=i: tokens[starts[i] : ends[i]].astype(np.int32) for i in range(reads)]
    rows = [format_row("flat .npy + offsets, memory-mapped", path, write_s, flat)]
    for options in ("group_size:1", "group_size:1,uncompressed"):
        path = os.path.join(workdir, f"docs-{len(rows)}.array_record")

        def write(path=path, options=options) -> None:
            writer = ArrayRecordWriter(path, options)
            for doc in doc_list:
                writer.write(doc.tobytes())
            writer.close()

        write_s = timed(write)
        reader = ArrayRecordReader(path, "readahead_buffer_size:0")
        records = [
            lambda i=i, reader=reader: np.frombuffer(reader.read([int(doc_of_chunk[picks[i]])])[0], np.uint16)[
                offset_in_doc[picks[i]] : offset_in_doc[picks[i]] + seq_len + 1].astype(np.int32)
            for i in range(reads)
        ]
        assert all(np.array_equal(a(), b()) for a, b in zip(flat[:100], records[:100]))  # the same chunks
        rows.append(format_row(f"array_record ({options}), a record per document", path, write_s, records))
    for row in rows:
        row["flat is faster"] = f"{rows[0]['random chunks/s'] / row['random chunks/s']:.1f}x"
    return rows


def timed(fn: Callable[[], Any]) -> float:
    """Best of three: what the code costs once the page cache is warm."""
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def format_row(name: str, path: str, write_s: float, reads: list[Callable[[], np.ndarray]]) -> dict:
    read_s = timed(lambda: [read() for read in reads])
    tokens_read = sum(len(read()) for read in reads)
    return {"format": name, "file MB": round(os.path.getsize(path) / 1e6, 1),
            "write MB/s": round(os.path.getsize(path) / write_s / 1e6), "random chunks/s": round(len(reads) / read_s),
            "tokens/s read": round(tokens_read / read_s)}


def bench_pipeline(ds, batches: int) -> dict:
    """Tokens/s of a batch stream (after 5 warm-up batches) and its fraction of real (non-pad) tokens."""
    it = iter(ds)
    try:
        for _ in range(5):  # worker start-up and first fills
            next(it)
        seen = it.tokens_seen
        t = time.perf_counter()
        for _ in range(batches):
            batch = next(it)
        elapsed = time.perf_counter() - t
        real = it.tokens_seen - seen
        tokens = batches * batch["inputs"].size
    finally:
        it.close()
    return {"tokens_per_s": tokens / elapsed, "real_fraction": real / tokens}


def print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()) + " |")
    print()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cached_tokenizer(cache_dir: str, docs: list[str], vocab_size: int) -> tokenizer.Tokenizer:
    """The BPE tokenizer of these documents and vocab size, trained once and kept in `cache_dir`."""
    key = hashlib.sha256(f"{sources.corpus_fingerprint(docs)}|{vocab_size}|bpe".encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"tokenizer-{key}.model")
    if os.path.exists(path):
        return tokenizer.Tokenizer.load(path)
    tok = tokenizer.SentencePieceTokenizer.train(docs, vocab_size, "bpe")
    tok.save(path)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_bytes", type=int, default=0, help="of the built-in corpus (0: all of it)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--shard_docs", type=int, default=32, help="small enough that 2 workers share the corpus")
    parser.add_argument("--batches", type=int, default=100, help="pipeline batches timed")
    parser.add_argument("--format_tokens", type=int, default=10_000_000, help="tokens in the format test (at least)")
    parser.add_argument("--reads", type=int, default=20_000, help="random chunk reads in the format test")
    parser.add_argument("--cache_dir", default=os.path.join(tempfile.gettempdir(), "jaxlm-bench-cache"))
    args = parser.parse_args()
    packages = ("numpy", "grain", "array_record", "sentencepiece")
    versions = " | ".join(f"{p} {importlib.metadata.version(p)}" for p in packages)
    print(f"# {time.strftime('%Y-%m-%d')} | {cpu_model()}, {len(os.sched_getaffinity(0))} cores"
          f" | python {platform.python_version()} | {versions}\n")
    source = sources.SourceSpec("builtin", max_bytes=args.max_bytes)
    docs = list(sources.iter_documents(source))
    t = time.perf_counter()
    tok = cached_tokenizer(args.cache_dir, docs, args.vocab)
    print(f"corpus: {len(docs)} documents, {sum(len(d.encode()) for d in docs) / 1e6:.1f} MB; tokenizer bpe"
          f" {args.vocab} ({time.perf_counter() - t:.0f} s, cached in {args.cache_dir})\n")

    workdir = tempfile.mkdtemp(prefix="jaxlm-data-bench-")
    try:
        tok_path = os.path.join(workdir, "tokenizer.model")
        tok.save(tok_path)
        rows = []
        for workers in (1, 2):
            # The CLI, as users run it: a script's heavy imports (JAX here) would be re-imported by each spawned worker.
            out = os.path.join(workdir, f"prepared-{workers}")
            command = [
                sys.executable, "-m", "jaxlm.data.prepare", "--input", "builtin", f"--max_bytes={args.max_bytes}",
                "--tokenizer", tok_path, "--output", out, f"--shard_docs={args.shard_docs}", f"--workers={workers}",
            ]
            t = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            elapsed = time.perf_counter() - t
            tokens = sum(prepare.read_manifest(out)["splits"][s]["tokens"] for s in prepare.SPLITS)
            rows.append({"prepare (CLI, start-up included)": f"{workers} worker{'s' * (workers > 1)}", "tokens": tokens,
                         "seconds": round(elapsed, 1), "tokens/s": round(tokens / elapsed)})
        print_table(rows)

        train = prepare.open_prepared(out)
        model_1b = ModelConfig.from_config(config.load_recipe("1b").model)
        need = 0.5 * H100_PEAK_BF16_FLOPS / flops_per_token(model_1b, 2048)
        rows = []
        options = dict(seq_len=args.seq_len, batch_size=args.batch, seed=0)
        streams = {"prepared shards": lambda w: pipeline.make_train_dataset(train, num_workers=w, **options),
                   "raw text, tokenized on the fly": lambda w: pipeline.make_text_train_dataset(
                       docs, tok, num_workers=w, **options)}
        for name, make in streams.items():
            for num_workers in (0, 2):
                result = bench_pipeline(make(num_workers), args.batches)
                rows.append({"pipeline": f"{name}, {args.batch}x{args.seq_len}, num_workers={num_workers}",
                             "tokens/s": round(result["tokens_per_s"]),
                             "real (non-pad) tokens": f"{result['real_fraction']:.1%}",
                             "x the 1b recipe on one H100 at 50% MFU": f"{result['tokens_per_s'] / need:.1f}x"})
        print_table(rows)
        print(f"1b recipe on one H100 at 50% MFU consumes {need:,.0f} tokens/s; 10x is {10 * need:,.0f} tokens/s\n")

        print_table(bench_formats(train, workdir, args.seq_len, args.format_tokens, args.reads))
    finally:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
