"""Attention kernels behind one function: causal, grouped-query, packed documents.

`attend` is the only place that knows which kernel runs. Packed documents are given as segment ids
(0 = padding, 1.. = document within the row); a query attends to earlier keys of its own document.
Kernels: XLA's attention (the reference, any backend); causal blocks (`blocked_attention`: plain XLA
ops that skip the matmuls above the diagonal, with a FlashAttention-2 backward; `auto` on a CPU); cuDNN
flash attention (GPUs; on Hopper the
documents reach it in its packed layout, `cudnn_packed_attention`, elsewhere the document mask as a
dense bias); jax's Pallas (Triton) flash attention, which takes the segment ids
themselves (GPUs; interpreted elsewhere: correct and slow, for tests); jax's Pallas TPU splash attention,
with the segment ids as its own (TPUs; interpreted elsewhere). `benchmarks/attention.py`
checks and times them against each other.
A sequence split over the `context` mesh axis (context parallelism) attends across its devices by all-gather or
ring (`jaxlm.models.context_parallel`).
Decoding goes through `attend_cached` instead: keys and values of earlier tokens come from a
`KVCache`, always with XLA's attention.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import spmd

from jaxlm.errors import UserError
from jaxlm.mesh import constrain, logical_to_spec, trace_platform
from jaxlm.models import cudnn_batching
from jaxlm.models.context_parallel import context_attention, context_size, ring_diagonal_tile, ring_tile

log = logging.getLogger(__name__)



F32 = 4  # bytes of a float32


@dataclasses.dataclass(frozen=True)
class Kernel:
    """An attention kernel (config.model.attention), with what the memory planner (`jaxlm.memory`) asks of
    it. `s`: one micro-batch's per-device element counts (`memory.ActivationSizes`: q and kv [B, T, heads x
    head_dim], scores [B, N, T, T], head_stats [B, N, T]); `a`: the activations' bytes per element."""

    name: str
    # Whether it keeps the [T, S] softmax probabilities for the backward pass (XLA's attention), or only
    # the softmax statistics, recomputing the probabilities block by block (the flash kernels)
    keeps_scores: bool
    takes_mask: bool = True  # whether it reads the [T, T] mask the model builds (cuDNN takes segment ids)

    def forward_bytes(self, s, a: int) -> float:
        """What it keeps for its backward pass: the float32 softmax and the probabilities, or only the
        softmax statistics."""
        return (F32 + a) * s.scores if self.keeps_scores else F32 * s.head_stats

    def backward_bytes(self, s, a: int) -> float:
        """Its phase of a recomputed layer's backward: the recomputed scores and their gradients (float32
        logits and softmax, the probabilities, the gradients of both); a flash kernel's q, k, v, output,
        their gradients and the softmax statistics."""
        if self.keeps_scores:
            return (3 * F32 + a) * s.scores
        return 2 * a * (2 * s.q + 2 * s.kv) + F32 * s.head_stats

    def dots_saved(self, s, a: int, batched: bool) -> float:
        """What remat's dots policies save of it beyond the projections: XLA's batched matmuls' outputs
        (the float32 logits and the output; `batched`: the policy saves batched matmuls)."""
        return (F32 * s.scores + a * s.q) if self.keeps_scores and batched else 0.0

    def kept_in_one_program(self, s, dtype) -> float:
        """What XLA keeps beyond `forward_bytes` without remat when the layers are one program
        (`memory.one_program`)."""
        return 0.0

    def working_bytes(self, s, a: int) -> float:
        """What a layer's backward without remat holds beyond its activations' gradients (`memory`'s
        `WORKING_SET_NO_REMAT` x its forward): none for a kernel on one device's whole sequence."""
        return 0.0

    def shared_bytes(self, s, a: int) -> float:
        """What it keeps once for every layer, beyond the model's mask (`takes_mask`): none."""
        return 0.0


def _seq_len(s) -> int:
    """The sequence length the attention's scores span ([.., T, T] per head)."""
    return round(s.scores / s.head_stats)


