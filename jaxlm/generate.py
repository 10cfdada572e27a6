"""Sampling with a KV cache: `python -m jaxlm.generate --run_dir=runs/tiny --prompt='def main('`.

The prompts of a batch are left-padded to one length and run through the model once (the prefill),
which fills every layer's key/value cache and samples each row's first new token. Then one compiled
decode step, reused for every token, feeds each row its last token at its own position, appends the
token's keys and values to the cache and samples the next. A row stops at EOS; the loop stops when
every row has, or after `max_new_tokens`. The cache is plain arrays ([layers, batch, slots,
kv_heads, head_dim]) passed in and out of the two compiled functions and donated between steps,
sharded like the activations (batch over data x fsdp, heads over tensor).

Greedy decoding (temperature 0) gives exactly the tokens that repeated full forward passes give
(tested); temperature, top-k and top-p sampling draw from a PRNG key derived from `seed`, so a seed
always gives the same text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
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

from jaxlm import cli, inference, train_state
from jaxlm import mesh as mesh_lib
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


class SamplingArrays(NamedTuple):
    """A `Sampling` and the EOS and pad ids as device scalars: arguments of the compiled functions, not
    constants of them, so one compiled prefill and decode step serve every setting and tokenizer."""

    temperature: jax.Array  # float32 []
    top_k: jax.Array  # int32 []
    top_p: jax.Array  # float32 []
    eos_id: jax.Array  # int32 []; -1: never stop
    pad_id: jax.Array  # int32 []: a stopped row's tokens

    @classmethod
    def of(cls, sampling: Sampling, eos_id: int | None, pad_id: int = 0) -> SamplingArrays:
        return cls(np.float32(sampling.temperature), np.int32(sampling.top_k), np.float32(sampling.top_p),
                   np.int32(-1 if eos_id is None else eos_id), np.int32(pad_id))


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

        def next_tokens(logits, state_key, count, done, sampling: SamplingArrays):
            token = sample_logits(logits, jax.random.fold_in(state_key, count), sampling)
            token = jnp.where(done, sampling.pad_id, token)
            return token, done | (token == sampling.eos_id)

        def prefill(params, prompts, start, done, rng, sampling, cache_len, max_new):
            with spmd.logical_axis_rules(rules):
                model = nnx.merge(graphdef, params)
                batch, length = prompts.shape
                cache = transformer.init_cache(cfg, batch, cache_len, start)
                positions = jnp.maximum(jnp.arange(length)[None, :] - start[:, None], 0)  # [B, T]
                logits, cache = model(prompts, positions, cache=cache, last_only=True)  # every row ends at slot T - 1
                count = jnp.zeros((), jnp.int32)
                token, done = next_tokens(logits[:, -1], rng, count, done, sampling)
                tokens = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(token)
                return cache, DecodeState(tokens=tokens, last=token, done=done, count=count + 1, key=rng,
                                          sampling=sampling)

        def decode(params, cache, state):
            with spmd.logical_axis_rules(rules):
                model = nnx.merge(graphdef, params)
                positions = (cache.index - cache.start)[:, None]  # [B, 1]: each row's own position
                logits, cache = model(state.last[:, None], positions, cache=cache)
                token, done = next_tokens(logits[:, 0], state.key, state.count, state.done, state.sampling)
                tokens = jax.lax.dynamic_update_slice(state.tokens, token[:, None], (jnp.int32(0), state.count))
                return cache, state._replace(tokens=tokens, last=token, done=done, count=state.count + 1)

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
        eos_id: int | None | Literal["tokenizer"] = "tokenizer",
    ) -> list[Completion]:
        """New tokens for each prompt (token ids, normally starting with BOS). A row stops at `eos_id`:
        by default the tokenizer's (`self.eos_id`); None never stops early."""
        eos_id = self.eos_id if isinstance(eos_id, str) else eos_id
        tokens, start, is_padding, cache_len, max_new = self.prepare(prompts, max_new_tokens)
        prefill, decode = self.compiled()
        with jax.set_mesh(self.mesh):
            rows, whole, put = self._sharding("act_batch"), NamedSharding(self.mesh, P()), inference.put_global
            key = put(np.asarray(jax.random.PRNGKey(seed)), whole)
            settings = SamplingArrays(*[put(x, whole) for x in SamplingArrays.of(sampling, eos_id, self.pad_id)])
            cache, state = prefill(self.params, put(tokens, self._sharding("act_batch", None)), put(start, rows),
                                   put(is_padding, rows), key, settings, cache_len, max_new)
            for n in range(1, max_new):
                if n % DONE_CHECK_EVERY == 0 and bool(np.all(jax.device_get(state.done))):
                    break
                cache, state = decode(self.params, cache, state)
            new = np.asarray(jax.device_get(state.tokens))
        out = []
        for row, prompt in enumerate(prompts):
            ids = new[row].tolist()
            reason = "length"
            if eos_id is not None and eos_id in ids:
                ids, reason = ids[: ids.index(eos_id)], "eos"
            out.append(Completion(prompt_ids=list(prompt), ids=ids, finish_reason=reason))
        return out

    def generate(self, prompts: Sequence[str], **kwargs) -> list[Completion]:
        """`generate_ids` for text prompts: each is encoded with BOS in front, each completion decoded."""
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer; use generate_ids")
        ids = self.tokenizer.encode(list(prompts), add_bos=True, add_eos=False)
        completions = self.generate_ids(ids, **kwargs)
        for completion, prompt in zip(completions, prompts):
            completion.prompt, completion.text = prompt, self.tokenizer.decode(completion.ids)
        return completions


