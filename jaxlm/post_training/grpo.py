"""GRPO's parts: group rollouts from the current weights, group-relative advantages, the clipped objective.

Group relative policy optimization (DeepSeekMath, arXiv:2402.03300) samples a group of `G` completions
per prompt, scores each with reward functions (`jaxlm.post_training.rewards`), and takes each
completion's advantage relative to its group: (r - mean of the group) / (std of the group + eps), or,
Dr.GRPO (arXiv:2503.20783), r - mean alone (`scale_rewards=False`). It then maximises PPO's clipped
surrogate of the policy ratio ratio = pi(token) / pi_old(token) on every completion token:

    per-token loss = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta k3,
    k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman's unbiased, non-negative estimator of KL(pi || ref))

over `mu` optimizer steps on one batch of rollouts (`pi_old` is the policy that sampled them; on the
first step ratio = 1, and the clip matters on the later ones). `epsilon_high` > `epsilon` is DAPO's
clip-higher (arXiv:2503.14476). The loss is averaged per token over the batch (`loss_aggregation="token"`,
DAPO's), per completion then over completions (`"sequence"`, the original GRPO's), or summed over tokens
and divided by completions x max_new_tokens (`"constant"`, Dr.GRPO's): each as a (sum, count) pair that
adds over micro-batches, as `jaxlm.steps.summed_loss`'s does, so k micro-batches give one batch's update.

Log-probabilities are of the model's distribution at the sampling temperature (logits / temperature;
greedy sampling counts as temperature 1), as TRL computes them; top-k and top-p shape what is sampled,
not the log-probabilities, as everywhere else.

**Rollouts** (`Sampler`): one compiled function per batch shape runs the KV-cache sampler of
`jaxlm.sampling` (its `prefill_step` and `decode_step`, the same code `generate.Generator` jits) with the decode
steps in a `lax.while_loop` that ends when every row has stopped, then lays the sequences out as the
train step reads them and runs one forward pass over them for the sampling policy's log-probabilities.
It takes the parameters as an argument (the train state's `params`: the frozen base and the LoRA
adapters, or the whole model), so it samples from the current weights where they are, without a copy
through the host; the only host traffic is the prompts in and, for the rewards, the sampled ids out.
The same key gives the same rollouts (`Sampler.key(seed, step)` for a resumable run).

The training layout (`Rollouts.batch`), every row from slot 0: the prompt, its completion (up to and
including the stop token the row ended with), padding; `inputs`, `targets` (the next token), `positions`,
`segment_ids` (1 on the prompt and completion, 0 on padding) and `weights` (1 where the target is a
completion token: the completion mask), [rows, seq_len] each, with `seq_len` fixed (`Sampler`'s) so that
the train step compiles once.

**How it plugs into the train step's objective registry** (`python -m jaxlm.train`, `OBJECTIVES`):

- config keys: `GRPOConfig` (the `grpo` section), and the sampler's settings from it;
- batch fields, each [rows, seq_len]: the five above plus `old_logprobs` (`Rollouts.old_logprobs`),
  `advantages` (`expand_advantages` of `group_advantages` of the rewards: the row's advantage on every
  token) and, with `beta` > 0, `ref_logprobs` (`reference_logprobs`: under LoRA the same parameters with
  the adapters off, `without_adapters`, so no second copy is held; in full training a frozen copy of the
  parameters the run started from, `run.init_from`'s: `jaxlm.objectives.grpo`);
- the loss inside the one compiled step: `summed_loss(params, model_spec, batch, dropout_key, settings)`
  returns (sum, (count, metric sums)) like `steps.summed_loss(..., with_aux=True)`: the step divides both
  by the count summed over micro-batches;
- the loop, per step: prompts of a batch (each with its reference answer) -> `Sampler.__call__` (timed:
  sampling time) -> decode the completions, `rewards.score` -> `group_advantages` -> `mu` optimizer steps
  on the same batch (timed: training time), each a call of the compiled train step;
- metrics: `reward` (mean), `reward/<name>` per function, `kl`, `clipped_fraction`, `completion_length`,
  `stopped_fraction` (`metrics`), and the two times.

`update` is that loop's optimizer step without the train step's micro-batches and mesh handling: what
the tests and the benchmark use until the objective is registered.

Left: the registration itself (the `OBJECTIVES` entry, the `grpo` section in `config.SECTIONS`, the
prompt data's reader, resume of the rollout key, which is `Sampler.key(seed, step)`); log-probabilities
made a chunk of positions at a time for large vocabularies (`steps.chunked_loss_sum`'s approach); the
`configs/grpo_tiny.py` recipe and the notebook.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import mesh as mesh_lib
from jaxlm import sampling as sampling_lib
from jaxlm import steps
from jaxlm.errors import UserError
from jaxlm.section import Section, check, check_choice, setting
from jaxlm.train_state import ModelSpec

AGGREGATIONS = ("token", "sequence", "constant")
FROM_THE_MODEL = sampling_lib.Sampling()  # temperature 1, no top-k or top-p: the model's own distribution


@dataclasses.dataclass(frozen=True)
class GRPOConfig(Section):
    """GRPO: `group_size` completions per prompt, scored by `rewards`, advantages relative to the group,
    the clipped objective with a KL penalty to the reference, `mu` optimizer steps per batch of rollouts."""

    section: ClassVar[str] = "grpo"
    group_size: int = setting(8, "completions sampled per prompt (G); advantages are relative to the group")
    max_new_tokens: int = setting(128, "the most tokens a completion has; a row also stops at EOS")
    max_prompt_len: int = setting(256, "the longest prompt in tokens: the rows are max_prompt_len + max_new_tokens")
    temperature: float = setting(1.0, "sampling temperature (0 = greedy); log-probs are of logits / temperature")
    top_k: int = setting(0, "sample from the k most likely tokens; 0 = all")
    top_p: float = setting(1.0, "sample from the top-p nucleus; 1 = all")
    rewards: str = setting("exact_match", "comma-separated rewards: exact_match, format, module:function")
    reward_weights: str = setting("", "comma-separated weights, one per reward; '' = 1 each")
    scale_rewards: bool = setting(True, "divide by the group's std (GRPO); false: r - mean only (Dr.GRPO)")
    epsilon: float = setting(0.2, "the ratio's clip below: 1 - epsilon")
    epsilon_high: float = setting(0.0, "the ratio's clip above: 1 + epsilon_high (DAPO); 0 = epsilon")
    beta: float = setting(
        0.0, "the KL penalty's weight (k3 estimator) to the reference: LoRA's base with the adapters off, else "
             "run.init_from's model (held beside the state); 0 = none, no reference")
    mu: int = setting(1, "optimizer steps on each batch of rollouts")
    loss_aggregation: str = setting("token", "token (DAPO) | sequence (GRPO) | constant (Dr.GRPO)")

    def validate(self) -> None:
        check(self.group_size >= 2, self.key("group_size"), self.group_size, "at least 2 (a group to compare with)")
        check(self.max_new_tokens >= 1, self.key("max_new_tokens"), self.max_new_tokens, "a positive number")
        check(self.max_prompt_len >= 1, self.key("max_prompt_len"), self.max_prompt_len, "a positive number")
        sampling_lib.Sampling(self.temperature, self.top_k, self.top_p)  # its own one-line errors
        check(0 < self.epsilon < 1, self.key("epsilon"), self.epsilon, "a number in (0, 1)")
        check(self.epsilon_high >= 0, self.key("epsilon_high"), self.epsilon_high, "0 (= epsilon) or positive")
        check(self.beta >= 0, self.key("beta"), self.beta, "0 (no KL penalty) or positive")
        check(self.mu >= 1, self.key("mu"), self.mu, "at least 1")
        check_choice(self.key("loss_aggregation"), self.loss_aggregation, AGGREGATIONS)

    @property
    def sampling(self) -> sampling_lib.Sampling:
        return sampling_lib.Sampling(self.temperature, self.top_k, self.top_p)

    @property
    def clip_high(self) -> float:
        return self.epsilon_high or self.epsilon


# ----------------------------------------------------------------------------- the math (pure jnp)


def group_advantages(rewards: jax.Array, group_size: int, scale: bool = True, eps: float = 1e-4) -> jax.Array:
    """Each completion's advantage [N] from its reward [N], rows grouped by prompt (row = prompt * G + g):
    (r - the group's mean) / (the group's std + eps), the std the population's (ddof 0); without `scale`,
    r - mean (Dr.GRPO). A group whose rewards are all equal gets 0 everywhere: it teaches nothing."""
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    centered = r - jnp.mean(r, axis=1, keepdims=True)
    if scale:
        centered = centered / (jnp.std(r, axis=1, keepdims=True) + eps)
    return centered.reshape(-1)


def expand_advantages(advantages: jax.Array, rows: int, seq_len: int) -> jax.Array:
    """The batch field: [rows, seq_len], each row's advantage on every position (0 for the batch's
    padding rows past the advantages given), so that micro-batches split it like the other fields."""
    a = jnp.zeros((rows,), jnp.float32).at[: advantages.shape[0]].set(advantages)
    return jnp.broadcast_to(a[:, None], (rows, seq_len))


def token_logprobs(model, batch: dict[str, jax.Array], temperature: jax.Array | float = 1.0,
                   dropout_key=None) -> jax.Array:
    """log pi(target | the sequence before it) [B, T] float32 under an NNX model, in the training layout,
    of logits / temperature (temperature 0, greedy, counts as 1). Every position's; mask with `weights`."""
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"], dropout_key=dropout_key)
    temperature = jnp.asarray(temperature, jnp.float32)
    logits = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    return -steps.token_losses(logits, batch["targets"], 0.0)


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """Per token, exp(ref - logp) - (ref - logp) - 1: an unbiased estimate of KL(pi || ref) at a token
    sampled from pi, never negative."""
    d = ref_logprobs - logprobs
    return jnp.exp(d) - d - 1.0


