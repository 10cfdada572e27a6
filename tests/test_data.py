"""Data path: built-in corpus, split, SentencePiece tokenizer, caches and the grain pipeline."""

import collections
import hashlib
import inspect
import json
import os
import textwrap

import floats
import grain
import numpy as np
import pytest
import sentencepiece as spm

from helpers import llama_layout_model
from jaxlm.data import pipeline, sources
from jaxlm.data.tokenizer import SentencePieceTokenizer, Tokenizer
from jaxlm.errors import UserError

UNICODE_TEXTS = [
    "héllo wörld 😀🚀👩‍👩‍👧 你好，世界 こんにちは 안녕하세요 Ωμέγα",
    "tabs\tand  runs   of    spaces\n\n\nblank lines\r\nand CRLF ",
    "   leading and trailing whitespace   \n",
    "digits 1234567890 and symbols ~!@#$%^&*()_+{}|:\"<>?",
    "",
]
SEQ_LEN = 16


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return sources.builtin_corpus(300_000)


@pytest.fixture(scope="module")
def bpe(corpus: list[str]) -> Tokenizer:
    return SentencePieceTokenizer.train(corpus, 512)


def synthetic_docs(num_docs: int = 40, seed: int = 0) -> list[np.ndarray]:
    """Documents of distinct tokens: doc i holds 1000 * (i + 1) + [0, n), so pairs reveal their origin."""
    lengths = np.random.default_rng(seed).integers(1, 60, size=num_docs)
    return [(1000 * (i + 1) + np.arange(n)).astype(np.int32) for i, n in enumerate(lengths)]


