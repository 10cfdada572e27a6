"""GRPO through `python -m jaxlm.train` (`jaxlm.objectives.grpo`): the objective's loss on a real rollout
batch equals `grpo.summed_loss` computed directly and the compiled step's reported loss; its batches are
the sampler's and the rewards'; in full training the KL's reference is the model run.init_from started
from (0 KL on the first step, its log-probs those of that checkpoint's model computed apart, the same
reference read again on resume, a changed or missing one refused in one line, its bytes in the memory
plan); GRPO steps raise a learnable reward; a resumed run is bit-exact (the rollouts' prompts and key are
functions of the step); checkpoints fall on rollout boundaries only, and a run stopped inside a rollout
says which checkpoint it resumes from; the config's checks; the prompt reader."""

import json
import os
import pathlib
import shutil
import textwrap

import floats
import jax
import numpy as np
import pytest
from command_forks import run_command
from flax import nnx

from jaxlm import config, explore, init_from, memory, train, train_setup
from jaxlm.data import builtin_addition, prompts
from jaxlm.errors import UserError
from jaxlm.objectives import grpo as grpo_objective
from jaxlm.objectives.dpo import fingerprint
from jaxlm.post_training import grpo

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A reward a random model can learn at once: the share of a completion's characters that are ASCII letters
# or digits (about a quarter of a byte tokenizer's tokens), so every group's rewards differ.
ALNUM = textwrap.dedent("""
    def alnum(prompt, completion, answer):
        return sum(c.isascii() and c.isalnum() for c in completion) / max(len(completion), 1)
""")


def small(tmp_path, *overrides):
    """The recipe's tiny GRPO on 8 prompts x 4 completions, one optimizer step per rollout, from a random model
    unless `overrides` give run.init_from (whose architecture and tokenizer it then takes, as the commands do)."""
    cfg = config.load_recipe("grpo_tiny")
    pairs = [("run.init_from", ""), ("data.cache_dir", str(tmp_path / "cache")), ("run.output_dir", str(tmp_path)),
             ("grpo.group_size", "4"), ("grpo.mu", "1"), ("data.global_batch_size", "32"), *overrides]
    config.apply_overrides(cfg, pairs)
    if cfg.run.init_from:
        init_from.resolve_config(cfg, pairs)
    return cfg


def save_source(directory, seed: int):
    """A run directory to start GRPO from (run.init_from), in seconds: the recipe's SFT stage's model as
    initialised with `seed` (never trained: what matters here is which parameters the run starts from),
    saved as the CLI saves a run (config.json, its byte tokenizer, checkpoints/0)."""
    cfg = config.load_recipe("grpo_tiny:sft")
    config.apply_overrides(cfg, [("run.output_dir", str(directory)), ("data.cache_dir", str(directory / "cache")),
                                 ("run.seed", str(seed))])
    setup = train_setup.build(cfg)
    return explore.save(setup, explore.load_data(setup))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The run GRPO starts from in full training with a KL penalty (its reference)."""
    return save_source(tmp_path_factory.mktemp("source"), seed=3)


def independent_logprobs(run, batch) -> np.ndarray:
    """The log-probs of `batch`'s targets (on its completion tokens, 0 elsewhere) under the model of a run
    directory's newest checkpoint, read apart from any training (`explore.load`: its own mesh) at temperature 1."""
    loaded = explore.load(run)
    host = {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}
    with jax.set_mesh(loaded.mesh):
        logps = jax.jit(lambda p, b: grpo.token_logprobs(nnx.merge(loaded.model_spec.graphdef, p), b))(loaded.params,
                                                                                                        host)
    return np.where(host["weights"] > 0, np.asarray(logps), 0.0)