class BlockedKernel(Kernel):
    """`blocked_attention`'s: a flash kernel made of XLA ops, one query block at a time."""

    def backward_bytes(self, s, a: int) -> float:
        """A flash kernel's, and one query block's scores, probabilities and gradients; float32 dk, dv."""
        seq_len = _seq_len(s)
        return (super().backward_bytes(s, a) + (3 * F32 + a) * s.scores * attention_block(seq_len) / seq_len
                + 2 * F32 * s.kv)

    def kept_in_one_program(self, s, dtype) -> float:
        """The causal blocks' backward pass computed ahead in the forward, as it needs nothing from the loss:
        each block's probabilities, recomputed from the saved log-sum-exp, in float32 (merged with the
        forward's scores) and in the values' dtype, and each block's keys and values up to it, transposed
        for the backward's matmuls. n blocks of queries against the keys up to them: (n + 1) / 2n of the
        [T, T] square, and n (n + 1) / 2 blocks of keys and of values. Read from XLA:CPU's buffer live
        ranges at the step's peak, where every layer holds them (benchmarks/BENCHMARKS.md). In float32
        compute the two are one buffer (measured; float16, run in float32, is counted as two: unmeasured)."""
        seq_len = _seq_len(s)
        n = -(-seq_len // attention_block(seq_len))
        # the values' dtype: the compute dtype, but float32 for float16, as `blocked_attention` runs it on a
        # CPU (where this term arises: the layers are one program by default; a GPU's float16 is counted alike)
        c = F32 if np.dtype(dtype) == np.float16 else np.dtype(dtype).itemsize
        probabilities = F32 + (0 if np.dtype(dtype) == np.float32 else c)  # float32: the one copy
        return probabilities * s.scores * (n + 1) / (2 * n) + c * s.kv * (n + 1)


class CudnnKernel(Kernel):
    """cuDNN's flash attention (`cudnn_attention`)."""

    def dots_saved(self, s, a: int, batched: bool) -> float:
        """Its fused forward, saved with the dots whatever the policy (`transformer._fused_attention_saveable`):
        the output and the softmax statistics."""
        return a * s.q + F32 * s.head_stats


class AllGatherKernel(Kernel):
    """Context parallelism's `allgather` (`context_parallel._allgather_local`): a device's queries [B, t, N, H]
    against the whole sequence's keys and values [B, T, K, H], all-gathered, by XLA's attention (`keeps_scores`:
    its [B, N, t, T] softmax and probabilities) or cuDNN's, with a [B, 1, t, T] mask. `s`: the context axis's
    `s.context` = c splits the sequence, T = c t. The mask is the same in every layer (the same positions and
    segment ids), one buffer that XLA makes once (`shared_bytes`; checked against the compiled step:
    benchmarks/BENCHMARKS.md, "Context parallelism on 8 H100s")."""

    def _gathered(self, s, a: int) -> float:
        return 2 * a * s.kv * s.context  # the whole sequence's keys and values, in the compute dtype

    def forward_bytes(self, s, a: int) -> float:
        """The kernel's own and the gathered keys and values (the backward's matmuls read them)."""
        return super().forward_bytes(s, a) + self._gathered(s, a)

    def shared_bytes(self, s, a: int) -> float:
        """The [B, 1, t, T] mask: one byte per element for XLA's attention, the additive bias cuDNN is given
        in the compute dtype."""
        return (1 if self.keeps_scores else a) * s.tokens * _seq_len(s)

    def backward_bytes(self, s, a: int) -> float:
        """The kernel's own, and the gathered keys and values with their float32 gradients before the
        reduce-scatter takes them home."""
        return super().backward_bytes(s, a) + self._gathered(s, a) * (1 + F32 / a)

    def working_bytes(self, s, a: int) -> float:
        """The gathered keys' and values' float32 gradients, whole until the reduce-scatter."""
        return self._gathered(s, a) * F32 / a

    def kept_in_one_program(self, s, dtype) -> float:
        """XLA's attention, its backward's probabilities in the compute dtype computed ahead in the forward when
        the layers are one program (XLA:CPU's buffers; tests/test_plan.py checks the plan against the compile)."""
        return np.dtype(dtype).itemsize * s.scores if self.keeps_scores else 0.0


class RingKernel(Kernel):
    """Context parallelism's `ring` (`context_parallel._ring`): a flash kernel made of XLA einsums, one [tile,
    tile] block of a device's queries against one device's chunk of keys and values at a time (a scan over a
    step's blocks), keeping for the backward only what a flash kernel keeps (q, k, v and the output, counted with
    the layer, and the log-sum-exp); its backward holds one block's working set (the steps run one at a time:
    `context_parallel._ring_fwd`). `s.context` = c splits the sequence, t = T / c."""

    def working_bytes(self, s, a: int) -> float:
        """One backward block: [B, N, tile, tile] float32 scores, probabilities and their gradients and the
        probabilities in the compute dtype (`context_parallel.ring_tile`: at most RING_TILE, a divisor of t/2);
        two chunks of keys and values (the one attended, the one arriving) and two of their float32 gradient
        sums; the queries' float32 gradient sum and the softmax statistics (the log-sum-exp and the output's dot
        with its gradient)."""
        t = s.scores / s.context / s.head_stats  # [B, N, t, t] / [B, N, t]
        tile = ring_tile(round(t))
        block = s.head_stats * tile * tile / t  # [B, N, tile, tile]
        return (3 * F32 + a) * block + 2 * 2 * (a + F32) * s.kv + F32 * s.q + 2 * F32 * s.head_stats

    def backward_bytes(self, s, a: int) -> float:
        """A flash kernel's, and one block's working set."""
        return super().backward_bytes(s, a) + self.working_bytes(s, a)


class CudnnRingKernel(RingKernel):
    """The ring with cuDNN's flash attention per block (`context_parallel._flash_ring`): what a flash kernel
    keeps, and a backward step's working set without any block of scores (cuDNN keeps its own on chip)."""

    def working_bytes(self, s, a: int) -> float:
        """A diagonal tile's document mask, an additive [B, 1, m, m] bias in the compute dtype (m: the diagonal
        step's tiles, `context_parallel.ring_diagonal_tile`); two chunks of keys and values (the one attended,
        the one arriving) and two of their float32 gradient sums; the queries' float32 gradient sum and the
        softmax statistics (the log-sum-exp and cuDNN's output-gradient dot)."""
        t = s.scores / s.context / s.head_stats  # [B, N, t, t] / [B, N, t]
        m = ring_diagonal_tile(round(t))
        return a * s.tokens * m * m / t + 2 * 2 * (a + F32) * s.kv + F32 * s.q + 2 * F32 * s.head_stats


# context parallelism's strategies (config.model.context_attention) by the kernel their blocks run with
CONTEXT_KERNELS = {("allgather", "xla"): AllGatherKernel("allgather (XLA)", keeps_scores=True, takes_mask=False),
                   ("allgather", "cudnn"): AllGatherKernel("allgather (cuDNN)", keeps_scores=False, takes_mask=False),
                   ("ring", "xla"): RingKernel("ring (XLA einsums)", keeps_scores=False, takes_mask=False),
                   ("ring", "cudnn"): CudnnRingKernel("ring (cuDNN blocks)", keeps_scores=False, takes_mask=False)}


def context_kernel(strategy: str, implementation: str) -> Kernel:
    """The kernel a sequence split over `context` attends with (`context_parallel.context_attention`): cuDNN's
    when `implementation` is cuDNN (allgather's attention, or the ring's flash kernel per block), else XLA's
    (allgather's attention, the ring's einsums in tiles)."""
    return CONTEXT_KERNELS[(strategy, "cudnn" if implementation == "cudnn" else "xla")]


KERNELS = {k.name: k for k in (Kernel("xla", keeps_scores=True), BlockedKernel("blocked", keeps_scores=False),
                               CudnnKernel("cudnn", keeps_scores=False, takes_mask=False),
                               Kernel("pallas", keeps_scores=False), Kernel("splash", keeps_scores=False))}
IMPLEMENTATIONS = tuple(KERNELS)


def cudnn_unsupported_reason(dtype, head_dim: int) -> str | None:
    """Why cuDNN flash attention cannot run this shape and dtype, or None when it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it needs bfloat16 or float16 compute, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 128:
        return f"it needs a head_dim that is a multiple of 8 and at most 128, not {head_dim}"
    return None


def select_implementation(requested: str, platform: str | None = None, *, dtype=jnp.bfloat16, head_dim: int = 64,
                          log_choice: bool = True) -> str:
    """Resolve 'auto' for the backend, dtype and head size: the one place that decides what 'auto'
    means. The choice and any fallback are logged (unless `log_choice` is false: the planner).

    An explicit kernel the backend cannot run is a config error (one clear line), never a silent swap.
    'auto' never picks Pallas (not yet measured against cuDNN on a GPU); on a TPU it picks splash attention.
    Pallas off a GPU, and splash off a TPU, run interpreted (correct and slow: for tests).
    """
    platform = platform or jax.default_backend()
    if requested not in ("auto", *IMPLEMENTATIONS):
        raise UserError(f"config.model.attention={requested!r}: use one of auto, {', '.join(IMPLEMENTATIONS)}")
    reason = "the backend is not a GPU" if platform != "gpu" else cudnn_unsupported_reason(dtype, head_dim)
    if requested == "cudnn" and reason:
        raise UserError(f"config.model.attention='cudnn' cannot run here: {reason}; use 'auto' or 'xla'")
    # off a GPU, the causal blocks (measured on CPUs; on a GPU without cuDNN XLA's attention stays: unmeasured);
    # on a TPU, the Pallas TPU kernel made for it
    fallback = {"cpu": "blocked", "tpu": "splash"}.get(platform, "xla")
    chosen = requested if requested != "auto" else (fallback if reason else "cudnn")
    home = {"pallas": "gpu", "splash": "tpu"}.get(chosen, platform)
    if home != platform and log_choice:
        log.warning("attention: %r on %s runs the kernel interpreted: correct, and far slower than 'xla'", chosen,
                    platform)
    if requested == "auto" and log_choice:
        why = f" (cuDNN not used: {reason})" if reason and platform == "gpu" else ""
        (log.warning if why else log.info)("attention: 'auto' chose %r on %s%s", chosen, platform, why)
    return chosen


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids -> [B, 1, T, T] bool: True where query and key are in the same document."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]


def packed_fits(segment_ids: jax.Array | np.ndarray, max_segments: int) -> jax.Array | np.bool_:
    """Whether every row of [B, T] segment ids has at most `max_segments` runs of equal ids (what the
    packed layout of `packed_segments` can express): a bool scalar, without building the layout. A
    NumPy array (a batch still on the host, `jaxlm.train_setup.TrainSetup.attention_choice`) is
    checked with NumPy."""
    xp = np if isinstance(segment_ids, np.ndarray) else jnp
    starts = segment_ids[:, 1:] != segment_ids[:, :-1]
    return xp.all(1 + xp.sum(starts, axis=1) <= max_segments)


def packed_segments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Segment ids [B, T] -> cuDNN's packed ("ragged") layout: (seqlens [B, M], offsets [B, M + 1], fits).

    Each maximal run of equal ids in a row is one segment, padding runs included, so that every token
    lies in exactly one segment: offsets[b, i] is where row b's i-th run starts and seqlens[b, i] its
    length; -1 fills the rest (the layout of `jax._src.cudnn.fused_attention_stablehlo`). `fits` is
    False when some row has more than M runs, which the layout cannot express; the caller must then
    fall back to a mask. Attention restricted to each segment, causal from the segment's start, is
    exactly the document mask and the causal mask together (tested on CPU).
    """
    b, t = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [B, T]: the run each token is in
    rows = jnp.arange(b)[:, None]
    slot = jnp.where(starts & (run < max_segments), run, max_segments + 1)  # out of range: dropped
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    offsets = jnp.full((b, max_segments + 1), -1, jnp.int32).at[rows, slot].set(positions, mode="drop")
    lengths = jnp.zeros((b, max_segments), jnp.int32).at[rows, run].add(1, mode="drop")
    seqlens = jnp.where(lengths > 0, lengths, -1)
    return seqlens, offsets, jnp.all(run[:, -1] < max_segments)


def packed_layout_supported(capability: str | None) -> bool:
    """Whether jax's cuDNN attention takes the packed layout on a GPU of this compute capability
    (jax requires Hopper, 9.0, or newer)."""
    return capability is not None and tuple(int(x) for x in capability.split(".")) >= (9, 0)


def attend(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H], K divides N (grouped-query)
    v: jax.Array,  # [B, S, K, H]
    *,
    segment_ids: jax.Array | None = None,  # [B, T]
    implementation: str = "xla",
    max_segments: int = 0,
    context_strategy: str = "allgather",
    context_layout: str = "contiguous",
) -> jax.Array:  # [B, T, N, H]
    """Causal softmax attention; with segment ids, no attention across documents.

    `max_segments` > 0 (cuDNN only, GPUs of compute capability 9.0+): packed documents go to cuDNN in its
    packed layout, at most that many segments per row (`cudnn_packed_attention`), instead of as a mask.
    Under a mesh whose `context` axis splits the sequence, `context_parallel.context_attention` instead, by
    `context_strategy` on q, k and v in `context_layout`'s order."""
    if context_size() > 1:
        return context_attention(q, k, v, segment_ids, implementation, context_strategy, context_layout)
    if implementation == "pallas":
        return pallas_attention(q, k, v, segment_ids)
    if implementation == "splash":
        return splash_attention(q, k, v, segment_ids)
    if implementation == "blocked":
        return blocked_attention(q, k, v, segment_ids)
    if implementation == "cudnn":
        cudnn_batching.install()  # jax's own batching rules fail under the data-replica and stage vmaps
        if segment_ids is not None and max_segments > 0:
            return cudnn_packed_attention(q, k, v, segment_ids, max_segments)
    # The mask follows the batch, never the sequence: made whole where the attention runs.
    mask = None if segment_ids is None else constrain(document_mask(segment_ids), ("act_batch", None, None, None))
    if q.dtype == jnp.float16 and implementation == "xla" and trace_platform() == "cpu":
        # XLA:CPU has no float16 dot with float32 accumulation (jax's XLA attention asks for one): on a CPU,
        # float16 attention runs in float32 and rounds its output to float16
        out = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                           mask=mask, is_causal=True, implementation=implementation)
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


