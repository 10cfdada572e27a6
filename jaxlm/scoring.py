"""Log-likelihoods of text under a loaded run: the compiled scorer, and continuations scored in batches.

`jaxlm.evaluate` scores a corpus (perplexity) and multiple-choice files with these; `jaxlm.lm_eval`
answers lm-evaluation-harness's `loglikelihood` requests with the same functions, so the two agree.

A continuation is split from its context as lm-evaluation-harness splits it (`encode_pair`): the
context's trailing whitespace moves to the continuation, the whole text is encoded and cut after the
context's own tokens (so a word that the context and continuation share at their border is tokenized as
in the whole text), and BOS leads where the tokenizer's own convention puts it (`Tokenizer.adds_bos`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd

from jaxlm import inference, steps
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError

LENGTH_BUCKET = 32  # rows are padded to a few lengths (`bucket_length`): few shapes, few compilations
Batch = dict[str, np.ndarray]


def make_scorer(run: inference.LoadedRun):
    """(params, batch) -> per-row float32 [B] sums: of the weighted token losses, of the weights, and of the
    weighted targets that are not the model's most likely next token (0: every one is its greedy choice).

    A batch holds int32 `inputs`, `targets`, `segment_ids` (0 = padding), `positions` and float32
    `weights` [B, T] (which targets count); the loss of a target is -log p(target | earlier tokens).
    """
    graphdef, rules = run.model_spec.graphdef, run.rules

    def score(params, batch):
        with spmd.logical_axis_rules(rules):
            model = nnx.merge(graphdef, params)
            logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])  # [B, T, V]
            weights = batch["weights"]
            losses = steps.token_losses(logits, batch["targets"], 0.0) * weights
            misses = (jnp.argmax(logits, axis=-1) != batch["targets"]) * weights
            return jnp.sum(losses, axis=1), jnp.sum(weights, axis=1), jnp.sum(misses, axis=1)

    rows = run.sharding(("act_batch", None))
    batch_sharding = {k: rows for k in ("inputs", "targets", "segment_ids", "positions", "weights")}
    out = run.sharding(())  # [B] sums, replicated: every process can read them
    return jax.jit(score, in_shardings=(run.param_shardings, batch_sharding), out_shardings=(out, out, out))


def put_batch(run: inference.LoadedRun, batch: Batch) -> dict[str, jax.Array]:
    return {k: run.put(v, ("act_batch", None)) for k, v in batch.items()}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_length(n: int, max_len: int, multiple: int = 1) -> int:
    """`n` rounded up to a multiple of LENGTH_BUCKET or, if larger, of an eighth of the power of two at or above
    it (multiples of 32 up to 256, then four lengths per doubling: under 25% padding), at most `max_len`; then
    up to a `multiple` (the mesh's: `LoadedRun.sequence_multiple`; the padding past `max_len` is never scored)."""
    step = max(LENGTH_BUCKET, 1 << max(0, (n - 1).bit_length() - 3))
    return round_up(min(round_up(n, step), max_len), multiple)


# ----------------------------------------------------------------------------- tokens of a request


def prefix_id(tok: Tokenizer) -> int:
    """What an empty context is: BOS, else EOS (lm-evaluation-harness's `prefix_token_id`)."""
    prefix = tok.bos_id if tok.bos_id >= 0 else tok.eos_id
    if prefix < 0:
        raise UserError("the tokenizer has neither BOS nor EOS, so a continuation without a context has nothing to "
                        "follow; give each request a context")
    return prefix


def encode(tok: Tokenizer, text: str, add_bos: bool) -> list[int]:
    """The ids of `text`, with BOS first if `add_bos` and the text does not already begin with BOS's text
    (a Hugging Face tokenizer encodes that as the token itself: transformers' rule in lm-evaluation-harness)."""
    if add_bos and tok.bos_id >= 0 and text.startswith(tok.token_text(tok.bos_id) or "\0"):
        add_bos = False
    return tok.encode([text], add_bos=add_bos, add_eos=False)[0]


def encode_pair(tok: Tokenizer, context: str, continuation: str, add_bos: bool,
                prefix: int | None = None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness splits a request (`TemplateLM._encode_pair`,
    and `TemplateLM.loglikelihood` for an empty context): the context's trailing whitespace moves to the
    front of the continuation; the whole text is encoded and cut after the context's own ids. A context
    without ids is `prefix` (default `prefix_id`), or the continuation's first id where that is the prefix."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = encode(tok, context, add_bos) if context else []
    if not context_ids:
        ids = tok.encode([continuation], add_bos=False, add_eos=False)[0]
        prefix = prefix_id(tok) if prefix is None else prefix
        return ([prefix], ids) if not ids or ids[0] != prefix else (ids[:1], ids[1:])
    whole = encode(tok, context + continuation, add_bos)
    return context_ids, whole[len(context_ids):]


def continuation_request(context_ids: Sequence[int], continuation_ids: Sequence[int],
                         max_len: int) -> tuple[np.ndarray, int]:
    """(tokens, continuation length) for `score_continuations`: the context's ids then the continuation's,
    their start cut off where they pass the model's context (`max_len` + 1 tokens: max_len targets)."""
    if not continuation_ids:
        raise UserError("a continuation has no tokens (an empty answer or choice); give each one some text")
    if len(continuation_ids) > max_len:
        raise UserError(f"a continuation is {len(continuation_ids)} tokens, longer than the model's context "
                        f"({max_len}); shorten it")
    return np.asarray([*context_ids, *continuation_ids][-(max_len + 1):], np.int32), len(continuation_ids)


# ----------------------------------------------------------------------------- scoring in batches


def score_continuations(run: inference.LoadedRun, requests: Sequence[tuple[np.ndarray, int]], *,
                        batch_size: int | None = None, scorer=None) -> list[tuple[float, bool]]:
    """For each (tokens, n): the log-likelihood of its last n tokens, each given all the tokens before it,
    and whether each of those n is the model's most likely next token (lm-evaluation-harness's
    `(logprob, is_greedy)`). Each request holds 2 to the model's context + 1 tokens (`continuation_request`).

    Requests are sorted by length and scored `batch_size` rows at a time (default: the run's
    data.global_batch_size, rounded up to the devices the batch splits over), each batch padded to a
    `bucket_length`; every batch is dispatched before any result is read.
    """
    max_len = run.model_cfg.max_seq_len
    for tokens, n in requests:
        if not 1 <= n < len(tokens) <= max_len + 1:
            raise ValueError(f"a request of {len(tokens)} tokens scoring the last {n}: give 1 <= n < tokens <= "
                             f"{max_len + 1}")
    order = sorted(range(len(requests)), key=lambda i: len(requests[i][0]))  # similar lengths share a batch
    batch_size = round_up(batch_size or run.cfg.data.global_batch_size, run.batch_shards)
    scorer = scorer or make_scorer(run)
    results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    pending = []
    with jax.set_mesh(run.mesh):
        for start in range(0, len(order), batch_size):
            group = order[start : start + batch_size]
            length = bucket_length(max(len(requests[i][0]) - 1 for i in group), max_len, run.sequence_multiple)
            batch = {k: np.zeros((batch_size, length), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
            batch["weights"] = np.zeros((batch_size, length), np.float32)
            for row, i in enumerate(group):
                seq, n = requests[i]
                t = len(seq) - 1
                batch["inputs"][row, :t], batch["targets"][row, :t] = seq[:-1], seq[1:]
                batch["segment_ids"][row, :t] = 1
                batch["positions"][row, :t] = np.arange(t)
                batch["weights"][row, t - n : t] = 1.0  # the continuation's tokens only
            loss_sums, _, misses = scorer(run.params, put_batch(run, batch))
            pending.append((group, loss_sums, misses))
        for group, loss_sums, misses in pending:
            losses = np.asarray(jax.device_get(loss_sums), np.float64)
            greedy = np.asarray(jax.device_get(misses)) == 0
            for row, i in enumerate(group):
                results[i] = (-float(losses[row]), bool(greedy[row]))
    return results
