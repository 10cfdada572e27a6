"""DPO (`jaxlm.objectives.dpo`, `jaxlm.data.preferences`): the loss and its gradient against NumPy, the
reference's log-probs against the reference model scoring each sequence alone, LoRA's adapters-off
reference against the base model, micro-batches, bad pairs, and (slow) training and exact resume."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import small_config
from jaxlm import config, lora, steps, train_setup, train_state
from jaxlm.data import preferences
from jaxlm.errors import UserError
from jaxlm.models.transforms.lora import LoRA
from jaxlm.objectives import dpo as dpo_lib
from jaxlm.optim import OptimConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEQ, VOCAB = 24, 96


def pairs_batch(rows=4, seed=0, ref=True):
    """`rows` pair rows of random sequences (a prompt of 3-5 tokens weighing 0, a completion of 2-6
    weighing 1), with random reference sums when `ref`; and the sequences, for scoring them alone."""
    rng = np.random.default_rng(seed)
    out, seqs = [], []
    for _ in range(rows):
        enc = []
        for _ in range(2):
            p, c = rng.integers(3, 6), rng.integers(2, 7)
            ids = rng.integers(4, VOCAB, p + c).astype(np.int32)
            w = np.r_[np.zeros(p), np.ones(c)].astype(np.uint8)
            enc += [ids, w]
        seqs.append(enc)
        r = tuple(rng.normal(-20, 3, 2)) if ref else None
        out.append(preferences.pair_row(*enc, SEQ, r))
    return {k: np.stack([o[k] for o in out]) for k in out[0]}, seqs


def numpy_sums(logits, batch):
    """Per pair, the summed log-probs of the weighted targets of segments 1 and 2, in float64 [B, 2], and
    the softmax (for the gradient)."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, batch["targets"][..., None].astype(np.int64), -1)[..., 0] * batch["weights"]
    seg = batch["segment_ids"]
    sums = np.stack([(picked * (seg == s)).sum(1) for s in (1, 2)], 1)
    counts = np.stack([(batch["weights"] * (seg == s)).sum(1) for s in (1, 2)], 1)
    return sums, counts, np.exp(logp)


def numpy_loss_and_dlogits(logits, batch, cfg):
    """The summed DPO loss over the pairs and its gradient with respect to the logits, by hand."""
    pi, n, softmax = numpy_sums(logits, batch)
    seg = batch["segment_ids"]
    ref = np.stack([(batch["ref_logps"] * (seg == s)).sum(1) for s in (1, 2)], 1).astype(np.float64)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    if cfg.loss == "sigmoid":
        h = (pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1])
        loss = -np.log(sig(cfg.beta * h))
        dh = -cfg.beta * sig(-cfg.beta * h)
        dpi = np.stack([dh, -dh], 1)
    elif cfg.loss == "ipo":
        h = (pi[:, 0] - ref[:, 0]) / n[:, 0] - (pi[:, 1] - ref[:, 1]) / n[:, 1]
        loss = (h - 1 / (2 * cfg.beta)) ** 2
        dh = 2 * (h - 1 / (2 * cfg.beta))
        dpi = np.stack([dh / n[:, 0], -dh / n[:, 1]], 1)
    else:  # simpo
        x = cfg.beta * (pi[:, 0] / n[:, 0] - pi[:, 1] / n[:, 1]) - cfg.simpo_gamma
        loss = -np.log(sig(x))
        dx = -sig(-x)
        dpi = np.stack([dx * cfg.beta / n[:, 0], -dx * cfg.beta / n[:, 1]], 1)
    if cfg.sft_weight:  # RPO: + alpha * (-pi_c / n_c)
        loss = loss - cfg.sft_weight * pi[:, 0] / n[:, 0]
        dpi[:, 0] -= cfg.sft_weight / n[:, 0]
    # d pi_s / d logits[t] = w_t [seg_t == s] (onehot(target_t) - softmax_t)
    coef = sum(dpi[:, s - 1][:, None] * (seg == s) for s in (1, 2)) * batch["weights"]
    onehot = np.eye(logits.shape[-1])[batch["targets"]]
    return loss.sum(), coef[..., None] * (onehot - softmax)


@pytest.mark.parametrize("loss,sft_weight", [("sigmoid", 0.0), ("ipo", 0.0), ("simpo", 0.0), ("sigmoid", 0.7),
                                              ("simpo", 0.7)])