_WHOLE_BATCH_SEGMENTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("whole_batch_segments",
                                                                                          default=None)
_PACKED_KERNEL: contextvars.ContextVar[bool | None] = contextvars.ContextVar("packed_kernel", default=None)


@contextlib.contextmanager
def packed_kernel(choice: bool | None):
    """While tracing, which kernel `cudnn_packed_attention` runs: True the packed layout, False the
    masked kernel, each alone; None (the default) both, behind a `lax.cond` on the rows. A GPU reads a
    conditional's predicate back to the host and waits for the device to reach it (XLA's
    `ConditionalThunk`: a copy, then `BlockHostUntilDone`), once per layer and direction in every
    micro-batch, so a caller that knows the batch (the trainer: `TrainSetup.attention_choice`, on the
    host's copy of the segment ids) compiles the one kernel it needs. A choice of True on rows that do
    not fit is wrong: the caller's to check."""
    token = _PACKED_KERNEL.set(choice)
    try:
        yield
    finally:
        _PACKED_KERNEL.reset(token)


@contextlib.contextmanager
def whole_batch_segments(segment_ids: jax.Array):
    """While tracing a model call vmapped over slices of a batch (`jaxlm.steps`' data replicas, the
    pipeline's stages), the segment ids of all the slices ([..., T], outside the vmap):
    `cudnn_packed_attention` chooses the packed or masked kernel on them, once for all slices. The
    outermost call wins (its rows include an inner one's)."""
    if _WHOLE_BATCH_SEGMENTS.get() is not None:
        yield
        return
    token = _WHOLE_BATCH_SEGMENTS.set(segment_ids)
    try:
        yield
    finally:
        _WHOLE_BATCH_SEGMENTS.reset(token)


