"""GRPO as an objective of `python -m jaxlm.train` (`--config.objective.name=grpo`, settings in `config.grpo`).

The maths, the rollouts and the rewards are `jaxlm.post_training.grpo` and `.rewards`; this module runs
them in the one training loop. GRPO is on-policy: its batches are made from the current state
(`Objective.on_policy`, `next_batch`), not read from a stream. Per rollout (every `grpo.mu` steps):

1. the rollout's prompts, `data.global_batch_size / grpo.group_size` of them (`prompts.PromptOrder`:
   a function of the rollout's index), each sampled `group_size` times with the current parameters,
   where they are (`grpo.Sampler`, one compiled program; the key `Sampler.key(run.seed, rollout)`);
2. the completions decoded on the host and scored by the rewards (`rewards.score`), the advantages
   relative to each group (`group_advantages`), and with `grpo.beta` > 0 the reference's log-probs, in one
   more compiled forward over the rollout's rows (`prepare`'s `_ref`; its parameters are not donated);
3. `mu` optimizer steps on that batch, each a call of the one compiled train step (`steps.make_train_step`
   with this objective's `loss`, `grpo.summed_loss`).

Checkpoints are saved at rollout boundaries only (after steps that are multiples of `mu`: `run.steps` and
`checkpoint.every_steps` must be; a signal or a time-due save waits for the boundary, at most mu - 1
steps): a rollout's batch is a function of the parameters at its start, which a checkpoint saved inside
it would no longer hold, while at a boundary the parameters, the rollout's index (the step) and
`run.seed` are all a resumed run needs to sample the same rollouts. Nothing of the data stream is saved.

The KL's reference (`grpo.beta` > 0): with LoRA adapters alone trained (lora.rank > 0, optim.trainable
empty), the base with the adapters off, no second copy of the weights. Otherwise (full training, or more
than the adapters) the model the run started from, `run.init_from`'s checkpoint, which must be given: a copy
of the first state's parameters held on the devices beside the train state (not in it: no optimizer state,
not in a checkpoint), as many bytes as the parameters (the memory planner's "reference parameters"). The
run directory records it (`grpo_reference.json`: the source run's directory, the checkpoint's step, a
fingerprint of the parameters); a resumed run reads that checkpoint again as the run started from it
(`TrainSetup.read_start`) and refuses, in one line, one that is gone or whose parameters changed.

Metrics per step: `reward` (the rollout's mean), `reward/<name>` per function, `completion_length`,
`stopped_fraction` (repeated over the rollout's `mu` steps), `clipped_fraction`, `kl` (with beta > 0),
`sampling_s` (the rollout's sampling and scoring, on the step that sampled, else 0), `training_s` (the
train step, dispatch to done) and `sampling_share` (sampling_s / (sampling_s + training_s)). Evaluation:
held-out prompts answered greedily, `val_exact_match` (the built-in `exact_match` reward's mean),
`val_reward` (the configured rewards'), `val_completion_length`; `val_loss` is 1 - val_exact_match, so
that `checkpoint.keep_best` keeps the most accurate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax.core import spmd

from jaxlm import checkpoint
from jaxlm import sampling as sampling_lib
from jaxlm.console import console
from jaxlm.data import loader, sources, tokenizer
from jaxlm.data import prompts as prompts_lib
from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import UserError
from jaxlm.objectives.base import Objective
from jaxlm.objectives.dpo import adapters_off, fingerprint
from jaxlm.post_training import grpo, rewards
from jaxlm.section import check

RECORD = "grpo_reference.json"  # in the run directory: the KL reference of a full-training run (grpo.beta > 0)


def adapters_alone(cfg: ml_collections.ConfigDict) -> bool:
    """Whether LoRA's adapters alone train (lora.rank > 0, optim.trainable empty): the base, the KL's reference
    with the adapters off, never changes."""
    return cfg.lora.rank > 0 and not cfg.optim.trainable


class GRPO(Objective):
    """Group relative policy optimization on prompts with answers (`jaxlm.data.prompts`)."""

    name = "grpo"
    sections = (grpo.GRPOConfig,)
    on_policy = True

    def __init__(self, cfg: ml_collections.ConfigDict | None = None, settings: grpo.GRPOConfig | None = None):
        super().__init__(cfg)
        self.grpo = settings or (grpo.GRPOConfig.from_config(cfg.grpo) if cfg is not None else grpo.GRPOConfig())
        self._rollout: tuple[int, dict, dict] | None = None  # (rollout index, device batch, host metrics)

    @classmethod
    def validate(cls, cfg: ml_collections.ConfigDict) -> None:
        g = grpo.GRPOConfig.from_config(cfg.grpo)
        d = cfg.data
        rows = g.max_prompt_len + g.max_new_tokens
        check(d.seq_len == rows, "data.seq_len", d.seq_len,
              f"grpo.max_prompt_len + grpo.max_new_tokens = {rows} with objective.name=grpo (a rollout row's length)")
        check(d.global_batch_size % g.group_size == 0, "data.global_batch_size", d.global_batch_size,
              f"a multiple of grpo.group_size={g.group_size}: each rollout is global_batch_size / group_size prompts "
              f"x group_size completions")
        check(cfg.run.steps % g.mu == 0, "run.steps", cfg.run.steps,
              f"a multiple of grpo.mu={g.mu} (a run ends, and checkpoints are saved, at rollout boundaries)")
        check(cfg.checkpoint.every_steps % g.mu == 0, "checkpoint.every_steps", cfg.checkpoint.every_steps,
              f"a multiple of grpo.mu={g.mu} (checkpoints are saved at rollout boundaries)")
        if g.beta > 0 and not adapters_alone(cfg):
            check(bool(cfg.run.init_from), "grpo.beta", g.beta,
                  "0 in full training without run.init_from: give run.init_from (the KL's reference is the model the "
                  "run starts from), or train LoRA adapters alone (lora.rank > 0, optim.trainable empty: the "
                  "reference is the base with the adapters off)")
        check(d.corpus not in ("builtin", sources.BUILTIN_CHAT), "data.corpus", d.corpus,
              f"prompts with answers with objective.name=grpo: {prompts_lib.BUILTIN} or JSONL files of {{prompt, answer}}")
        check(d.format == "auto", "data.format", d.format,
              "auto with objective.name=grpo (prompts are told by their fields)")
        check(cfg.mesh.stage in (0, 1), "mesh.stage", cfg.mesh.stage, "1 with objective.name=grpo (no pipeline)")
        rewards.resolve(g.rewards, g.reward_weights)  # a reward that does not import: one line, before any device work

    # ---- the step

    def batch_fields(self) -> dict[str, Any]:
        fields = {"old_logprobs": np.float32, "advantages": np.float32}
        if self.grpo.beta > 0:
            fields["ref_logprobs"] = np.float32
        return fields

    def aux_shapes(self, model_spec) -> dict[str, tuple[int, ...]]:
        names = ("tokens", "clipped", *(("kl",) if self.grpo.beta > 0 else ()))
        return {f"grpo/{n}": () for n in names}

    def loss(self, trainable, frozen, model_spec, batch, dropout_key, z_loss: float, loss_chunk_len: int = 0):
        params = model_spec.merge(trainable, frozen)
        total, (count, sums) = grpo.summed_loss(params, model_spec, batch, dropout_key, self.grpo)
        return total, (count, {f"grpo/{k}": v for k, v in sums.items()})

    def eval_fn(self, model_spec, rules):
        def eval_fn(params, batch, packed=None):  # (evaluation samples: `evaluate`; this step is never called)
            return {}

        return eval_fn

    # ---- on-policy batches

    def checkpoint_allowed(self, step: int) -> bool:
        return step % self.grpo.mu == 0

    def prepare(self, setup, state, data, run_dir, resume_step: int) -> None:
        """The rewards, the samplers (the rollouts', and a greedy one for evaluation) and the reference."""
        g, cfg = self.grpo, self.cfg
        self.rewards = rewards.resolve(g.rewards, g.reward_weights)
        self._tokenizer = data.tokenizer
        self.exact = rewards.resolve("exact_match")
        kwargs = dict(stop_ids=data.stop_ids, pad_id=max(data.tokenizer.pad_id, 0), bos_id=data.tokenizer.bos_id)
        args = (setup.model_cfg, setup.model_spec.graphdef, setup.mesh, setup.rules, setup.shardings.params)
        self.sampler = grpo.Sampler(*args, **grpo.Sampler.settings_kwargs(g), **kwargs)
        self.greedy = grpo.Sampler(*args, group_size=1, max_new_tokens=g.max_new_tokens, max_prompt_len=g.max_prompt_len,
                                   sampling=sampling_lib.GREEDY, **kwargs)
        self.order = prompts_lib.PromptOrder(len(data.train_ids), cfg.data.global_batch_size // g.group_size,
                                             cfg.data.seed)
        self._rollout = None
        self._ref = self.reference = None
        if g.beta > 0:
            if not adapters_alone(cfg):  # a copy of the parameters the run started from
                self.reference = self.reference_params(setup, state, pathlib.Path(run_dir), resume_step)
            graphdef, rules, temperature = setup.model_spec.graphdef, setup.rules, g.temperature

            def ref(params, batch):
                with spmd.logical_axis_rules(rules):
                    logps = grpo.reference_logprobs(graphdef, adapters_off(params), batch, temperature)
                return jnp.where(batch["weights"] > 0, logps, 0.0)

            self._ref = jax.jit(ref, in_shardings=(setup.shardings.params, setup.batch_sharding),
                                out_shardings=setup.batch_sharding)

    def reference_params(self, setup, state, run_dir: pathlib.Path, resume_step: int):
        """The KL's reference in full training: a fresh run's first parameters (those `run.init_from` read,
        copied: the train state is donated), recorded in the run directory; a resumed run's, the recorded
        checkpoint read again as the run read it (`TrainSetup.read_start`), refused in one line when it is
        gone or its fingerprint changed."""
        record = run_dir / RECORD
        fresh = "start again with config.run.fresh=true"
        if not resume_step:
            if setup.init_from is None:  # (validate refuses it: a setup built another way)
                raise UserError("grpo.beta > 0 in full training: the reference is the model the run starts from, "
                                "and this state was not read from run.init_from; give run.init_from, or use LoRA")
            params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=setup.shardings.params)(state.params)
            identity = {"init_from": setup.init_from["run_dir"], "step": int(setup.init_from["step"]),
                        "fingerprint": fingerprint(params)}
            if jax.process_index() == 0:
                write_bytes_atomically(record, (json.dumps(identity, indent=2) + "\n").encode())
        else:
            if not record.exists():
                raise UserError(f"{run_dir} holds no {RECORD}: the KL reference this GRPO run (grpo.beta > 0, full "
                                f"training) started with is unknown; {fresh}")
            identity = json.loads(record.read_text())
            source, step = pathlib.Path(identity["init_from"]), int(identity["step"])
            if step not in checkpoint.complete_steps(source / "checkpoints"):
                raise UserError(f"{source} no longer holds checkpoint {step}, the KL reference this GRPO run started "
                                f"from ({record}); restore it, or {fresh}")
            try:
                params, _ = setup.read_start(source, step)
            except UserError as e:
                raise UserError(f"the KL reference ({record}): {source} checkpoint {step} does not load ({e}); "
                                f"restore it, or {fresh}") from None
            if fingerprint(params) != identity["fingerprint"]:
                raise UserError(f"the KL reference changed since this GRPO run started: {source} checkpoint {step} "
                                f"now holds other parameters than {record} records; restore the ones it started "
                                f"from, or {fresh}")
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
        console(f"jaxlm: KL reference (grpo.beta={self.grpo.beta}): {identity['init_from']} checkpoint "
                f"{identity['step']}, {count / 1e6:.2f}M parameters held beside the train state")
        return params

    def next_batch(self, setup, state, data, step: int) -> tuple[dict[str, jax.Array], dict[str, float]]:
        """The batch of 1-based `step` (on the devices) and the host's metrics of its rollout: a new rollout
        from `state`'s parameters on each rollout's first step, the same batch on its other mu - 1."""
        index = (step - 1) // self.grpo.mu
        if self._rollout is not None and self._rollout[0] == index:
            return self._rollout[1], {**self._rollout[2], "sampling_s": 0.0}
        start = time.perf_counter()
        chosen, epoch = self.order.take(index)
        rollouts = self.sampler(state.params, [data.train_ids[i] for i in chosen],
                                grpo.Sampler.key(self.cfg.run.seed, index))
        group = self.grpo.group_size
        asked = [data.train_prompts[i] for i in chosen for _ in range(group)]
        texts = [data.tokenizer.decode(ids) for ids in rollouts.completion_ids()]
        total, per = rewards.score(self.rewards, [p.text for p in asked], texts, [p.answer for p in asked])
        advantages = grpo.group_advantages(total, group, self.grpo.scale_rewards)
        batch = rollouts.batch()
        rows, width = batch["inputs"].shape
        batch["advantages"] = jax.device_put(grpo.expand_advantages(advantages, rows, width), setup.batch_sharding)
        batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in batch.items()}
        if self._ref is not None:  # the reference: the start's parameters, or these with LoRA's adapters off
            batch["ref_logprobs"] = self._ref(state.params if self.reference is None else self.reference, batch)
        metrics = grpo.metrics(rollouts, total, per)
        data.train.epoch = epoch
        data.train.tokens_seen += int(np.sum(jax.device_get(rollouts.lengths)))
        self._rollout = (index, batch, metrics)
        return batch, {**metrics, "sampling_s": time.perf_counter() - start}

    def step_metrics(self, metrics: dict[str, Any]) -> dict[str, float]:
        """The per-token means the step's sums give (`clipped_fraction`, `kl`): its auxiliary entries are
        divided by the loss's count, which is tokens only for loss_aggregation=token."""
        values = jax.device_get({k: v for k, v in metrics.items() if k.startswith("grpo/")})
        tokens = max(float(values["grpo/tokens"]), 1e-30)
        out = {"clipped_fraction": float(values["grpo/clipped"]) / tokens}
        if "grpo/kl" in values:
            out["kl"] = float(values["grpo/kl"]) / tokens
        return out

    # ---- evaluation

    def evaluate(self, setup, params, batches, target_bytes: int | None = None) -> dict[str, float]:
        """Each held-out prompt answered greedily: `val_exact_match` (the fraction whose final answer equals
        the reference's), `val_reward` (the configured rewards' weighted mean), `val_completion_length`,
        `val_prompts`, and `val_loss` = 1 - val_exact_match. Empty without held-out prompts."""
        if not batches:
            return {}
        chunk = self.cfg.data.global_batch_size
        exact, reward, lengths = [], [], []
        for lo in range(0, len(batches), chunk):
            part = batches[lo: lo + chunk]
            ids = [p for _, p in part]
            ids += [ids[0]] * (chunk - len(ids))  # one compiled shape for every chunk
            rollouts = self.greedy(params, ids, jax.random.PRNGKey(0))
            completion_ids = rollouts.completion_ids()[: len(part)]
            texts = [self._tokenizer.decode(c) for c in completion_ids]
            args = ([p.text for p, _ in part], texts, [p.answer for p, _ in part])
            exact.append(rewards.score(self.exact, *args)[0])
            reward.append(rewards.score(self.rewards, *args)[0])
            lengths.append(np.asarray(jax.device_get(rollouts.lengths))[: len(part)])
        accuracy = float(np.mean(np.concatenate(exact)))
        return {"val_loss": 1.0 - accuracy, "val_exact_match": accuracy,
                "val_reward": float(np.mean(np.concatenate(reward))),
                "val_completion_length": float(np.mean(np.concatenate(lengths))), "val_prompts": float(len(batches))}

    def describe_eval(self, val: dict[str, float]) -> str:
        return (f"held-out exact match {100 * val['val_exact_match']:.1f}% (greedy, {val['val_prompts']:.0f} prompts) | "
                f"reward {val['val_reward']:.3f} | completion {val['val_completion_length']:.1f} tokens")

    # ---- data

    def load_data(self, cfg: ml_collections.ConfigDict, shards: int | None, rows: slice | None):
        return load_prompts(cfg, rows)


