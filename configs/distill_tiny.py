"""Distillation on a CPU: configs/tiny.py's trained model (the teacher, runs/tiny) taught to a student of a
quarter of its parameters, on the same built-in corpus and therefore the same tokenizer (`jaxlm.objectives.distill`).
Two commands, the teacher first (about 2 minutes on 2 CPU cores), then the student:

    python -m jaxlm.train --config=configs/tiny.py           # the teacher: runs/tiny
    python -m jaxlm.train --config=configs/distill_tiny.py   # the student: runs/distill_tiny

The student's loss is half the KL to the teacher's distribution and half the next-token loss (alpha =
0.5) at T = 1: on the teacher's distribution alone (alpha = 1) it followed a teacher barely better than
itself and ended worse than the student trained alone (docs/post-training.md has the measurements). Its
`val_loss` is its own next-token loss on the held-out text, to compare with the same student trained
without a teacher (`--config.objective.name=lm --config.run.name=student_alone`), and `val_kl` its KL to
the teacher. Any run with this tokenizer is a teacher: `--config.distill.teacher=<run directory>`.
"""

from jaxlm.config import load_recipe


def get_config():
    c = load_recipe("tiny")  # the teacher's data, tokenizer, batch and schedule
    c.objective.name = "distill"
    c.distill.update(teacher="runs/tiny", temperature=1.0, alpha=0.5)
    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=192)
    return c