def cudnn_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                           max_segments: int) -> jax.Array:
    """cuDNN flash attention with the documents in its packed ("ragged") layout: each row's runs of
    equal segment ids (`packed_segments`, at most `max_segments`) are attended separately, causal from
    their start, with no [B, 1, T, T] mask for the kernel to read: faster than the masked kernel
    (benchmarks/BENCHMARKS.md). A batch with a row of more runs than `max_segments` takes the masked
    kernel instead (`lax.cond`, the same branch on every shard: same result, slower), so the bound is a
    speed setting, never a correctness one; under `packed_kernel` the caller has made that choice on the
    host and only its kernel is compiled. Uses jax's cuDNN wrapper directly (`jax.nn.dot_product_attention`
    does not take segment offsets); jax allows the layout on compute capability 9.0+ only. Under a mesh it
    runs per shard (`per_shard`): partitioned by XLA, the conditional gathered the whole batch onto every
    device (benchmarks/BENCHMARKS.md)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # local import: private JAX API, only needed on GPUs

    choice = _PACKED_KERNEL.get()
    # Whether every row of the whole batch fits (all shards take the same branch), as a per-row array so
    # that it reaches each shard with its rows. Under a vmap (the data replicas), decided on all the
    # replicas' rows (`whole_batch_segments`): a predicate that differs per vmapped slice would turn the
    # conditional into a select that runs both kernels.
    whole = _WHOLE_BATCH_SEGMENTS.get()
    rows = segment_ids if whole is None else whole.reshape(-1, whole.shape[-1])
    fits = jnp.broadcast_to(packed_fits(rows, max_segments), segment_ids.shape[:1])

    def local(q, k, v, segment_ids, fits):
        def packed(q, k, v, segment_ids):
            seqlens, offsets, _ = packed_segments(segment_ids, max_segments)
            return cudnn.dot_product_attention(q, k, v, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets,
                                               kv_offsets=offsets, scale=1.0 / math.sqrt(q.shape[-1]),
                                               mask_type=cudnn.MaskType.PADDING_CAUSAL)

        def masked(q, k, v, segment_ids):
            return jax.nn.dot_product_attention(q, k, v, mask=document_mask(segment_ids), is_causal=True,
                                                implementation="cudnn")

        if choice is not None:  # decided by the caller, on the host (`packed_kernel`): no conditional
            return (packed if choice else masked)(q, k, v, segment_ids)
        # the true branch is the one the roofline counts (jaxlm.hlo: the expected case)
        return jax.lax.cond(fits[0], packed, masked, q, k, v, segment_ids)

    return per_shard(local, q, k, v, segment_ids, fits)


def per_shard(fn, q: jax.Array, k: jax.Array, v: jax.Array, *rows: jax.Array) -> jax.Array:
    """`fn(q, k, v, *rows)` on each device's shard (shard_map) under the model's mesh, batch and heads
    split as the activations are, the sequence whole; `rows` are [B, ...] per-row arrays (segment ids,
    offsets), split with the batch. Without a mesh, `fn` itself."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return fn(q, k, v, *rows)
    q_spec = logical_to_spec(("act_batch", None, "act_heads", None), rules)
    kv_spec = logical_to_spec(("act_batch", None, "act_kv_heads", None), rules)
    row_specs = tuple(logical_to_spec(("act_batch",) + (None,) * (r.ndim - 1), rules) for r in rows)
    return jax.shard_map(fn, in_specs=(q_spec, kv_spec, kv_spec, *row_specs), out_specs=q_spec,
                         check_vma=False)(q, k, v, *rows)