def test_the_objectives_loss_on_a_rollout_equals_summed_loss_and_the_steps_loss(tmp_path, source):
    """One real rollout (8 prompts x 4 completions sampled from the model run.init_from gives, scored by
    exact_match and a user's reward) through the objective, in full training with a KL penalty (beta=0.1): its
    batch holds the sampler's rows, advantages relative to each group, and the reference's log-probs, those of
    the init_from checkpoint's model computed apart. On the first step the policy is the reference (KL 0) and
    the ratio 1; `GRPO.loss` equals `grpo.summed_loss` on it, and the compiled train step reports sum / count.
    The next rollout, from the trained parameters, is still scored against the start's model. The run
    directory records the reference; a resumed run reads the same parameters again, and refuses one that
    changed or is gone in one line. The memory plan counts the reference's bytes."""
    (tmp_path / "r.py").write_text(ALNUM)
    cfg = small(tmp_path, ("run.init_from", str(source)), ("grpo.beta", "0.1"), ("optim.peak_lr", "3e-3"),
                ("optim.warmup_steps", "0"), ("grpo.rewards", f"exact_match,{tmp_path}/r.py:alnum"),
                ("grpo.reward_weights", "1,0.5"))
    objective = grpo_objective.GRPO(cfg)
    data = objective.load_data(cfg, None, None)
    setup = train_setup.build(cfg)
    assert setup.init_from == {"run_dir": str(source.resolve()), "step": 0}
    objective.prepare(setup, setup.state, data, tmp_path, 0)
    # the reference: a copy of the parameters the run starts from (not the state's arrays, which the step donates)
    reference = objective.reference
    floats.identical(reference, setup.state.params, why=floats.MOVED)
    assert all(r is not p for r, p in zip(jax.tree.leaves(reference), jax.tree.leaves(setup.state.params)))
    record = json.loads((tmp_path / grpo_objective.RECORD).read_text())
    assert record == {"init_from": str(source.resolve()), "step": 0, "fingerprint": fingerprint(reference)}
    with jax.set_mesh(setup.mesh):
        batch, host = objective.next_batch(setup, setup.state, data, 1)
        again, host2 = objective.next_batch(setup, setup.state, data, 1)  # the same step: the same batch
    assert again is batch and host2["sampling_s"] == 0.0
    assert set(batch) == {"inputs", "targets", "positions", "segment_ids", "weights", "old_logprobs", "advantages",
                          "ref_logprobs"}
    assert batch["inputs"].shape == (32, 24)
    floats.close(batch["ref_logprobs"], independent_logprobs(source, batch))
    # the advantages: the rewards of each group of 4, centred and scaled, on every position of its rows
    adv = np.asarray(batch["advantages"])
    assert np.all(adv == adv[:, :1])
    groups = adv[:, 0].reshape(8, 4)
    np.testing.assert_allclose(groups.mean(axis=1), 0.0, atol=1e-5)
    assert np.any(groups != 0)
    assert 0 <= host["reward"] <= 1.5 and set(host) >= {"reward", "reward/exact_match", f"reward/{tmp_path}/r.py:alnum",
                                                         "completion_length", "stopped_fraction", "sampling_s"}
    np.testing.assert_allclose(host["reward"], host["reward/exact_match"] + 0.5 * host[f"reward/{tmp_path}/r.py:alnum"],
                               rtol=1e-5)
    # at the sampling policy ratio = 1 and the KL 0 (the policy is the reference: the same parameters through
    # the same model on the same rows, which both programs compute alike), the step's loss is minus the
    # token-mean advantage
    w = np.asarray(batch["weights"])
    with jax.set_mesh(setup.mesh):
        state, metrics = setup.train_step(setup.state, batch, setup.expected_attention_choice())
    np.testing.assert_allclose(float(metrics["loss"]), -np.sum(adv * w) / np.sum(w), atol=1e-6)
    assert objective.step_metrics(metrics) == {"clipped_fraction": 0.0, "kl": 0.0}
    assert float(metrics["tokens"]) == np.sum(w)
    # after that step (ratio != 1): the objective's loss is summed_loss's, and the next step reports sum / count
    spec = setup.model_spec
    trainable, frozen = spec.split(state.params)
    with jax.set_mesh(setup.mesh):
        total, (count, sums) = jax.jit(lambda t, f, b: objective.loss(t, f, spec, b, None, 0.0))(trainable, frozen, batch)
        want, (want_count, want_sums) = jax.jit(
            lambda p, b: grpo.summed_loss(p, spec, b, None, objective.grpo))(state.params, batch)
    assert abs(float(want)) > 1e-3  # a value that tells
    np.testing.assert_allclose(float(total), float(want), rtol=1e-6)
    assert float(count) == float(want_count) == float(np.sum(w))
    assert {k: float(v) for k, v in sums.items()} == pytest.approx({f"grpo/{k}": float(v) for k, v in want_sums.items()})
    with jax.set_mesh(setup.mesh):
        state, metrics = setup.train_step(state, batch, setup.expected_attention_choice())
    np.testing.assert_allclose(float(metrics["loss"]), float(want) / float(want_count), rtol=1e-5)
    means = objective.step_metrics(metrics)
    np.testing.assert_allclose(means["clipped_fraction"], float(want_sums["clipped"]) / float(want_sums["tokens"]),
                               rtol=1e-5)
    np.testing.assert_allclose(means["kl"], float(want_sums["kl"]) / float(want_sums["tokens"]), rtol=1e-5)
    assert means["kl"] > 1e-4  # the policy moved from the reference
    # the next rollout, sampled from the trained parameters: scored against the start's model all the same
    with jax.set_mesh(setup.mesh):
        batch, _ = objective.next_batch(setup, state, data, 2)
    ref = independent_logprobs(source, batch)
    floats.close(batch["ref_logprobs"], ref)
    assert np.max(np.abs(np.asarray(batch["old_logprobs"]) - ref)) > 1e-3  # (the policy's log-probs are others)

    # a resumed run: the recorded checkpoint read again is the same reference, bit for bit
    floats.identical(objective.reference_params(setup, state, tmp_path, 2), reference, why=floats.MOVED)
    path = tmp_path / grpo_objective.RECORD
    for change, words in [({"fingerprint": "0" * 64}, "the KL reference changed since this GRPO run started"),
                          ({"step": 7}, f"{source.resolve()} no longer holds checkpoint 7"),
                          (None, f"holds no {grpo_objective.RECORD}")]:
        if change is None:
            path.unlink()
        else:
            path.write_text(json.dumps({**record, **change}))
        with pytest.raises(UserError) as e:
            objective.reference_params(setup, state, tmp_path, 2)
        assert words in str(e.value) and "\n" not in str(e.value) and "config.run.fresh=true" in str(e.value)

    # the memory plan: the reference's parameters as the objective holds them, on each device and in all
    plan = memory.estimate(cfg, 8, platform="cpu")
    row = plan.row("reference parameters")
    leaves = jax.tree.leaves(reference)
    assert row.total_bytes == sum(x.nbytes for x in leaves) > 0
    assert row.per_device_bytes == sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    assert row.per_device_bytes < row.total_bytes / 4  # split over fsdp=8 (the norms whole)
    without = memory.estimate(small(tmp_path, ("run.init_from", str(source))), 8, platform="cpu")
    assert "reference parameters" not in [r.name for r in without.rows]
    assert plan.per_device_bytes - without.per_device_bytes == row.per_device_bytes