def test_the_loss_and_its_gradient_equal_a_numpy_computation(loss, sft_weight):
    cfg = dpo_lib.DPOConfig(beta=0.3, loss=loss, simpo_gamma=0.4, sft_weight=sft_weight)
    batch, _ = pairs_batch()
    logits = np.random.default_rng(1).normal(0, 2, (*batch["inputs"].shape, VOCAB)).astype(np.float32)

    def summed(lg):
        token = steps.token_losses(lg, jnp.asarray(batch["targets"]), 0.0)
        w = jnp.asarray(batch["weights"])
        logps = dpo_lib.segment_sums(jnp.where(w > 0, -token * w, 0.0), jnp.asarray(batch["segment_ids"]))
        counts = dpo_lib.segment_sums(w, jnp.asarray(batch["segment_ids"]))
        ref = None if loss == "simpo" else dpo_lib.batch_reference(jax.tree.map(jnp.asarray, batch))
        return jnp.sum(dpo_lib.preference_losses(logps, ref, counts, cfg)[0])

    value, grad = jax.value_and_grad(summed)(jnp.asarray(logits))
    want_value, want_grad = numpy_loss_and_dlogits(logits, batch, cfg)
    np.testing.assert_allclose(float(value), want_value, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    assert np.abs(want_grad).max() > 1e-3  # (a gradient that could have been wrong)


def test_the_objectives_loss_on_a_model_equals_numpy_from_its_logits_and_its_metrics_add_up():
    cfg = small_config(vocab_size=VOCAB, max_seq_len=SEQ)
    model = train_state.build_model(cfg, 0)
    spec = train_state.build_model_spec(cfg)
    params = nnx.to_pure_dict(nnx.state(model))
    batch, _ = pairs_batch(rows=3)
    objective = dpo_lib.DPO(dpo=dpo_lib.DPOConfig(beta=0.5))
    trainable, frozen = spec.split(params)
    total, (count, out) = objective.loss(trainable, frozen, spec, jax.tree.map(jnp.asarray, batch), None, 0.0)
    logits = np.asarray(model(batch["inputs"], batch["positions"], batch["segment_ids"]))
    want, _ = numpy_loss_and_dlogits(logits, batch, objective.dpo)
    np.testing.assert_allclose(float(total), want, rtol=1e-5)
    assert float(count) == 3
    pi, _, _ = numpy_sums(logits, batch)
    seg = batch["segment_ids"]
    ref = np.stack([(batch["ref_logps"] * (seg == s)).sum(1) for s in (1, 2)], 1)
    rewards = 0.5 * (pi - ref)
    np.testing.assert_allclose(float(out["dpo/reward_chosen"]), rewards[:, 0].sum(), rtol=1e-5)
    np.testing.assert_allclose(float(out["dpo/margin"]), (rewards[:, 0] - rewards[:, 1]).sum(), rtol=1e-5)
    assert float(out["dpo/accuracy"]) == (rewards[:, 0] > rewards[:, 1]).sum()


def test_a_pair_row_scores_each_sequence_as_if_alone():
    """The rows' segments: the packed pair's log-probs equal each sequence scored alone (its own row)."""
    cfg = small_config(vocab_size=VOCAB, max_seq_len=SEQ)
    model = train_state.build_model(cfg, 0)
    spec = train_state.build_model_spec(cfg)
    params = nnx.to_pure_dict(nnx.state(model))
    batch, seqs = pairs_batch(rows=2, ref=False)
    sums, counts, _ = dpo_lib.sequence_logps(params, spec, jax.tree.map(jnp.asarray, batch))
    for row, enc in enumerate(seqs):
        for s, (ids, w) in enumerate((enc[:2], enc[2:])):
            n = len(ids) - 1
            logits = np.asarray(model(ids[None, :-1], np.arange(n)[None], np.ones((1, n), np.int32)))
            alone = {"targets": ids[None, 1:], "weights": w[None, 1:].astype(np.float32),
                     "segment_ids": np.ones((1, n), np.int32)}
            np.testing.assert_allclose(float(sums[row, s]), numpy_sums(logits, alone)[0][0, 0], rtol=1e-5)
            assert float(counts[row, s]) == w[1:].sum()


def test_loras_adapters_off_reference_is_the_base_model():
    base_cfg = small_config(vocab_size=VOCAB, max_seq_len=SEQ)
    cfg = small_config(vocab_size=VOCAB, max_seq_len=SEQ, lora=LoRA(4, 8.0, ("wq", "wv", "w_up"), (), 0.0))
    params = nnx.to_pure_dict(nnx.state(train_state.build_model(cfg, 0)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    params = jax.tree_util.tree_unflatten(treedef, [  # adapters that change the model
        v + 0.1 * np.random.default_rng(i).normal(size=v.shape).astype(np.float32)
        if "lora_b" in jax.tree_util.keystr(p) else v for i, (p, v) in enumerate(leaves)])
    batch = jax.tree.map(jnp.asarray, pairs_batch(rows=2, ref=False)[0])
    spec, base_spec = train_state.build_model_spec(cfg), train_state.build_model_spec(base_cfg)
    adapted = dpo_lib.sequence_logps(params, spec, batch)[0]
    off = dpo_lib.sequence_logps(dpo_lib.adapters_off(params), spec, batch)[0]
    base = dpo_lib.sequence_logps(lora.base_params(params), base_spec, batch)[0]
    np.testing.assert_allclose(np.asarray(off), np.asarray(base), rtol=1e-6)
    assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-2  # the adapters were on


def test_micro_batches_give_the_update_of_one_batch():
    """Pairs add up over micro-batches as tokens do: 2 micro-batches step as one batch."""
    cfg = small_config(vocab_size=VOCAB, max_seq_len=SEQ)
    spec = train_state.build_model_spec(cfg)
    tx, schedule = optax.sgd(0.5), optax.constant_schedule(0.5)
    objective = dpo_lib.DPO(dpo=dpo_lib.DPOConfig(beta=0.5))
    batch = jax.tree.map(jnp.asarray, pairs_batch(rows=4)[0])
    results = []
    for k in (1, 2):
        params = nnx.to_pure_dict(nnx.state(train_state.build_model(cfg, 0)))
        state = train_state.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                                       rng=jax.random.key_data(jax.random.key(0)))
        step = jax.jit(steps.make_train_step(spec, tx, schedule, optim=OptimConfig(micro_batches=k),
                                             objective=objective))
        results.append(step(state, batch))
    (s1, m1), (s2, m2) = results
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    assert float(m1["tokens"]) == float(m2["tokens"]) == 4
    for name in ("dpo/accuracy", "dpo/margin", "dpo/reward_chosen"):
        np.testing.assert_allclose(float(m1[name]), float(m2[name]), rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                 s1.params, s2.params)


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}


@pytest.mark.parametrize("row, words", [
    ({"prompt": "2+2=", "chosen": "4"}, ":2: no field 'rejected'"),
    ({"prompt": "2+2=", "chosen": " ", "rejected": "5"}, ":2: the chosen completion is empty"),
    ({"prompt": 3, "chosen": "4", "rejected": "5"}, ":2: 'prompt' is a int"),
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "user", "content": "x"}], "rejected": "y"},
     ":2: 'chosen' must be a string or a list of one assistant message"),
    ("[1, 2]", ":2: a JSON list, not an object"),
])
def test_a_bad_pair_is_one_line_naming_its_line(tmp_path, row, words):
    corpus = write_rows(tmp_path / "pairs.jsonl", [GOOD, row])
    with pytest.raises(UserError) as e:
        list(preferences.iter_pairs(corpus))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_pair_longer_than_seq_len_is_refused_with_the_length_that_fits(tmp_path):
    from jaxlm.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer.train([], 300, "byte")  # a token per byte: BOS + 4 + 40 + EOS = 45 targets
    pairs = list(preferences.iter_pairs(write_rows(tmp_path / "p.jsonl", [GOOD, {**GOOD, "chosen": "x" * 40}])))
    with pytest.raises(UserError) as e:
        preferences.encode_pairs(pairs, tok, "", 32)
    message = str(e.value)
    assert "p.jsonl:2: the pair needs" in message and "1 of 2 pairs" in message and "raise data.seq_len to 51" in message
    rows = preferences.encode_pairs(pairs, tok, "", 51)  # and at that length every pair fits, uncut
    assert len(rows) == 2 and rows[1]["segment_ids"].max() == 2


