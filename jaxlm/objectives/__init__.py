"""Training objectives: what the one compiled train step minimises, and everything that choice owns.

`python -m jaxlm.train` runs every objective: `config.objective.name` picks an entry of `OBJECTIVES`
(`lm`, the default: next-token cross-entropy with SFT's loss weights; `dpo`: preference optimization,
`jaxlm.objectives.dpo`). Post-training methods plug in here rather than as flags of the step, as the
MLP and attention registries own their arithmetic (`jaxlm.models.mlps.base`). An objective owns:

- **its config**: the typed sections it adds (`sections`, e.g. `dpo`; `config.SECTIONS` lists them) and
  its checks across sections (`validate`, run by `config.validate` when the objective is chosen);
- **its data**: `load_data(cfg, shards, rows)` -> a `loader.Data` whose stream yields its batches (DPO:
  each row one preference pair, chosen and rejected as the row's segments 1 and 2, so that a pair is
  never split between micro-batches or devices); read and checked before any device work;
- **its batch fields** beyond the language model's five [B, T] arrays (`batch_fields`: name -> dtype),
  [B, T] too, so that they shard and split into micro-batches as the tokens do;
- **its frozen inputs**: `prepare(setup, state, data, run_dir, resume_step)` runs once the train state
  exists and before the first step, to compute what the step reads but never trains (DPO: the
  reference model's log-probs, into the batch; later a teacher's parameters, GRPO's rollouts' old
  log-probs and advantages);
- **its loss**, inside the one compiled step: `loss(trainable, frozen, model_spec, batch, dropout_key,
  z_loss, loss_chunk_len) -> (sum, (count, aux))`, the signature of `steps.trainable_loss`. `sum` is a
  sum over the micro-batch's examples (tokens for the LM, pairs for DPO) and `count` how many, so that
  micro-batches add up as the LM loss does (the step divides the summed loss and gradients by the summed
  count). `aux` holds the model's auxiliary outputs times `count` (`jaxlm.models.aux`) and the
  objective's own metrics as sums, each named `<objective>/<metric>` (`aux_shapes` declares them all);
  the step reports their means over the count under those names (the model's as `aux/<name>`);
- **its evaluation**: `eval_fn(model_spec, rules)` (the compiled eval step's function: sums over a
  batch), `evaluate(setup, params, batches, target_bytes)` -> `{"val_loss": ..., ...}` and
  `describe_eval(val)` (the console's words for it).

The LM objective is the step as it was before objectives existed: the same functions, the same
compiled program (tests/test_reference.py checks its steps bit for bit).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import ml_collections
import numpy as np

from jaxlm import steps
from jaxlm.data.loader import DataConfig, load_data
from jaxlm.section import Section, check_choice, setting


class Objective:
    """An entry of `OBJECTIVES` (see the module's docstring for what each method owns). Built from the
    whole config (`from_config`); holds no state of a run."""

    name: ClassVar[str]
    sections: ClassVar[tuple[type[Section], ...]] = ()

    def __init__(self, cfg: ml_collections.ConfigDict | None = None):
        self.cfg = cfg

    @classmethod
    def validate(cls, cfg: ml_collections.ConfigDict) -> None:
        """Checks across sections when this objective is chosen (one `UserError` line)."""

    def batch_fields(self) -> dict[str, Any]:
        """The batch's [B, T] arrays beyond inputs, targets, segment_ids, positions and weights."""
        return {}

    def loss(self, trainable, frozen, model_spec, batch, dropout_key, z_loss: float, loss_chunk_len: int = 0):
        raise NotImplementedError

    def aux_shapes(self, model_spec) -> dict[str, tuple[int, ...]]:
        return dict(model_spec.aux_shapes)

    def eval_fn(self, model_spec, rules):
        raise NotImplementedError

    def evaluate(self, setup, params, batches, target_bytes: int | None = None) -> dict[str, float]:
        raise NotImplementedError

    def describe_eval(self, val: dict[str, float]) -> str:
        return f"val loss {val['val_loss']:.4f}"

    def load_data(self, cfg: ml_collections.ConfigDict, shards: int | None, rows: slice | None):
        raise NotImplementedError

    def prepare(self, setup, state, data, run_dir, resume_step: int) -> None:
        """Compute the frozen inputs the step reads (none for the LM)."""


class LanguageModel(Objective):
    """Next-token cross-entropy, weighted per target (`weights`: SFT trains on the answers alone)."""

    name = "lm"

    def loss(self, trainable, frozen, model_spec, batch, dropout_key, z_loss: float, loss_chunk_len: int = 0):
        return steps.trainable_loss(trainable, frozen, model_spec, batch, dropout_key, z_loss, loss_chunk_len)

    def eval_fn(self, model_spec, rules):
        return steps.make_eval_step(model_spec, rules)

    def evaluate(self, setup, params, batches, target_bytes: int | None = None) -> dict[str, float]:
        """Held-out metrics over fixed batches: `val_loss` (token-mean cross-entropy, nats),
        `val_perplexity` (its exp), `val_tokens`, and `val_bits_per_byte` (the summed loss in bits over
        the UTF-8 bytes the target tokens stand for; it compares runs with different tokenizers) when
        `target_bytes` is given. Empty when there are no batches, or no token in them to score."""
        if not batches:
            return {}
        sums = jax.device_get([setup.eval_step(params, setup.put_batch(batch), setup.attention_choice(batch))
                               for batch in batches])
        total, tokens = sum(float(loss) for loss, _ in sums), sum(float(count) for _, count in sums)
        if not tokens:  # nothing to score (SFT rows whose answers were all cut off): no loss, rather than 0
            return {}
        loss = total / tokens
        out = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)), "val_tokens": tokens}
        if target_bytes:
            out["val_bits_per_byte"] = total / math.log(2) / target_bytes
        return out

    def describe_eval(self, val: dict[str, float]) -> str:
        bpb = f" | bits/byte {val['val_bits_per_byte']:.4f}" if "val_bits_per_byte" in val else ""
        return f"val loss {val['val_loss']:.4f} | perplexity {val['val_perplexity']:.2f}{bpb}"

    def load_data(self, cfg: ml_collections.ConfigDict, shards: int | None, rows: slice | None):
        return load_data(DataConfig.from_config(cfg.data), shards, rows)