def test_the_config_checks(tmp_path):
    cfg = small(tmp_path)
    config.validate(cfg)
    for key, value, words in [("data.seq_len", "32", "grpo.max_prompt_len + grpo.max_new_tokens = 24"),
                              ("data.global_batch_size", "30", "a multiple of grpo.group_size=4"),
                              ("grpo.mu", "7", "a multiple of grpo.mu=7"),
                              ("grpo.beta", "0.1", "0 in full training without run.init_from: give run.init_from"),
                              ("grpo.rewards", "no_such_module_x:f", "does not import")]:
        bad = small(tmp_path, (key, value))
        with pytest.raises(UserError, match=words.replace("+", r"\+").replace(".", r"\.")):
            config.validate(bad)
    with pytest.raises(UserError, match=r"or train LoRA adapters alone"):  # LoRA and more trained: full training
        config.validate(small(tmp_path, ("grpo.beta", "0.1"), ("lora.rank", "4"), ("optim.trainable", "norms")))
    config.validate(small(tmp_path, ("grpo.beta", "0.1"), ("lora.rank", "4")))  # the base, adapters off
    cfg = config.load_recipe("grpo_tiny")  # (the reference: run.init_from, not read by the checks)
    config.apply_overrides(cfg, [("grpo.beta", "0.1"), ("run.init_from", "runs/no_such_run")])
    config.validate(cfg)