def test_chat_pairs_score_the_final_answer_alone():
    from jaxlm.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer.train([], 300, "byte")
    pair = preferences.check_pair({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                              {"role": "user", "content": "and?"}],
                                   "chosen": "fine", "rejected": [{"role": "assistant", "content": "bad"}]}, "x:1")
    ids_c, w_c, ids_r, w_r = preferences.PairEncoder.make("simple", tok, True)(tok, pair)
    assert tok.decode(ids_c[w_c == 1].tolist()).startswith("fine")
    assert tok.decode(ids_r[w_r == 1].tolist()).startswith("bad")
    assert "yo" not in tok.decode(ids_c[w_c == 1].tolist())  # the earlier answer is prompt


def test_the_config_checks_live_reference_needs_lora():
    cfg = config.load_recipe("dpo_tiny")
    config.apply_overrides(cfg, [("dpo.reference", "live")])
    with pytest.raises(UserError, match="dpo.reference='live' is not allowed"):
        config.validate(cfg)
    config.apply_overrides(cfg, [("lora.rank", "4")])
    config.validate(cfg)


def dpo_args(tmp_path, name, *extra, steps=12):
    return ["--config=configs/dpo_tiny.py", f"--config.run.output_dir={tmp_path}", f"--config.run.name={name}",
            f"--config.run.steps={steps}", "--config.run.log_every=1", "--config.run.eval_every=0",
            "--config.checkpoint.every_steps=5", f"--config.data.cache_dir={tmp_path / 'cache'}", *extra]


