"""Training objectives: what the one compiled train step minimises, and everything that choice owns.

`python -m jaxlm.train` runs every objective: `config.objective.name` picks an entry of `OBJECTIVES`
(`lm`, the default: next-token cross-entropy with SFT's loss weights; `dpo`: preference optimization,
`jaxlm.objectives.dpo`; `grpo`: reinforcement learning with verifiable rewards, `jaxlm.objectives.grpo`;
`distill`: a student trained on a teacher's distribution, `jaxlm.objectives.distill`). Post-training methods plug
in here rather than as flags of the step, as the MLP and attention registries own their arithmetic
(`jaxlm.models.mlps.base`). An objective owns:

- **its config**: the typed sections it adds (`sections`, e.g. `dpo`; `config.SECTIONS` lists them) and
  its checks across sections (`validate`, run by `config.validate` when the objective is chosen);
- **its data**: `load_data(cfg, shards, rows)` -> a `loader.Data` whose stream yields its batches (DPO:
  each row one preference pair, chosen and rejected as the row's segments 1 and 2, so that a pair is
  never split between micro-batches or devices); read and checked before any device work;
- **its batch fields** beyond the language model's five [B, T] arrays (`batch_fields`: name -> dtype),
  [B, T] too, so that they shard and split into micro-batches as the tokens do;
- **its frozen inputs**: `prepare(setup, state, data, run_dir, resume_step)` runs once the train state
  exists and before the first step, to compute what the step reads but never trains (DPO: the
  reference model's log-probs, into the batch; later GRPO's rollouts' old log-probs and advantages);
  an input of the step itself, outside the batch and the train state, is declared by `frozen_inputs(setup)`
  -> (pytree, shardings) with `has_frozen_inputs` (distillation: the teacher's parameters, one argument of
  the one compiled step, with their shardings, never donated, never a constant of the program), `prepare`
  putting its values in `setup.frozen_inputs`; `loss` and the eval function then take it as their last
  argument;
- **its loss**, inside the one compiled step: `loss(trainable, frozen, model_spec, batch, dropout_key,
  z_loss, loss_chunk_len) -> (sum, (count, aux))`, the signature of `steps.trainable_loss`. `sum` is a
  sum over the micro-batch's examples (tokens for the LM, pairs for DPO) and `count` how many, so that
  micro-batches add up as the LM loss does (the step divides the summed loss and gradients by the summed
  count). `aux` holds the model's auxiliary outputs times `count` (`jaxlm.models.aux`) and the
  objective's own metrics as sums, each named `<objective>/<metric>` (`aux_shapes` declares them all);
  the step reports their means over the count under those names (the model's as `aux/<name>`);
- **its own batches, on-policy** (`on_policy`; GRPO): instead of reading `data.train`, the loop asks
  `next_batch(setup, state, data, step)` for each step's batch, on the devices, made from the current
  state (GRPO: completions sampled with the current parameters, scored, advantages), and the host's
  metrics of it; `step_metrics(metrics)` adds host values computed from the step's device metrics (the
  loop waits for the step then: GRPO's training time); a checkpoint is saved only after a step where
  `checkpoint_allowed(step)` (GRPO: rollout boundaries), a due save waiting for the next such step;
- **its evaluation**: `eval_fn(model_spec, rules)` (the compiled eval step's function: sums over a
  batch), `evaluate(setup, params, batches, target_bytes)` -> `{"val_loss": ..., ...}` and
  `describe_eval(val)` (the console's words for it).

The LM objective is the step as it was before objectives existed: the same functions, the same
compiled program (tests/test_reference.py checks its steps bit for bit).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import ml_collections

from jaxlm.objectives.base import LanguageModel, Objective, batch_dtypes
from jaxlm.objectives.distill import Distill
from jaxlm.objectives.dpo import DPO
from jaxlm.objectives.grpo import GRPO
from jaxlm.section import Section, check_choice, setting

__all__ = ["OBJECTIVES", "Objective", "LanguageModel", "ObjectiveConfig", "batch_dtypes", "from_config",
           "objective_class", "validate"]

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (LanguageModel, DPO, GRPO, Distill)}
OBJECTIVE_NAMES = tuple(OBJECTIVES)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig(Section):
    """What the train step minimises (`jaxlm.objectives`): an entry of OBJECTIVES, which owns its own
    section (`dpo`, `distill`) for its settings."""

    section: ClassVar[str] = "objective"
    name: str = setting(
        "lm",
        "lm (next-token cross-entropy; SFT's loss weights from data.format) | dpo (preference pairs: "
        "config.dpo) | grpo (rewards on sampled completions: config.grpo) | distill (a teacher's distribution: "
        "config.distill); docs/post-training.md")

    def validate(self) -> None:
        check_choice(self.key("name"), self.name, OBJECTIVE_NAMES)


def objective_class(name: str) -> type[Objective]:
    return OBJECTIVES[name]


def from_config(cfg: ml_collections.ConfigDict) -> Objective:
    """The chosen objective of a config (the LM for a config without an objective section)."""
    name = cfg.objective.name if "objective" in cfg else "lm"
    return objective_class(name)(cfg)


def validate(cfg: ml_collections.ConfigDict) -> None:
    """The chosen objective's checks across sections (`Objective.validate`)."""
    if "objective" in cfg:
        objective_class(cfg.objective.name).validate(cfg)