def test_the_prompt_reader(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "2+2=", "answer": 4}\n'
                                      '{"prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"}\n')
    rows = list(prompts.iter_prompts(str(tmp_path / "p.jsonl")))
    assert [(r.text, r.answer, r.chat) for r in rows] == [("2+2=", "4", False), ("Capital of France?", "Paris", True)]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "2+2="}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:1: no field 'answer'"):
        list(prompts.iter_prompts(str(tmp_path / "bad.jsonl")))
    # the built-in task: the file its script writes; each answer is the sum
    assert builtin_addition.PATH.read_text() == builtin_addition.text()
    rows = list(prompts.iter_prompts("builtin_addition"))
    assert len(rows) == builtin_addition.ROWS
    assert all(int(r.answer) == sum(map(int, r.prompt[:-1].split("+"))) for r in rows)
    # a rollout's prompts are a function of its index: a permutation per pass
    order = prompts.PromptOrder(10, 4, 0)
    taken = [order.take(i)[0] for i in range(5)]
    assert sorted(taken[0] + taken[1] + taken[2][:2]) == list(range(10)) and order.take(3) == order.take(3)


def grpo_args(tmp_path, name, *extra, steps=8, init=""):
    return ["--config=configs/grpo_tiny.py", f"--config.run.init_from={init}", f"--config.run.output_dir={tmp_path}",
            f"--config.run.name={name}", f"--config.run.steps={steps}", "--config.run.log_every=1",
            "--config.run.eval_every=0", "--config.grpo.group_size=4", "--config.grpo.mu=1",
            "--config.data.global_batch_size=32",
            f"--config.data.cache_dir={tmp_path / 'cache'}", *extra]