def clipped_surrogate(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, epsilon: float,
                      epsilon_high: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(per-token loss -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A), whether the clip bound it), with
    ratio = exp(logprobs - old_logprobs). A token is clipped where the clipped term is the smaller: ratio
    below 1 - eps with A < 0, or above 1 + eps_high with A > 0; there its gradient is 0."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = jnp.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + high) * advantages
    is_clipped = ((ratio < 1.0 - epsilon) & (advantages < 0)) | ((ratio > 1.0 + high) & (advantages > 0))
    return -jnp.minimum(unclipped, clipped), is_clipped


def aggregate(per_token: jax.Array, weights: jax.Array, how: str, max_new_tokens: int = 0) -> tuple[jax.Array, jax.Array]:
    """(sum, count) of a per-token loss [B, T] over the completion tokens (`weights`), which add over
    micro-batches; the loss is sum / count over the whole batch. "token": every token alike (count =
    tokens); "sequence": each completion's token mean, alike (count = completions); "constant": tokens
    summed, count = completions x `max_new_tokens` (Dr.GRPO). A row without tokens counts in none."""
    weights = weights.astype(jnp.float32)
    tokens = jnp.sum(weights, axis=1)
    has = (tokens > 0).astype(jnp.float32)
    if how == "token":
        return jnp.sum(per_token * weights), jnp.sum(tokens)
    if how == "sequence":
        return jnp.sum(jnp.sum(per_token * weights, axis=1) / jnp.maximum(tokens, 1.0)), jnp.sum(has)
    if how == "constant":
        if max_new_tokens < 1:
            raise ValueError("the constant aggregation needs max_new_tokens")
        return jnp.sum(per_token * weights), jnp.sum(has) * max_new_tokens
    raise ValueError(f"loss aggregation {how!r}: one of {AGGREGATIONS}")