def _registry() -> dict[str, type[Objective]]:
    # local import: dpo.py derives from this module's `Objective` (at the top, a cycle)
    from jaxlm.objectives.dpo import DPO

    return {cls.name: cls for cls in (LanguageModel, DPO)}


OBJECTIVE_NAMES = ("lm", "dpo")  # (the registry's keys, for the config's check without importing every entry)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig(Section):
    """What the train step minimises (`jaxlm.objectives`): an entry of OBJECTIVES, which owns its own
    section (`dpo`) for its settings."""

    section: ClassVar[str] = "objective"
    name: str = setting(
        "lm",
        "lm (next-token cross-entropy; SFT's loss weights from data.format) | dpo (preference pairs: "
        "config.dpo; docs/post-training.md)")

    def validate(self) -> None:
        check_choice(self.key("name"), self.name, OBJECTIVE_NAMES)


def objective_class(name: str) -> type[Objective]:
    return _registry()[name]


def from_config(cfg: ml_collections.ConfigDict) -> Objective:
    """The chosen objective of a config (the LM for a config without an objective section)."""
    name = cfg.objective.name if "objective" in cfg else "lm"
    return objective_class(name)(cfg)


def validate(cfg: ml_collections.ConfigDict) -> None:
    """The chosen objective's checks across sections (`Objective.validate`)."""
    if "objective" in cfg:
        objective_class(cfg.objective.name).validate(cfg)


def batch_dtypes(objective: Objective) -> dict[str, Any]:
    """Every batch field's dtype: the LM's five and the objective's."""
    return {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
            "weights": np.float32, **objective.batch_fields()}
