"""DPO: direct preference optimization from pairs of a chosen and a rejected completion.

`--config.objective.name=dpo`, settings in `config.dpo` (`DPOConfig`), data as in
`jaxlm.data.preferences` (each batch row one pair: chosen = segment 1, rejected = segment 2).

With pi and ref the summed log-probs of a completion's scored tokens (its weights: the completion and
its end marker, never the prompt) under the trained policy and the frozen reference, and
h = (pi_c - ref_c) - (pi_r - ref_r), the loss of a pair is (`preference_losses`)
  sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(beta h)
  ipo     (Azar et al. 2023):          (h' - 1 / (2 beta))^2, h' of the log-probs averaged per token, as
                                       TRL computes it
  simpo   (Meng et al. 2024):          -log sigmoid(beta (pi_c / n_c - pi_r / n_r) - gamma): no reference
plus, with `dpo.sft_weight` = alpha > 0, alpha (-pi_c / n_c): the chosen completion's next-token loss per
token (RPO, Pang et al. 2024; TRL's `rpo_alpha`), which keeps DPO from lowering the chosen completions'
likelihood along with the rejected ones'.
The implicit rewards are beta (pi - ref) (per token for ipo; beta pi / n for simpo); the metrics are
their means (`dpo/reward_chosen`, `dpo/reward_rejected`), the mean margin between them (`dpo/margin`)
and the fraction of pairs whose chosen reward is the larger (`dpo/accuracy`); evaluation reports the
same over the held-out pairs (`val_preference_accuracy`, ...). Per-pair sums, so micro-batches add up.

The reference (`dpo.reference`):
- `precomputed` (the default): the model as the run starts (LoRA: the base, the adapters off), run once
  over every pair before the first step (`reference_logps`); its per-sequence sums are kept in
  `data.cache_dir` as `dpo-reference-<key>.npz`, the key a hash of the encoded pairs, the model's and
  LoRA's settings and a fingerprint of the reference's parameters (so that another model or other data
  computes them again), and the run directory records the key (`dpo_reference.json`), which a resumed
  run reads them by (a LoRA run, whose base does not change, computes them again if they are gone).
- `live` (LoRA, adapters alone trained): the base with the adapters off, in the train step itself,
  without a gradient: one more forward per step, and no second copy of the weights either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import steps
from jaxlm.console import console
from jaxlm.data import loader, preferences, sft, sources, tokenizer
from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import UserError
from jaxlm.models import attention, aux
from jaxlm.objectives.base import Objective
from jaxlm.section import Section, check, check_choice, setting

LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCES = ("precomputed", "live")
METRICS = ("reward_chosen", "reward_rejected", "margin", "accuracy")
RECORD = "dpo_reference.json"  # in the run directory: the key of the reference's log-probs it trains against


@dataclasses.dataclass(frozen=True)
class DPOConfig(Section):
    """Preference optimization (`config.objective.name=dpo`, `jaxlm.objectives.dpo`)."""

    section: ClassVar[str] = "dpo"
    beta: float = setting(0.1, "how far from the reference the policy may move: the scale of the implicit reward")
    loss: str = setting("sigmoid", "sigmoid (DPO) | ipo (squared, log-probs per token) | simpo (no reference, "
                                   "log-probs per token, margin dpo.simpo_gamma)")
    simpo_gamma: float = setting(0.5, "dpo.loss=simpo: the target margin gamma between the rewards")
    sft_weight: float = setting(
        0.0, "adds this times the chosen completion's next-token loss per token to each pair's loss (RPO; TRL's "
             "rpo_alpha); 0 = off")
    reference: str = setting(
        "precomputed",
        "the reference's log-probs: precomputed (once before training, kept in data.cache_dir) | live (in every "
        "step: LoRA's base with the adapters off, no second copy)")

    def validate(self) -> None:
        check(self.beta > 0, self.key("beta"), self.beta, "a positive number")
        check_choice(self.key("loss"), self.loss, LOSSES)
        check(self.simpo_gamma >= 0, self.key("simpo_gamma"), self.simpo_gamma, "0 or more")
        check(self.sft_weight >= 0, self.key("sft_weight"), self.sft_weight, "0 (off) or more")
        check_choice(self.key("reference"), self.reference, REFERENCES)


# ----------------------------------------------------------------------------- the arithmetic


def adapters_off(params):
    """`params` with every LoRA adapter's B at zero: the base model's outputs exactly (x W + (x A) 0)."""

    def off(path, leaf):
        last = path[-1] if path else None
        return jnp.zeros_like(leaf) if getattr(last, "key", None) == "lora_b" else leaf

    return jax.tree_util.tree_map_with_path(off, params)


def _chunked_token_losses(project, x: jax.Array, targets: jax.Array, chunk_len: int) -> jax.Array:
    """Per-token cross-entropy [B, T] with the logits made `chunk_len` positions at a time (each chunk's
    recomputed in the backward pass), as `steps.chunked_loss_sum` makes them."""
    b, t, _ = x.shape
    n = t // chunk_len

    def split(a):
        return a.reshape(b, n, chunk_len, *a.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def chunk(x_c, t_c):
        return steps.token_losses(project(x_c), t_c, 0.0)

    out = jax.lax.map(lambda c: chunk(*c), (split(x), split(targets)))  # [n, B, chunk_len]
    return out.swapaxes(0, 1).reshape(b, t)


def segment_sums(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, 2]: the sums over each row's segment 1 (chosen) and segment 2 (rejected)."""
    masks = jnp.stack([segment_ids == 1, segment_ids == 2], axis=-1).astype(jnp.float32)
    return jnp.einsum("bt,bts->bs", values.astype(jnp.float32), masks)


