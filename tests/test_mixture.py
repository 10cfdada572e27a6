"""Data mixtures (`jaxlm.data.mixture`): weighted sources, stages, exact resume, per-source metrics."""

import json
import math

import floats
import numpy as np
import pytest

from jaxlm.data import loader, mixture, pipeline
from jaxlm.errors import UserError

SEQ_LEN = 32


def token_docs(base: int, num_docs: int, seed: int) -> list[np.ndarray]:
    """Documents whose tokens tell their source: base + [0, n) (n from 2 to 59)."""
    lengths = np.random.default_rng(seed).integers(2, 60, size=num_docs)
    return [(base + np.arange(n)).astype(np.int32) for n in lengths]


DOCS = {"a": token_docs(10_000, 300, 0), "b": token_docs(20_000, 120, 1), "c": token_docs(30_000, 50, 2)}


def stream(sources: str, stages: str = "", rows: int = 8, shard: int = 0, shards: int = 1,
           num_workers: int = 0) -> mixture.MixtureIterator:
    schedule = mixture.Schedule.parse(sources, stages)
    return mixture.open_shard({n: DOCS[n] for n in schedule.names}, schedule, seq_len=SEQ_LEN, rows=rows, seed=0,
                              shard=shard, shards=shards, num_workers=num_workers)