@dataclasses.dataclass
class PromptStream:
    """What the loop reads of a data stream: the pass over the prompts and the completion tokens so far."""

    rows: slice
    epoch: int = 0
    tokens_seen: int = 0


@dataclasses.dataclass
class PromptData(loader.Data):
    """`loader.Data` for GRPO (`train` a `PromptStream`): the training prompts (ids, rows), the held-out ones
    as the evaluation's batches ((Prompt, ids) pairs), the ids a completion stops at."""

    train_prompts: list = dataclasses.field(default_factory=list)
    train_ids: list = dataclasses.field(default_factory=list)
    stop_ids: tuple = ()

    @property
    def eval_target_bytes(self) -> int:
        return 0


def prompt_tokenizer(cfg: ml_collections.ConfigDict, train: list) -> tokenizer.Tokenizer:
    """data.tokenizer_path's tokenizer, or one trained on the training prompts and answers (cached)."""
    d = cfg.data
    if d.tokenizer_path:
        return tokenizer.Tokenizer.load(d.tokenizer_path)
    files = sources.resolve_files(sources.SourceSpec(d.corpus, "auto", "text", ""))
    identity = [d.corpus, [(f, pathlib.Path(f).stat().st_size, pathlib.Path(f).stat().st_mtime_ns) for f in files],
                d.val_fraction, d.seed, d.chat_template, "grpo"]
    key = hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()[:16]
    path = pathlib.Path(d.cache_dir) / f"tokenizer-{key}-{d.tokenizer_type}-{d.tokenizer_vocab_size}.model"
    if path.exists():
        return tokenizer.Tokenizer.load(path)
    console(f"jaxlm: training a {d.tokenizer_type} tokenizer ({d.tokenizer_vocab_size} tokens) on {d.corpus}")
    tok = tokenizer.SentencePieceTokenizer.train(prompts_lib.tokenizer_texts(train), d.tokenizer_vocab_size,
                                                 d.tokenizer_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


def load_prompts(cfg: ml_collections.ConfigDict, rows: slice | None) -> PromptData:
    """data.corpus's prompts -> the training prompts and the held-out ones (`data.val_fraction`, by a hash
    of their content), encoded and checked before any device work."""
    d, g = cfg.data, grpo.GRPOConfig.from_config(cfg.grpo)
    split: dict[bool, list] = {False: [], True: []}
    for prompt in prompts_lib.iter_prompts(d.corpus):
        split[sources.is_validation(prompt.key, d.val_fraction, d.seed)].append(prompt)
    if not split[False]:
        raise UserError(f"the corpus {d.corpus!r} holds no training prompts ({len(split[True])} held out); give "
                        f"JSONL files of {{prompt, answer}} rows, or lower data.val_fraction")
    tok = prompt_tokenizer(cfg, split[False])
    if tok.vocab_size > d.tokenizer_vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but config.model.vocab_size="
                        f"{d.tokenizer_vocab_size}; set config.model.vocab_size={tok.vocab_size}")
    train_ids, stop_ids = prompts_lib.encode(split[False], tok, d.chat_template, g.max_prompt_len)
    val_ids, _ = prompts_lib.encode(split[True], tok, d.chat_template, g.max_prompt_len)
    report = (f"GRPO data: {len(train_ids):,} prompts ({sum(map(len, train_ids)):,} tokens), {len(val_ids):,} held out; "
              f"{d.global_batch_size // g.group_size} prompts x {g.group_size} completions per rollout")
    console(f"jaxlm: {report}")
    return PromptData(train=PromptStream(rows or slice(0, d.global_batch_size)),
                      eval_batches=list(zip(split[True], val_ids)),
                      tokenizer=tok, train_tokens=sum(map(len, train_ids)), train_documents=len(train_ids),
                      sft_report=report, train_prompts=split[False], train_ids=train_ids, stop_ids=stop_ids)