def run_cli(argv):
    return run_command("train", argv, cwd=ROOT, env=dict(os.environ), timeout=900)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_saves_at_rollout_boundaries_and_resumes_bit_exact(tmp_path, source):
    """mu=2, a checkpoint every 2 steps, full training from run.init_from with a KL penalty (beta=0.1): a run
    of 6 steps, and the same run stopped after 4 and resumed from its step-2 checkpoint (the rollout of steps
    3-4 sampled again from the restored parameters with the same key and prompts, the reference read again
    from the init_from checkpoint the run recorded), log the same losses, rewards and KLs, bit for bit. Every
    step reports the rollout's metrics and the times; the KL is 0 on the first step and not on the second (the
    same rollout, after an update); the held-out exact match is evaluated before the first step."""
    (tmp_path / "r.py").write_text(ALNUM)
    extra = ("--config.grpo.mu=2", "--config.checkpoint.every_steps=2", f"--config.grpo.rewards={tmp_path}/r.py:alnum",
             # no warmup: a warmup longer than a run is cut to the run's length, so the 4- and 6-step runs differ
             "--config.optim.peak_lr=3e-3", "--config.optim.warmup_steps=0", "--config.grpo.beta=0.1")
    done = run_cli(grpo_args(tmp_path, "full", *extra, "--config.run.eval_every=6", steps=6, init=source))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out exact match" in done.stdout and "(before the first step)" in done.stdout
    full = records(tmp_path / "full")
    val = [r for r in full if "val_exact_match" in r]
    assert [r["step"] for r in val] == [0, 6] and val[0]["val_loss"] == 1.0 - val[0]["val_exact_match"]
    steps = [r for r in full if "loss" in r]
    for r in steps:
        assert {"reward", "reward/" + f"{tmp_path}/r.py:alnum", "clipped_fraction", "completion_length",
                "sampling_s", "training_s", "sampling_share", "kl"} <= set(r)
    assert [r["sampling_s"] > 0 for r in steps] == [True, False] * 3  # one rollout per mu=2 steps
    assert steps[0]["reward"] == steps[1]["reward"] and steps[1]["clipped_fraction"] >= 0
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 1e-4, [r["kl"] for r in steps]
    first = run_cli(grpo_args(tmp_path, "resumed", *extra, steps=4, init=source))
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(int(p.name) for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    (tmp_path / "resumed" / "checkpoints" / "4").rename(tmp_path / "resumed" / "set-aside-4")
    second = run_cli(grpo_args(tmp_path, "resumed", *extra, steps=6, init=source))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from step 2" in second.stdout and f"KL reference (grpo.beta=0.1): {source}" in second.stdout
    recorded = [json.loads((tmp_path / run / grpo_objective.RECORD).read_text()) for run in ("full", "resumed")]
    assert recorded[0] == recorded[1] and recorded[0]["step"] == 0

    def trace(run):
        return {r["step"]: (r["loss"], r["reward"], r["grad_norm"], r["kl"]) for r in records(tmp_path / run)
                if "loss" in r}

    assert sorted(trace("resumed")) == list(range(1, 7))
    assert trace("resumed") == trace("full")


@pytest.mark.slow
def test_grpo_steps_raise_a_learnable_reward(tmp_path):
    """From a random model, 24 GRPO steps on the share of letters and digits in a completion raise its
    mean from about a quarter (the byte vocabulary's share) well above."""
    (tmp_path / "r.py").write_text(ALNUM)
    done = run_cli(grpo_args(tmp_path, "learn", f"--config.grpo.rewards={tmp_path}/r.py:alnum",
                             "--config.optim.peak_lr=3e-3", steps=24))
    assert done.returncode == 0, done.stderr[-3000:]
    rewards_ = [r["reward"] for r in records(tmp_path / "learn") if "loss" in r]
    first, last = np.mean(rewards_[:4]), np.mean(rewards_[-4:])
    assert first < 0.4 and last > first + 0.2, rewards_


@pytest.mark.slow
def test_a_resumed_run_whose_reference_changed_or_is_gone_is_refused_in_one_line(tmp_path):
    """Full training with a KL penalty from a run that is then made again (another seed: the same step, other
    parameters): the resume is refused in one line naming the reference's checkpoint and the record; with the
    checkpoint gone, another line. The run's own checkpoints are as they were."""
    (tmp_path / "r.py").write_text(ALNUM)
    source = save_source(tmp_path / "src", seed=3)

    def cfg(steps):
        return small(tmp_path, ("run.init_from", str(source)), ("grpo.beta", "0.1"), ("run.steps", str(steps)),
                     ("checkpoint.every_steps", "2"), ("grpo.rewards", f"{tmp_path}/r.py:alnum"), ("run.name", "kl"),
                     ("run.eval_at_start", "off"), ("run.eval_every", "0"), ("run.compile_cache_dir", ""))

    train.run(cfg(2))
    run_dir = tmp_path / "kl"
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    shutil.rmtree(source)
    assert save_source(tmp_path / "src", seed=4) == source
    with pytest.raises(UserError) as e:
        train.run(cfg(4))
    message = str(e.value)
    assert "\n" not in message and "the KL reference changed since this GRPO run started" in message
    assert f"{source.resolve()} checkpoint 0" in message and grpo_objective.RECORD in message
    shutil.rmtree(source / "checkpoints" / "0")
    with pytest.raises(UserError) as e:
        train.run(cfg(4))
    assert "\n" not in str(e.value) and f"{source.resolve()} no longer holds checkpoint 0" in str(e.value)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_a_run_stopped_inside_a_rollout_names_the_checkpoint_it_resumes_from(tmp_path):
    """optim.on_nonfinite=stop with mu=2: a run saves at step 2 (a reward of 0 while a file says so: no
    gradient, the parameters unchanged), then resumed without it at an absurd learning rate: step 3's update
    makes step 4 non-finite, which the loop reads after step 5 began, inside a rollout, where no checkpoint
    resumes exactly. The stop names the last checkpoint, step 2, and the steps a re-run does again, 3-5."""
    (tmp_path / "r.py").write_text(ALNUM + textwrap.dedent(f"""
        import pathlib
        def quiet_then_alnum(prompt, completion, answer):
            return 0.0 if pathlib.Path({str(tmp_path / "quiet")!r}).exists() else alnum(prompt, completion, answer)
    """))
    (tmp_path / "quiet").touch()

    def cfg(steps, every):
        return small(tmp_path, ("grpo.mu", "2"), ("run.steps", str(steps)), ("checkpoint.every_steps", str(every)),
                     ("grpo.rewards", f"{tmp_path}/r.py:quiet_then_alnum"), ("optim.peak_lr", "1e30"),
                     ("optim.warmup_steps", "0"), ("run.name", "nonfinite"), ("run.eval_at_start", "off"),
                     ("run.eval_every", "0"), ("run.compile_cache_dir", ""))

    train.run(cfg(2, 2))
    (tmp_path / "quiet").unlink()
    with pytest.raises(train.NonFiniteError) as e:
        train.run(cfg(8, 8))  # (checkpoint.every_steps may change on resume)
    checkpoints = tmp_path / "nonfinite" / "checkpoints"
    assert e.value.step == 4 and e.value.checkpoint_dir == checkpoints / "2"
    assert e.value.kept == (f"no checkpoint saved at step 5, inside a rollout (checkpoints fall on rollout "
                            f"boundaries); the last is {checkpoints / '2'}: a re-run resumes from it and does steps "
                            f"3-5 again")
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2"]