def take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def origin(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Each row's source by its tokens (a: 1, b: 2, c: 3 from the token ids; -1 for an empty row)."""
    first = batch["inputs"][:, 0]
    return np.where(batch["segment_ids"][:, 0] > 0, first // 10_000, -1)


# --- parsing ---


def test_sources_and_stages_parse_and_bad_ones_stop_in_one_line():
    parsed = mixture.parse_sources("web=data/a/*.jsonl|data/b.txt:0.7, code=builtin:0.3,hq=x:y/z")
    assert parsed == [mixture.Source("web", "data/a/*.jsonl,data/b.txt", 0.7), mixture.Source("code", "builtin", 0.3),
                      mixture.Source("hq", "x:y/z", 1.0)]  # a path may hold ':' (no weight: 1)
    schedule = mixture.Schedule.parse("a=x:3,b=y:1", "10:b=1;20:a=1,b=1")
    np.testing.assert_allclose(schedule.weights(9), [0.75, 0.25])
    np.testing.assert_allclose(schedule.weights(10), [0.0, 1.0])  # from step 10 on; a unnamed: 0
    np.testing.assert_allclose(schedule.weights(25), [0.5, 0.5])
    np.testing.assert_allclose(schedule.shares(1, 30), [9 * 0.75 + 11 * 0.5, 9 * 0.25 + 10 + 11 * 0.5])
    bad = {
        ("a=x:0,b=y:0", ""): "the weights sum to 0",
        ("a=x:-1,b=y:2", ""): "not a finite number of at least 0",
        ("a=x:1,a=y:1", ""): "two sources are named 'a'",
        ("a=x:1,x.jsonl", ""): "'x.jsonl' is not name=paths[:weight]",
        ("a b=x", ""): "the source name 'a b'",
        ("a=x,b=y", "5:c=1"): "stage 5 names the source 'c', which data.sources does not (a, b)",
        ("a=x,b=y", "5:a=0"): "the weights of the stage at step 5 sum to 0",
        ("a=x,b=y", "9:a=1;5:b=1"): "the stage at step 5 does not come after the one at step 9",
        ("a=x,b=y", "zero:a=1"): "is not step:name=weight",
    }
    for (sources, stages), words in bad.items():
        with pytest.raises(UserError) as e:
            mixture.Schedule.parse(sources, stages)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_resumed_run_may_change_the_weights_not_the_sources():
    from jaxlm import config
    from jaxlm.run_dir import config_differences

    def cfg(sources, stages=""):
        return config.recipe("tiny", data__sources=sources, data__stages=stages)

    saved = json.loads(cfg("a=x:1,b=y:1").to_json())
    assert config_differences(saved, cfg("a=x:0.2,b=y:0.8", "5:a=1"), config.base_config()) == []
    assert config_differences(saved, cfg("a=x:1,b=z:1"), config.base_config()) == [
        "data.sources: 'a=x:1,b=y:1' -> 'a=x:1,b=z:1'"]
    with pytest.raises(UserError, match="step 400 is beyond run.steps=300"):
        cfg("a=x,b=y", "400:a=1")


# --- sampling ---


def test_rows_are_drawn_by_the_weights_each_from_one_source():
    """3000 draws of weights 0.6/0.3/0.1: each source's share of the rows (and of the real tokens) within
    four binomial standard deviations; every row holds one source's tokens, the one `source_ids` names."""
    it = stream("a=x:6,b=y:3,c=z:1")
    rows = np.zeros(3)
    tokens = np.zeros(3)
    for batch in take(it, 375):
        assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "source_ids", "weights"}
        ids = batch["source_ids"][:, 0]
        assert (batch["source_ids"] == ids[:, None]).all()
        real = batch["segment_ids"] > 0
        assert ((batch["inputs"] // 10_000 == ids[:, None] + 1) | ~real).all()  # the row's tokens are its source's
        rows += np.bincount(ids, minlength=3)
        tokens += np.bincount(ids, weights=real.sum(axis=1), minlength=3)
    n, p = rows.sum(), np.array([0.6, 0.3, 0.1])
    assert n == 3000
    assert (np.abs(rows - n * p) <= 4 * np.sqrt(n * p * (1 - p))).all(), rows / n
    assert (np.abs(tokens / tokens.sum() - p) <= 4 * np.sqrt(p * (1 - p) / n) + 0.01).all(), tokens / tokens.sum()
    assert min(it.epochs.values()) > 0 and it.epoch == max(it.epochs.values())  # each source's own passes


def test_a_stage_changes_the_proportions_from_its_step_on():
    it = stream("a=x:1,b=y:1,c=z:0", "41:c=1;81:a=0.2,b=0.8")
    counts = {stage: np.zeros(3) for stage in range(3)}
    for step, batch in enumerate(take(it, 160), 1):
        counts[(step >= 41) + (step >= 81)] += np.bincount(batch["source_ids"][:, 0], minlength=3)
    assert counts[0][2] == 0 and abs(counts[0][0] - 160) <= 4 * math.sqrt(320 * 0.25)  # c weighs 0 at first
    assert counts[1].tolist() == [0, 0, 320]  # steps 41-80: c alone
    assert counts[2][2] == 0 and abs(counts[2][0] - 0.2 * 640) <= 4 * math.sqrt(640 * 0.16)


def test_shards_draw_apart_and_cover_the_rows():
    """Data shard j of 2 draws its own rows; together the two shards give the global batch's rows."""
    one, two = stream("a=x,b=y", rows=4, shard=0, shards=2), stream("a=x,b=y", rows=4, shard=1, shards=2)
    a, b = next(one), next(two)
    assert a["inputs"].shape == b["inputs"].shape == (4, SEQ_LEN)
    assert not np.array_equal(a["source_ids"], b["source_ids"]) or not np.array_equal(a["inputs"], b["inputs"])


# --- resume ---


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_from_the_saved_state_is_exact(num_workers):
    """The state after 30 batches, through JSON as a checkpoint holds it, gives the next 20 batches of the
    uninterrupted stream, bit for bit; with each source read by 2 worker processes too."""
    def opened():
        return stream("a=x:5,b=y:3,c=z:2", "35:c=1", num_workers=num_workers)

    its = [opened() for _ in range(3)]
    try:
        full = take(its[0], 50)
        take(its[1], 30)
        its[2].set_state(json.loads(json.dumps(its[1].get_state())))
        floats.identical(take(its[2], 20), full[30:], why=floats.SAME_PROGRAM)
    finally:
        for it in its:
            it.close()


def test_weights_changed_on_resume_act_from_the_resume_step_and_replay_nothing():
    """Resumed after 30 batches with other weights: batch 31 on draws by the new ones, and each source goes on
    from the row it had reached: its rows over the two runs are its own stream's, none repeated or skipped."""
    first = stream("a=x:1,b=y:1")
    before = take(first, 30)
    resumed = stream("a=x:1,b=y:9")
    resumed.set_state(json.loads(json.dumps(first.get_state())))
    after = take(resumed, 30)
    new = np.concatenate([b["source_ids"][:, 0] for b in after])
    assert abs(new.mean() - 0.9) <= 4 * math.sqrt(0.09 / len(new))  # b's share is the new weight's
    # a step's draw depends on the step and its weights alone: those of a run with the new weights throughout
    throughout = np.concatenate([b["source_ids"][:, 0] for b in take(stream("a=x:1,b=y:9"), 60)[30:]])
    assert np.array_equal(new, throughout)
    for index, name in enumerate(("a", "b")):
        rows = [{k: b[k][i] for k in ("inputs", "segment_ids")} for b in before + after
                for i in range(8) if b["source_ids"][i, 0] == index]
        alone = iter(pipeline.make_row_stream(DOCS[name], seq_len=SEQ_LEN, bins=8,
                                              seed=mixture.source_seed(0, name)))
        own = [{k: row[k] for k in ("inputs", "segment_ids")} for row in take(alone, len(rows))]
        floats.identical(rows, own, why=floats.SAME_PROGRAM)


def test_the_sources_of_a_resumed_mixture_must_be_the_checkpoints():
    first = stream("a=x,b=y")
    next(first)
    other = stream("a=x,c=z")
    with pytest.raises(UserError, match="has the sources a, b but data.sources names a, c"):
        other.set_state(first.get_state())


# --- the data section ---


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two small corpora on disk, JSONL and text, and a cache to prepare them into."""
    directory = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(directory / "words.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(5, 60)))}) + "\n")
    (directory / "digits.txt").write_text("\n\n".join("".join(rng.choice(list("0123456789+="), rng.integers(5, 90)))
                                                      for _ in range(200)))
    return directory


def data_config(directory, **fields) -> loader.DataConfig:
    defaults = dict(separator="\\n\\n", cache_dir=str(directory / "cache"), tokenizer_vocab_size=300, seq_len=SEQ_LEN,
                    global_batch_size=8, val_tokens=1000, val_fraction=0.05)
    return loader.DataConfig(**{**defaults, **fields})


def test_one_source_is_the_corpus_bit_for_bit(corpora):
    """data.sources with one source reads what data.corpus reads: the same tokenizer, batches and held-out set."""
    path = str(corpora / "words.jsonl")
    tok = str(corpora / "tok.model")
    corpus = loader.load_data(data_config(corpora, corpus=path))
    corpus.tokenizer.save(tok)
    single = loader.load_data(data_config(corpora, sources=f"words={path}:0.5"))
    assert single.mixture is None and single.tokenizer.sha256 == corpus.tokenizer.sha256
    floats.identical([next(single.train) for _ in range(5)], [next(corpus.train) for _ in range(5)],
                     why=floats.SAME_PROGRAM)
    floats.identical(single.eval_batches, corpus.eval_batches, why=floats.SAME_PROGRAM)


def test_a_mixture_of_files_reads_each_source_and_holds_out_each(corpora):
    d = data_config(corpora, sources=f"words={corpora / 'words.jsonl'}:3,digits={corpora / 'digits.txt'}:1",
                    stages="20:digits=1")
    d.validate()
    data = loader.load_data(d)
    facts = {f.name: f for f in data.mixture.sources}
    assert facts["words"].documents + facts["digits"].documents == data.train_documents
    assert facts["words"].tokens + facts["digits"].tokens == data.train_tokens
    batches = [next(data.train) for _ in range(30)]
    ids = np.stack([b["source_ids"][:, 0] for b in batches])
    assert (ids[19:] == 1).all() and 0 < ids[:19].mean() < 1  # digits alone from step 20
    held = [b["source_ids"].flat[0] for b in data.eval_batches]
    assert sorted(set(held)) == [0, 1] and all((b["source_ids"] == b["source_ids"].flat[0]).all()
                                               for b in data.eval_batches)
    report = data.mixture.report(1, 100, 8 * SEQ_LEN)
    drawn = {"words": 19 * 0.75 * 256, "digits": (19 * 0.25 + 81) * 256}
    for name, f in facts.items():
        line = next(line for line in report.splitlines() if line.startswith(name))
        assert f"{f.documents:,}" in line and f"{f.tokens:,}" in line and f"{round(drawn[name]):,}" in line
        assert f"{drawn[name] / f.tokens:.3g}" in line  # its effective epochs
    with pytest.raises(UserError, match=r"data.sources: source 'gone': no input files match '.*missing\*.txt'"):
        loader.load_data(data_config(corpora, sources=f"words={corpora / 'words.jsonl'},gone={corpora}/missing*.txt"))


def test_a_mixture_tokenized_on_the_fly_draws_as_the_prepared_one(corpora):
    """data.tokenize_on_the_fly: each source's texts tokenized in the pipeline (documents shuffled, not chunks:
    other rows than its prepared shards give); each step draws the same sources for the same rows, and each
    row holds its source's text. Its tokens are unknown to the report."""
    from jaxlm import config

    sources = f"words={corpora / 'words.jsonl'}:3,digits={corpora / 'digits.txt'}:1"
    prepared = loader.load_data(data_config(corpora, sources=sources))
    tok = corpora / "mix.model"
    prepared.tokenizer.save(tok)
    fly = loader.load_data(data_config(corpora, sources=sources, tokenize_on_the_fly=True, tokenizer_path=str(tok)))
    batches = [next(fly.train) for _ in range(10)]
    assert np.array_equal(np.stack([b["source_ids"] for b in batches]),
                          np.stack([next(prepared.train)["source_ids"] for _ in range(10)]))
    for batch in batches:
        for row, source in zip(batch["inputs"], batch["source_ids"][:, 0]):
            text = fly.tokenizer.decode([int(t) for t in row if t > 3])  # (0-3: padding, unk, BOS, EOS)
            alphabet = set("0123456789+=\n") if source == 1 else set("abcdefghijklmnopqrstuvwxyz \n")
            assert set(text) <= alphabet and text.strip(), (source, text)
    assert [f.tokens for f in fly.mixture.sources] == [None, None] and fly.train_tokens is None
    assert "n/a (on the fly)" in fly.mixture.report(1, 10, 8 * SEQ_LEN)
    cfg = config.recipe("tiny", data__sources=sources, data__corpus="x.txt")
    assert config.inert_settings(cfg, config.derive(cfg, 8)) == [
        "data.corpus='x.txt' is not read: data.sources names the corpora this run trains on (give the corpus as one "
        "of its sources)"]


# --- per-source metrics ---


@pytest.mark.parametrize("loss_chunk_len", [0, 8])
def test_the_loss_by_source_is_each_sources_tokens_loss_from_the_same_forward(loss_chunk_len):
    """`summed_loss` with sources: the sums by source equal the loss of each source's tokens alone (the batch
    with the other rows' weights zeroed), the whole logits or made 8 positions at a time."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from helpers import random_batch, small_config
    from jaxlm import steps, train_state
    from jaxlm.models.transformer import Transformer

    cfg = small_config(loss_chunk_len=loss_chunk_len)
    model = Transformer(cfg, rngs=nnx.Rngs(params=0))
    spec, params = train_state.build_model_spec(cfg), nnx.to_pure_dict(nnx.state(model))
    batch = random_batch(6, cfg.max_seq_len, cfg.vocab_size)
    batch["source_ids"] = np.repeat(np.array([2, 0, 2, 1, 0, 2], np.int32)[:, None], cfg.max_seq_len, axis=1)

    @jax.jit
    def sums(b):
        total, (tokens, out) = steps.summed_loss(params, spec, b, None, 1e-3, loss_chunk_len, with_aux=True, sources=3)
        return total, tokens, out[steps.SOURCE_LOSS], out[steps.SOURCE_TOKENS]

    total, tokens, by_source, tokens_by_source = jax.device_get(sums({k: jnp.asarray(v) for k, v in batch.items()}))
    for source in range(3):
        alone = {**batch, "weights": batch["weights"] * (batch["source_ids"] == source)}
        own_total, own_tokens = jax.device_get(sums({k: jnp.asarray(v) for k, v in alone.items()}))[:2]
        floats.close(np.float32(by_source[source]), np.float32(own_total))
        assert tokens_by_source[source] == own_tokens == alone["weights"].sum()
    floats.close(np.float32(by_source.sum()), np.float32(total))
    assert tokens_by_source.sum() == tokens


def test_a_mixture_run_logs_each_sources_loss_tokens_and_held_out_loss(corpora, tmp_path, capsys):
    """The tiny recipe on two sources in 2 micro-batches: every step's loss/<source> and tokens/<source> in
    metrics.jsonl and TensorBoard (the tokens add up to the step's; the losses, weighted by them, to its loss),
    none of a source from the stage that gives it weight 0; val_loss/<source>; the start-of-run report."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from helpers import train_tiny

    sources = f"words={corpora / 'words.jsonl'}:3,digits={corpora / 'digits.txt'}:1"
    summary = train_tiny(tmp_path, "mix", ("data.sources", sources), ("data.stages", "4:digits=1"),
                         ("data.separator", r"\n\n"), ("model.vocab_size", "300"), ("optim.micro_batches", "2"),
                         ("run.steps", "5"), ("run.log_every", "1"), ("run.eval_every", "0"), ("model.n_layers", "1"),
                         ("data.val_tokens", "2048"))
    out = capsys.readouterr().out
    assert "data mixture of 2 sources, steps 1-5 (weights: words 0.75, digits 0.25; from step 4: words 0, digits 1)" in out
    records = [json.loads(line) for line in (tmp_path / "mix" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps_] == [1, 2, 3, 4, 5]
    for r in steps_:
        assert r["tokens/words"] + r["tokens/digits"] == r["tokens"]
        mean = sum(r[f"loss/{n}"] * r[f"tokens/{n}"] for n in ("words", "digits") if f"loss/{n}" in r) / r["tokens"]
        assert mean == pytest.approx(r["loss"], rel=1e-5)
    assert all("loss/words" in r and r["tokens/words"] > 0 for r in steps_[:3])  # 16 rows at 0.75: not all digits
    assert all("loss/words" not in r and r["tokens/words"] == 0 for r in steps_[3:])
    held = next(r for r in records if "val_loss" in r)
    assert held["val_loss/words"] > 0 and held["val_loss/digits"] > 0
    assert min(held["val_loss/words"], held["val_loss/digits"]) < held["val_loss"] < max(held["val_loss/words"],
                                                                                          held["val_loss/digits"])
    assert summary["val_loss"] == held["val_loss"]
    events = EventAccumulator(str(tmp_path / "mix" / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    for tag in ("loss/digits", "tokens/digits", "loss/words", "val_loss/words"):
        logged = [(r["step"], r[tag]) for r in records if tag in r]
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(s, pytest.approx(v)) for s, v in logged], tag
    # `jaxlm.evaluate --corpus=val` (and compression's calibration) read each source's splits, not data.corpus
    from jaxlm import evaluate, inference
    from jaxlm.data import prepare

    run = inference.load_run(tmp_path / "mix")
    docs, where = evaluate.corpus_documents(run, "val")
    d = loader.DataConfig.from_config(run.cfg.data)
    dirs = {s.name: loader.cached_prepared_dir(loader.source_config(d, s), run.tokenizer.sha256)
            for s in mixture.parse_sources(d.sources)}
    assert where.startswith("validation split of words: ") and ", digits: " in where
    held_out = [np.asarray(x, np.int32) for name in ("words", "digits") for x in prepare.open_prepared(dirs[name], "val")]
    floats.identical([np.asarray(x) for x in docs], held_out, why=floats.MOVED)
    calibration = evaluate.training_documents(run, 200)  # 100 target tokens of each source's training split
    lengths = np.cumsum([len(x) - 1 for x in calibration])
    first_digits = int(np.searchsorted(lengths, 100, side="right"))
    assert lengths[-1] == 200 and lengths[first_digits - 1] == 100
    for doc, name in ((calibration[0], "words"), (calibration[first_digits], "digits")):
        floats.identical(np.asarray(doc), np.asarray(prepare.open_prepared(dirs[name], "train")[0][:len(doc)], np.int32),
                         why=floats.MOVED)


# --- a killed and resumed mixture (slow: whole runs of python -m jaxlm.train) ---


def mixture_args(corpora, tmp_path, name, sources="words={words}:3,digits={digits}:1", stages="9:digits=1", steps=12):
    sources = sources.format(words=corpora / "words.jsonl", digits=corpora / "digits.txt")
    return ["--config=configs/tiny.py", f"--config.run.output_dir={tmp_path}", f"--config.run.name={name}",
            f"--config.run.steps={steps}", "--config.run.log_every=1", "--config.run.eval_every=0",
            "--config.checkpoint.every_steps=5", "--config.model.vocab_size=300", "--config.model.n_layers=2",
            f"--config.data.cache_dir={tmp_path / 'cache'}", r"--config.data.separator=\n\n",
            f"--config.data.sources={sources}", f"--config.data.stages={stages}"]


def by_step(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.mark.slow
def test_a_mixture_killed_mid_run_resumes_to_the_uninterrupted_runs_batches(corpora, tmp_path):
    """SIGKILL at step 7 (after the step-5 checkpoint, before the stage at step 9): resumed from step 5, every
    step's loss and its loss and tokens by source equal the uninterrupted run's, bit for bit."""
    import signal

    from test_resume import run, run_until

    code, _, err = run(mixture_args(corpora, tmp_path, "full"))
    assert code == 0, err[-3000:]
    killed = mixture_args(corpora, tmp_path, "killed")
    code, _, _ = run_until(killed, "step      7/", signal.SIGKILL)
    assert code == -signal.SIGKILL
    code, out, err = run(killed)
    assert code == 0 and "resuming from step 5" in out, err[-3000:]
    assert "data mixture of 2 sources, steps 6-12" in out
    keys = ("loss", "tokens", "loss/words", "tokens/words", "loss/digits", "tokens/digits")
    full, resumed = by_step(tmp_path / "full"), by_step(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 13))
    def table(records):  # nan: a source without tokens in the step (no loss/<source>)
        return np.array([[records[s].get(k, np.nan) for k in keys] for s in range(1, 13)])

    floats.identical(table(resumed), table(full), why=floats.SAME_PROGRAM)
    assert all(full[s]["tokens/words"] == 0 for s in range(9, 13)) and full[1]["tokens/words"] > 0


@pytest.mark.slow
def test_weights_changed_on_resume_take_effect_from_the_resume_step(corpora, tmp_path):
    """A run of 6 steps resumed to 12 with digits alone (other weights, no stage): steps 1-6 as they were, 7-12
    digits only; the report says so from step 7."""
    from test_resume import run

    code, _, err = run(mixture_args(corpora, tmp_path, "run", stages="", steps=6))
    assert code == 0, err[-3000:]
    before = by_step(tmp_path / "run")
    code, out, err = run(mixture_args(corpora, tmp_path, "run", sources="words={words}:0,digits={digits}:1",
                                      stages="", steps=12))
    assert code == 0 and "resuming from step 6" in out, err[-3000:]
    assert "steps 7-12 (weights: words 0, digits 1)" in out
    after = by_step(tmp_path / "run")
    assert [after[s] for s in range(1, 7)] == [before[s] for s in range(1, 7)]
    assert all(after[s]["tokens/words"] > 0 for s in range(1, 7))  # 16 rows a step, words at 3/4
    assert all(after[s]["tokens/words"] == 0 and after[s]["tokens/digits"] == after[s]["tokens"] for s in range(7, 13))
    code, _, err = run(mixture_args(corpora, tmp_path, "run", sources="words={digits},digits={words}", steps=12))
    assert code == 2 and "data.sources:" in err and "another config" in err
