"""Distillation (issue 50, item 3): a student trained on a teacher's output distribution, the parts the
train step's objective seam plugs in.

The loss, per target position with loss weight w (the batch's `weights`: 0 for padding and prompts):

    w * (alpha * T^2 * KL(p_teacher^T || p_student^T) + (1 - alpha) * CE(student, target))

where p^T = softmax(logits / T). The forward KL (the teacher's distribution as the target, as Hinton et al.
2015) is scaled by T^2 so that its gradient, which scales as 1/T, keeps its size as the temperature
changes; alpha = 1 distils alone, alpha = 0 is the plain next-token loss. `top_k` > 0 compares the two
distributions on the teacher's k most likely tokens and the rest of the vocabulary as one outcome (a
KL between the distributions coarsened to those k + 1 outcomes: never negative, zero where the two
agree on them, never above the full KL, and the student's whole vocabulary still gets a gradient
through the rest), where Tunix's logit strategy renormalizes both over the k tokens and leaves the
student's tail without one. Everything is in float32, as `jaxlm.steps.token_losses`, whose
cross-entropy (and z-loss) the next-token term is.

Sums, not means: `loss_sums` returns the weighted sums of the loss and of its two terms over a batch,
which add over micro-batches as `steps.summed_loss`'s do; the step divides once by the sum of weights.
Memory: the teacher's logits are one more [B, T, V] array in its compute dtype beside the student's;
with `model.loss_chunk_len` (`chunked_loss_sums`, as `steps.chunked_loss_sum`) both models' logits are
made that many positions at a time from their final hidden states and rematerialized in the backward
pass, so only one chunk of each is alive.

The teacher is any jaxlm run directory, a trained run or a Hugging Face model imported with `python -m
jaxlm.hf import` (`jaxlm.post_training.teacher.load_teacher`, apart from this module so that the objective
registry, which the config imports, never imports the run reader, which imports the config): its newest
(or `distill.teacher_step`) checkpoint's parameters are read onto the STUDENT's mesh by the student's
logical-axis rules (`inference.load_run` with `mesh` and `rules`), so its forward pass is sharded as the
student's is, inside the same program. A teacher with another tokenizer (its file's sha256, the identity a
run records, or its vocabulary size) is refused in one line naming both (`check_teacher`), as is a model
whose logits are not as wide as the student's.

How it plugs into `python -m jaxlm.train` (`jaxlm.objectives.distill`, `config.objective.name=distill`):

- config: `DistillConfig`, section `distill` (teacher, teacher_step, temperature, alpha, top_k,
  teacher_param_dtype), in `jaxlm.config.SECTIONS`.
- data: the student's, with `check_teacher` (the directory, the tokenizer, the logits' width) as it is read,
  before any device work.
- setup: `TrainSetup.abstract_run` when the steps are built (the objective's `frozen_inputs`: the shapes
  and shardings the step is jitted with), `TrainSetup.load_run` once per start (the objective's `prepare`),
  on the student's mesh by its rules; the `LoadedRun`'s `params` are the step's frozen input.
- step: the teacher's params are a FROZEN INPUT of the jitted train step, an argument beside the state
  with their shardings in `in_shardings`, never donated, never closed over (a closure would bake them
  into the program as constants) and never in the `TrainState` (the optimizer never sees them, and a
  checkpoint does not hold a second model). `make_trainable_loss(teacher_spec, settings)` (and the
  objective's `loss`) take `steps.trainable_loss`'s arguments plus `teacher_params` last, for
  `jax.value_and_grad` on the student's trainable parameters (argument 0) and `steps.micro_batch_loss`; in
  the replica-local scan the teacher's params are the same for every replica (not vmapped). The teacher's
  forward runs inside the step, per micro-batch, without dropout, under `jax.lax.stop_gradient`: no
  gradient reaches it (tested).
- metrics: the third element of `summed_loss`'s aux, `{"distill/kl", "distill/ce"}`, are weighted sums;
  divided by the step's sum of weights they are the mean KL (before T^2 and alpha) and the student's
  next-token loss, the number to compare with a student trained without a teacher. Evaluation reports both
  on the held-out batches (`val_loss`, `val_kl`).
- resume: the run directory records the teacher's directory, checkpoint step, tokenizer sha256 and a
  fingerprint of its parameters; a resumed run reads that step again, and a teacher that changed is refused.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import checkpoint, steps
from jaxlm.data.tokenizer import FILE_NAMES, Tokenizer, find_in
from jaxlm.errors import UserError
from jaxlm.models import aux
from jaxlm.section import Section, check, check_choice, setting
from jaxlm.train_state import ModelSpec

# What the masked-out logits of a top-k comparison become: the smallest float32, not -inf, so that a row
# whose vocabulary is all kept (ties at the k-th logit) gives a rest of probability 0 and finite gradients.
_LOWEST = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class DistillConfig(Section):
    """The teacher and the distillation loss (`config.distill`)."""

    section: ClassVar[str] = "distill"
    teacher: str = setting(
        "", "the teacher: a jaxlm run directory (trained, or a Hugging Face model imported with python -m jaxlm.hf "
            "import) with the student's tokenizer", path=("dir", "in"))
    teacher_step: int = setting(-1, "the teacher checkpoint's step (-1 = its newest that loads)")
    temperature: float = setting(1.0, "T: both distributions are softmax(logits / T); the KL is scaled by T^2")
    alpha: float = setting(
        1.0, "the KL's weight; 1 - alpha weights the next-token loss (1 = distillation alone)")
    top_k: int = setting(
        0, "compare the teacher's k most likely tokens and the rest of the vocabulary as one (0 = every token)")
    teacher_param_dtype: str = setting(
        "", "the teacher's parameters as they are read: bfloat16 halves their memory (\"\" = as saved)")

    def validate(self) -> None:
        check(self.temperature > 0, self.key("temperature"), self.temperature, "a temperature above 0")
        check(0.0 <= self.alpha <= 1.0, self.key("alpha"), self.alpha, "a weight from 0 to 1")
        check(self.top_k >= 0, self.key("top_k"), self.top_k, "0 (every token) or a number of tokens")
        check(self.teacher_step >= -1, self.key("teacher_step"), self.teacher_step, "-1 (the newest) or a step")
        check_choice(self.key("teacher_param_dtype"), self.teacher_param_dtype, ("float32", "bfloat16", "float16"),
                     allow_empty=True)


# ----------------------------------------------------------------------------- the loss


def token_kl(student_logits: jax.Array, teacher_logits: jax.Array, temperature: float, top_k: int = 0) -> jax.Array:
    """KL(p_teacher^T || p_student^T) per position [B, T] in float32, from logits [B, T, V]; no gradient
    reaches the teacher's logits. With `top_k`, over the teacher's k largest logits (every logit equal to
    the k-th is kept too) and the rest of the vocabulary as one outcome (the module's docstring)."""
    s = student_logits.astype(jnp.float32) / temperature
    t = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / temperature
    log_s = s - jax.nn.logsumexp(s, axis=-1, keepdims=True)
    log_t = t - jax.nn.logsumexp(t, axis=-1, keepdims=True)
    terms = jnp.exp(log_t) * (log_t - log_s)
    if not top_k:
        return jnp.sum(terms, axis=-1)
    kept = t >= jax.lax.top_k(t, top_k)[0][..., -1:]  # a mask, not a gather: a local reduction where V is split
    inside = jnp.sum(jnp.where(kept, terms, 0.0), axis=-1)
    rest_t = jax.nn.logsumexp(jnp.where(kept, _LOWEST, log_t), axis=-1)  # log of the rest's probability
    rest_s = jax.nn.logsumexp(jnp.where(kept, _LOWEST, log_s), axis=-1)
    return inside + jnp.exp(rest_t) * (rest_t - rest_s)


def loss_sums(student_logits: jax.Array, teacher_logits: jax.Array, targets: jax.Array, weights: jax.Array,
              settings: DistillConfig, z_loss: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the weighted sum of the loss, of the KL, of the next-token loss) over a batch: scalars in float32
    that add over micro-batches. The loss is alpha * T^2 * KL + (1 - alpha) * (cross-entropy + z-loss);
    the KL's sum is before T^2 and alpha, and the next-token term's is `steps.token_losses`'s."""
    kl = token_kl(student_logits, teacher_logits, settings.temperature, settings.top_k)
    ce = steps.token_losses(student_logits, targets, z_loss)
    alpha, t2 = settings.alpha, settings.temperature ** 2
    per_token = alpha * t2 * kl + (1.0 - alpha) * ce
    return jnp.sum(per_token * weights), jnp.sum(kl * weights), jnp.sum(ce * weights)


def chunked_loss_sums(project: Callable[[jax.Array], jax.Array], x: jax.Array,
                      teacher_project: Callable[[jax.Array], jax.Array], teacher_x: jax.Array, targets: jax.Array,
                      weights: jax.Array, settings: DistillConfig, z_loss: float, chunk_len: int):
    """`loss_sums` with both models' logits made `chunk_len` positions at a time from their final hidden
    states (`x` [B, T, D] the student's, `teacher_x` [B, T, D'] the teacher's; `project` and
    `teacher_project` map a chunk of them to logits [B, chunk_len, V]). Each chunk is rematerialized in the
    backward pass, so one chunk of each model's float32 logits is alive instead of the whole [B, T, V];
    equal to `loss_sums` (value and gradient) up to summation order."""
    split = steps.position_chunks(x.shape[1], chunk_len)

    @jax.checkpoint
    def chunk_sums(x_c, tx_c, t_c, w_c):
        return loss_sums(project(x_c), teacher_project(tx_c), t_c, w_c, settings, z_loss)

    def body(total, chunk):
        return jax.tree.map(jnp.add, total, chunk_sums(*chunk)), None

    zeros = (jnp.zeros((), jnp.float32),) * 3
    chunks = (split(x), split(jax.lax.stop_gradient(teacher_x)), split(targets), split(weights))
    return jax.lax.scan(body, zeros, chunks)[0]


# ----------------------------------------------------------------------------- in the train step


def teacher_forward(teacher_params, teacher_spec: ModelSpec, batch: steps.Batch, hidden: bool = False):
    """The teacher on a batch as the step runs it: its parameters held fixed (`stop_gradient`), no
    dropout; logits [B, T, V], or with `hidden` (the chunked loss) (final hidden states [B, T, D'], the
    model, whose `logits` makes a chunk's logits)."""
    teacher = nnx.merge(teacher_spec.graphdef, jax.lax.stop_gradient(teacher_params))
    out = teacher(batch["inputs"], batch["positions"], batch["segment_ids"], hidden=hidden)
    return (out, teacher) if hidden else out


def summed_loss(params, model_spec: ModelSpec, teacher_params, teacher_spec: ModelSpec, batch: steps.Batch,
                dropout_key, settings: DistillConfig, z_loss: float = 0.0, loss_chunk_len: int = 0):
    """`steps.summed_loss` (with its auxiliary outputs, training) for distillation: (the weighted sum of the
    loss plus the student's auxiliary loss terms times the sum of weights, (the sum of weights, the
    auxiliary outputs times it, {"distill/kl": ..., "distill/ce": ...} weighted sums)). Everything adds
    over micro-batches."""
    model = nnx.merge(model_spec.graphdef, params)
    weights, targets = batch["weights"], batch["targets"]
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    if loss_chunk_len and loss_chunk_len < batch["inputs"].shape[1]:
        teacher_x, teacher = teacher_forward(teacher_params, teacher_spec, batch, hidden=True)
        x, out = model(*args, dropout_key=dropout_key, hidden=True, with_aux=True)
        total, kl, ce = chunked_loss_sums(model.logits, x, teacher.logits, teacher_x, targets, weights, settings,
                                          z_loss, loss_chunk_len)
    else:
        teacher_logits = teacher_forward(teacher_params, teacher_spec, batch)
        logits, out = model(*args, dropout_key=dropout_key, with_aux=True)
        total, kl, ce = loss_sums(logits, teacher_logits, targets, weights, settings, z_loss)
    tokens = jnp.sum(weights)
    for term in aux.loss_terms(out):
        total = total + term * tokens
    return total, (tokens, aux.scale(out, tokens), {"distill/kl": kl, "distill/ce": ce})


def make_trainable_loss(teacher_spec: ModelSpec, settings: DistillConfig):
    """The loss the step differentiates: `steps.trainable_loss`'s arguments (trainable, frozen, model_spec,
    batch, dropout_key, z_loss, loss_chunk_len) and `teacher_params` last; the teacher's graph and the
    settings are fixed here (static: one program per teacher and settings)."""

    def loss(trainable, frozen, model_spec: ModelSpec, batch, dropout_key, z_loss, loss_chunk_len, teacher_params):
        return summed_loss(model_spec.merge(trainable, frozen), model_spec, teacher_params, teacher_spec, batch,
                           dropout_key, settings, z_loss, loss_chunk_len)

    return loss


# ----------------------------------------------------------------------------- the teacher


def check_same_tokenizer(student: Tokenizer, teacher: Tokenizer, student_where: str, teacher_where: str) -> None:
    """Refuse, in one line naming both, a teacher whose tokenizer is not the student's: the same token ids
    must mean the same text for the two distributions to be compared (the file's sha256, as a run
    records it, and the vocabulary size)."""
    if student.sha256 == teacher.sha256 and student.vocab_size == teacher.vocab_size:
        return
    raise UserError(
        f"the teacher's tokenizer is not the student's: teacher {teacher_where} ({teacher.vocab_size} tokens, sha256 "
        f"{teacher.sha256[:16]}), student {student_where} ({student.vocab_size} tokens, sha256 "
        f"{student.sha256[:16]}); distill from a teacher trained or imported with the student's tokenizer")


def check_teacher(settings: DistillConfig, tokenizer: Tokenizer, vocab_size: int,
                  tokenizer_where: str = "the student's tokenizer") -> None:
    """Refuse, one line each, before any parameter is read: a teacher directory that is missing or not a run,
    a tokenizer that is not the student's (`tokenizer`, found at `tokenizer_where`), logits not as wide as the
    student's (`vocab_size`), a `teacher_step` the teacher has no checkpoint of. Reads the teacher's
    config.json and tokenizer alone (the objective runs this with its data, before any device work)."""
    run_dir = pathlib.Path(settings.teacher)
    key = f"config.distill.teacher={settings.teacher}"
    if not run_dir.is_dir():
        raise UserError(f"{key}: no such directory; give the run directory of a trained teacher (python -m "
                        f"jaxlm.train, or python -m jaxlm.hf import)")
    try:
        saved = json.loads((run_dir / "config.json").read_text())
        teacher_vocab = int(saved["model"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{key} is not a run directory (no readable config.json with model.vocab_size); give the "
                        f"directory python -m jaxlm.train or python -m jaxlm.hf import wrote") from None
    tok_path = find_in(run_dir)
    if tok_path is None:
        raise UserError(f"{key}: the run has no tokenizer ({' or '.join(FILE_NAMES)}); give a run directory "
                        f"python -m jaxlm.train or jaxlm.hf import wrote")
    check_same_tokenizer(tokenizer, Tokenizer.load(tok_path), tokenizer_where, str(tok_path))
    if teacher_vocab != vocab_size:
        raise UserError(f"{key} has logits over {teacher_vocab} ids (its model.vocab_size) and the student over "
                        f"{vocab_size}; give the student the teacher's --config.model.vocab_size={teacher_vocab}")
    steps_there = checkpoint.complete_steps(run_dir / "checkpoints")
    if settings.teacher_step >= 0 and settings.teacher_step not in steps_there:
        raise UserError(f"config.distill.teacher_step={settings.teacher_step}: {run_dir} has no complete checkpoint "
                        f"of that step; its checkpoints: {', '.join(map(str, steps_there)) or 'none'}")
