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
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import commands, inference, train_state
from jaxlm import mesh as mesh_lib
from jaxlm import sampling as sampling_lib
from jaxlm.commands import chat_prompts, read_prompts_file  # (the command line's prompts, read before JAX too)
from jaxlm.data import sft
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError, report_error, run_command
from jaxlm.models import attention, transformer
from jaxlm.sampling import (  # noqa: F401 -- the sampler's core, also used (and long imported) as generate.<name>
    GREEDY,
    MAX_STOP_IDS,
    PROMPT_BUCKET,
    DecodeState,
    Sampling,
    SamplingArrays,
    StopIds,
    decode_step,
    prefill_step,
    sample_logits,
    stop_tuple,
)
from jaxlm.sampling import next_tokens as _next_tokens

log = logging.getLogger(__name__)

DONE_CHECK_EVERY = 8  # decode steps between checks whether every row has stopped (a device-to-host sync)


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int]  # the new tokens, EOS not included
    finish_reason: str  # 'eos' or 'length'
    prompt: str | None = None
    text: str | None = None  # the new tokens decoded
    messages: list[dict[str, str]] | None = None  # a chat prompt's conversation (rendered to prompt_ids)


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
        bos = -1 if self.tokenizer is None else self.tokenizer.bos_id
        tokens, start, is_padding = sampling_lib.left_pad(prompts, self.batch_shards, self.pad_id, bos)
        return tokens, start, is_padding, tokens.shape[1] + max_new, max_new

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        eos_id: StopIds | Literal["tokenizer"] = "tokenizer",
        finished: Callable[[np.ndarray], bool] | None = None,
    ) -> list[Completion]:
        """New tokens for each prompt (token ids, normally starting with BOS). A row stops at `eos_id`
        (one id or several: EOS and a chat template's end-of-turn marker): by default the tokenizer's
        (`self.eos_id`); None never stops early. `finished(tokens)`, given the new tokens so far [prompts,
        n] (pad after a row's stop id) every DONE_CHECK_EVERY steps, ends generation early where it says
        every row is done (a row's stop string found in its text: lm-evaluation-harness's `until`)."""
        eos_id = stop_tuple(self.eos_id if isinstance(eos_id, str) else eos_id)
        tokens, start, is_padding, cache_len, max_new = self.prepare(prompts, max_new_tokens)
        prefill, decode = self.compiled()
        with jax.set_mesh(self.mesh):
            rows, whole, put = self._sharding("act_batch"), NamedSharding(self.mesh, P()), inference.put_global
            key = put(np.asarray(jax.random.PRNGKey(seed)), whole)
            settings = SamplingArrays(*[put(x, whole) for x in SamplingArrays.of(sampling, eos_id, self.pad_id)])
            cache, state = prefill(self.params, put(tokens, self._sharding("act_batch", None)), put(start, rows),
                                   put(is_padding, rows), key, settings, cache_len, max_new)
            def tokens_finished(state: DecodeState) -> bool:  # `finished` on the real rows' tokens so far
                return finished(np.asarray(jax.device_get(state.tokens))[: len(prompts), : int(state.count)])

            cache, state, _ = self.decode_until_done(cache, state, max_new, tokens_finished if finished else None)
            new = np.asarray(jax.device_get(state.tokens))
        return [completion(prompt, new[row], eos_id) for row, prompt in enumerate(prompts)]

    def decode_until_done(self, cache, state: DecodeState, max_new: int,
                          finished: Callable[[DecodeState], bool] | None = None,
                          ) -> tuple[attention.KVCache, DecodeState, int]:
        """Decode steps after a prefill until every row has stopped, or `finished(state)` says the caller has
        what it needs (each looked at every DONE_CHECK_EVERY steps), or `max_new` tokens are out; also the
        number of steps run (tokens fed to the cache)."""
        _, decode = self.compiled()
        steps = 0
        for n in range(1, max_new):
            if n % DONE_CHECK_EVERY == 0 and (bool(np.all(jax.device_get(state.done))) or (finished and finished(state))):
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


def _refuse_a_run_without_a_template(run_dir: str) -> None:
    """`inference.chat_template`'s one line for a run that has no chat template, from its config.json
    and tokenizer alone; a directory that is not a whole run is left to `inference.load_run` to name."""
    try:
        cfg, tok = inference.read_config(pathlib.Path(run_dir)), Tokenizer.load(run_dir)
    except UserError:
        return
    inference.chat_template(cfg, tok, run_dir)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    chat = commands.generate_is_chat(args)
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        eos_id = None if args.ignore_eos else "tokenizer"
        if args.interactive:
            if args.prompt or args.messages or args.prompts_file:
                raise UserError(commands.INTERACTIVE_WITH_PROMPTS)
            _refuse_a_run_without_a_template(args.run_dir)  # before its checkpoint loads (seconds, gigabytes)
            run = inference.load_run(args.run_dir, step=args.step, dtype=args.dtype, param_dtype=args.param_dtype)
            session = ChatSession(Generator.from_run(run), run.chat_template(), system=args.system,
                                  max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, eos_id=eos_id)
            return _interactive(session, args.json)
        if chat:
            conversations = chat_prompts(args)
            if not conversations:
                raise UserError(commands.NO_CONVERSATION)
            _refuse_a_run_without_a_template(args.run_dir)
        else:
            prompts = list(args.prompt) + [line for _, line in
                                           (read_prompts_file(args.prompts_file) if args.prompts_file else [])]
            if not prompts:
                raise UserError(commands.NO_PROMPT)
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
