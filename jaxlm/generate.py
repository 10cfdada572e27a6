"""Sampling with a KV cache: `python -m jaxlm.generate --run_dir=runs/tiny --prompt='def main('`.

The prompts of a batch are left-padded to one length and run through the model once (the prefill),
which fills every layer's key/value cache and samples each row's first new token. Then one compiled
decode step, reused for every token, feeds each row its last token at its own position, appends the
token's keys and values to the cache and samples the next. A row stops at EOS; the loop stops when
every row has, or after `max_new_tokens`. The cache is plain arrays ([layers, batch, slots,
kv_heads, head_dim]) passed in and out of the two compiled functions and donated between steps,
sharded like the activations (batch over data x fsdp x expert, heads over tensor).

Greedy decoding (temperature 0) gives exactly the tokens that repeated full forward passes give
(tested); temperature, top-k and top-p sampling draw from a PRNG key derived from `seed`, so a seed
always gives the same text.

A chat model is prompted with token ids, never with text decoded from them: a conversation is rendered
by the run's chat template with its generation prompt (`jaxlm.data.sft`, the renderer training uses) and
encoded with its special tokens (`<|im_start|>`), which `Tokenizer.decode` would drop. `ChatSession`
keeps a conversation and its KV cache between turns (`--interactive`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import sys
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import commands, inference, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.data import sft
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError, report_error, run_command
from jaxlm.models import attention, transformer

log = logging.getLogger(__name__)

PROMPT_BUCKET = 16  # prompts are padded to a multiple of this, so nearby lengths share one compiled prefill
DONE_CHECK_EVERY = 8  # decode steps between checks whether every row has stopped (a device-to-host sync)


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


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int]  # the new tokens, EOS not included
    finish_reason: str  # 'eos' or 'length'
    prompt: str | None = None
    text: str | None = None  # the new tokens decoded
    messages: list[dict[str, str]] | None = None  # a chat prompt's conversation (rendered to prompt_ids)


def _next_tokens(logits, key, count, done, sampling: SamplingArrays):
    """Each row's next token (pad once it has stopped) and whether it has now stopped."""
    token = sample_logits(logits, jax.random.fold_in(key, count), sampling)
    token = jnp.where(done, sampling.pad_id, token)
    return token, done | jnp.any(token[:, None] == sampling.stop_ids[None, :], axis=-1)


def prefill_step(cfg: transformer.ModelConfig, graphdef, rules: mesh_lib.Rules, params, prompts, start, done, rng,
                 sampling: SamplingArrays, cache_len: int, max_new: int) -> tuple[attention.KVCache, DecodeState]:
    """The prefill, traced inside a jit (`Generator.compiled`, and `jaxlm.post_training.grpo`'s rollout): the
    left-padded prompts [B, T] (row b's first real slot `start[b]`; rows `done` are batch padding) run once,
    filling a cache of `cache_len` slots, and each row's first new token is sampled (`max_new` columns kept)."""
    with spmd.logical_axis_rules(rules):
        model = nnx.merge(graphdef, params)
        batch, length = prompts.shape
        cache = transformer.init_cache(cfg, batch, cache_len, start)
        positions = jnp.maximum(jnp.arange(length)[None, :] - start[:, None], 0)  # [B, T]
        logits, cache = model(prompts, positions, cache=cache, last_only=True)  # every row ends at slot T - 1
        count = jnp.zeros((), jnp.int32)
        token, done = _next_tokens(logits[:, -1], rng, count, done, sampling)
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
        token, done = _next_tokens(logits[:, 0], state.key, state.count, state.done, state.sampling)
        tokens = jax.lax.dynamic_update_slice(state.tokens, token[:, None], (jnp.int32(0), state.count))
        return cache, state._replace(tokens=tokens, last=token, done=done, count=state.count + 1)