def objective_sums(logprobs: jax.Array, batch: dict[str, jax.Array], settings: GRPOConfig):
    """The GRPO loss as (sum, (count, metric sums)) from the policy's log-probs [B, T] and the batch's
    `old_logprobs`, `advantages`, `weights` and (with beta > 0) `ref_logprobs`. The metric sums add over
    micro-batches: `tokens` (completion tokens), `kl` (k3 summed over them), `clipped` (clipped tokens)."""
    weights = batch["weights"].astype(jnp.float32)
    per_token, is_clipped = clipped_surrogate(logprobs, batch["old_logprobs"], batch["advantages"],
                                              settings.epsilon, settings.clip_high)
    sums = {"tokens": jnp.sum(weights), "clipped": jnp.sum(is_clipped * weights)}
    if settings.beta > 0:
        kl = k3_kl(logprobs, batch["ref_logprobs"])
        per_token = per_token + settings.beta * kl
        sums["kl"] = jnp.sum(kl * weights)
    total, count = aggregate(per_token, weights, settings.loss_aggregation, settings.max_new_tokens)
    return total, (count, sums)


def summed_loss(params, model_spec: ModelSpec, batch: dict[str, jax.Array], dropout_key, settings: GRPOConfig):
    """The objective's loss inside a train step: (sum, (count, metric sums)) over a (micro-)batch in the
    training layout with the GRPO fields, the log-probs at the settings' temperature (`objective_sums`)."""
    model = nnx.merge(model_spec.graphdef, params)
    logprobs = token_logprobs(model, batch, settings.temperature, dropout_key)
    return objective_sums(logprobs, batch, settings)


