"""Distillation as an objective: `--config.objective.name=distill`, settings in `config.distill`
(`jaxlm.post_training.distill.DistillConfig`, which also holds the loss and the teacher's loading).

- data: the language model's (`data.*`: text or SFT rows, their loss weights), with the teacher's directory,
  tokenizer and logits' width checked against the student's as the data is read, before any device work
  (`distill.check_teacher`: a teacher with another tokenizer is one line naming both);
- the step's frozen input (`frozen_inputs`): the teacher's parameters, one argument of the one compiled train
  step beside the state and the batch, with the shardings the student's rules give them on the student's
  mesh: not donated, not in the `TrainState` (no optimizer state, no second model in a checkpoint), not a
  constant of the program. At build they are abstract (read from the teacher's config); `prepare` loads
  them (`distill.check_teacher`, then `TrainSetup.load_run`: on the student's mesh by its rules), once per start;
- the loss: `distill.summed_loss` per micro-batch (the teacher's forward inside, without a gradient), with
  `distill/kl` and `distill/ce` reported as means over the step's weighted tokens;
- evaluation: the student's next-token loss on the held-out batches (`val_loss`, `val_perplexity`,
  `val_bits_per_byte`, comparable with a student trained without a teacher) and the KL to the teacher
  (`val_kl`, before T^2 and alpha);
- resume: the run directory records the teacher it distils from (`distill_teacher.json`: its directory, the
  checkpoint's step, its tokenizer's sha256 and a fingerprint of its parameters). A resumed run reads that
  step again whatever `distill.teacher_step` says, so that a teacher trained on meanwhile changes nothing,
  and refuses, in one line, a teacher whose checkpoint is gone or whose parameters or tokenizer changed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import jax
import ml_collections
from flax.core import spmd

from jaxlm import checkpoint
from jaxlm.console import console
from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import UserError
from jaxlm.models import attention
from jaxlm.objectives.base import LanguageModel
from jaxlm.objectives.dpo import fingerprint
from jaxlm.post_training import distill
from jaxlm.section import check

RECORD = "distill_teacher.json"  # in the run directory: the teacher this run distils from
METRICS = ("kl", "ce")


class Distill(LanguageModel):
    """A student trained on a teacher's distribution (`jaxlm.post_training.distill`), on the LM's data."""

    name = "distill"
    sections = (distill.DistillConfig,)
    has_frozen_inputs = True

    def __init__(self, cfg: ml_collections.ConfigDict | None = None, settings: distill.DistillConfig | None = None):
        super().__init__(cfg)
        self.settings = settings or (distill.DistillConfig.from_config(cfg.distill) if cfg is not None
                                     else distill.DistillConfig())
        self.teacher_spec = None  # the teacher's ModelSpec, known once `frozen_inputs` has read its config

    @classmethod
    def validate(cls, cfg: ml_collections.ConfigDict) -> None:
        check(bool(cfg.distill.teacher), "distill.teacher", cfg.distill.teacher,
              "the run directory of a trained teacher with objective.name=distill (python -m jaxlm.train, or "
              "python -m jaxlm.hf import)")
        check(cfg.mesh.stage in (0, 1), "mesh.stage", cfg.mesh.stage, "1 with objective.name=distill (no pipeline)")

    # ---- data

    def load_data(self, cfg: ml_collections.ConfigDict, shards: int | None, rows: slice | None):
        data = super().load_data(cfg, shards, rows)
        where = cfg.data.tokenizer_path or f"the student's tokenizer (data.corpus={cfg.data.corpus})"
        distill.check_teacher(self.settings, data.tokenizer, cfg.model.vocab_size, where)
        return data

    # ---- the step's frozen input: the teacher's parameters

    def frozen_inputs(self, setup) -> tuple[Any, Any]:
        self.teacher_spec, abstract = setup.abstract_run(self.settings.teacher,
                                                         param_dtype=self.settings.teacher_param_dtype or None)
        return abstract, jax.tree.map(lambda x: x.sharding, abstract)

    def prepare(self, setup, state, data, run_dir, resume_step: int) -> None:
        """Load the teacher onto the student's mesh into `setup.frozen_inputs`: the checkpoint recorded in the
        run directory when resuming (refused in one line when it is gone or changed), else `distill.teacher_step`
        or the newest, which is then recorded."""
        run_dir, settings = pathlib.Path(run_dir), self.settings
        record = run_dir / RECORD
        recorded = None
        if resume_step:
            if not record.exists():
                raise UserError(f"{run_dir} holds no {RECORD}: the teacher this distillation run started with is "
                                f"unknown; start again with config.run.fresh=true")
            recorded = json.loads(record.read_text())
            gone = recorded["step"] not in checkpoint.complete_steps(pathlib.Path(settings.teacher) /
                                                                            "checkpoints")
            if gone:
                raise UserError(f"the teacher {settings.teacher} no longer holds checkpoint {recorded['step']}, which "
                                f"this run distils from ({run_dir / RECORD}); restore it, or start again with "
                                f"config.run.fresh=true")
            settings = dataclasses.replace(settings, teacher_step=recorded["step"])
        where = self.cfg.data.tokenizer_path or "the student's tokenizer"
        distill.check_teacher(settings, data.tokenizer, self.cfg.model.vocab_size, where)
        teacher = setup.load_run(settings.teacher, step=None if settings.teacher_step < 0 else settings.teacher_step,
                                 param_dtype=settings.teacher_param_dtype or None)
        expected = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), setup.frozen_inputs)
        if jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), teacher.params) != expected:
            raise ValueError("the teacher's loaded parameters differ from the abstract ones the step was built for")
        identity = {"teacher": str(settings.teacher), "step": teacher.step,
                    "tokenizer_sha256": teacher.tokenizer.sha256, "fingerprint": fingerprint(teacher.params)}
        if recorded is not None and (recorded["fingerprint"], recorded["tokenizer_sha256"]) != (
                identity["fingerprint"], identity["tokenizer_sha256"]):
            raise UserError(f"the teacher {settings.teacher} changed since this run started: its checkpoint "
                            f"{teacher.step} now holds other parameters or another tokenizer than {run_dir / RECORD} "
                            f"records; distil from the teacher it started with, or start again with "
                            f"config.run.fresh=true")
        if recorded is None and jax.process_index() == 0:
            write_bytes_atomically(record, (json.dumps(identity, indent=2) + "\n").encode())
        setup.frozen_inputs = teacher.params
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(teacher.params))
        console(f"jaxlm: teacher {settings.teacher} (checkpoint {teacher.step}, {count / 1e6:.2f}M parameters, "
                f"{teacher.model_cfg.n_layers} layers) on the student's mesh; T={settings.temperature}, "
                f"alpha={settings.alpha}" + (f", top_k={settings.top_k}" if settings.top_k else ""))

    # ---- the loss

    def loss(self, trainable, frozen, model_spec, batch, dropout_key, z_loss: float, loss_chunk_len: int = 0,
             teacher_params=None):
        """`distill.summed_loss` with `steps.trainable_loss`'s arguments and the teacher's parameters (the step's
        frozen input) last: (the sum, (the sum of weights, the student's auxiliary outputs and the
        `distill/kl`, `distill/ce` sums))."""
        total, (tokens, out, terms) = distill.summed_loss(
            model_spec.merge(trainable, frozen), model_spec, teacher_params, self.teacher_spec, batch, dropout_key,
            self.settings, z_loss, loss_chunk_len)
        return total, (tokens, {**out, **terms})

    def aux_shapes(self, model_spec) -> dict[str, tuple[int, ...]]:
        return {**dict(model_spec.aux_shapes), **{f"distill/{m}": () for m in METRICS}}

    # ---- evaluation

    def eval_fn(self, model_spec, rules):
        chunk = model_spec.cfg.loss_chunk_len if model_spec.cfg is not None else 0

        def eval_fn(params, batch, packed, teacher_params):
            with spmd.logical_axis_rules(rules), attention.packed_kernel(packed):
                _, (tokens, _, terms) = distill.summed_loss(params, model_spec, teacher_params, self.teacher_spec,
                                                            batch, None, self.settings, 0.0, chunk)
                return {"ce": terms["distill/ce"], "kl": terms["distill/kl"], "tokens": tokens}

        return eval_fn

    def evaluate(self, setup, params, batches, target_bytes: int | None = None) -> dict[str, float]:
        """The student's `val_loss` (token-mean next-token loss, nats), `val_perplexity`, `val_bits_per_byte`
        (given `target_bytes`), `val_tokens`, and `val_kl`, the token-mean KL(teacher || student) at the
        temperature; empty without held-out tokens."""
        if not batches:
            return {}
        sums = jax.device_get([setup.eval_step(params, setup.put_batch(b), setup.attention_choice(b),
                                               *setup.frozen_args()) for b in batches])
        total = {k: sum(float(s[k]) for s in sums) for k in ("ce", "kl", "tokens")}
        tokens = total["tokens"]
        if not tokens:
            return {}
        loss = total["ce"] / tokens
        out = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)), "val_tokens": tokens,
               "val_kl": total["kl"] / tokens}
        if target_bytes:
            out["val_bits_per_byte"] = total["ce"] / math.log(2) / target_bytes
        return out

    def describe_eval(self, val: dict[str, float]) -> str:
        return f"{super().describe_eval(val)} | KL to the teacher {val['val_kl']:.4f}"