class Generator:
    """Batched sampling from a model's parameters on a mesh, with one compiled prefill and one compiled
    decode step for every sampling setting (compiled once per batch shape and cache length).

    The special ids are the tokenizer's. Without one (prompts given as ids) padding is id 0 and a row
    stops early only at an `eos_id` given to `generate_ids`."""

    def __init__(self, model_cfg: transformer.ModelConfig, params, mesh: Mesh, rules: mesh_lib.Rules,
                 param_shardings=None, tokenizer: Tokenizer | None = None, graphdef=None):
        self.model_cfg, self.params, self.mesh, self.rules, self.tokenizer = model_cfg, params, mesh, rules, tokenizer
        self.graphdef = graphdef if graphdef is not None else train_state.build_model_spec(model_cfg).graphdef
        self.param_shardings = param_shardings or jax.tree.map(lambda x: x.sharding, params)
        self.batch_shards = inference.batch_shards(mesh, rules)
        self._compiled = None
        self._extend = None

    @classmethod
    def from_run(cls, run: inference.LoadedRun) -> Generator:
        return cls(run.model_cfg, run.params, run.mesh, run.rules, run.param_shardings, run.tokenizer,
                   run.model_spec.graphdef)

    @property
    def pad_id(self) -> int:
        """Fills the slots left of a prompt and a row's tokens after it stops (masked, never read)."""
        return 0 if self.tokenizer is None else self.tokenizer.pad_id

    @property
    def eos_id(self) -> int | None:
        """Where a row stops by default: the tokenizer's EOS; None (never) without one."""
        eos = -1 if self.tokenizer is None else self.tokenizer.eos_id
        return eos if eos >= 0 else None

    # ------------------------------------------------------------------------- shardings

    def _sharding(self, *names) -> NamedSharding:
        return NamedSharding(self.mesh, mesh_lib.logical_to_spec(names, self.rules))

    def _cache_sharding(self) -> attention.KVCache:
        replicated = NamedSharding(self.mesh, P())
        kv = self._sharding(*attention.CACHE_AXES)
        return attention.KVCache(k=kv, v=kv, index=replicated, start=self._sharding("act_batch"), layer=replicated)

    def _state_sharding(self) -> DecodeState:
        # Replicated (a few ints per row): every process can read the tokens and whether all rows are done.
        replicated = NamedSharding(self.mesh, P())
        return DecodeState(tokens=replicated, last=replicated, done=replicated, count=replicated, key=replicated,
                           sampling=SamplingArrays(*[replicated] * len(SamplingArrays._fields)))

    # ------------------------------------------------------------------------- compiled functions

    def compiled(self):
        """(prefill, decode), jitted once for every sampling setting (compiled per batch shape and cache length).

        prefill(params, prompts [B, T], start [B], done [B], key, sampling, cache_len, max_new) -> (cache, state)
        decode(params, cache, state) -> (cache, state), donating both.
        """
        if self._compiled is not None:
            return self._compiled
        cfg, graphdef, rules = self.model_cfg, self.graphdef, self.rules

        def prefill(params, prompts, start, done, rng, sampling, cache_len, max_new):
            return prefill_step(cfg, graphdef, rules, params, prompts, start, done, rng, sampling, cache_len, max_new)

        def decode(params, cache, state):
            return decode_step(graphdef, rules, params, cache, state)

        outs = (self._cache_sharding(), self._state_sharding())
        rows = self._sharding("act_batch")
        replicated = NamedSharding(self.mesh, P())
        prefill_jit = jax.jit(
            prefill, static_argnums=(6, 7), out_shardings=outs,
            in_shardings=(self.param_shardings, self._sharding("act_batch", None), rows, rows, replicated,
                          SamplingArrays(*[replicated] * len(SamplingArrays._fields))),
        )
        decode_jit = jax.jit(decode, donate_argnums=(1, 2), in_shardings=(self.param_shardings, *outs),
                             out_shardings=outs)
        self._compiled = (prefill_jit, decode_jit)
        return self._compiled

    def compiled_extend(self):
        """(empty_cache, extend), jitted: what a `ChatSession` adds to `compiled()`'s decode step.

        empty_cache(rows, slots) -> a zero cache whose rows all start at slot 0 (no left padding).
        extend(params, cache, chunk [B, T], length, index, done [B], key, sampling, max_new) -> (cache,
        state), donating the cache: the first `length` tokens of each row of `chunk` (the rest is padding,
        so that nearby lengths share one compiled function) are written at slots [index, index + length),
        attending to the slots before them, and the first new token is sampled after them. What the cache
        held from `index` on is overwritten or, past the chunk, masked until written again.
        """
        if self._extend is not None:
            return self._extend
        cfg, graphdef, rules = self.model_cfg, self.graphdef, self.rules

        def empty_cache(rows, slots):
            with spmd.logical_axis_rules(rules):
                return transformer.init_cache(cfg, rows, slots, jnp.zeros((rows,), jnp.int32))

        def extend(params, cache, chunk, length, index, done, rng, sampling, max_new):
            with spmd.logical_axis_rules(rules):
                model = nnx.merge(graphdef, params)
                batch, width = chunk.shape
                cache = cache._replace(index=index)
                positions = jnp.maximum(index + jnp.arange(width)[None, :] - cache.start[:, None], 0)  # [B, T]
                hidden, cache = model(chunk, positions, cache=cache, hidden=True)  # [B, T, D]
                last = jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1, axis=1)  # [B, 1, D]: the last real token
                logits = model.logits(last)
                count = jnp.zeros((), jnp.int32)
                token, done = _next_tokens(logits[:, -1], rng, count, done, sampling)
                tokens = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(token)
                state = DecodeState(tokens=tokens, last=token, done=done, count=count + 1, key=rng, sampling=sampling)
                return cache._replace(index=index + length), state

        cache_sharding, state_sharding = self._cache_sharding(), self._state_sharding()
        rows = self._sharding("act_batch")
        replicated = NamedSharding(self.mesh, P())
        empty_jit = jax.jit(empty_cache, static_argnums=(0, 1), out_shardings=cache_sharding)
        extend_jit = jax.jit(
            extend, static_argnums=(8,), donate_argnums=(1,), out_shardings=(cache_sharding, state_sharding),
            in_shardings=(self.param_shardings, cache_sharding, self._sharding("act_batch", None), replicated,
                          replicated, rows, replicated, SamplingArrays(*[replicated] * len(SamplingArrays._fields))),
        )
        self._extend = (empty_jit, extend_jit)
        return self._extend

    # ------------------------------------------------------------------------- generation

    def max_new_tokens_for(self, prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
        """`max_new_tokens`, lowered so the longest prompt plus its new tokens fit the model's context."""
        context = self.model_cfg.max_seq_len
        longest = max(prompt_lengths)
        if longest >= context:
            raise UserError(
                f"a prompt is {longest} tokens but the model's context is {context} tokens (model.max_seq_len); "
                f"shorten it to at most {context - 1} tokens, leaving room for new ones"
            )
        if max_new_tokens < 1:
            raise UserError(f"--max_new_tokens={max_new_tokens}: generate at least one token")
        if longest + max_new_tokens > context:
            log.warning("generating at most %d tokens: the longest prompt (%d tokens) plus %d new tokens would pass "
                        "the model's context of %d", context - longest, longest, max_new_tokens, context)
        return min(max_new_tokens, context - longest)

    def prepare(self, prompts: Sequence[Sequence[int]], max_new_tokens: int):
        """Left-padded prompts [B', T] (B' rounded up to the devices the batch splits over), each row's
        first slot [B'], which rows are padding [B'], the cache length and the number of new tokens."""
        if not prompts:
            raise UserError("no prompts given")
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise UserError("a prompt has no tokens; begin each with BOS (the tokenizer adds it to text prompts)")
        max_new = self.max_new_tokens_for(lengths, max_new_tokens)
        length = -(-max(lengths) // PROMPT_BUCKET) * PROMPT_BUCKET
        rows = -(-len(prompts) // self.batch_shards) * self.batch_shards
        tokens = np.full((rows, length), self.pad_id, np.int32)
        start = np.full(rows, length - 1, np.int32)  # batch padding rows: a lone token, BOS where there is one
        bos = -1 if self.tokenizer is None else self.tokenizer.bos_id
        tokens[:, -1] = bos if bos >= 0 else self.pad_id
        for row, prompt in enumerate(prompts):
            tokens[row, length - len(prompt):] = np.asarray(prompt, np.int32)
            start[row] = length - len(prompt)
        is_padding = np.arange(rows) >= len(prompts)
        return tokens, start, is_padding, length + max_new, max_new

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        eos_id: StopIds | Literal["tokenizer"] = "tokenizer",
    ) -> list[Completion]:
        """New tokens for each prompt (token ids, normally starting with BOS). A row stops at `eos_id`
        (one id or several: EOS and a chat template's end-of-turn marker): by default the tokenizer's
        (`self.eos_id`); None never stops early."""
        eos_id = stop_tuple(self.eos_id if isinstance(eos_id, str) else eos_id)
        tokens, start, is_padding, cache_len, max_new = self.prepare(prompts, max_new_tokens)
        prefill, decode = self.compiled()
        with jax.set_mesh(self.mesh):
            rows, whole, put = self._sharding("act_batch"), NamedSharding(self.mesh, P()), inference.put_global
            key = put(np.asarray(jax.random.PRNGKey(seed)), whole)
            settings = SamplingArrays(*[put(x, whole) for x in SamplingArrays.of(sampling, eos_id, self.pad_id)])
            cache, state = prefill(self.params, put(tokens, self._sharding("act_batch", None)), put(start, rows),
                                   put(is_padding, rows), key, settings, cache_len, max_new)
            cache, state, _ = self.decode_until_done(cache, state, max_new)
            new = np.asarray(jax.device_get(state.tokens))
        return [completion(prompt, new[row], eos_id) for row, prompt in enumerate(prompts)]

    def decode_until_done(self, cache, state: DecodeState, max_new: int) -> tuple[attention.KVCache, DecodeState, int]:
        """Decode steps after a prefill until every row has stopped (looked at every DONE_CHECK_EVERY
        steps) or `max_new` tokens are out; also the number of steps run (tokens fed to the cache)."""
        _, decode = self.compiled()
        steps = 0
        for n in range(1, max_new):
            if n % DONE_CHECK_EVERY == 0 and bool(np.all(jax.device_get(state.done))):
                break
            cache, state = decode(self.params, cache, state)
            steps += 1
        return cache, state, steps

    def generate(self, prompts: Sequence[str], **kwargs) -> list[Completion]:
        """`generate_ids` for text prompts: each is encoded with BOS in front, each completion decoded."""
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer; use generate_ids")
        ids = self.tokenizer.encode(list(prompts), add_bos=True, add_eos=False)
        completions = self.generate_ids(ids, **kwargs)
        for completion, prompt in zip(completions, prompts):
            completion.prompt, completion.text = prompt, self.tokenizer.decode(completion.ids)
        return completions

    def generate_chat(self, conversations: Sequence[Sequence[dict[str, str]]], template: sft.Encoder,
                      **kwargs) -> list[Completion]:
        """The assistant's next turn of each conversation: `generate_ids` on the ids of the conversation
        rendered by `template` with its generation prompt (`LoadedRun.chat_template()` is a run's), each
        answer decoded (its special tokens, such as an end-of-turn marker, dropped)."""
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer; render the prompts and use generate_ids")
        ids = [template.prompt_ids(self.tokenizer, messages) for messages in conversations]
        if kwargs.get("eos_id", "tokenizer") == "tokenizer":  # EOS, and the template's end of a turn
            kwargs["eos_id"] = template.stop_ids(self.tokenizer)
        completions = self.generate_ids(ids, **kwargs)
        for completion, messages in zip(completions, conversations):
            completion.messages, completion.text = list(messages), self.tokenizer.decode(completion.ids)
        return completions


def completion(prompt: Sequence[int], new: np.ndarray, eos_id: StopIds) -> Completion:
    """A row's Completion: its new tokens up to the first stop id (not included)."""
    ids, reason, stops = new.tolist(), "length", set(stop_tuple(eos_id))
    end = next((i for i, token in enumerate(ids) if token in stops), None)
    if end is not None:
        ids, reason = ids[:end], "eos"
    return Completion(prompt_ids=list(prompt), ids=ids, finish_reason=reason)


def common_start(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common start of two id sequences."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatSession:
    """A conversation with a model, turn by turn (`python -m jaxlm.generate --interactive`): `reply(text)`
    adds the user's message, renders the whole conversation with the chat template and its generation
    prompt, samples the assistant's answer and adds it (decoded) to the conversation.

    The KV cache is kept between turns. Each turn's prompt is rendered whole, not appended to, so its ids
    are exactly those a one-shot `--chat` with the same history is prompted with (tested); the model runs
    only on the ids after the longest common start of those and the ids already in the cache (the
    previous prompt and the tokens of its answer), writing over the slots after it. With a template that
    renders a conversation's start as the start of the whole (every common one) and an answer that
    encodes back to its own tokens, that is the new user message and the template's text around it. A
    template that renders earlier turns differently (one that drops past reasoning), or an answer whose
    text encodes to other ids, shortens the common start: the model recomputes from there, at worst the
    whole conversation (a re-prefill), and the answer is the same either way.
    """

    def __init__(self, generator: Generator, template: sft.Encoder, *, system: str | None = None,
                 max_new_tokens: int = 128, sampling: Sampling = GREEDY, seed: int = 0,
                 eos_id: StopIds | Literal["tokenizer"] = "tokenizer"):
        if generator.tokenizer is None:
            raise ValueError("a ChatSession needs a Generator with a tokenizer")
        if max_new_tokens < 1:
            raise UserError(f"--max_new_tokens={max_new_tokens}: generate at least one token")
        self.generator, self.template, self.system = generator, template, system
        self.max_new_tokens, self.sampling, self.seed = max_new_tokens, sampling, seed
        # EOS and the template's end of a turn (`sft.Encoder.stop_ids`), unless given
        self.eos_id = stop_tuple(template.stop_ids(generator.tokenizer) if isinstance(eos_id, str) else eos_id)
        self.messages: list[dict[str, str]] = []
        self.turns = 0
        self.reused = 0  # the last turn's prompt ids that were already in the cache
        self._cache = None
        self._cached: list[int] = []  # the ids whose keys and values the cache holds, from slot 0
        self.reset()

    def reset(self) -> None:
        """Start the conversation over (the cache stays: a new conversation's common start with it is reused)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> Completion:
        """The assistant's answer to the user's message `text`, which both join the conversation. A
        message that does not fit the model's context is refused (UserError), the conversation unchanged."""
        messages = [*self.messages, {"role": "user", "content": text}]
        tokenizer = self.generator.tokenizer
        result = self._generate(self.template.prompt_ids(tokenizer, messages))
        result.messages, result.text = messages, tokenizer.decode(result.ids)
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        return result

    def _generate(self, ids: list[int]) -> Completion:
        gen = self.generator
        context = gen.model_cfg.max_seq_len
        if len(ids) >= context:
            raise UserError(f"the conversation is {len(ids)} tokens but the model's context is {context} tokens "
                            f"(model.max_seq_len); /reset starts it over")
        empty_cache, extend = gen.compiled_extend()
        rows = gen.batch_shards  # row 0 is the conversation, the others padding the batch to the devices
        # The chunk's width is rounded up, so that nearby lengths share one compiled function; the cache has
        # room past the context for the padding of the last chunk.
        slots = -(-(context + PROMPT_BUCKET) // PROMPT_BUCKET) * PROMPT_BUCKET
        start = min(common_start(self._cached, ids), len(ids) - 1)  # at least one token runs: its logits
        new = ids[start:]
        width = -(-len(new) // PROMPT_BUCKET) * PROMPT_BUCKET
        chunk = np.full((rows, width), gen.pad_id, np.int32)
        chunk[0, : len(new)] = new
        done = np.arange(rows) >= 1
        max_new = min(self.max_new_tokens, context - len(ids))
        with jax.set_mesh(gen.mesh):
            whole, put = NamedSharding(gen.mesh, P()), inference.put_global
            if self._cache is None:
                self._cache = empty_cache(rows, slots)
            key = put(np.asarray(jax.random.fold_in(jax.random.PRNGKey(self.seed), self.turns)), whole)
            settings = SamplingArrays(*[put(x, whole) for x in SamplingArrays.of(self.sampling, self.eos_id,
                                                                                 gen.pad_id)])
            cache, self._cache = self._cache, None  # donated: if extending fails, the next turn starts afresh
            self._cached = []
            cache, state = extend(gen.params, cache, put(chunk, gen._sharding("act_batch", None)), np.int32(len(new)),
                                  np.int32(start), put(done, gen._sharding("act_batch")), key, settings,
                                  self.max_new_tokens)
            cache, state, steps = gen.decode_until_done(cache, state, max_new)
            tokens = np.asarray(jax.device_get(state.tokens))[0]
        self._cache, self._cached = cache, ids + tokens[:steps].tolist()  # the tokens fed back are in the cache
        self.turns += 1
        self.reused = start
        return completion(ids, tokens[:max_new], self.eos_id)


def load(run_dir, *, step: int | None = None, dtype: str | None = None, param_dtype: str | None = None,
         devices=None) -> Generator:
    """A Generator for checkpoint `step` (default: the newest) of a run directory."""
    return Generator.from_run(inference.load_run(run_dir, step=step, dtype=dtype, param_dtype=param_dtype,
                                                 devices=devices))


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `_main`, its errors, interrupts and environment failures as one line and an exit code."""
    return run_command(lambda: _main(argv), resume="run the same command again")


make_parser = commands.generate_parser  # the command line, declared in jaxlm.commands (light to import)


def _read_prompts_file(path: str) -> list[tuple[int, str]]:
    """The (line number, text) of each non-blank line of --prompts_file."""
    try:
        with open(path, encoding="utf-8") as f:
            return [(number, line.rstrip("\n")) for number, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise UserError(f"--prompts_file={path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts_file={path} is not UTF-8 text (byte {e.start}); give a text file") from None


def _conversation(text: str, where: str, system: str | None) -> list[dict[str, str]]:
    """A conversation from its JSON text (`sft.check_prompt`), with the system message put first if it has none."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at character {e.pos}); give a list of {{\"role\": ..., "
                        f"\"content\": ...}} messages") from None
    messages = sft.check_prompt(row, where)
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _refuse_a_run_without_a_template(run_dir: str) -> None:
    """`inference.chat_template`'s one line for a run that has no chat template, from its config.json
    and tokenizer alone; a directory that is not a whole run is left to `inference.load_run` to name."""
    try:
        cfg, tok = inference.read_config(pathlib.Path(run_dir)), Tokenizer.load(run_dir)
    except UserError:
        return
    inference.chat_template(cfg, tok, run_dir)


def chat_prompts(args) -> list[list[dict[str, str]]]:
    """The conversations the command line gives: --prompt (a user message each), --messages, and
    --prompts_file's lines."""
    first = [{"role": "system", "content": args.system}] if args.system is not None else []
    conversations = [[*first, {"role": "user", "content": p}] for p in args.prompt]
    conversations += [_conversation(m, f"--messages #{i}", args.system) for i, m in enumerate(args.messages, 1)]
    if args.prompts_file:
        conversations += [_conversation(line, f"{args.prompts_file}:{number}", args.system)
                          for number, line in _read_prompts_file(args.prompts_file)]
    return conversations


def _main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    chat = bool(args.chat or args.messages or args.system is not None or args.interactive
                or (args.prompts_file or "").lower().endswith(".jsonl"))
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        eos_id = None if args.ignore_eos else "tokenizer"
        if args.interactive:
            if args.prompt or args.messages or args.prompts_file:
                raise UserError("--interactive reads the conversation from standard input; drop --prompt, --messages "
                                "and --prompts_file (a system message: --system)")
            _refuse_a_run_without_a_template(args.run_dir)  # before its checkpoint loads (seconds, gigabytes)
            run = inference.load_run(args.run_dir, step=args.step, dtype=args.dtype, param_dtype=args.param_dtype)
            session = ChatSession(Generator.from_run(run), run.chat_template(), system=args.system,
                                  max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, eos_id=eos_id)
            return _interactive(session, args.json)
        if chat:
            conversations = chat_prompts(args)
            if not conversations:
                raise UserError("give at least one conversation: --prompt=TEXT (a user message), --messages=JSON or "
                                "--prompts_file=FILE.jsonl")
            _refuse_a_run_without_a_template(args.run_dir)
        else:
            prompts = list(args.prompt) + [line for _, line in
                                           (_read_prompts_file(args.prompts_file) if args.prompts_file else [])]
            if not prompts:
                raise UserError("give at least one --prompt=TEXT (or --prompts_file=FILE)")
        run = inference.load_run(args.run_dir, step=args.step, dtype=args.dtype, param_dtype=args.param_dtype)
        generator = Generator.from_run(run)
        options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, eos_id=eos_id)
        if chat:
            template = run.chat_template()
            completions = generator.generate_chat([c for c in conversations for _ in range(args.num_samples)],
                                                  template, **options)
        else:
            completions = generator.generate([p for p in prompts for _ in range(args.num_samples)], **options)
    except UserError as e:
        return report_error(e)
    for i, c in enumerate(completions):
        if args.json:
            head = {"messages": c.messages} if chat else {"prompt": c.prompt}
            print(json.dumps({**head, "completion": c.text, "ids": c.ids, "tokens": len(c.ids),
                              "finish_reason": c.finish_reason}))
        else:
            print(f"--- sample {i + 1}/{len(completions)} ({len(c.ids)} tokens, {c.finish_reason})")
            print(c.text if chat else f"{c.prompt}{c.text}")
    return 0


def _interactive(session: ChatSession, as_json: bool) -> int:
    """The --interactive loop: a user message per line of standard input, each answer printed (as text,
    or a JSON object with its ids). Ends at end of input or /exit (0); Ctrl-C ends it through
    `run_command` (130). A message the model cannot take (past its context) is one error line, and the
    conversation goes on without it."""
    tty = sys.stdin.isatty()
    if tty:
        print("jaxlm: chat with the model; /reset starts over, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        if tty:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
        else:
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\n")
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            session.reset()
            continue
        if not command:
            continue
        try:
            answer = session.reply(line)
        except UserError as e:
            report_error(e)
            continue
        if as_json:
            print(json.dumps({"turn": session.turns, "completion": answer.text, "ids": answer.ids,
                              "tokens": len(answer.ids), "finish_reason": answer.finish_reason,
                              "prompt_tokens": len(answer.prompt_ids), "reused_tokens": session.reused},
                             ), flush=True)
        else:
            print(answer.text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