PALLAS_BLOCK = 16  # the smallest block Triton's matmuls take: sequences must be a multiple of it


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """jax's Pallas (Triton) flash attention, causal, with segment ids; key/value heads repeated per
    query group. Under a mesh it runs per shard (`per_shard`), the sequence whole, as for the other kernels."""
    # local import: experimental JAX API (Pallas, Triton), only needed on GPUs
    from jax.experimental.pallas.ops.gpu import attention as kernel

    b, t, n, h = q.shape
    if t % PALLAS_BLOCK:
        raise UserError(f"config.model.attention='pallas' needs a sequence length that is a multiple of "
                        f"{PALLAS_BLOCK}, not {t}; change data.seq_len or use 'cudnn' or 'xla'")
    interpret = trace_platform() != "gpu"
    block = math.gcd(t, 32 if interpret else 128)  # jax's defaults on a GPU: 128 forward, 32 backward
    small = math.gcd(t, 32)
    blocks = kernel.BlockSizes(block_q=block, block_k=block, block_q_dkv=small, block_kv_dkv=small,
                               block_q_dq=small, block_kv_dq=small)
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)

    def local(q, k, v, segment_ids):
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        return kernel.mha(q, k, v, segment_ids, sm_scale=1.0 / math.sqrt(h), causal=True, block_sizes=blocks,
                          interpret=interpret)

    return per_shard(local, q, k, v, segment_ids)


