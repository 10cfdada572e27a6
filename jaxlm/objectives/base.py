"""The objective's interface (`Objective`, documented in `jaxlm.objectives`) and the language model's
objective, apart from the registry so that each entry may derive from them without an import cycle."""


from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import ml_collections
import numpy as np

from jaxlm import metrics as metrics_lib
from jaxlm import steps
from jaxlm.data import mixture
from jaxlm.data.loader import DataConfig, load_data
from jaxlm.section import Section


class Objective:
    """An entry of `OBJECTIVES` (see the module's docstring for what each method owns). Built from the
    whole config (`from_config`); holds no state of a run."""

    name: ClassVar[str]
    sections: ClassVar[tuple[type[Section], ...]] = ()
    # whether the step takes frozen inputs (`frozen_inputs`): an argument of the train and eval steps after
    # `packed`, passed to `loss` (and the eval function) as the last argument
    has_frozen_inputs: ClassVar[bool] = False

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

    # ---- on-policy objectives (GRPO): batches made from the current state, not read from `data.train`

    on_policy: ClassVar[bool] = False

    def next_batch(self, setup, state, data, step: int) -> tuple[dict[str, jax.Array], dict[str, float]]:
        """(1-based `step`'s batch on the devices, the host's metrics of it), made from `state`."""
        raise NotImplementedError

    def step_metrics(self, metrics: dict[str, jax.Array]) -> dict[str, float]:
        """Host values from a finished step's metrics (the loop waits for the step when on-policy)."""
        return {}

    def scalars(self, metrics: dict[str, Any]) -> dict[str, float]:
        """A finished step's metrics as the named floats the run logs (`metrics.scalars`)."""
        return metrics_lib.scalars(metrics)

    def checkpoint_allowed(self, step: int) -> bool:
        """Whether a checkpoint after `step` resumes exactly (a due save waits for the next such step)."""
        return True

    def frozen_inputs(self, setup) -> tuple[Any, Any] | None:
        """(a pytree, its shardings): what the steps take as their last argument and never train (a teacher's
        parameters), or None (`has_frozen_inputs` False). Called by `train_setup.build` once the mesh exists,
        before the steps are jitted with these shardings; the pytree may be abstract (`jax.ShapeDtypeStruct`s)
        there, `prepare` then puts the values in `setup.frozen_inputs`."""
        return None


class LanguageModel(Objective):
    """Next-token cross-entropy, weighted per target (`weights`: SFT trains on the answers alone).

    With a data mixture (`data.sources` of two or more, `jaxlm.data.mixture`), the batch's `source_ids` say
    each token's source; the step sums the loss and the tokens by source (`steps.summed_loss`), logged as
    `loss/<source>` (its tokens' mean loss in the step, absent in a step without its tokens) and
    `tokens/<source>` (its tokens in the step), and the evaluation gives `val_loss/<source>`."""

    name = "lm"

    def __init__(self, cfg: ml_collections.ConfigDict | None = None):
        super().__init__(cfg)
        mix = mixture.parse_sources(cfg.data.sources) if cfg is not None and "sources" in cfg.data else []
        self.sources: tuple[str, ...] = tuple(s.name for s in mix) if len(mix) > 1 else ()

    def batch_fields(self) -> dict[str, Any]:
        return {"source_ids": np.int32} if self.sources else {}

    def loss(self, trainable, frozen, model_spec, batch, dropout_key, z_loss: float, loss_chunk_len: int = 0):
        return steps.trainable_loss(trainable, frozen, model_spec, batch, dropout_key, z_loss, loss_chunk_len,
                                    sources=len(self.sources))

    def aux_shapes(self, model_spec) -> dict[str, tuple[int, ...]]:
        shapes = dict(model_spec.aux_shapes)
        if self.sources:
            shapes |= {steps.SOURCE_LOSS: (len(self.sources),), steps.SOURCE_TOKENS: (len(self.sources),)}
        return shapes

    def scalars(self, metrics: dict[str, Any]) -> dict[str, float]:
        """The step reports the sums by source over its tokens (means over the step's tokens, as every auxiliary
        output): as `loss/<source>` and `tokens/<source>`."""
        metrics = dict(metrics)
        loss_sums, shares = metrics.pop(steps.SOURCE_LOSS, None), metrics.pop(steps.SOURCE_TOKENS, None)
        values = super().scalars(metrics)
        if shares is not None:
            loss_sums, shares = (np.asarray(jax.device_get(a), np.float64) for a in (loss_sums, shares))
            for name, loss_sum, share in zip(self.sources, loss_sums, shares, strict=True):
                values[f"tokens/{name}"] = float(round(share * values["tokens"]))
                if share > 0:
                    values[f"loss/{name}"] = loss_sum / share
        return values

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
        if self.sources and "source_ids" in batches[0]:  # a mixture's: each batch is one source's held-out rows
            for index, name in enumerate(self.sources):
                own = [(float(a), float(b)) for (a, b), batch in zip(sums, batches) if batch["source_ids"].flat[0] == index]
                if sum(b for _, b in own):
                    out[f"val_loss/{name}"] = sum(a for a, _ in own) / sum(b for _, b in own)
        return out

    def describe_eval(self, val: dict[str, float]) -> str:
        bpb = f" | bits/byte {val['val_bits_per_byte']:.4f}" if "val_bits_per_byte" in val else ""
        by_source = ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in val.items() if k.startswith("val_loss/"))
        return (f"val loss {val['val_loss']:.4f} | perplexity {val['val_perplexity']:.2f}{bpb}"
                + (f" | by source: {by_source}" if by_source else ""))

    def load_data(self, cfg: ml_collections.ConfigDict, shards: int | None, rows: slice | None):
        return load_data(DataConfig.from_config(cfg.data), shards, rows)


def batch_dtypes(objective: Objective) -> dict[str, Any]:
    """Every batch field's dtype: the LM's five and the objective's."""
    return {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
            "weights": np.float32, **objective.batch_fields()}