def run_cli(argv):
    return subprocess.run([sys.executable, "-m", "jaxlm.train", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def step_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["dpo/accuracy"]) for r in records if "loss" in r}


@pytest.mark.slow
def test_training_raises_the_preference_accuracy_and_a_resumed_run_is_bit_exact(tmp_path):
    """The recipe's steps raise the held-out preference accuracy; a run stopped at step 7 and resumed (from
    its step-5 checkpoint, the reference's log-probs read back by their key) logs every step's loss as the
    uninterrupted run does, bit for bit."""
    done = run_cli(dpo_args(tmp_path, "full", "--config.run.eval_every=12"))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_preference_accuracy" in r]
    assert val[0]["step"] == 0 and val[-1]["step"] == 12
    assert val[0]["val_loss"] == pytest.approx(np.log(2), abs=1e-4)
    assert val[-1]["val_preference_accuracy"] >= 0.8 > val[0]["val_preference_accuracy"]
    assert val[-1]["val_loss"] < 0.6
    first = run_cli(dpo_args(tmp_path, "resumed", steps=7))
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "resumed" / "checkpoints" / "7").rename(tmp_path / "resumed" / "set-aside-7")  # resume from 5
    second = run_cli(dpo_args(tmp_path, "resumed"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from step 5" in second.stdout and "read from" in second.stdout
    full, resumed = step_losses(tmp_path / "full"), step_losses(tmp_path / "resumed")
    assert sorted(resumed) == sorted(full) == list(range(1, 13))
    assert resumed == full


@pytest.mark.slow  # the default suite's 10-minute budget (make test-slow runs it); the sums: the other cases
def test_the_precomputed_reference_log_probs_are_the_reference_models(tmp_path):
    """`reference_logps` (the setup's sharded batches, before the first step) against the starting model
    scoring each held-out sequence alone, in NumPy."""
    cfg = config.load_recipe("dpo_tiny")
    config.apply_overrides(cfg, [("data.cache_dir", str(tmp_path)), ("data.global_batch_size", "8")])
    data = dpo_lib.load_pairs(cfg, None, None)
    setup = train_setup.build(cfg)
    rows = data.val_rows
    got = dpo_lib.reference_logps(setup, setup.state.params, rows)
    assert got.shape == (len(rows), 2) and len(rows) > 8  # (more than one batch, the last one padded)
    model = nnx.merge(setup.model_spec.graphdef, setup.state.params)
    for i in (0, len(rows) - 1):
        ids_c, w_c, ids_r, w_r = rows.encoded[i]
        for s, (ids, w) in enumerate(((ids_c, w_c), (ids_r, w_r))):
            n = len(ids) - 1
            logits = np.asarray(model(ids[None, :-1], np.arange(n)[None], np.ones((1, n), np.int32)))
            alone = {"targets": ids[None, 1:], "weights": w[None, 1:].astype(np.float32),
                     "segment_ids": np.ones((1, n), np.int32)}
            np.testing.assert_allclose(got[i, s], numpy_sums(logits, alone)[0][0, 0], rtol=1e-5)