SPLASH_LANES = 128  # splash's blocks are multiples of a TPU vector register's 128 lanes
SPLASH_BLOCK = 512  # the largest block splash attention takes here


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """JAX's Pallas TPU splash attention, causal, with the segment ids as its own (query and key ids both);
    grouped-query heads taken as they are (query head n reads key/value head n // group, as here). Blocks
    that the causal mask empties are skipped. A sequence that is not a multiple of 128 is padded at its end
    with a document of its own, which no real query can see (it comes after all of them) and which is cut
    from the output. Under a mesh it runs per shard (`per_shard`), the sequence whole; off a TPU, interpreted."""
    # local import: experimental JAX API (Pallas TPU), only needed on TPUs
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    b, t, n, h = q.shape
    padded = -(-t // SPLASH_LANES) * SPLASH_LANES
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    if padded != t:
        pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - t)), constant_values=-1)
    interpret = trace_platform() != "tpu"
    scale = 1.0 / math.sqrt(h)

    def local(q, k, v, segment_ids):
        kernel = _splash_kernel(padded, q.shape[2], interpret)
        q = (q.astype(jnp.float32) * scale).astype(q.dtype)  # splash takes the scores unscaled

        def row(q, k, v, ids):  # one sequence: [T, heads, H] -> splash's [heads, T, H]
            out = kernel(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1),
                         segment_ids=splash.SegmentIds(q=ids, kv=ids))
            return out.swapaxes(0, 1)

        return jax.vmap(row)(q, k, v, segment_ids)

    out = per_shard(local, q, k, v, segment_ids)
    return out[:, :t] if padded != t else out


def _splash_kernel(seq_len: int, heads: int, interpret: bool):
    """Splash attention for `heads` query heads of causal self-attention over `seq_len` positions, with
    square blocks of the largest size up to SPLASH_BLOCK that divides the sequence, forward and backward.
    The backward pass is one kernel (splash's fused backward: dq, dk and dv from one visit of each block, the
    scores recomputed once), not a dq kernel and a dkv kernel that each recompute them. Made anew in each
    trace: its block tables are arrays of the trace that makes them (made concrete, they would need a
    device, which a compile-only TPU program has none of)."""
    # local import: experimental JAX API (Pallas TPU), only needed for splash attention
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    block = math.gcd(seq_len, SPLASH_BLOCK)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    mask = masks.MultiHeadMask([masks.CausalMask((seq_len, seq_len))] * heads)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