def sequence_logps(params, model_spec, batch, dropout_key=None, loss_chunk_len: int = 0):
    """(summed log-probs of each pair's chosen and rejected scored tokens [B, 2], their counts [B, 2],
    the model's auxiliary outputs)."""
    model = nnx.merge(model_spec.graphdef, params)
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    if loss_chunk_len and loss_chunk_len < batch["inputs"].shape[1]:
        x, out = model(*args, dropout_key=dropout_key, hidden=True, with_aux=True)
        losses = _chunked_token_losses(model.logits, x, batch["targets"], loss_chunk_len)
    else:
        logits, out = model(*args, dropout_key=dropout_key, with_aux=True)
        losses = steps.token_losses(logits, batch["targets"], 0.0)
    weights = batch["weights"]
    # where a weight is 0 the token's loss is not read (a where, not a product: 0 * inf would be nan)
    logps = jnp.where(weights > 0, -losses * weights, 0.0)
    return segment_sums(logps, batch["segment_ids"]), segment_sums(weights, batch["segment_ids"]), out


def batch_reference(batch) -> jax.Array:
    """The precomputed reference log-probs of a batch's pairs [B, 2] (`preferences.pair_row`)."""
    return segment_sums(batch["ref_logps"], batch["segment_ids"])


def preference_losses(policy: jax.Array, reference: jax.Array | None, counts: jax.Array, dpo: DPOConfig):
    """(each pair's loss [B], the implicit rewards of its chosen and rejected completion [B, 2]) from the
    policy's and the reference's summed log-probs [B, 2] and the scored tokens' counts [B, 2] (the
    module's docstring has the formulas; `reference` is None for simpo)."""
    losses, rewards = _preference_terms(policy, reference, counts, dpo)
    if dpo.sft_weight > 0:
        losses = losses - dpo.sft_weight * policy[:, 0] / jnp.maximum(counts[:, 0], 1.0)
    return losses, rewards


def _preference_terms(policy, reference, counts, dpo: DPOConfig):
    beta = dpo.beta
    if dpo.loss == "simpo":
        rewards = beta * policy / jnp.maximum(counts, 1.0)
        return -jax.nn.log_sigmoid(rewards[:, 0] - rewards[:, 1] - dpo.simpo_gamma), rewards
    ratios = policy - reference
    if dpo.loss == "ipo":
        ratios = ratios / jnp.maximum(counts, 1.0)
        h = ratios[:, 0] - ratios[:, 1]
        return jnp.square(h - 1.0 / (2.0 * beta)), beta * ratios
    h = ratios[:, 0] - ratios[:, 1]
    return -jax.nn.log_sigmoid(beta * h), beta * ratios