def metric_means(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`kl` and `clipped_fraction`: the sums' means per completion token."""
    tokens = jnp.maximum(sums["tokens"], 1.0)
    out = {"clipped_fraction": sums["clipped"] / tokens}
    if "kl" in sums:
        out["kl"] = sums["kl"] / tokens
    return out


def without_adapters(params: dict) -> dict:
    """The reference under LoRA: the same parameters with every adapter's B zeroed, which turns the
    adapters off (their update is (x A) B); inside a compiled function the zeros cost no copy of the base."""

    def visit(tree):
        return {k: (jnp.zeros_like(v) if k == "lora_b" else visit(v) if isinstance(v, dict) else v)
                for k, v in tree.items()}

    return visit(params)


def reference_logprobs(graphdef, ref_params, batch: dict[str, jax.Array], temperature: float) -> jax.Array:
    """The reference policy's log-probs [B, T] (the `ref_logprobs` field), gradient stopped."""
    return jax.lax.stop_gradient(token_logprobs(nnx.merge(graphdef, ref_params), batch, temperature))


# ----------------------------------------------------------------------------- rollouts


class Rollouts(NamedTuple):
    """A batch of rollouts on the device: rows prompt-major (row = prompt * G + g), then any padding rows
    that round the batch up to the devices it splits over (`rows` are the real ones)."""

    inputs: jax.Array  # [R, L] int32: prompt, completion, padding (pad id), from slot 0
    targets: jax.Array  # [R, L] int32: the next token (pad at the end)
    positions: jax.Array  # [R, L] int32
    segment_ids: jax.Array  # [R, L] int32: 1 on the prompt and completion, 0 on padding
    weights: jax.Array  # [R, L] float32: 1 where the target is a completion token (the completion mask)
    old_logprobs: jax.Array  # [R, L] float32: the sampling policy's log-prob of each target (0 off the mask)
    completions: jax.Array  # [R, N] int32: the sampled tokens (pad after the stop token)
    lengths: jax.Array  # [R] int32: completion tokens, the stop token included
    stopped: jax.Array  # [R] bool: ended at a stop id (finish reason "eos"), else at the length ("length")
    rows: int  # the real rows: prompts x G

    def batch(self) -> dict[str, jax.Array]:
        """The training-layout fields (advantages and reference log-probs are added by the caller)."""
        return {k: getattr(self, k) for k in ("inputs", "targets", "positions", "segment_ids", "weights",
                                              "old_logprobs")}

    def completion_ids(self) -> list[list[int]]:
        """Each real row's completion ids on the host, without its stop token (what rewards read)."""
        tokens, lengths, stopped = jax.device_get((self.completions, self.lengths, self.stopped))
        return [tokens[r, : lengths[r] - int(stopped[r])].tolist() for r in range(self.rows)]

    def finish_reasons(self) -> list[str]:
        return ["eos" if s else "length" for s in np.asarray(jax.device_get(self.stopped))[: self.rows]]


def completion_mask(tokens: jax.Array, stop_ids: jax.Array, is_padding: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mask [R, N] of each row's completion tokens, up to and including its first stop id; whether the
    row stopped [R]). Batch padding rows have none."""
    is_stop = jnp.any(tokens[..., None] == stop_ids[None, None, :], axis=-1)
    before = jnp.cumsum(is_stop, axis=1) - is_stop  # stop tokens strictly before each column
    mask = (before == 0) & ~is_padding[:, None]
    return mask, jnp.any(is_stop & mask, axis=1)


def training_layout(prompts: jax.Array, start: jax.Array, tokens: jax.Array, mask: jax.Array, pad_id: jax.Array,
                    seq_len: int) -> dict[str, jax.Array]:
    """The left-padded prompts [R, P] (row r's from slot start[r]) and completions [R, N] (`mask`: its
    tokens) as rows from slot 0 of `seq_len` positions: inputs, targets, positions, segment_ids, weights."""
    rows, width = prompts.shape
    full = jnp.concatenate([prompts, tokens], axis=1)  # [R, P + N]
    real = jnp.concatenate([jnp.arange(width)[None, :] >= start[:, None], mask], axis=1)
    generated = jnp.concatenate([jnp.zeros_like(prompts, bool), mask], axis=1)
    idx = jnp.arange(seq_len)[None, :] + start[:, None]  # [R, L]: row r's slot t is full's idx
    inside = idx < full.shape[1]

    def take(a):
        return jnp.where(inside, jnp.take_along_axis(a, jnp.minimum(idx, full.shape[1] - 1), axis=1), False)

    is_real = take(real)
    seq = jnp.where(is_real, take(full), pad_id)
    pad_col = jnp.full((rows, 1), pad_id, jnp.int32)
    return {
        "inputs": seq,
        "targets": jnp.concatenate([seq[:, 1:], pad_col], axis=1),
        "positions": jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32)[None, :], (rows, seq_len)),
        "segment_ids": is_real.astype(jnp.int32),
        "weights": jnp.concatenate([take(generated)[:, 1:], jnp.zeros((rows, 1), bool)], axis=1).astype(jnp.float32),
    }


class Sampler:
    """Group rollouts from parameters on the device: `sampler(params, prompts, key)` -> `Rollouts`.

    Takes the model (its config and NNX graphdef), the mesh, the rules and the parameters' shardings,
    as the train state has them, and the tokenizer's ids: a row stops at any of `stop_ids` (EOS, a
    chat template's end of turn; none: only at the length), padding is `pad_id`. `from_generator`
    takes them from a `generate.Generator`. Rows are max_prompt_len + max_new_tokens positions, so
    that every call, and the train step after it, has one shape."""

    def __init__(self, model_cfg, graphdef, mesh, rules, param_shardings, *, group_size: int, max_new_tokens: int,
                 max_prompt_len: int, sampling: sampling_lib.Sampling = FROM_THE_MODEL,
                 stop_ids: sampling_lib.StopIds = None, pad_id: int = 0, bos_id: int = -1):
        if group_size < 1:
            raise UserError(f"group_size={group_size}: sample at least one completion per prompt")
        if max_prompt_len + max_new_tokens > model_cfg.max_seq_len:
            raise UserError(f"max_prompt_len + max_new_tokens = {max_prompt_len} + {max_new_tokens} passes the model's "
                            f"context of {model_cfg.max_seq_len} tokens (model.max_seq_len); lower them")
        self.model_cfg, self.graphdef, self.mesh, self.rules = model_cfg, graphdef, mesh, rules
        self.param_shardings, self.pad_id, self.bos_id = param_shardings, pad_id, bos_id
        self.group_size, self.sampling = group_size, sampling
        self.max_new_tokens, self.max_prompt_len = max_new_tokens, max_prompt_len
        self.seq_len = max_prompt_len + max_new_tokens
        self.stop_ids = sampling_lib.stop_tuple(stop_ids)
        self.batch_shards = math.prod(mesh.shape[a] for a in mesh_lib.axes_of(mesh_lib.logical_to_spec(
            ("act_batch",), rules)[0]))  # (inference.batch_shards: not imported, config imports this module)
        self._jit = None

    @classmethod
    def from_generator(cls, gen, stop_ids: sampling_lib.StopIds | str = "tokenizer", **kwargs) -> Sampler:
        """A Sampler of a `generate.Generator`'s model, mesh and ids (stopping at its EOS unless given)."""
        bos = -1 if gen.tokenizer is None else gen.tokenizer.bos_id
        return cls(gen.model_cfg, gen.graphdef, gen.mesh, gen.rules, gen.param_shardings, pad_id=gen.pad_id,
                   bos_id=bos, stop_ids=gen.eos_id if isinstance(stop_ids, str) else stop_ids, **kwargs)

    @staticmethod
    def settings_kwargs(settings: GRPOConfig) -> dict:
        """The Sampler's keyword arguments a `grpo` config section gives."""
        return dict(group_size=settings.group_size, max_new_tokens=settings.max_new_tokens,
                    max_prompt_len=settings.max_prompt_len, sampling=settings.sampling)

    @staticmethod
    def key(seed: int, step: int) -> jax.Array:
        """The rollout key of a step: the same seed and step give the same rollouts (a resumed run's)."""
        return jax.random.fold_in(jax.random.PRNGKey(seed), step)

    def _sharding(self, *names) -> NamedSharding:
        return NamedSharding(self.mesh, mesh_lib.logical_to_spec(names, self.rules))

    def compiled(self):
        """rollout(params, prompts [R, P], start [R], is_padding [R], key, sampling, cache_len, max_new)
        -> (training-layout fields, old log-probs, completions, lengths, stopped); jitted once, compiled
        per prompt width (a multiple of `sampling_lib.PROMPT_BUCKET`) and row count."""
        if self._jit is not None:
            return self._jit
        seq_len, cfg, graphdef, rules = self.seq_len, self.model_cfg, self.graphdef, self.rules

        def rollout(params, prompts, start, is_padding, key, sampling, cache_len, max_new):
            cache, state = sampling_lib.prefill_step(cfg, graphdef, rules, params, prompts, start, is_padding, key,
                                                 sampling, cache_len, max_new)

            def more(carry):
                return (carry[1].count < max_new) & ~jnp.all(carry[1].done)

            def step(carry):
                return sampling_lib.decode_step(graphdef, rules, params, *carry)

            _, state = jax.lax.while_loop(more, step, (cache, state))
            mask, stopped = completion_mask(state.tokens, sampling.stop_ids, is_padding)
            batch = training_layout(prompts, start, state.tokens, mask, sampling.pad_id, seq_len)
            with spmd.logical_axis_rules(rules):
                old = token_logprobs(nnx.merge(graphdef, params), batch, sampling.temperature)
            old = jnp.where(batch["weights"] > 0, old, 0.0)
            tokens = jnp.where(mask, state.tokens, sampling.pad_id)
            return batch, old, tokens, jnp.sum(mask, axis=1, dtype=jnp.int32), stopped

        rows, grid = self._sharding("act_batch"), self._sharding("act_batch", None)
        replicated = NamedSharding(self.mesh, P())
        fields = {k: grid for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
        self._jit = jax.jit(
            rollout, static_argnums=(6, 7),
            in_shardings=(self.param_shardings, grid, rows, rows, replicated,
                          sampling_lib.SamplingArrays(*[replicated] * len(sampling_lib.SamplingArrays._fields))),
            out_shardings=(fields, grid, grid, rows, rows))
        return self._jit

    def __call__(self, params, prompts: Sequence[Sequence[int]], key: jax.Array) -> Rollouts:
        """`group_size` completions of each prompt (token ids, BOS first), sampled with `key`."""
        too_long = [len(p) for p in prompts if len(p) > self.max_prompt_len]
        if too_long:
            raise UserError(f"a prompt is {max(too_long)} tokens, longer than max_prompt_len={self.max_prompt_len}; "
                            f"raise it or shorten the prompts")
        if not prompts or min(len(p) for p in prompts) < 1:
            raise UserError("no prompts, or a prompt without tokens; begin each with BOS")
        group = [p for p in prompts for _ in range(self.group_size)]
        tokens, start, is_padding = sampling_lib.left_pad(group, self.batch_shards, self.pad_id, self.bos_id)
        with jax.set_mesh(self.mesh):
            whole, put = NamedSharding(self.mesh, P()), _put_global
            settings = sampling_lib.SamplingArrays(*[put(x, whole) for x in sampling_lib.SamplingArrays.of(
                self.sampling, self.stop_ids, self.pad_id)])
            rows = self._sharding("act_batch")
            batch, old, completions, lengths, stopped = self.compiled()(
                params, put(tokens, self._sharding("act_batch", None)), put(start, rows), put(is_padding, rows),
                put(np.asarray(jax.device_get(key)), whole), settings, tokens.shape[1] + self.max_new_tokens,
                self.max_new_tokens)
        return Rollouts(**batch, old_logprobs=old, completions=completions, lengths=lengths, stopped=stopped,
                        rows=len(group))


def _put_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array every process holds whole onto `sharding` (`inference.put_global`'s)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def metrics(rollouts: Rollouts, total: np.ndarray, per_reward: dict[str, np.ndarray]) -> dict[str, float]:
    """The rollout metrics of a step: mean reward, each reward's mean, mean completion length (tokens,
    the stop token included) and the fraction of completions that stopped at a stop id."""
    lengths, stopped = jax.device_get((rollouts.lengths, rollouts.stopped))
    out = {"reward": float(np.mean(total))}
    out.update({f"reward/{name}": float(np.mean(v)) for name, v in per_reward.items()})
    out["completion_length"] = float(np.mean(lengths[: rollouts.rows]))
    out["stopped_fraction"] = float(np.mean(stopped[: rollouts.rows]))
    return out


# ----------------------------------------------------------------------------- a standalone optimizer step


def update(model_spec: ModelSpec, tx: optax.GradientTransformation, settings: GRPOConfig, rules=()):
    """A jitted optimizer step on the GRPO loss: (params, opt_state, batch) -> (params, opt_state, metrics),
    the gradient of the trainable parameters only (`ModelSpec.split`: the LoRA adapters, or everything),
    the loss sum / count of `summed_loss`. The train step's objective does the same with micro-batches."""

    def step(params, opt_state, batch):
        trainable, frozen = model_spec.split(params)

        def loss_fn(t):
            with spmd.logical_axis_rules(rules):
                total, (count, sums) = summed_loss(model_spec.merge(t, frozen), model_spec, batch, None, settings)
            return total / jnp.maximum(count, 1.0), sums

        (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        out: dict[str, Any] = {"loss": loss, **metric_means(sums)}
        return model_spec.merge(trainable, frozen), opt_state, out

    return jax.jit(step)
