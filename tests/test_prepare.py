"""Prepared data: sharded tokenization, its manifest, resumption after a kill, and reading it back."""

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import floats
import numpy as np
import pytest

from jaxlm.data import pipeline, prepare, sources
from jaxlm.data.tokenizer import SentencePieceTokenizer, Tokenizer
from jaxlm.errors import UserError

SEQ_LEN = 64
OPTIONS = dict(val_fraction=0.2, seed=0, shard_docs=8)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> str:
    """Real text in two formats: stdlib sources split into documents at blank lines, plus JSONL."""
    root = tmp_path_factory.mktemp("corpus")
    texts = sources.builtin_corpus(120_000)
    for i in range(3):
        (root / f"part{i}.txt").write_text("\n\n\n".join(texts[i::3]), encoding="utf-8")
    records = [{"text": f"record {i}: héllo wörld 😀 " * (i + 1), "id": i} for i in range(12)]
    (root / "extra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(root)


@pytest.fixture(scope="module")
def source(corpus_dir: str) -> sources.SourceSpec:
    return sources.SourceSpec(f"{corpus_dir}/*.txt,{corpus_dir}/*.jsonl", separator="\n\n\n")


@pytest.fixture(scope="module")
def docs(source: sources.SourceSpec) -> list[str]:
    return list(sources.iter_documents(source))


@pytest.fixture(scope="module")
def tok(docs: list[str]) -> Tokenizer:
    return SentencePieceTokenizer.train(docs, 512)


@pytest.fixture(scope="module")
def tok_path(tok: Tokenizer, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok") / "tok.model")
    tok.save(path)
    return path


@pytest.fixture(scope="module")
def prepared(source: sources.SourceSpec, tok: Tokenizer, tmp_path_factory) -> str:
    """An uninterrupted single-worker prepare: the reference output."""
    out = str(tmp_path_factory.mktemp("prepared") / "out")
    prepare.prepare(source, tok, out, workers=1, progress=False, **OPTIONS)
    return out


def file_bytes(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def split_tokens(tok: Tokenizer, docs: list[str], split: str) -> list[np.ndarray]:
    chosen = [d for d in docs if sources.is_validation(d, OPTIONS["val_fraction"], OPTIONS["seed"]) == (split == "val")]
    return pipeline.tokenize_documents(tok, chosen)


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Returns once every process holding the output pipes has exited: workers must not outlive a kill."""
    return subprocess.run(
        [sys.executable, "-m", "jaxlm.data.prepare", *args], capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=60,
    )


def cli_args(corpus_dir: str, tok_path: str, out: str, workers: int) -> list[str]:
    return [
        "--input", f"{corpus_dir}/*.txt,{corpus_dir}/*.jsonl", "--separator", "\\n\\n\\n", "--tokenizer", tok_path,
        "--output", out, "--workers", str(workers), *(f"--{k}={v}" for k, v in OPTIONS.items()),
    ]


# --- writing ---


def test_manifest_matches_the_data(prepared: str, tok: Tokenizer, corpus_dir: str) -> None:
    manifest = prepare.read_manifest(prepared)
    assert manifest["complete"] and manifest["format_version"] == prepare.FORMAT_VERSION
    assert manifest["tokenizer"] == {"sha256": tok.sha256, "vocab_size": 512}
    assert manifest["token_dtype"] == "uint16"
    assert Tokenizer.load(os.path.join(prepared, prepare.TOKENIZER)).sha256 == tok.sha256
    texts = [os.path.join(corpus_dir, f"part{i}.txt") for i in range(3)]
    assert [s["path"] for s in manifest["sources"]] == texts + [os.path.join(corpus_dir, "extra.jsonl")]
    for source in manifest["sources"]:
        data = open(source["path"], "rb").read()
        assert source["bytes"] == len(data)
        assert source["sha256"] == hashlib.sha256(data).hexdigest()
    names = set()
    for split in prepare.SPLITS:
        info = manifest["splits"][split]
        docs = prepare.open_prepared(prepared, split, verify=True)
        assert len(info["shards"]) >= 2
        assert info["documents"] == sum(s["documents"] for s in info["shards"]) == len(docs)
        assert info["tokens"] == sum(s["tokens"] for s in info["shards"]) == docs.num_tokens
        assert all(s["documents"] == OPTIONS["shard_docs"] for s in info["shards"][:-1])
        names |= {s["file"] for s in info["shards"]}
    assert set(os.listdir(prepared)) == names | {prepare.MANIFEST, prepare.TOKENIZER}


def test_splits_are_disjoint_and_hold_every_document(prepared: str, tok: Tokenizer, docs: list[str]) -> None:
    texts = {}
    for split in prepare.SPLITS:
        got = prepare.open_prepared(prepared, split)
        expected = split_tokens(tok, docs, split)
        assert len(got) == len(expected) > 0
        for a, b in zip(got, expected):
            assert a.dtype == np.uint16
            np.testing.assert_array_equal(a, b)
        texts[split] = {tok.decode(d.tolist()) for d in got}
    assert not texts["train"] & texts["val"]
    assert texts["train"] | texts["val"] == set(docs)


def test_prepared_batches_equal_in_memory_batches(prepared: str, tok: Tokenizer, docs: list[str]) -> None:
    def batches(doc_tokens) -> list[dict[str, np.ndarray]]:
        it = iter(pipeline.make_train_dataset(doc_tokens, seq_len=SEQ_LEN, batch_size=4, seed=0))
        return [next(it) for _ in range(12)]

    def eval_batches(doc_tokens) -> list[dict[str, np.ndarray]]:
        return pipeline.make_eval_batches(doc_tokens, seq_len=SEQ_LEN, batch_size=4, max_batches=100)

    for got, expected in [
        (batches(prepare.open_prepared(prepared)), batches(split_tokens(tok, docs, "train"))),
        (eval_batches(prepare.open_prepared(prepared, "val")), eval_batches(split_tokens(tok, docs, "val"))),
    ]:
        for a, b in zip(got, expected, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype == (np.float32 if k == "weights" else np.int32)
                # the same pipeline on the same tokens, from the shards or from memory: its weights to the bit
                floats.identical(a[k], b[k], why=floats.SAME_PROGRAM)


def test_grain_workers_map_the_shards_again(prepared: str, tok: Tokenizer, docs: list[str]) -> None:
    train = prepare.open_prepared(prepared)
    assert len(pickle.dumps(pipeline._Chunks(train, SEQ_LEN))) < 2000  # file references, not the corpus

    def segments(doc_tokens, num_workers: int) -> collections.Counter:
        ds = pipeline.make_train_dataset(
            doc_tokens, seq_len=SEQ_LEN, batch_size=4, seed=0, num_workers=num_workers, num_epochs=1
        )
        counts = collections.Counter()
        for batch in ds:
            for row, seg_row in zip(batch["inputs"], batch["segment_ids"]):
                counts.update(tuple(row[seg_row == s].tolist()) for s in np.unique(seg_row[seg_row > 0]))
        return counts

    # The stream depends on num_workers, and so do the chunks each worker's last, partial batch drops
    # at the end of the epoch: the shards the workers map again give the in-memory stream's chunks.
    in_memory = split_tokens(tok, docs, "train")
    got = segments(train, num_workers=2)
    assert got == segments(in_memory, num_workers=2)
    # every one a chunk of the epoch, which misses at most each worker's dropped rows (< batch_size each)
    chunks = pipeline._Chunks(in_memory, SEQ_LEN)
    epoch = collections.Counter(tuple(chunks[i]["inputs"].tolist()) for i in range(len(chunks)))
    assert not got - epoch
    assert sum(len(c) * n for c, n in (epoch - got).items()) < 2 * 4 * SEQ_LEN


def test_two_workers_write_the_same_bytes_as_one(
    prepared: str, source: sources.SourceSpec, tok: Tokenizer, tmp_path
) -> None:
    prepare.prepare(source, tok, tmp_path / "out", workers=2, progress=False, **OPTIONS)
    assert file_bytes(str(tmp_path / "out")) == file_bytes(prepared)


def test_a_small_corpus_is_tokenized_in_process_on_the_tokenizers_threads(
    prepared: str, source: sources.SourceSpec, tok: Tokenizer, tmp_path, monkeypatch
) -> None:
    """The trainer's path (`in_process_bytes`): below it no worker process starts (a worker's start imports
    the trainer's own modules, JAX among them), and the bytes are the single worker's."""

    def no_worker_processes(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(prepare.concurrent.futures, "ProcessPoolExecutor", no_worker_processes)
    prepare.prepare(source, tok, tmp_path / "out", workers=2, progress=False, in_process_bytes=2**40, **OPTIONS)
    assert file_bytes(str(tmp_path / "out")) == file_bytes(prepared)
    with pytest.raises(AssertionError, match="worker process"):  # above it, the workers are processes
        prepare.prepare(source, tok, tmp_path / "big", workers=2, progress=False, in_process_bytes=1, **OPTIONS)


KILL_OPTIONS = dict(val_fraction=0.2, seed=0, shard_docs=2)  # many small shards: a signal lands half way


@pytest.fixture(scope="module")
def many_shards(tok: Tokenizer, tmp_path_factory):
    """corpus size -> (a corpus of hundreds of 2-document shards, its uninterrupted prepare), once per size."""
    root, made = tmp_path_factory.mktemp("many"), {}

    def make(max_bytes: int) -> tuple[pathlib.Path, pathlib.Path]:
        if max_bytes not in made:
            corpus, reference = root / f"corpus-{max_bytes}.txt", root / f"reference-{max_bytes}"
            corpus.write_text("\n\n\n".join(sources.builtin_corpus(max_bytes)), encoding="utf-8")
            prepare.prepare(sources.SourceSpec(str(corpus), separator="\n\n\n"), tok, reference, workers=1,
                            progress=False, **KILL_OPTIONS)
            made[max_bytes] = corpus, reference
        return made[max_bytes]

    return make


def signal_when_shards_appear(args: list[str], out: pathlib.Path, sig: signal.Signals) -> tuple[int, str]:
    """Run the prepare command and send it `sig` once 2 shards are on disk (unless it finished
    first); its exit code and stderr, once it and its workers have exited (they hold its pipes)."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxlm.data.prepare", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while len(list(out.glob("*.tokens"))) < 2 and proc.poll() is None:
        time.sleep(0.005)
    if proc.poll() is None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize(
    "sig, code, last_line",
    [
        (signal.SIGKILL, -signal.SIGKILL, None),  # the OOM killer, a lost node: no chance to clean up
        (signal.SIGTERM, 75, "jaxlm: stopped by SIGTERM; run the same command again to continue"),  # a scheduler
        pytest.param(signal.SIGINT, 130, "jaxlm: interrupted (run the same command again to continue)",  # Ctrl-C
                     marks=pytest.mark.slow),  # SIGTERM's path with another line (the default suite's time)
    ],
    ids=["SIGKILL", "SIGTERM", "SIGINT"],
)
def test_prepare_stopped_halfway_resumes_to_the_same_bytes(
    sig: signal.Signals, code: int, last_line: str | None, many_shards, tok_path: str, tmp_path
) -> None:
    """A real signal to the command, with two worker processes, once a few of many shards are on
    disk: the workers exit with it, and the same command completes the data, byte for byte what an
    uninterrupted run writes, without writing the finished shards again."""
    for max_bytes in (1_500_000, 4_000_000, 12_000_000):  # more to do if the last try finished before the signal
        corpus, reference = many_shards(max_bytes)
        num_shards = len(list(reference.glob("*.tokens")))
        out = tmp_path / f"out-{max_bytes}"
        args = ["--input", str(corpus), "--separator", "\\n\\n\\n", "--tokenizer", tok_path, "--output", str(out),
                "--workers", "2", *(f"--{k}={v}" for k, v in KILL_OPTIONS.items())]
        returncode, err = signal_when_shards_appear(args, out, sig)
        shards = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tokens")}
        if returncode != 0 and len(shards) < num_shards:
            break
    else:
        pytest.fail(f"prepare wrote all its shards before {sig.name} landed, even with {max_bytes:,} bytes of input")
    assert returncode == code, err[-2000:]
    if last_line is not None:
        assert err.strip().splitlines()[-1] == last_line
    assert 2 <= len(shards) < num_shards
    if sig != signal.SIGKILL:  # a graceful stop lets the running shards finish: no partial write is left
        assert not list(out.glob("*.tmp"))
    assert not prepare.read_manifest(out)["complete"]
    with pytest.raises(UserError, match="did not finish"):
        prepare.open_prepared(out)

    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stderr
    assert "prepared" in resumed.stdout
    assert file_bytes(str(out)) == file_bytes(str(reference))
    assert all((out / n).stat().st_mtime_ns == t for n, t in shards.items())  # not written again


# --- reading and refusing ---


def test_damaged_shard_is_named_and_rewritten_by_prepare(
    prepared: str, source: sources.SourceSpec, tok: Tokenizer, tmp_path, caplog
) -> None:
    out = str(tmp_path / "out")
    shutil.copytree(prepared, out)
    shard = os.path.join(out, "train-00001.tokens")
    data = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"train-00001\.tokens is truncated .*re-run prepare"):
        prepare.open_prepared(out)
    with open(shard, "wb") as f:  # same size, one byte changed: only the sha256 tells
        f.write(data[:-1] + bytes([data[-1] ^ 1]))
    prepare.open_prepared(out)
    with pytest.raises(UserError, match=r"train-00001\.tokens is corrupt .*re-run prepare"):
        prepare.open_prepared(out, verify=True)
    whole = prepare.open_prepared(prepared)
    skipped = prepare.open_prepared(out, verify=True, skip_damaged=True)  # or leave it out, with a warning
    lost = prepare.read_manifest(out)["splits"]["train"]["shards"][1]["documents"]
    assert len(skipped) == len(whole) - lost > 0
    assert "skipping shard" in caplog.text and "train-00001.tokens is corrupt" in caplog.text
    prepare.prepare(source, tok, out, progress=False, **OPTIONS)
    assert file_bytes(out) == file_bytes(prepared)


def test_other_tokenizer_inputs_or_options_are_refused(
    prepared: str, source: sources.SourceSpec, docs: list[str], corpus_dir: str, tmp_path
) -> None:
    out = str(tmp_path / "out")
    shutil.copytree(prepared, out)
    tok = Tokenizer.load(os.path.join(prepared, prepare.TOKENIZER))
    with pytest.raises(UserError, match="another tokenizer"):
        prepare.prepare(source, SentencePieceTokenizer.train(docs, 260, "byte"), out, progress=False, **OPTIONS)
    with pytest.raises(UserError, match="other options"):
        prepare.prepare(source, tok, out, progress=False, **{**OPTIONS, "shard_docs": 9})
    changed = str(tmp_path / "corpus")
    shutil.copytree(corpus_dir, changed)
    moved = dataclasses.replace(source, paths=f"{changed}/*.txt,{changed}/*.jsonl")
    with open(os.path.join(changed, "extra.jsonl"), "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(UserError, match="other input files"):
        prepare.prepare(moved, tok, out, progress=False, **OPTIONS)
    # The same contents read from another place are the same inputs.
    os.remove(os.path.join(changed, "extra.jsonl"))
    shutil.copy(os.path.join(corpus_dir, "extra.jsonl"), changed)
    prepare.prepare(moved, tok, out, progress=False, **OPTIONS)
    with pytest.raises(UserError, match="not an empty directory"):
        prepare.prepare(source, tok, corpus_dir, progress=False, **OPTIONS)
    assert file_bytes(out) == file_bytes(prepared)


def test_cli_reports_bad_input_in_one_line(tok_path: str, tmp_path, capsys) -> None:
    def error(*args: str) -> str:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        assert prepare.main(["--tokenizer", tok_path, "--output", str(out), *args]) == 2  # later flags win
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.endswith("\n")
        assert err.count("\n") == 1 and "docs/s" not in err, err  # the line alone: no progress bar before it
        assert err.startswith("jaxlm: error: ")
        assert not out.exists()  # the directory it began is gone with the failure
        return err.strip()

    assert "no input files match" in error("--input", str(tmp_path / "missing/*.txt"))
    (tmp_path / "blank.txt").write_text("  \n\n")
    assert "holds no documents" in error("--input", str(tmp_path / "blank.txt"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')
    assert "bad.jsonl:2" in error("--input", str(tmp_path / "bad.jsonl"))
    assert "nope.model' does not exist" in error("--input", "builtin", "--tokenizer", str(tmp_path / "nope.model"))


def test_a_failed_prepare_removes_the_directory_it_began_and_keeps_one_it_continues(tok: Tokenizer, tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(400)) + '{"body": "x"}\n')
    source, options = sources.SourceSpec(str(path)), dict(val_fraction=0.0, shard_docs=1, workers=1, progress=False)
    bad_row = "c.jsonl:401: no field 'text'"
    with pytest.raises(UserError, match=bad_row):
        prepare.prepare(source, tok, tmp_path / "new" / "out", **{**options, "shard_docs": 100})
    assert not (tmp_path / "new" / "out").exists()  # made by prepare: removed
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=bad_row):
        prepare.prepare(source, tok, tmp_path / "empty", **{**options, "shard_docs": 100})
    assert list((tmp_path / "empty").iterdir()) == []  # the user's directory stays, as it was
    # Interrupted (Ctrl-C) after a few shards, then failing at the bad row: its shards stay to be continued.
    out, inside = tmp_path / "continued", threading.Event()

    def interrupt() -> None:
        while not (out / "train-00002.tokens").exists():
            time.sleep(0.001)
        if inside.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    inside.set()
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare(source, tok, out, **options)
    finally:
        inside.clear()
        thread.join()
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tokens")}
    assert 3 <= len(written) < 400 and not prepare.read_manifest(out)["complete"]
    with pytest.raises(UserError, match=bad_row):
        prepare.prepare(source, tok, out, **options)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.tokens") if p.name in written} == written
    assert not prepare.read_manifest(out)["complete"]


# --- progress through the data ---


def test_epoch_and_tokens_seen_follow_the_stream_and_resume() -> None:
    docs = [(1000 * (i + 1) + np.arange(n)).astype(np.int32) for i, n in enumerate(range(3, 43))]
    pairs_per_epoch = sum(len(d) - 1 for d in docs)

    def make(num_epochs: int | None) -> pipeline.TrainIterator:
        return iter(pipeline.make_train_dataset(docs, seq_len=16, batch_size=1, seed=0, num_epochs=num_epochs))

    it, epochs, tokens = make(2), [], []
    for batch in it:
        assert sorted(batch) == ["inputs", "positions", "segment_ids", "targets", "weights"]
        tokens.append(int((batch["segment_ids"] > 0).sum()))
        epochs.append(it.epoch)
        assert it.tokens_seen == sum(tokens)
    assert sum(tokens) == 2 * pairs_per_epoch
    assert epochs[0] == 0 and epochs[-1] == 1 and epochs == sorted(epochs)
    # With one packing bin, rows close in order: only the row that crosses into epoch 1 mixes epochs.
    first_epoch_tokens = sum(t for t, e in zip(tokens, epochs) if e == 0)
    assert pairs_per_epoch - 16 < first_epoch_tokens <= pairs_per_epoch

    it = make(None)
    for _ in range(len(epochs) // 2 - 5):  # resume a few batches before the end of epoch 0
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [(next(it)["inputs"], it.epoch, it.tokens_seen) for _ in range(10)]
    assert {epoch for _, epoch, _ in expected} == {0, 1}
    resumed = make(None)
    resumed.set_state(state)
    for inputs, epoch, tokens_seen in expected:
        np.testing.assert_array_equal(next(resumed)["inputs"], inputs)
        assert (resumed.epoch, resumed.tokens_seen) == (epoch, tokens_seen)
