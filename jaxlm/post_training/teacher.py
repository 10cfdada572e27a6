"""A distillation teacher read onto a student's mesh (`jaxlm.post_training.distill` has the loss and the
checks): apart from it because it reads runs (`jaxlm.inference`, which imports the config), and the objective
registry, which the config imports, must not."""

from __future__ import annotations

import pathlib

from jax.sharding import Mesh

from jaxlm import inference
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.mesh import Rules
from jaxlm.post_training.distill import DistillConfig, check_teacher


def load_teacher(settings: DistillConfig, mesh: Mesh, rules: Rules, tokenizer: Tokenizer, vocab_size: int,
                 tokenizer_where: str = "the student's tokenizer", dtype: str | None = None) -> inference.LoadedRun:
    """The teacher run `settings.teacher` loaded for the student's step: checked against the student's
    tokenizer (`tokenizer`, found at `tokenizer_where`) and `vocab_size` before any parameter is read
    (`distill.check_teacher`), and its parameters (checkpoint `teacher_step`, or the newest that loads) placed
    on the student's `mesh` by the student's `rules`, cast to `teacher_param_dtype` where set. `dtype`
    overrides the teacher's compute dtype (its run's by default). `TrainSetup.load_run` is the same read."""
    check_teacher(settings, tokenizer, vocab_size, tokenizer_where)
    return inference.load_run(pathlib.Path(settings.teacher),
                              step=None if settings.teacher_step < 0 else settings.teacher_step, dtype=dtype,
                              param_dtype=settings.teacher_param_dtype or None, mesh=mesh, rules=rules)
