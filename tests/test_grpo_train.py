"""GRPO through `python -m jaxlm.train` (`jaxlm.objectives.grpo`): the objective's loss on a real rollout
batch equals `grpo.summed_loss` computed directly and the compiled step's reported loss; its batches are
the sampler's and the rewards'; GRPO steps raise a learnable reward; a resumed run is bit-exact (the
rollouts' prompts and key are functions of the step); checkpoints fall on rollout boundaries only; the
config's checks; the prompt reader."""

import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxlm import config, train_setup
from jaxlm.data import builtin_addition, prompts
from jaxlm.errors import UserError
from jaxlm.objectives import grpo as grpo_objective
from jaxlm.post_training import grpo

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A reward a random model can learn at once: the share of a completion's characters that are ASCII letters
# or digits (about a quarter of a byte tokenizer's tokens), so every group's rewards differ.
ALNUM = textwrap.dedent("""
    def alnum(prompt, completion, answer):
        return sum(c.isascii() and c.isalnum() for c in completion) / max(len(completion), 1)
""")


def small(tmp_path, *overrides):
    cfg = config.load_recipe("grpo_tiny")
    config.apply_overrides(cfg, [("run.init_from", ""), ("data.cache_dir", str(tmp_path / "cache")),
                                 ("run.output_dir", str(tmp_path)), ("grpo.group_size", "4"),
                                 ("data.global_batch_size", "32"), *overrides])
    return cfg


def test_the_objectives_loss_on_a_rollout_equals_summed_loss_and_the_steps_loss(tmp_path):
    """One real rollout (8 prompts x 4 completions sampled from a random model, scored by exact_match and a
    user's reward) through the objective: its batch holds the sampler's rows, advantages relative to each
    group; `GRPO.loss` equals `grpo.summed_loss` on it, and the compiled train step reports sum / count."""
    (tmp_path / "r.py").write_text(ALNUM)
    cfg = small(tmp_path, ("grpo.rewards", f"exact_match,{tmp_path}/r.py:alnum"), ("grpo.reward_weights", "1,0.5"))
    objective = grpo_objective.GRPO(cfg)
    data = objective.load_data(cfg, None, None)
    setup = train_setup.build(cfg)
    objective.prepare(setup, setup.state, data, tmp_path, 0)
    with jax.set_mesh(setup.mesh):
        batch, host = objective.next_batch(setup, setup.state, data, 1)
        again, host2 = objective.next_batch(setup, setup.state, data, 1)  # the same step: the same batch
    assert again is batch and host2["sampling_s"] == 0.0
    assert set(batch) == {"inputs", "targets", "positions", "segment_ids", "weights", "old_logprobs", "advantages"}
    assert batch["inputs"].shape == (32, 24)
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
    # at the sampling policy ratio = 1, the step's loss is minus the token-mean advantage
    w = np.asarray(batch["weights"])
    with jax.set_mesh(setup.mesh):
        state, metrics = setup.train_step(setup.state, batch, setup.expected_attention_choice())
    np.testing.assert_allclose(float(metrics["loss"]), -np.sum(adv * w) / np.sum(w), atol=1e-6)
    assert objective.step_metrics(metrics) == {"clipped_fraction": 0.0} and float(metrics["tokens"]) == np.sum(w)
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
        _, metrics = setup.train_step(state, batch, setup.expected_attention_choice())
    np.testing.assert_allclose(float(metrics["loss"]), float(want) / float(want_count), rtol=1e-5)
    clipped = objective.step_metrics(metrics)["clipped_fraction"]
    np.testing.assert_allclose(clipped, float(want_sums["clipped"]) / float(want_sums["tokens"]), rtol=1e-5)


def test_the_config_checks(tmp_path):
    cfg = small(tmp_path)
    config.validate(cfg)
    for key, value, words in [("data.seq_len", "32", "grpo.max_prompt_len + grpo.max_new_tokens = 24"),
                              ("data.global_batch_size", "30", "a multiple of grpo.group_size=4"),
                              ("grpo.mu", "7", "a multiple of grpo.mu=7"),
                              ("grpo.beta", "0.1", "unless LoRA adapters alone train"),
                              ("grpo.rewards", "no_such_module_x:f", "does not import")]:
        bad = small(tmp_path, (key, value))
        with pytest.raises(UserError, match=words.replace("+", r"\+").replace(".", r"\.")):
            config.validate(bad)
    config.validate(small(tmp_path, ("grpo.beta", "0.1"), ("lora.rank", "4")))


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


def grpo_args(tmp_path, name, *extra, steps=8):
    return ["--config=configs/grpo_tiny.py", "--config.run.init_from=", f"--config.run.output_dir={tmp_path}",
            f"--config.run.name={name}", f"--config.run.steps={steps}", "--config.run.log_every=1",
            "--config.run.eval_every=0", "--config.grpo.group_size=4", "--config.data.global_batch_size=32",
            f"--config.data.cache_dir={tmp_path / 'cache'}", *extra]


def run_cli(argv):
    return subprocess.run([sys.executable, "-m", "jaxlm.train", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_saves_at_rollout_boundaries_and_resumes_bit_exact(tmp_path):
    """mu=2, a checkpoint every 2 steps: a run of 6 steps, and the same run stopped after 4 and resumed
    from its step-2 checkpoint (the rollout of steps 3-4 sampled again from the restored parameters with
    the same key and prompts), log the same losses and rewards, bit for bit. Every step reports the
    rollout's metrics and the times; the held-out exact match is evaluated before the first step."""
    (tmp_path / "r.py").write_text(ALNUM)
    extra = ("--config.grpo.mu=2", "--config.checkpoint.every_steps=2", f"--config.grpo.rewards={tmp_path}/r.py:alnum",
             # no warmup: a warmup longer than a run is cut to the run's length, so the 4- and 6-step runs differ
             "--config.optim.peak_lr=3e-3", "--config.optim.warmup_steps=0")
    done = run_cli(grpo_args(tmp_path, "full", *extra, "--config.run.eval_every=6", steps=6))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out exact match" in done.stdout and "(before the first step)" in done.stdout
    full = records(tmp_path / "full")
    val = [r for r in full if "val_exact_match" in r]
    assert [r["step"] for r in val] == [0, 6] and val[0]["val_loss"] == 1.0 - val[0]["val_exact_match"]
    steps = [r for r in full if "loss" in r]
    for r in steps:
        assert {"reward", "reward/" + f"{tmp_path}/r.py:alnum", "clipped_fraction", "completion_length",
                "sampling_s", "training_s", "sampling_share"} <= set(r)
    assert [r["sampling_s"] > 0 for r in steps] == [True, False] * 3  # one rollout per mu=2 steps
    assert steps[0]["reward"] == steps[1]["reward"] and steps[1]["clipped_fraction"] >= 0
    first = run_cli(grpo_args(tmp_path, "resumed", *extra, steps=4))
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(int(p.name) for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    (tmp_path / "resumed" / "checkpoints" / "4").rename(tmp_path / "resumed" / "set-aside-4")
    second = run_cli(grpo_args(tmp_path, "resumed", *extra, steps=6))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from step 2" in second.stdout

    def trace(run):
        return {r["step"]: (r["loss"], r["reward"], r["grad_norm"]) for r in records(tmp_path / run) if "loss" in r}

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