class KVCache(NamedTuple):
    """Keys and values of every layer, for decoding one token at a time after a prefill.

    Rows are left-padded: row b's tokens fill slots [start[b], index), so every row writes its next
    token to the same slot, `index`. Plain arrays in and out of the compiled prefill and decode
    functions (no state hidden in the model); `layer` is set by the decoder for each block.
    """

    k: jax.Array  # [L, B, S, K, H] in the compute dtype, 16-bit floats as their bits (`cache_dtype`)
    v: jax.Array  # [L, B, S, K, H]
    index: jax.Array  # int32 []: the slot the next token (or the first of a chunk) is written to
    start: jax.Array  # int32 [B]: each row's first slot; slots before it are padding, never attended to
    layer: jax.Array | int = 0  # the block whose keys and values an attention reads and writes


# Logical names of a cache's axes [L, B, S, K, H]: rows and heads sharded like the activations (batch
# over data x fsdp x expert, heads over tensor); the slots never are (each step writes one at a moving index).
CACHE_AXES = (None, "act_batch", None, "act_kv_heads", None)


def cache_dtype(dtype) -> jnp.dtype:
    """How a cache holds keys and values of `dtype`: 16-bit floats as uint16 bit patterns.

    XLA:CPU updates a bfloat16 buffer by converting all of it to float32 and back: writing one token
    into each layer of a 12-layer, 32-row, 512-slot cache took 0.4 s, against 0.3 ms as uint16
    (measured). Integers are updated in place on every backend, and the bitcasts around them are free.
    """
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 else dtype


def _bitcast(x: jax.Array, dtype) -> jax.Array:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Write this chunk's keys and values [B, T, K, H] into the cache at slots [index, index + T), then
    attend its queries [B, T, N, H] to the layer's filled slots: causal, each row from its `start`.

    XLA attention over the whole cache length, masked: this is the decode path (one query per row),
    where flash kernels do not pay.
    """
    zero = jnp.zeros((), jnp.int32)
    layer, index = jnp.asarray(cache.layer, jnp.int32), jnp.asarray(cache.index, jnp.int32)
    at = (layer, zero, index, zero, zero)
    k_all = constrain(jax.lax.dynamic_update_slice(cache.k, _bitcast(k, cache.k.dtype)[None], at), CACHE_AXES)
    v_all = constrain(jax.lax.dynamic_update_slice(cache.v, _bitcast(v, cache.v.dtype)[None], at), CACHE_AXES)
    keys = _bitcast(jax.lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False), k.dtype)  # [B, S, K, H]
    values = _bitcast(jax.lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False), v.dtype)
    query_slot = index + jnp.arange(q.shape[1])[None, :, None]  # [1, T, 1]
    key_slot = jnp.arange(keys.shape[1])[None, None, :]  # [1, 1, S]
    mask = (key_slot <= query_slot) & (key_slot >= cache.start[:, None, None])  # [B, T, S]
    mask = mask | (key_slot == query_slot)  # a padding query sees itself, so no row of the softmax is empty
    out = jax.nn.dot_product_attention(q, keys, values, mask=mask[:, None], implementation="xla")
    return out, cache._replace(k=k_all, v=v_all)


# ------------------------------------------------------------------------------------------ causal blocks
def attention_block(seq_len: int) -> int:
    """The query block of `blocked_attention` for a sequence length: at most 8 blocks of at least 64 tokens
    (32 up to 64 tokens, one block up to 32). Each block is its own matmuls in the program, so more blocks
    skip more of the square (n blocks compute (n + 1) / 2n of it) but take longer to compile: on a 2-core
    CPU blocks of 32 and 64 ran equally fast at 256 tokens, 64 was 12% faster than 128 at 1024 tokens,
    and the tiny recipe's step (128 tokens) compiled in 4.5-5.3 s with 4 blocks, 3.6-3.9 s with 2, 3.2-3.4
    s under XLA's attention (benchmarks/BENCHMARKS.md)."""
    if seq_len <= 32:
        return seq_len
    if seq_len <= 64:
        return 32
    return max(64, -(-seq_len // 8))


def _block_scores(q, k, segment_ids, start: int, stop: int, scale: float) -> jax.Array:
    """Scaled float32 scores of queries [start, stop) against keys [0, stop), those not allowed (later
    keys, other documents) at float32's lowest: [B, K, G, stop - start, stop]."""
    s = jnp.einsum("btkgh,bskh->bkgts", q[:, start:stop], k[:, :stop], preferred_element_type=jnp.float32) * scale
    allowed = jnp.arange(start, stop)[:, None] >= jnp.arange(stop)[None, :]
    if segment_ids is not None:
        same = segment_ids[:, start:stop, None] == segment_ids[:, None, :stop]
        allowed = allowed[None] & same
        allowed = allowed[:, None, None]
    return jnp.where(allowed, s, jnp.finfo(jnp.float32).min)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(q, k, v, segment_ids, block: int):
    return _blocked_fwd(q, k, v, segment_ids, block)[0]


def _blocked_fwd(q, k, v, segment_ids, block: int):
    t, h = q.shape[1], q.shape[-1]  # q: [B, T, K, G, H]
    scale = 1.0 / math.sqrt(h)
    outs, lses = [], []
    for start in range(0, t, block):
        stop = min(start + block, t)
        s = _block_scores(q, k, segment_ids, start, stop, scale)
        top = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - top)
        total = jnp.sum(e, axis=-1, keepdims=True)
        p = (e / total).astype(v.dtype)
        o = jnp.einsum("bkgts,bskh->btkgh", p, v[:, :stop], preferred_element_type=jnp.float32)
        outs.append(o.astype(q.dtype))
        lses.append((top + jnp.log(total))[..., 0])  # [B, K, G, stop - start]
    out, lse = jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=-1)
    return out, (q, k, v, segment_ids, out, lse)