def load(run_dir, *, step: int | None = None, dtype: str | None = None, param_dtype: str | None = None,
         devices=None) -> Generator:
    """A Generator for checkpoint `step` (default: the newest) of a run directory."""
    return Generator.from_run(inference.load_run(run_dir, step=step, dtype=dtype, param_dtype=param_dtype,
                                                 devices=devices))


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `_main`, its errors, interrupts and environment failures as one line and an exit code."""
    return run_command(lambda: _main(argv), resume="run the same command again")


def make_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.generate` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.generate", description=__doc__.split("\n\n")[0])
    parser.add_path("--run_dir", kind="dir", io="in", required=True,
                    help="a training run's directory (run.output_dir/run.name)")
    parser.add_number("--step", kind=int, minimum=0, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    parser.add_path("--prompts_file", kind="file", io="in", help="a file with one prompt per line (adds to --prompt)")
    parser.add_number("--num_samples", kind=int, minimum=1, default=1, help="completions per prompt")
    parser.add_number("--max_new_tokens", kind=int, minimum=1, default=128)
    parser.add_number("--temperature", minimum=0, allowed="0 (greedy) or a positive number", default=0.8,
                      help="0 = greedy")
    parser.add_number("--top_k", kind=int, minimum=0, allowed="0 (off) or a positive number of tokens", default=0,
                      help="0 = off")
    parser.add_number("--top_p", above=0, maximum=1, allowed="a probability in (0, 1]; 1 is off", default=1.0,
                      help="1 = off")
    parser.add_number("--seed", kind=int, minimum=0, default=0)
    parser.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the run's model.dtype)")
    parser.add_argument("--param_dtype", default=None, help="cast parameters as they load, e.g. bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    return parser


def _main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        prompts = list(args.prompt)
        if args.prompts_file:
            try:
                with open(args.prompts_file, encoding="utf-8") as f:
                    prompts += [line.rstrip("\n") for line in f if line.strip()]
            except OSError as e:
                raise UserError(f"--prompts_file={args.prompts_file}: {e.strerror}") from None
            except UnicodeDecodeError as e:
                raise UserError(f"--prompts_file={args.prompts_file} is not UTF-8 text (byte {e.start}); give a text "
                                f"file") from None
        if not prompts:
            raise UserError("give at least one --prompt=TEXT (or --prompts_file=FILE)")
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        generator = load(args.run_dir, step=args.step, dtype=args.dtype, param_dtype=args.param_dtype)
        batch = [p for p in prompts for _ in range(args.num_samples)]
        completions = generator.generate(batch, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                         seed=args.seed, eos_id=None if args.ignore_eos else "tokenizer")
    except UserError as e:
        return report_error(e)
    for i, c in enumerate(completions):
        if args.json:
            print(json.dumps({"prompt": c.prompt, "completion": c.text, "tokens": len(c.ids),
                              "finish_reason": c.finish_reason}))
        else:
            print(f"--- sample {i + 1}/{len(completions)} ({len(c.ids)} tokens, {c.finish_reason})")
            print(f"{c.prompt}{c.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
