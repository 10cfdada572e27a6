"""Distillation through `python -m jaxlm.train` (`config.objective.name=distill`, `jaxlm.objectives.distill`):
the objective's loss in the one compiled train step equals `distill.loss_sums` computed directly (plain,
micro-batched and replica-local), with the teacher's parameters a jit argument, not donated; a short
distillation of the trained facts run into a smaller student lowers its KL to the teacher; a resumed run
equals the uninterrupted one, bit for bit; a resumed run whose teacher changed is refused in one line; the
memory planner counts the teacher."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd

import tiny_run
from jaxlm import config, memory, train, train_setup
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError
from jaxlm.objectives import distill as distill_objective
from jaxlm.post_training import distill

STUDENT = dict(vocab_size=300, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, mlp_dim=64)


def student_config(facts_run, out, name="student", **overrides):
    """The tiny recipe as a smaller student of the facts run, on the facts corpus with the facts run's data
    settings (and so its cached tokenizer); `overrides` (`section__key=value`) add or replace keys."""
    pairs = []
    for arg in tiny_run.train_args(facts_run.parent)[1:]:
        key, value = arg[len("--config."):].split("=", 1)
        if not key.startswith(("model.", "run.")):
            pairs.append((key, value))
    pairs += [(f"model.{k}", str(v)) for k, v in STUDENT.items()]
    pairs += [("objective.name", "distill"), ("distill.teacher", str(facts_run)), ("run.output_dir", str(out)),
              ("run.name", name), ("run.compile_cache_dir", ""), ("optim.warmup_steps", "2"),
              ("run.eval_every", "0"), ("run.log_every", "1"), ("model.dtype", "float32")]
    pairs += [(k.replace("__", "."), str(v)) for k, v in overrides.items()]
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, pairs)
    return cfg


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mesh,micro_batches", [(dict(fsdp=-1), 1),
                                                pytest.param(dict(data=2, fsdp=4), 2, marks=pytest.mark.slow)])
def test_the_step_minimises_loss_sums_with_the_teacher_a_frozen_argument(facts_run, tmp_path, mesh, micro_batches):
    """One train step on a real batch of the facts corpus: its loss, KL and next-token metrics are
    `distill.loss_sums` of the student's and the teacher's logits, computed here directly, over the sum of
    weights (data=2 with micro-batches: the replica-local path). The teacher's parameters are the step's
    fourth argument, with the shardings the student's rules give them, and never donated."""
    cfg = student_config(facts_run, tmp_path, optim__micro_batches=micro_batches, distill__temperature=2.0,
                         distill__alpha=0.7, **{f"mesh__{k}": v for k, v in mesh.items()})
    objective = distill_objective.Distill(cfg)
    data = objective.load_data(cfg, None, None)
    setup = train_setup.build(cfg)
    objective = setup.objective
    assert isinstance(objective, distill_objective.Distill) and objective.has_frozen_inputs
    objective.prepare(setup, setup.state, data, tmp_path, 0)
    teacher = setup.frozen_inputs
    host = next(data.train)
    batch = setup.put_batch(host)
    settings = objective.settings

    with jax.set_mesh(setup.mesh):
        @jax.jit
        def direct(params, teacher_params, batch):
            with spmd.logical_axis_rules(setup.rules):
                args = (batch["inputs"], batch["positions"], batch["segment_ids"])
                s = nnx.merge(setup.model_spec.graphdef, params)(*args)
                t = nnx.merge(objective.teacher_spec.graphdef, teacher_params)(*args)
                return distill.loss_sums(s, t, batch["targets"], batch["weights"], settings)

        total, kl, ce = (float(x) for x in direct(setup.state.params, teacher, batch))
        lowered = setup.train_step.lower(setup.state, batch, None, teacher)
        state, metrics = setup.train_step(setup.state, batch, None, *setup.frozen_args())
    weights = float(host["weights"].sum())
    assert float(metrics["tokens"]) == weights > 0
    np.testing.assert_allclose(float(metrics["loss"]), total / weights, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["distill/kl"]), kl / weights, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["distill/ce"]), ce / weights, rtol=2e-5)
    assert kl / weights > 0.1 and abs(total - (0.7 * 4 * kl + 0.3 * ce)) < 1e-3 * abs(total)
    assert int(state.step) == 1
    # the teacher: the step's fourth argument, each leaf an input of the program, none donated
    state_args, teacher_args = lowered.args_info[0][0], lowered.args_info[0][2]  # (packed, static: not an input)
    assert all(a.donated for a in jax.tree.leaves(state_args))
    assert len(jax.tree.leaves(teacher_args)) == len(jax.tree.leaves(teacher)) > 0
    assert not any(a.donated for a in jax.tree.leaves(teacher_args))
    assert jax.tree.leaves(teacher)[0].sharding.mesh == setup.mesh