def _blocked_bwd(block: int, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    t, h = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(h)
    # FlashAttention-2's backward, a query block at a time against the keys up to it: the probabilities
    # recomputed from the saved log-sum-exp, every matmul with low-precision operands summed in float32
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 3, 1)  # [B,K,G,T]
    dq_blocks = []
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for start in range(0, t, block):
        stop = min(start + block, t)
        s = _block_scores(q, k, segment_ids, start, stop, scale)
        p = jnp.exp(s - lse[..., start:stop, None])
        do = d_out[:, start:stop]
        dv = dv.at[:, :stop].add(jnp.einsum("bkgts,btkgh->bskh", p.astype(v.dtype), do,
                                            preferred_element_type=jnp.float32))
        dp = jnp.einsum("btkgh,bskh->bkgts", do, v[:, :stop], preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., start:stop, None]) * scale).astype(q.dtype)
        dq_blocks.append(jnp.einsum("bkgts,bskh->btkgh", ds, k[:, :stop], preferred_element_type=jnp.float32))
        dk = dk.at[:, :stop].add(jnp.einsum("bkgts,btkgh->bskh", ds, q[:, start:stop],
                                            preferred_element_type=jnp.float32))
    dq = jnp.concatenate(dq_blocks, axis=1).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                      block: int = 0) -> jax.Array:
    """Causal attention a block of queries at a time, each against only the keys at or before it: the
    matmuls above the diagonal blocks are skipped (at 256 tokens and blocks of 64, 5/8 of the full square
    is computed, against all of it under a mask), softmax in float32, every matmul with the inputs'
    (low-precision) operands summed in float32, and a custom backward (FlashAttention-2's, the
    probabilities recomputed from the saved log-sum-exp) whose matmuls take low-precision operands too:
    JAX's own gradient of a float32-result dot takes float32 cotangents, which XLA:CPU runs as float32
    dots. Plain XLA ops, any backend; `auto`'s choice on a CPU (`benchmarks/attention.py` times it
    against XLA's attention). `block` 0: `attention_block(T)`."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    if k.shape[1] != t:
        raise ValueError(f"blocked_attention: keys ({k.shape[1]}) and queries ({t}) must have one length")
    dtype = q.dtype
    if dtype == jnp.float16 and trace_platform() == "cpu":  # no float16 dot with float32 sums on XLA:CPU
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    out = _blocked(q.reshape(b, t, kv, n // kv, h), k, v, segment_ids, block or attention_block(t))
    return out.reshape(b, t, n, h).astype(dtype)


def reference_attention(q, k, v, *, segment_ids=None) -> jax.Array:
    """Plain float32 einsum attention, the reference the kernels are tested against."""
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    k = jnp.repeat(k, groups, axis=2).astype(jnp.float32)
    v = jnp.repeat(v, groups, axis=2).astype(jnp.float32)
    scores = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k) / jnp.sqrt(h)
    allowed = jnp.tril(jnp.ones((t, k.shape[1]), bool))[None, None]
    if segment_ids is not None:
        allowed = allowed & document_mask(segment_ids)
    scores = jnp.where(allowed, scores, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v).astype(q.dtype)
