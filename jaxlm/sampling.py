"""The sampler's core, traced inside other programs' jits: how a token is drawn, the prefill and the decode
step with a KV cache, and the left-padded prompt layout they read.

`jaxlm.generate` (the command, `Generator`, `ChatSession`) jits these for interactive sampling;
`jaxlm.post_training.grpo` traces the same functions inside its compiled rollout. They live here, below
both, so that a training objective (layer 3) can sample with the code `generate` samples with. See
`jaxlm.generate`'s docstring for how the prefill, the decode steps and the cache fit together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd

from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.models import attention, transformer

PROMPT_BUCKET = 16  # prompts are padded to a multiple of this, so nearby lengths share one compiled prefill


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits. The defaults sample from the model's distribution."""

    temperature: float = 1.0  # 0 = greedy (argmax)
    top_k: int = 0  # keep only the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the fewest most likely tokens whose probabilities sum to at least p; 1 = all

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UserError(f"--temperature={self.temperature}: use 0 (greedy) or a positive number")
        if self.top_k < 0:
            raise UserError(f"--top_k={self.top_k}: use 0 (off) or a positive number of tokens")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top_p={self.top_p}: use a probability in (0, 1]; 1 is off")


GREEDY = Sampling(temperature=0.0)


# The ids a row may stop at: EOS and, for a chat, the template's end-of-turn marker when it is another
# token (`sft.Encoder.stop_ids`); a fixed count, so one compiled step serves every tokenizer
MAX_STOP_IDS = 4
StopIds = int | Sequence[int] | None  # None (or empty): never stop early


def stop_tuple(stop: StopIds) -> tuple[int, ...]:
    """The stop ids as a tuple (one id, several, or none)."""
    ids = () if stop is None else (stop,) if isinstance(stop, (int, np.integer)) else tuple(stop)
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {ids}")
    return tuple(int(i) for i in ids)


class SamplingArrays(NamedTuple):
    """A `Sampling` and the stop and pad ids as device arrays: arguments of the compiled functions, not
    constants of them, so one compiled prefill and decode step serve every setting and tokenizer."""

    temperature: jax.Array  # float32 []
    top_k: jax.Array  # int32 []
    top_p: jax.Array  # float32 []
    stop_ids: jax.Array  # int32 [MAX_STOP_IDS], -1 padded: a row stops after producing any of them
    pad_id: jax.Array  # int32 []: a stopped row's tokens

    @classmethod
    def of(cls, sampling: Sampling, stop: StopIds, pad_id: int = 0) -> SamplingArrays:
        ids = stop_tuple(stop)
        return cls(np.float32(sampling.temperature), np.int32(sampling.top_k), np.float32(sampling.top_p),
                   np.array(ids + (-1,) * (MAX_STOP_IDS - len(ids)), np.int32), np.int32(pad_id))


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling | SamplingArrays) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V]: the argmax at temperature 0, else a draw from the
    distribution at that temperature restricted to the top k tokens, then to the top-p nucleus of those."""
    if isinstance(sampling, Sampling):
        sampling = SamplingArrays.of(sampling, None)
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(sampling.temperature, 1e-6)
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V], descending
    k = jnp.where((sampling.top_k > 0) & (sampling.top_k < vocab), sampling.top_k, vocab)
    ordered = jnp.where(jnp.arange(vocab) < k, ordered, -jnp.inf)  # top-k, then top-p of what is left
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each
    kept = (jnp.arange(vocab) < k) & (mass_before < sampling.top_p)  # a prefix; the first is always kept
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    drawn = jax.random.categorical(key, jnp.where(scaled < threshold, -jnp.inf, scaled), axis=-1)
    return jnp.where(sampling.temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class DecodeState(NamedTuple):
    """Everything a decode step carries besides the cache."""

    tokens: jax.Array  # [B, max_new] int32: the new tokens so far (pad after a row stops)
    last: jax.Array  # [B] int32: each row's latest token, the next step's input
    done: jax.Array  # [B] bool: the row has produced EOS (or is batch padding)
    count: jax.Array  # int32 []: new tokens so far (the column the next one goes to)
    key: jax.Array  # PRNG key; step n samples with fold_in(key, n)
    sampling: SamplingArrays


def next_tokens(logits, key, count, done, sampling: SamplingArrays):
    """Each row's next token (pad once it has stopped) and whether it has now stopped."""
    token = sample_logits(logits, jax.random.fold_in(key, count), sampling)
    token = jnp.where(done, sampling.pad_id, token)
    return token, done | jnp.any(token[:, None] == sampling.stop_ids[None, :], axis=-1)


def prefill_step(cfg: transformer.ModelConfig, graphdef, rules: mesh_lib.Rules, params, prompts, start, done, rng,
                 sampling: SamplingArrays, cache_len: int, max_new: int) -> tuple[attention.KVCache, DecodeState]:
    """The prefill, traced inside a jit (`generate.Generator.compiled`, and `jaxlm.post_training.grpo`'s rollout): the
    left-padded prompts [B, T] (row b's first real slot `start[b]`; rows `done` are batch padding) run once,
    filling a cache of `cache_len` slots, and each row's first new token is sampled (`max_new` columns kept)."""
    with spmd.logical_axis_rules(rules):
        model = nnx.merge(graphdef, params)
        batch, length = prompts.shape
        cache = transformer.init_cache(cfg, batch, cache_len, start)
        positions = jnp.maximum(jnp.arange(length)[None, :] - start[:, None], 0)  # [B, T]
        logits, cache = model(prompts, positions, cache=cache, last_only=True)  # every row ends at slot T - 1
        count = jnp.zeros((), jnp.int32)
        token, done = next_tokens(logits[:, -1], rng, count, done, sampling)
        tokens = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(token)
        return cache, DecodeState(tokens=tokens, last=token, done=done, count=count + 1, key=rng, sampling=sampling)


def decode_step(graphdef, rules: mesh_lib.Rules, params, cache: attention.KVCache,
                state: DecodeState) -> tuple[attention.KVCache, DecodeState]:
    """One decode step, traced inside a jit: each row's last token at its own position, its keys and
    values appended to the cache, the next token sampled into column `state.count`."""
    with spmd.logical_axis_rules(rules):
        model = nnx.merge(graphdef, params)
        positions = (cache.index - cache.start)[:, None]  # [B, 1]: each row's own position
        logits, cache = model(state.last[:, None], positions, cache=cache)
        token, done = next_tokens(logits[:, 0], state.key, state.count, state.done, state.sampling)
        tokens = jax.lax.dynamic_update_slice(state.tokens, token[:, None], (jnp.int32(0), state.count))
        return cache, state._replace(tokens=tokens, last=token, done=done, count=state.count + 1)


def left_pad(prompts: Sequence[Sequence[int]], rows_multiple: int, pad_id: int, bos_id: int = -1):
    """Prompts (token ids) left-padded to one width, a multiple of PROMPT_BUCKET: (tokens [B', T], each
    row's first slot start [B'], which rows are batch padding [B']), B' the prompts' count rounded up to
    `rows_multiple` (the devices a batch splits over); a padding row is one token, BOS where there is one."""
    length = -(-max(len(p) for p in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
    rows = -(-len(prompts) // rows_multiple) * rows_multiple
    tokens = np.full((rows, length), pad_id, np.int32)
    start = np.full(rows, length - 1, np.int32)
    tokens[:, -1] = bos_id if bos_id >= 0 else pad_id
    for row, prompt in enumerate(prompts):
        tokens[row, length - len(prompt):] = np.asarray(prompt, np.int32)
        start[row] = length - len(prompt)
    return tokens, start, np.arange(rows) >= len(prompts)