@pytest.mark.slow
def test_distillation_lowers_the_kl_and_resumes_bit_exactly(facts_run, tmp_path):
    """The facts run (0.11M parameters, 2 layers) distilled into a student of 0.03M and 1 layer for 10 steps,
    in 2 micro-batches: the held-out KL to the teacher falls (the student's val_loss with it); the run records
    its teacher. The same run resumed from its step-5 checkpoint logs the same losses and KLs, bit for bit."""
    cfg = student_config(facts_run, tmp_path / "a", run__steps=10, run__eval_at_start="on", optim__micro_batches=2,
                         checkpoint__every_steps=5, checkpoint__keep_last=3)
    summary = train.run(cfg)
    run_dir = tmp_path / "a" / "student"
    rows = records(run_dir)
    evals = {r["step"]: r for r in rows if "val_kl" in r}
    assert set(evals) == {0, 10}
    assert evals[10]["val_kl"] < 0.9 * evals[0]["val_kl"], evals
    assert evals[10]["val_loss"] < evals[0]["val_loss"] and summary["val_loss"] == evals[10]["val_loss"]
    steps = [r for r in rows if "distill/kl" in r]
    assert len(steps) == 10 and steps[-1]["distill/kl"] < steps[0]["distill/kl"]
    record = json.loads((run_dir / distill_objective.RECORD).read_text())
    assert record["step"] == 120 and record["tokenizer_sha256"] == Tokenizer.load(facts_run).sha256

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "student" / "checkpoints" / "10")
    resumed = train.run(student_config(facts_run, tmp_path / "b", run__steps=10, run__eval_at_start="on",
                                       optim__micro_batches=2, checkpoint__every_steps=5, checkpoint__keep_last=3))
    assert resumed["resumed_from"] == 5

    def logged(rows):
        return [(r["step"], r.get("loss"), r.get("distill/kl"), r.get("val_kl")) for r in rows
                if "loss" in r or "val_kl" in r]

    assert logged(records(tmp_path / "b" / "student")) == logged(rows)


@pytest.mark.slow
def test_a_resumed_run_whose_teacher_changed_is_refused_in_one_line(facts_run, tmp_path):
    """A student of a copy of the facts run stops at step 2; the copy's checkpoint 120 is then replaced by the
    student's own run (the same tokenizer and vocabulary, another model): the resume is refused in one line
    naming the teacher and the record, and the student's checkpoints are as they were."""
    teacher = tmp_path / "teacher"
    shutil.copytree(facts_run, teacher)
    cfg = student_config(facts_run, tmp_path / "runs", run__steps=2, distill__teacher=str(teacher))
    train.run(cfg)
    student = tmp_path / "runs" / "student"
    before = sorted(p.name for p in (student / "checkpoints").iterdir())
    shutil.rmtree(teacher / "checkpoints" / "120")
    with pytest.raises(UserError) as e:
        train.run(student_config(facts_run, tmp_path / "runs", run__steps=4, distill__teacher=str(teacher)))
    message = str(e.value)
    assert "\n" not in message and "no longer holds checkpoint 120" in message and distill_objective.RECORD in message
    assert sorted(p.name for p in (student / "checkpoints").iterdir()) == before


def test_the_memory_planner_counts_the_teacher(facts_run, tmp_path):
    """The plan of a distillation holds the teacher's parameters (as many bytes as its float32 parameters,
    split over the 8 devices' fsdp) and its logits (as many as the student's)."""
    cfg = student_config(facts_run, tmp_path, optim__micro_batches=1)
    plan = memory.estimate(cfg, 8, platform="cpu")
    row = plan.row("teacher parameters")
    params = json.loads((facts_run / "summary.json").read_text())["params"]
    assert row.total_bytes == 4 * params, (row, params)
    assert row.per_device_bytes < row.total_bytes / 4  # split over fsdp=8 (the vocabulary's norms whole)
    logits = plan.row("teacher logits")
    assert logits.total_bytes > 0 and logits.phase == memory.BACKWARD
    lm = memory.estimate(student_config(facts_run, tmp_path, objective__name="lm"), 8, platform="cpu")
    assert plan.per_device_bytes - lm.per_device_bytes >= row.per_device_bytes