def segments(batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every packed segment of a batch, as its inputs/targets/positions."""
    out = []
    for row in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][row]
        for s in np.unique(seg[seg > 0]):
            mask = seg == s
            out.append({k: batch[k][row][mask] for k in ("inputs", "targets", "positions")})
    return out


def take(ds, n: int) -> list[dict[str, np.ndarray]]:
    it = iter(ds)
    try:
        return [next(it) for _ in range(n)]
    finally:
        it.close()


def assert_batches_equal(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        floats.identical(x, y, why=floats.SAME_PROGRAM)  # the pipeline twice: its weights too, to the bit


# --- sources ---


def test_builtin_corpus_is_deterministic_and_stops_at_max_bytes(corpus: list[str]) -> None:
    assert sources.builtin_corpus(300_000) == corpus
    sizes = [len(doc.encode("utf-8")) for doc in corpus]
    assert sum(sizes) >= 300_000 > sum(sizes[:-1])
    assert all(sizes)
    assert any("def " in doc for doc in corpus)


def test_the_validation_split_is_decided_by_the_text_not_the_position() -> None:
    docs = [f"document {i}\n" for i in range(200)]
    val = {d for d in docs if sources.is_validation(d, 0.1, seed=0)}
    assert 5 <= len(val) <= 40
    assert val == {d for d in docs[::-1] if sources.is_validation(d, 0.1, seed=0)}
    assert val != {d for d in docs if sources.is_validation(d, 0.1, seed=1)}
    assert not any(sources.is_validation(d, 0.0, seed=0) for d in docs)


def test_corpus_fingerprint() -> None:
    assert sources.corpus_fingerprint(["ab", "c"]) == sources.corpus_fingerprint(["ab", "c"])
    assert sources.corpus_fingerprint(["ab", "c"]) != sources.corpus_fingerprint(["a", "bc"])
    assert sources.corpus_fingerprint(["ab", "c"]) != sources.corpus_fingerprint(["c", "ab"])


# --- tokenizer ---


@pytest.mark.parametrize("model_type,vocab_size", [("bpe", 512), ("unigram", 512), ("char", 512), ("byte", 260)])
def test_tokenizer_round_trips_exactly(corpus: list[str], model_type: str, vocab_size: int) -> None:
    tok = SentencePieceTokenizer.train(corpus, vocab_size, model_type)
    assert tok.vocab_size == vocab_size
    held_out_source = inspect.getsource(textwrap)  # a real multi-line Python file
    texts = UNICODE_TEXTS + [held_out_source, corpus[0]]
    encoded = tok.encode(texts)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)  # every trained tokenizer's
    for text, ids in zip(texts, encoded):
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.unk_id not in ids and tok.pad_id not in ids
        assert max(ids) < vocab_size
        assert tok.decode(ids) == text
    assert tok.encode(["a\nb"], add_bos=False, add_eos=False)[0][0] not in (tok.bos_id, tok.eos_id)
    x_y = tok.encode(["x y"], add_bos=False, add_eos=False)[0]
    assert tok.decode([tok.bos_id, tok.pad_id, *x_y, tok.eos_id]) == "x y"


def test_bpe_learns_merges(bpe: Tokenizer, corpus: list[str]) -> None:
    num_tokens = sum(len(ids) - 2 for ids in bpe.encode(corpus))
    assert num_tokens < 0.6 * sum(len(doc.encode()) for doc in corpus)


def test_special_ids_and_identity_survive_save_load(bpe: Tokenizer, tmp_path) -> None:
    path = tmp_path / "tok.model"
    bpe.save(path)
    proto = spm.SentencePieceProcessor(model_file=str(path))
    assert [proto.id_to_piece(i) for i in (0, 1, 2, 3)] == ["<pad>", "<unk>", "<s>", "</s>"]
    loaded = Tokenizer.load(path)
    assert isinstance(loaded, SentencePieceTokenizer)
    assert (loaded.pad_id, loaded.unk_id, loaded.bos_id, loaded.eos_id) == (0, 1, 2, 3)
    assert loaded.sha256 == bpe.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.vocab_size == bpe.vocab_size
    assert loaded.encode(UNICODE_TEXTS) == bpe.encode(UNICODE_TEXTS)
    assert os.listdir(tmp_path) == ["tok.model"]  # no temporary file left behind


def test_a_model_trained_elsewhere_keeps_its_own_special_ids(tmp_path) -> None:
    path = tmp_path / "llama.model"
    path.write_bytes(llama_layout_model())  # unk 0, bos 1, eos 2, no pad
    tok = Tokenizer.load(path)
    assert (tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.pad_id == tok.eos_id  # no pad: EOS stands in (never scored, never attended to)
    ids = pipeline.tokenize_documents(tok, ["alice likes bob"])[0]
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids.tolist()) == "alice likes bob"
    assert tok.byte_lengths()[[0, 1, 2]].sum() == 0
    # No BOS, EOS or pad at all: encoding adds none, and padding falls back to id 0.
    bare = SentencePieceTokenizer(llama_layout_model(bos_id=-1, eos_id=-1))
    assert (bare.bos_id, bare.eos_id, bare.pad_id) == (-1, -1, 0)
    assert bare.encode(["ab"]) == bare.encode(["ab"], add_bos=False, add_eos=False)


def test_tokenizer_training_is_deterministic(corpus: list[str], bpe: Tokenizer) -> None:
    assert SentencePieceTokenizer.train(corpus, 512).sha256 == bpe.sha256


def test_tokenizer_errors(corpus: list[str], tmp_path) -> None:
    with pytest.raises(ValueError, match="bpe, unigram, char, byte"):
        SentencePieceTokenizer.train(corpus, 512, "wordpiece")
    with pytest.raises(UserError, match="vocab_size=200000"):
        SentencePieceTokenizer.train(corpus, 200_000)
    with pytest.raises(ValueError, match="260"):
        SentencePieceTokenizer.train(corpus, 100, "byte")
    with pytest.raises(UserError, match="not found"):
        Tokenizer.load(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        Tokenizer.load(tmp_path / "junk.model")


# --- tokenized documents ---


def test_tokenize_documents(bpe: Tokenizer, corpus: list[str]) -> None:
    docs = corpus[:4] + ["", "short"]
    doc_tokens = pipeline.tokenize_documents(bpe, docs)
    for doc, ids in zip(docs, doc_tokens):
        assert ids.dtype == np.int32 and ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id
        assert bpe.decode(ids.tolist()) == doc


# --- pipeline ---


def test_packed_batches_hold_true_next_token_pairs() -> None:
    batches = take(pipeline.make_train_dataset(synthetic_docs(), seq_len=SEQ_LEN, batch_size=4, seed=0), 30)
    for batch in batches:
        assert sorted(batch) == ["inputs", "positions", "segment_ids", "targets", "weights"]
        for key, value in batch.items():
            assert value.shape == (4, SEQ_LEN) and value.dtype == (np.float32 if key == "weights" else np.int32)
        pad = batch["segment_ids"] == 0
        # the loss skips padding only: 1.0 or 0.0 written, never computed
        floats.identical(batch["weights"], np.where(pad, 0.0, 1.0).astype(np.float32), why=floats.MOVED)
        assert not batch["inputs"][pad].any() and not batch["targets"][pad].any() and not batch["positions"][pad].any()
        for seg_row in batch["segment_ids"]:  # segments 1..k, then padding only at the end
            used = seg_row[seg_row > 0]
            assert np.all(seg_row[: len(used)] == used)
            assert np.array_equal(np.unique(used), np.arange(1, len(np.unique(used)) + 1))
        for seg in segments(batch):
            np.testing.assert_array_equal(seg["positions"], np.arange(len(seg["inputs"])))
            np.testing.assert_array_equal(seg["targets"], seg["inputs"] + 1)  # the document's next token
            np.testing.assert_array_equal(seg["targets"] // 1000, seg["inputs"] // 1000)  # same document
            offset_in_doc = seg["inputs"][0] % 1000
            assert offset_in_doc % SEQ_LEN == 0  # chunks start every seq_len tokens


def test_inputs_and_targets_pack_identically() -> None:
    ds = grain.experimental.FirstFitPackIterDataset(
        grain.MapDataset.source(pipeline._Chunks(synthetic_docs(), SEQ_LEN)).to_iter_dataset(),
        length_struct={"inputs": SEQ_LEN, "targets": SEQ_LEN},
        num_packing_bins=4,
        shuffle_bins=False,
    )
    for packed in ds:
        np.testing.assert_array_equal(packed["inputs_segment_ids"], packed["targets_segment_ids"])
        np.testing.assert_array_equal(packed["inputs_positions"], packed["targets_positions"])


def test_one_epoch_loses_no_token() -> None:
    docs = synthetic_docs()
    batches = list(pipeline.make_train_dataset(docs, seq_len=SEQ_LEN, batch_size=1, seed=3, num_epochs=1))
    targets = np.concatenate([b["targets"][b["segment_ids"] > 0] for b in batches])
    inputs = np.concatenate([b["inputs"][b["segment_ids"] > 0] for b in batches])
    # Every next-token pair of every document, exactly once.
    assert collections.Counter(targets.tolist()) == collections.Counter(np.concatenate([d[1:] for d in docs]).tolist())
    assert collections.Counter(inputs.tolist()) == collections.Counter(np.concatenate([d[:-1] for d in docs]).tolist())


def test_seed_fixes_the_order() -> None:
    docs = synthetic_docs()

    def make(seed: int) -> grain.IterDataset:
        return pipeline.make_train_dataset(docs, seq_len=SEQ_LEN, batch_size=4, seed=seed)

    assert_batches_equal(take(make(0), 5), take(make(0), 5))
    other = take(make(1), 5)
    assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(take(make(0), 5), other))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_iterator_state_is_exact(num_workers: int) -> None:
    docs = synthetic_docs()

    def make() -> grain.IterDataset:
        return pipeline.make_train_dataset(docs, seq_len=SEQ_LEN, batch_size=4, seed=0, num_workers=num_workers)

    it = iter(make())
    try:
        for _ in range(7):
            next(it)
        state = it.get_state()
        expected = [next(it) for _ in range(3)]
    finally:
        it.close()
    state = json.loads(json.dumps(state))  # as a checkpoint stores it
    resumed = iter(make())
    try:
        resumed.set_state(state)
        got = [next(resumed) for _ in range(3)]
    finally:
        resumed.close()
    assert_batches_equal(got, expected)


def test_shards_are_disjoint_and_cover_the_data() -> None:
    docs = synthetic_docs()

    def examples(shard_index: int, shard_count: int) -> collections.Counter:
        ds = pipeline.make_train_dataset(
            docs, seq_len=SEQ_LEN, batch_size=1, seed=0, shard_index=shard_index, shard_count=shard_count, num_epochs=1
        )
        return collections.Counter(tuple(seg["inputs"].tolist()) for b in ds for seg in segments(b))

    first, second, whole = examples(0, 2), examples(1, 2), examples(0, 1)
    assert first and second and not first.keys() & second.keys()
    assert first + second == whole
    with pytest.raises(ValueError):
        pipeline.make_train_dataset(docs, seq_len=SEQ_LEN, batch_size=1, seed=0, shard_index=2, shard_count=2)


def test_eval_batches_are_fixed_and_complete() -> None:
    docs = synthetic_docs()
    batches = pipeline.make_eval_batches(docs, seq_len=SEQ_LEN, batch_size=4, max_batches=1000)
    assert_batches_equal(batches, pipeline.make_eval_batches(docs, seq_len=SEQ_LEN, batch_size=4, max_batches=1000))
    assert all(v.shape == (4, SEQ_LEN) and v.dtype == (np.float32 if k == "weights" else np.int32)
               for b in batches for k, v in b.items())
    for b in batches:  # 1.0 or 0.0 written, never computed
        floats.identical(b["weights"], (b["segment_ids"] > 0).astype(np.float32), why=floats.MOVED)
    targets = np.concatenate([b["targets"][b["segment_ids"] > 0] for b in batches])
    assert collections.Counter(targets.tolist()) == collections.Counter(np.concatenate([d[1:] for d in docs]).tolist())
    # No shuffling: the first segment is the start of the first document with a next-token pair.
    first_doc = next(d for d in docs if len(d) >= 2)
    np.testing.assert_array_equal(segments(batches[0])[0]["inputs"], first_doc[: min(len(first_doc) - 1, SEQ_LEN)])
    assert_batches_equal(
        pipeline.make_eval_batches(docs, seq_len=SEQ_LEN, batch_size=4, max_batches=2), batches[:2]
    )


# --- tokenizing on the fly ---


def text_docs(corpus: list[str]) -> list[str]:
    """Small raw documents (split on blank lines) with emoji and CJK among them."""
    docs = [d for text in corpus[:3] for d in text.split("\n\n") if d][:60]
    return docs + UNICODE_TEXTS


def test_on_the_fly_gives_the_prepared_chunks_and_keeps_documents_apart(bpe: Tokenizer, corpus: list[str]) -> None:
    docs = text_docs(corpus)
    batches = list(pipeline.make_text_train_dataset(docs, bpe, seq_len=SEQ_LEN, batch_size=2, seed=0, num_epochs=1))
    # The segments are exactly the chunks of the tokenized documents (none crosses a document),
    # each once, except those in the dropped last partial batch.
    got = collections.Counter(tuple(seg["inputs"].tolist()) + (-1,) + tuple(seg["targets"].tolist())
                              for b in batches for seg in segments(b))
    chunks = pipeline._Chunks(pipeline.tokenize_documents(bpe, docs), SEQ_LEN)
    expected = collections.Counter(
        tuple(c["inputs"].tolist()) + (-1,) + tuple(c["targets"].tolist()) for c in (chunks[i] for i in range(len(chunks)))
    )
    assert not got - expected
    lost = expected - got
    assert sum(len(k) // 2 for k in lost.elements()) < 2 * SEQ_LEN  # at most the remainder batch's tokens
    for b in batches:
        for seg in segments(b):
            np.testing.assert_array_equal(seg["positions"], np.arange(len(seg["inputs"])))


def test_on_the_fly_tokenizer_is_pickled_as_its_model(bpe: Tokenizer) -> None:
    import pickle

    copy = pickle.loads(pickle.dumps(bpe))
    assert copy.sha256 == bpe.sha256 and copy.encode(UNICODE_TEXTS) == bpe.encode(UNICODE_TEXTS)


# grain's worker processes: test_resume_from_iterator_state_is_exact[2] in the default suite, here in the slow one
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_on_the_fly_resume_is_exact_and_counts_epochs(bpe: Tokenizer, corpus: list[str], num_workers: int) -> None:
    docs = text_docs(corpus)

    def make() -> grain.IterDataset:
        return pipeline.make_text_train_dataset(docs, bpe, seq_len=SEQ_LEN, batch_size=4, seed=0,
                                                num_workers=num_workers)

    one_epoch = len(list(pipeline.make_text_train_dataset(docs, bpe, seq_len=SEQ_LEN, batch_size=4, seed=0,
                                                          num_epochs=1)))
    it = iter(make())
    try:
        for _ in range(one_epoch + 2):  # into the second epoch
            next(it)
        state = it.get_state()
        assert it.epoch >= 1 and it.tokens_seen > 0
        expected = [next(it) for _ in range(3)]
    finally:
        it.close()
    state = json.loads(json.dumps(state))
    resumed = iter(make())
    try:
        resumed.set_state(state)
        got = [next(resumed) for _ in range(3)]
    finally:
        resumed.close()
    assert_batches_equal(got, expected)


def test_on_the_fly_of_nothing_is_a_user_error(bpe: Tokenizer) -> None:
    with pytest.raises(UserError, match="corpus is empty"):
        pipeline.make_text_train_dataset([], bpe, seq_len=SEQ_LEN, batch_size=1, seed=0)


@pytest.mark.parametrize("model_type,vocab_size", [("bpe", 512), ("unigram", 512), ("char", 512), ("byte", 260)])
def test_byte_lengths_of_a_documents_ids_add_up_to_its_utf8_size(corpus, model_type, vocab_size) -> None:
    tok = SentencePieceTokenizer.train(corpus[:2], vocab_size, model_type)
    lengths = tok.byte_lengths()
    assert lengths.shape == (vocab_size,) and lengths[[tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id]].sum() == 0
    for text in UNICODE_TEXTS + corpus[2:4]:
        ids = tok.encode([text])[0]  # with BOS and EOS, which stand for no bytes
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")), (model_type, text[:40])