def pair_sums(losses: jax.Array, rewards: jax.Array, pairs: jax.Array) -> dict[str, jax.Array]:
    """The metrics' sums over the real pairs (`pairs`: 1 for a row holding one, 0 for padding)."""
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return {
        "reward_chosen": jnp.sum(chosen * pairs),
        "reward_rejected": jnp.sum(rejected * pairs),
        "margin": jnp.sum((chosen - rejected) * pairs),
        "accuracy": jnp.sum((chosen > rejected).astype(jnp.float32) * pairs),
    }


# ----------------------------------------------------------------------------- the objective


class DPO(Objective):
    """Preference pairs (`jaxlm.data.preferences`), the loss of `dpo.loss` against the reference."""

    name = "dpo"
    sections = (DPOConfig,)

    def __init__(self, cfg: ml_collections.ConfigDict | None = None, dpo: DPOConfig | None = None):
        super().__init__(cfg)
        self.dpo = dpo or (DPOConfig.from_config(cfg.dpo) if cfg is not None else DPOConfig())

    @property
    def reference(self) -> str:
        """Where the reference's log-probs come from: precomputed, live or none (simpo)."""
        return "none" if self.dpo.loss == "simpo" else self.dpo.reference

    @classmethod
    def validate(cls, cfg: ml_collections.ConfigDict) -> None:
        dpo = DPOConfig.from_config(cfg.dpo)
        if dpo.reference == "live" and dpo.loss != "simpo":
            check(cfg.lora.rank > 0 and not cfg.optim.trainable, "dpo.reference", dpo.reference,
                  "precomputed, unless LoRA adapters alone train (lora.rank > 0, optim.trainable empty): a live "
                  "reference is the base with the adapters off, with no second copy of the weights")
        d = cfg.data
        check(d.corpus != "builtin" and d.corpus != sources.BUILTIN_CHAT, "data.corpus", d.corpus,
              f"preference pairs with objective.name=dpo: {preferences.BUILTIN} or JSONL files of "
              "{prompt, chosen, rejected}")
        check(d.format == "auto", "data.format", d.format, "auto with objective.name=dpo (pairs are told by their fields)")
        check(d.num_workers == 0, "data.num_workers", d.num_workers,
              "0 with objective.name=dpo (pair rows are built in the trainer's process)")
        check(cfg.mesh.stage in (0, 1), "mesh.stage", cfg.mesh.stage, "1 with objective.name=dpo (no pipeline)")

    def batch_fields(self) -> dict[str, Any]:
        return {"ref_logps": np.float32} if self.reference == "precomputed" else {}

    def aux_shapes(self, model_spec) -> dict[str, tuple[int, ...]]:
        return {**dict(model_spec.aux_shapes), **{f"dpo/{m}": () for m in METRICS}}

    def _pair_terms(self, params, model_spec, batch, dropout_key, loss_chunk_len):
        """(losses [B], rewards [B, 2], pairs [B], the model's auxiliary outputs)."""
        policy, counts, out = sequence_logps(params, model_spec, batch, dropout_key, loss_chunk_len)
        if self.reference == "precomputed":
            reference = batch_reference(batch)
        elif self.reference == "live":
            frozen_params = jax.lax.stop_gradient(adapters_off(params))
            reference = jax.lax.stop_gradient(sequence_logps(frozen_params, model_spec, batch, None, loss_chunk_len)[0])
        else:
            reference = None
        losses, rewards = preference_losses(policy, reference, counts, self.dpo)
        pairs = (counts[:, 0] > 0).astype(jnp.float32)
        return losses, rewards, pairs, out

    def loss(self, trainable, frozen, model_spec, batch, dropout_key, z_loss: float, loss_chunk_len: int = 0):
        params = model_spec.merge(trainable, frozen)
        losses, rewards, pairs, out = self._pair_terms(params, model_spec, batch, dropout_key, loss_chunk_len)
        count = jnp.sum(pairs)
        total = jnp.sum(losses * pairs)
        for term in aux.loss_terms(out):
            total = total + term * count
        metrics = {f"dpo/{k}": v for k, v in pair_sums(losses, rewards, pairs).items()}
        return total, (count, {**aux.scale(out, count), **metrics})

    def eval_fn(self, model_spec, rules):
        def eval_fn(params, batch, packed=None):
            with spmd.logical_axis_rules(rules), attention.packed_kernel(packed):
                losses, rewards, pairs, _ = self._pair_terms(params, model_spec, batch, None, _chunk(model_spec))
                return {"loss": jnp.sum(losses * pairs), "pairs": jnp.sum(pairs), **pair_sums(losses, rewards, pairs)}

        return eval_fn

    def evaluate(self, setup, params, batches, target_bytes: int | None = None) -> dict[str, float]:
        """`val_loss` (the mean loss over the held-out pairs), `val_preference_accuracy`, `val_margin`,
        `val_reward_chosen`, `val_reward_rejected`, `val_pairs`; empty without held-out pairs."""
        if not batches:
            return {}
        sums = jax.device_get([setup.eval_step(params, setup.put_batch(b), setup.attention_choice(b)) for b in batches])
        total = {k: sum(float(s[k]) for s in sums) for k in sums[0]}
        pairs = total["pairs"]
        if not pairs:
            return {}
        out = {"val_loss": total["loss"] / pairs, "val_pairs": pairs,
               "val_preference_accuracy": total["accuracy"] / pairs, "val_margin": total["margin"] / pairs}
        out.update({f"val_{k}": total[k] / pairs for k in ("reward_chosen", "reward_rejected")})
        return out

    def describe_eval(self, val: dict[str, float]) -> str:
        return (f"val loss {val['val_loss']:.4f} | preference accuracy {100 * val['val_preference_accuracy']:.1f}% | "
                f"margin {val['val_margin']:.3f} ({val['val_pairs']:.0f} held-out pairs)")

    # ---- data

    def load_data(self, cfg: ml_collections.ConfigDict, shards: int | None, rows: slice | None):
        return load_pairs(cfg, shards, rows)

    def prepare(self, setup, state, data, run_dir, resume_step: int) -> None:
        """The reference's log-probs into the rows (precomputed), then the held-out batches."""
        if self.reference == "precomputed":
            train, val = cached_reference(setup, state.params, data, pathlib.Path(run_dir), resume_step, self.cfg)
            data.train_rows.ref, data.val_rows.ref = train, val
        d = self.cfg.data
        max_batches = -(-d.val_tokens // (d.global_batch_size * d.seq_len)) if d.val_tokens else 0
        rows = data.train.rows
        data.eval_batches = [{k: v[rows] for k, v in b.items()}
                             for b in preferences.eval_batches(data.val_rows, d.global_batch_size, max_batches)]


def _chunk(model_spec) -> int:
    return model_spec.cfg.loss_chunk_len if model_spec.cfg is not None else 0


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class PairData(loader.Data):
    """`loader.Data` for pairs, and the rows themselves (`prepare` sets their reference)."""

    train_rows: Any = None
    val_rows: Any = None

    @property
    def eval_target_bytes(self) -> int:
        return 0  # (bits per byte is a language model's measure)


def _corpus_identity(d) -> list:
    if d.corpus == preferences.BUILTIN:
        files = [sources.BUILTIN_CHAT_FILE]
    else:
        files = sources.resolve_files(sources.SourceSpec(d.corpus, "auto", "text", ""))
    return [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]


def pair_tokenizer(cfg: ml_collections.ConfigDict, train_pairs) -> tokenizer.Tokenizer:
    """data.tokenizer_path's tokenizer, or one trained on the training pairs' text (cached)."""
    d = cfg.data
    if d.tokenizer_path:
        return tokenizer.Tokenizer.load(d.tokenizer_path)
    key = hashlib.sha256(json.dumps([d.corpus, _corpus_identity(d), d.val_fraction, d.seed, d.chat_template,
                                     "dpo"], default=str).encode()).hexdigest()[:16]
    path = pathlib.Path(d.cache_dir) / f"tokenizer-{key}-{d.tokenizer_type}-{d.tokenizer_vocab_size}.model"
    if path.exists():
        return tokenizer.Tokenizer.load(path)
    console(f"jaxlm: training a {d.tokenizer_type} tokenizer ({d.tokenizer_vocab_size} tokens) on {d.corpus}")
    chat = None
    texts = []
    for pair in train_pairs:
        for completion in (pair.chosen, pair.rejected):
            if pair.chat:
                if chat is None:
                    chat = sft.Encoder.make(sft.Spec("chat", d.chat_template), None)
                messages = [{"role": r, "content": c} for r, c in pair.prompt]
                messages.append({"role": "assistant", "content": completion})
                texts.extend(sft.tokenizer_texts(iter([sft.Example(pair.where, {"messages": messages})]), chat))
            else:
                texts.append(pair.prompt + completion)
    tok = tokenizer.SentencePieceTokenizer.train(texts, d.tokenizer_vocab_size, d.tokenizer_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


def load_pairs(cfg: ml_collections.ConfigDict, shards: int | None, rows: slice | None) -> PairData:
    """data.corpus's pairs -> the training stream and the held-out rows (their batches come in `prepare`)."""
    d = cfg.data
    split: dict[bool, list] = {False: [], True: []}
    for pair in preferences.iter_pairs(d.corpus):
        split[sources.is_validation(pair.key, d.val_fraction, d.seed)].append(pair)
    if not split[False] and not split[True]:
        raise UserError(f"the corpus {d.corpus!r} holds no pairs; give non-empty JSONL files")
    tok = pair_tokenizer(cfg, split[False])
    if tok.vocab_size > d.tokenizer_vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but config.model.vocab_size="
                        f"{d.tokenizer_vocab_size}; set config.model.vocab_size={tok.vocab_size}")
    train_rows = preferences.encode_pairs(split[False], tok, d.chat_template, d.seq_len)
    val_rows = preferences.encode_pairs(split[True], tok, d.chat_template, d.seq_len)
    section = loader.DataConfig.from_config(d)
    rows = loader.all_rows(section, rows)
    count = loader.resolve_shards(section, rows, shards)
    train = loader.ShardedStream(
        lambda j: iter(preferences.make_train_dataset(train_rows, batch_size=d.global_batch_size // count, seed=d.seed,
                                                      shard_index=j, shard_count=count)),
        count, rows, d.global_batch_size)
    report = (f"DPO data: {len(train_rows):,} pairs, {train_rows.tokens:,} tokens, {train_rows.trained:,} scored "
              f"(completions); {len(val_rows):,} held out")
    console(f"jaxlm: {report}")
    return PairData(train=train, eval_batches=[], tokenizer=tok, train_tokens=train_rows.tokens,
                    train_documents=len(train_rows), shards=count, sft_report=report, train_rows=train_rows,
                    val_rows=val_rows)


# ----------------------------------------------------------------------------- the reference


def reference_params(params):
    """The reference's parameters: the model as given, its LoRA adapters off."""
    return adapters_off(params)


def fingerprint(params) -> str:
    """A hash of sums over the parameters the reference uses (LoRA's adapters left out: they are off),
    computed on the devices: another model gives another fingerprint."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    kept = [(jax.tree_util.keystr(p), x) for p, x in flat
            if not any(getattr(k, "key", None) in ("lora_a", "lora_b") for k in p)]

    @jax.jit
    def sums(leaves):
        out = []
        for x in leaves:
            x = x.astype(jnp.float32).ravel()
            ramp = jnp.sin(jnp.arange(x.size, dtype=jnp.float32))
            out.append(jnp.stack([jnp.sum(x), jnp.sum(x * x), jnp.sum(x * ramp)]))
        return out

    values = jax.device_get(sums([x for _, x in kept]))
    h = hashlib.sha256()
    for (name, x), v in zip(kept, values, strict=True):
        h.update(f"{name}{tuple(x.shape)}{x.dtype}".encode() + np.asarray(v, np.float32).tobytes())
    return h.hexdigest()


def reference_logps(setup, params, rows: preferences.PairRows) -> np.ndarray:
    """The reference's (`params` with the adapters off) summed log-probs of every row's chosen and
    rejected completion [pairs, 2], in batches of data.global_batch_size, each process putting its rows."""
    if not len(rows):
        return np.zeros((0, 2), np.float32)
    model_spec, rules = setup.model_spec, setup.rules
    batch_size = setup.cfg.data.global_batch_size
    replicated = NamedSharding(setup.batch_sharding.mesh, P())

    def score(params, batch):
        with spmd.logical_axis_rules(rules):
            return sequence_logps(reference_params(params), model_spec, batch, None, _chunk(model_spec))[0]

    fn = jax.jit(score, in_shardings=(setup.shardings.params, setup.batch_sharding), out_shardings=replicated)
    out = []
    saved, rows.ref = rows.ref, None
    try:
        with jax.set_mesh(setup.mesh):
            for start in range(0, len(rows), batch_size):
                part = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
                real = len(part)
                part += [preferences.empty_row(rows.seq_len, False)] * (batch_size - real)
                batch = {k: np.stack([r[k] for r in part]) for k in part[0]}
                local = _process_rows(setup, batch_size)
                sums = jax.device_get(fn(params, setup.put_batch({k: v[local] for k, v in batch.items()})))
                out.append(np.asarray(sums, np.float32)[:real])
    finally:
        rows.ref = saved
    return np.concatenate(out)


def _process_rows(setup, batch_size: int) -> slice:
    if jax.process_count() == 1:
        return slice(0, batch_size)
    return loader.rows_held(setup.batch_sharding, (batch_size, setup.cfg.data.seq_len))


def reference_key(cfg: ml_collections.ConfigDict, data: PairData, params_fingerprint: str) -> str:
    identity = {"train": data.train_rows.sha256(), "val": data.val_rows.sha256(), "model": cfg.model.to_dict(),
                "lora": cfg.lora.to_dict(), "params": params_fingerprint}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cached_reference(setup, params, data: PairData, run_dir: pathlib.Path, resume_step: int,
                     cfg: ml_collections.ConfigDict) -> tuple[np.ndarray, np.ndarray]:
    """The reference's log-probs of the training and held-out rows: from data.cache_dir when computed
    before for this model and these pairs, else computed now and kept there; the run directory records
    their key. A resumed run reads the key it recorded; with LoRA adapters alone trained (the base, the
    reference, unchanged) it may compute them again."""
    record = run_dir / RECORD
    base_unchanged = cfg.lora.rank > 0 and not cfg.optim.trainable
    recorded = json.loads(record.read_text())["key"] if resume_step and record.exists() else None
    if resume_step and recorded is None:
        raise UserError(f"{run_dir} holds no {RECORD}: the key of the reference log-probs this DPO run started "
                        f"with is lost; start again with config.run.fresh=true")
    key = None
    if not resume_step or base_unchanged:
        key = reference_key(cfg, data, fingerprint(params))
        if recorded and key != recorded:
            raise UserError(f"the reference of this resumed DPO run differs from the one it started with ({RECORD}: "
                            f"{recorded}, now {key}); the model or the pairs changed: use config.run.fresh=true")
    key = key or recorded
    path = pathlib.Path(cfg.data.cache_dir) / f"dpo-reference-{key}.npz"
    if path.exists():
        with np.load(path) as stored:
            train, val = stored["train"], stored["val"]
        console(f"jaxlm: reference log-probs of {len(train) + len(val):,} pairs read from {path}")
    elif resume_step and not base_unchanged:
        raise UserError(f"{path}, the reference log-probs this DPO run trains against, is gone from data.cache_dir "
                        f"and the reference (the model as the run started) is not in its checkpoints; restore the "
                        f"file, or start again with config.run.fresh=true")
    else:
        console(f"jaxlm: computing the reference's log-probs of {len(data.train_rows) + len(data.val_rows):,} pairs")
        train, val = reference_logps(setup, params, data.train_rows), reference_logps(setup, params, data.val_rows)
        if jax.process_index() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, train=train, val=val)
            os.replace(tmp, path)
    if jax.process_index() == 0 and not record.exists():
        write_bytes_atomically(record, (json.dumps({"key": key}) + "\n").encode())
    return train, val

