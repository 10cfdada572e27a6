"""Context parallelism: a sequence split over the `context` mesh axis, and attention across the split.

Under a mesh whose `context` axis splits the activations' sequence (rule `act_seq`), each of the c devices
holds T/c of every row's positions through the whole model; only attention needs the rest of the sequence.
Two things are chosen by the model's config:

Layout (`model.context_layout`): which positions each device holds.
  contiguous  device i holds positions [i T/c, (i + 1) T/c). Under the causal mask the last device's queries
              see the whole sequence and the first's only their own chunk: c times the work, at c = 8 the
              last device does 15 times the first's (`causal_work`).
  balanced    the zig-zag assignment: the sequence cut into 2c chunks of T/2c, device i holding chunks i and
              2c - 1 - i, one early and one late, so every device's queries see the same number of keys
              (`causal_work`: equal). The model reorders its inputs (tokens, positions, segment ids) into
              this order at its entry and its final hidden states back at its exit (`to_layout`,
              `from_layout`: two collective permutes each, a chunk's worth per device), so the logits, the
              loss and everything a caller sees are in the sequence's own order; RoPE takes each token's
              own position, carried with it.

Strategy (`model.context_attention`): how queries reach the keys held by other devices.
  allgather   every device all-gathers the keys, values and segment ids of the whole sequence and attends
              its queries to them (XLA's attention with the mask at the tokens' global positions). Memory:
              the whole sequence's keys and values, [t, T] scores per head; traffic per layer (c - 1)/c of
              the sequence's keys and values forward, as much reduce-scattered backward.
  ring        keys, values and segment ids passed around the axis in c - 1 steps (collective permutes),
              each step's block of scores folded into the output by an online softmax; a custom backward
              passes them around again with their gradients (FlashAttention-2's recomputation from the
              saved log-sum-exp). Two kernels for the blocks, by `model.attention`:
              - cudnn (GPUs): each step's block is one call of cuDNN's flash attention, which returns its
                rows' log-sum-exp; the steps' outputs are combined by their log-sum-exps, and the backward
                calls cuDNN's backward on each block with the whole attention's output and log-sum-exp
                (`_flash_ring`: the diagonal block causal with the documents as a bias, in tiles of at most
                RING_DIAGONAL, every other block a padding mask over the one document its queries and keys
                can share). Memory: two chunks' keys and values and one diagonal tile's [m, m] bias.
              - any other (CPUs): XLA's einsums, in square blocks of at most RING_TILE queries by as many
                keys (a scan over the blocks), skipping those the causal mask empties: on the diagonal step
                those above the diagonal, and under the balanced layout half of every other step's square
                (the same work on every device). Memory: two chunks' keys and values and one block's
                float32 scores at a time.
              The steps run one after another. About four times allgather's traffic (the chunks pass again
              in the backward, their gradient sums in float32), in pieces that XLA overlaps with the blocks
              (benchmarks/BENCHMARKS.md, "Context parallelism on 8 H100s"). The cuDNN blocks' numerics are
              checked on CPUs through their emulation (`XlaBlocks`: the ring built on it equals plain
              attention), by compiling for H100s, and on a GPU by benchmarks/ring_blocks.py (cuDNN's blocks
              against the emulation); the ring has not yet run across GPUs.

Packed documents: the segment ids travel with their tokens (reordered with them, gathered or passed around
with the keys), and a query attends to a key only when both ids are equal and the key's global position is
not after the query's, under every layout and strategy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import spmd
from jax.sharding import PartitionSpec as P

from jaxlm.errors import UserError
from jaxlm.mesh import logical_to_spec, mesh_axes_of, trace_platform

CONTEXT_AXIS = "context"  # the mesh axis that splits every activation's sequence (rule act_seq)
STRATEGIES = ("allgather", "ring")  # config.model.context_attention
LAYOUTS = ("balanced", "contiguous")  # config.model.context_layout
_LOWEST = -1e30  # a masked score: finite, so that a row with no key yet has exp(m - m_new) = 0, never NaN


def context_size() -> int:
    """How many devices split the sequence (the `context` mesh axis, when the rules in force map
    `act_seq` onto it); 1 outside a mesh."""
    if CONTEXT_AXIS not in mesh_axes_of("act_seq"):
        return 1
    return jax.sharding.get_abstract_mesh().shape.get(CONTEXT_AXIS, 1)


def chunk_positions(index, context: int, local: int, layout: str) -> jax.Array:
    """The global sequence positions [local] of the tokens device `index` (an int or a traced index) holds
    under `layout`, in the order it holds them."""
    steps = jnp.arange(local, dtype=jnp.int32)
    if layout == "contiguous" or context == 1:
        return index * local + steps
    half = local // 2
    late = 2 * context - 1 - index
    return jnp.where(steps < half, index * half + steps, late * half + steps - half)


def layout_order(seq_len: int, context: int, layout: str) -> np.ndarray:
    """The sequence's positions in the order the devices hold them, device 0's first [seq_len] (NumPy)."""
    if layout == "contiguous" or context == 1:
        return np.arange(seq_len)
    half = seq_len // (2 * context)
    chunks = np.arange(seq_len).reshape(2 * context, half)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)])


def causal_work(seq_len: int, context: int, layout: str) -> np.ndarray:
    """Each device's attention work under the causal mask [context]: the (query, key) pairs its queries
    attend to (a query at position p sees p + 1 keys)."""
    order = layout_order(seq_len, context, layout).reshape(context, -1)
    return (order + 1).sum(axis=1)


# ----------------------------------------------------------------------------- the layout's reordering
def _seq_spec(*rest: str | None) -> P:
    """[B, T, *rest]: rows split as the activations' batch, the sequence over `context` alone, the other
    dimensions by their logical names (None: whole)."""
    s = list(logical_to_spec(("act_batch", None, *rest), spmd.get_logical_axis_rules()))
    s[1] = CONTEXT_AXIS
    return P(*s)


def _zigzag(x: jax.Array, context: int, inverse: bool) -> jax.Array:
    """Inside a shard_map over `context`: a device's [B, t, ...] from the contiguous layout (chunks 2i and
    2i + 1 of 2c) to the balanced one (chunks i and 2c - 1 - i), or back (`inverse`), by two collective
    permutes of half a chunk each."""
    c, half = context, x.shape[1] // 2
    first, second = x[:, :half], x[:, half:]
    i = jax.lax.axis_index(CONTEXT_AXIS)
    even = i % 2 == 0

    def holder(k):  # the device that holds chunk k in the balanced layout
        return k if k < c else 2 * c - 1 - k

    if not inverse:  # device j sends chunk 2j and chunk 2j + 1 to their holders
        got_even = jax.lax.ppermute(first, CONTEXT_AXIS, [(j, holder(2 * j)) for j in range(c)])
        got_odd = jax.lax.ppermute(second, CONTEXT_AXIS, [(j, holder(2 * j + 1)) for j in range(c)])
        # device i's early chunk i is the even one when i is even
        early, late = jnp.where(even, got_even, got_odd), jnp.where(even, got_odd, got_even)
        return jnp.concatenate([early, late], axis=1)
    # back: chunk k goes to device k // 2, the even chunk first
    chunk_even, chunk_odd = jnp.where(even, first, second), jnp.where(even, second, first)
    even_of = [j if j % 2 == 0 else 2 * c - 1 - j for j in range(c)]  # the even chunk device j holds
    got_first = jax.lax.ppermute(chunk_even, CONTEXT_AXIS, [(j, even_of[j] // 2) for j in range(c)])
    got_second = jax.lax.ppermute(chunk_odd, CONTEXT_AXIS, [(j, (2 * c - 1 - even_of[j]) // 2) for j in range(c)])
    return jnp.concatenate([got_first, got_second], axis=1)


def _reorder(x: jax.Array, layout: str, inverse: bool) -> jax.Array:
    context = context_size()
    if x is None or layout == "contiguous" or context == 1:
        return x
    if x.shape[1] % (2 * context):
        raise UserError(f"a sequence of {x.shape[1]} tokens does not split into the 2 x mesh.context={context} chunks "
                        f"of model.context_layout='balanced'; use a multiple of {2 * context} tokens, or "
                        "model.context_layout='contiguous'")
    spec = _seq_spec(*(None,) * (x.ndim - 2))
    return jax.shard_map(functools.partial(_zigzag, context=context, inverse=inverse), in_specs=(spec,),
                         out_specs=spec, check_vma=False)(x)


def to_layout(x: jax.Array | None, layout: str) -> jax.Array | None:
    """[B, T, ...] in the sequence's order -> in the order the context devices hold it (`layout`)."""
    return _reorder(x, layout, inverse=False)


def from_layout(x: jax.Array | None, layout: str) -> jax.Array | None:
    """The inverse of `to_layout`."""
    return _reorder(x, layout, inverse=True)


# --------------------------------------------------------------------------------------------- attention
def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, implementation: str,
                      strategy: str = "allgather", layout: str = "contiguous") -> jax.Array:
    """Causal attention over a sequence split over the `context` axis (module docstring), q [B, T, N, H], k
    and v [B, T, K, H] in `layout`'s order, each device's shard attended inside a shard_map: batch and heads
    split as the activations are, the sequence over `context`."""
    if implementation in ("pallas", "splash"):
        raise UserError(f"config.model.attention={implementation!r} with mesh.context > 1: not built (the "
                        "Pallas kernel takes whole sequences); use 'xla' or 'blocked'")
    context = context_size()
    q_spec, kv_spec, rows_spec = _seq_spec("act_heads", None), _seq_spec("act_kv_heads", None), _seq_spec()
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    if strategy == "ring":
        local = functools.partial(_ring_local, context=context, layout=layout, blocks=RING_BLOCKS.get(implementation))
    else:
        local = functools.partial(_allgather_local, context=context, layout=layout,
                                  kernel="cudnn" if implementation == "cudnn" else "xla")
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, rows_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v, segment_ids)


def _allgather_local(q, k, v, segment_ids, *, context: int, layout: str, kernel: str):
    """One device's queries [B, t, N, H] against the whole sequence's keys and values, all-gathered (their
    transposes, reduce-scatters, bring the keys' and values' gradients back to their chunks)."""
    t = q.shape[1]
    k = jax.lax.all_gather(k, CONTEXT_AXIS, axis=1, tiled=True)  # [B, T, K, H]: every device's chunk, in device order
    v = jax.lax.all_gather(v, CONTEXT_AXIS, axis=1, tiled=True)
    keys = jax.lax.all_gather(segment_ids, CONTEXT_AXIS, axis=1, tiled=True)  # [B, T]
    q_pos = chunk_positions(jax.lax.axis_index(CONTEXT_AXIS), context, t, layout)
    k_pos = jnp.asarray(layout_order(t * context, context, layout))
    allowed = q_pos[:, None] >= k_pos[None, :]  # [t, T]
    mask = (allowed[None] & (segment_ids[:, :, None] == keys[:, None, :]))[:, None]  # [B, 1, t, T]
    dtype = q.dtype
    if dtype == jnp.float16 and trace_platform() == "cpu":  # no float16 dot with float32 sums on XLA:CPU
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=kernel).astype(dtype)


def _ring_local(q, k, v, segment_ids, *, context: int, layout: str, blocks: RingBlocks | None = None):
    """One device's queries against every device's keys and values, passed around the ring: each step's blocks by
    `blocks`' flash kernel (`_flash_ring`), or without one by XLA's einsums in tiles (`_ring`)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    dtype = q.dtype
    if dtype == jnp.float16 and trace_platform() == "cpu":  # no float16 dot with float32 sums on XLA:CPU
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    if blocks is not None:
        return _flash_ring(q, k, v, segment_ids, context, layout, blocks).astype(dtype)
    out = _ring(q.reshape(b, t, kv, n // kv, h), k, v, segment_ids, context, layout)
    return out.reshape(b, t, n, h).astype(dtype)


RING_TILE = 1024  # the most queries, and keys, in one block of scores the ring computes at a time


def _tile_size(n: int, most: int) -> int:
    """The largest divisor of `n` that is at most `most`."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def ring_tile(local: int, layout: str = "balanced") -> int:
    """The side of the ring's square blocks of scores for a device's `local` positions: the largest divisor
    of its chunks (t/2 under the balanced layout, t under the contiguous one) up to RING_TILE."""
    return _tile_size(local // 2 if layout == "balanced" else local, RING_TILE)


def _ring_tiles(step: int, i, j, t: int, layout: str, tile: int) -> tuple[jax.Array, jax.Array]:
    """(query starts, key starts) [n] of the [tile, tile] blocks of scores ring step `step` computes on device
    `i` against the chunk of device `j` (itself at step 0); starts may be traced.

    The diagonal step (the device's own chunk, whose local order is increasing in global position under both
    layouts) takes the blocks on and below the diagonal: the causal mask empties those above. Balanced layout,
    off the diagonal: half of the [t, t] square is masked, and which half depends on whether the keys' device
    comes before this one; the two [t/2, t/2] squares that can hold allowed pairs are this device's late queries
    against the keys' early half, and (both early or both late) the diagonal half the case picks. Contiguous
    layout, off the diagonal: the whole square (masked whole on the devices before the keys' one)."""

    def grid(q0, k0, n: int, lower: bool = False):
        a, b = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        keep = a >= b if lower else np.ones(a.shape, bool)
        return q0 + jnp.asarray(a[keep] * tile, jnp.int32), k0 + jnp.asarray(b[keep] * tile, jnp.int32)

    if step == 0:
        return grid(0, 0, t // tile, lower=True)
    if layout == "contiguous":
        return grid(0, 0, t // tile)
    half = t // 2
    pick = jnp.where(j < i, 0, half)  # keys from an earlier device: early x early; a later one: late x late
    late, diagonal = grid(half, 0, half // tile), grid(pick, pick, half // tile)
    return jnp.concatenate([late[0], diagonal[0]]), jnp.concatenate([late[1], diagonal[1]])


def _masked_scores(q, k, q_pos, k_pos, seg_q, seg_k, scale):
    """Scores [B, K, G, tq, tk] in float32 and where they are allowed (causal at the global positions,
    within a document)."""
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    allowed = (q_pos[:, None] >= k_pos[None, :])[None] & (seg_q[:, :, None] == seg_k[:, None, :])  # [B, tq, tk]
    allowed = allowed[:, None, None]
    return jnp.where(allowed, s, _LOWEST), allowed


def _take(x, start, length, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, length, axis=axis)


def _put(x, update, start, axis):
    return jax.lax.dynamic_update_slice_in_dim(x, update, start, axis=axis)


def _pass_on(tree, context: int, direction: int = 1):
    """Each device's arrays to the next device around the context axis (`direction` -1: the previous one)."""
    return jax.lax.ppermute(tree, CONTEXT_AXIS, [(j, (j + direction) % context) for j in range(context)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, segment_ids, context: int, layout: str):
    return _ring_fwd(q, k, v, segment_ids, context, layout)[0]


def _ring_fwd(q, k, v, segment_ids, context: int, layout: str):
    b, t, kv, g, h = q.shape  # q: [B, t, K, G, H]
    scale = 1.0 / math.sqrt(h)
    tile = ring_tile(t, layout)
    i = jax.lax.axis_index(CONTEXT_AXIS)
    q_pos = chunk_positions(i, context, t, layout)
    top = jnp.full((b, kv, g, t), _LOWEST, jnp.float32)  # the running maximum of each query's scores
    total = jnp.zeros((b, kv, g, t), jnp.float32)  # the running sum of exp(score - top)
    acc = jnp.zeros(q.shape, jnp.float32)  # the running sum of exp(score - top) x value
    held = (k, v, segment_ids)
    for step in range(context):
        k_s, v_s, seg_s = held
        j = (i - step) % context
        k_pos = chunk_positions(j, context, t, layout)

        def block(sums, starts, k_s=k_s, v_s=v_s, seg_s=seg_s, k_pos=k_pos):  # one [tile, tile] block, in a scan
            acc, top, total = sums
            qs, ks = starts
            s, allowed = _masked_scores(_take(q, qs, tile, 1), _take(k_s, ks, tile, 1), _take(q_pos, qs, tile, 0),
                                        _take(k_pos, ks, tile, 0), _take(segment_ids, qs, tile, 1),
                                        _take(seg_s, ks, tile, 1), scale)
            m_old, l_old = _take(top, qs, tile, 3), _take(total, qs, tile, 3)
            m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
            fade = jnp.exp(m_old - m_new)
            p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
            pv = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), _take(v_s, ks, tile, 1),
                            preferred_element_type=jnp.float32)
            acc = _put(acc, _take(acc, qs, tile, 1) * fade.transpose(0, 3, 1, 2)[..., None] + pv, qs, 1)
            top, total = _put(top, m_new, qs, 3), _put(total, l_old * fade + jnp.sum(p, axis=-1), qs, 3)
            return (acc, top, total), None

        (acc, top, total), _ = jax.lax.scan(block, (acc, top, total), _ring_tiles(step, i, j, t, layout, tile))
        if step < context - 1:
            held = _pass_on(held, context)
            # One step at a time: the next step's blocks wait for this step's sums (the pass itself still overlaps
            # this step's blocks). Without the barrier XLA computes every step's scores at once, as the passes
            # bring the chunks, all of them alive together.
            held, acc, top, total = jax.lax.optimization_barrier((held, acc, top, total))
    out = (acc / total.transpose(0, 3, 1, 2)[..., None]).astype(q.dtype)  # every query sees itself: total > 0
    lse = top + jnp.log(total)  # [B, K, G, t]
    return out, (q, k, v, segment_ids, out, lse)


def _ring_bwd(context: int, layout: str, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    t, h = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(h)
    tile = ring_tile(t, layout)
    i = jax.lax.axis_index(CONTEXT_AXIS)
    q_pos = chunk_positions(i, context, t, layout)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 3, 1)  # [B,K,G,t]
    dq = jnp.zeros(q.shape, jnp.float32)
    # The keys and values travel with their gradients' running sums, the other way round the ring from the
    # forward pass's (the same passes would be one computation to XLA, which would keep the forward's received
    # chunks alive for the backward: the whole sequence's keys and values); after c passes the sums are home
    held = (k, v, segment_ids)
    grads = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(context):
        k_s, v_s, seg_s = held
        j = (i + step) % context
        k_pos = chunk_positions(j, context, t, layout)

        def block(sums, starts, k_s=k_s, v_s=v_s, seg_s=seg_s, k_pos=k_pos):  # one [tile, tile] block, in a scan
            dq, dk, dv = sums
            qs, ks = starts
            q_b, k_b, v_b = _take(q, qs, tile, 1), _take(k_s, ks, tile, 1), _take(v_s, ks, tile, 1)
            s, allowed = _masked_scores(q_b, k_b, _take(q_pos, qs, tile, 0), _take(k_pos, ks, tile, 0),
                                        _take(segment_ids, qs, tile, 1), _take(seg_s, ks, tile, 1), scale)
            p = jnp.where(allowed, jnp.exp(s - _take(lse, qs, tile, 3)[..., None]), 0.0)
            do = _take(d_out, qs, tile, 1)
            dv = _put(dv, _take(dv, ks, tile, 1) + jnp.einsum("bkgts,btkgh->bskh", p.astype(v.dtype), do,
                                                              preferred_element_type=jnp.float32), ks, 1)
            dp = jnp.einsum("btkgh,bskh->bkgts", do, v_b, preferred_element_type=jnp.float32)
            ds = (p * (dp - _take(delta, qs, tile, 3)[..., None]) * scale).astype(q.dtype)
            dq = _put(dq, _take(dq, qs, tile, 1) + jnp.einsum("bkgts,bskh->btkgh", ds, k_b,
                                                              preferred_element_type=jnp.float32), qs, 1)
            dk = _put(dk, _take(dk, ks, tile, 1) + jnp.einsum("bkgts,btkgh->bskh", ds, q_b,
                                                              preferred_element_type=jnp.float32), ks, 1)
            return (dq, dk, dv), None

        (dq, dk, dv), _ = jax.lax.scan(block, (dq, *grads), _ring_tiles(step, i, j, t, layout, tile))
        grads = _pass_on((dk, dv), context, -1)
        if step < context - 1:
            held = _pass_on(held, context, -1)
            held, grads, dq = jax.lax.optimization_barrier((held, grads, dq))  # one step at a time, as forward
    dk, dv = grads
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ------------------------------------------------------------------- the ring with a flash kernel per block
# The ring above computes its blocks of scores with XLA's einsums (the CPU path). On GPUs each step's block is
# instead one call of a flash kernel (cuDNN's) that returns its output and its rows' log-sum-exp; the steps'
# outputs are combined by their log-sum-exps, and the backward calls the kernel's backward on each block with
# the GLOBAL output and log-sum-exp as its forward's, which makes each block's gradients exactly its share of
# the true gradient (the ring-flash decomposition). The kernel sees two kinds of blocks:
#   diagonal  the device's own chunk against itself: causal in local order (increasing in global position under
#             both layouts) and within a document (the segment ids' mask);
#   padded    an off-diagonal block, every key before every query: the only document queries and keys can
#             share is the one running from the keys' last token to the queries' first (each document, padding
#             included, is one run of its row, as `attention.packed_segments` takes it), so the allowed pairs
#             are a prefix of the queries against a suffix of the keys. The keys are reversed (attention without
#             a causal mask does not depend on the keys' order), making the suffix a prefix, and the block is
#             the kernel's padding mask: query rows [0, q_len) against keys [0, kv_len).
# What the kernel does outside the padding mask's rows and keys is not relied on: those rows' outputs, log-sum-
# exps and gradients are replaced here, and a row with no allowed pair (q_len or kv_len 0, which the kernel is
# never given: it gets 1 and the row's results are dropped) contributes nothing.
class RingBlocks:
    """A flash kernel for the ring's blocks (`_flash_ring`): q [B, tq, N, H], k and v [B, tk, K, H] (K divides
    N), outputs in q's dtype, log-sum-exps [B, N, tq] float32 of the scaled scores."""

    def diagonal(self, q, k, v, segment_ids):
        """(out, lse) of the diagonal block: causal, within a document (segment ids [B, t])."""
        raise NotImplementedError

    def diagonal_grads(self, q, k, v, segment_ids, out, lse, d_out):
        """(dq, dk, dv) of the diagonal block given the whole attention's out and lse for its rows."""
        raise NotImplementedError

    def padded(self, q, k, v, q_len, kv_len):
        """(out, lse) of rows [0, q_len[b]) against keys [0, kv_len[b]) (int32 [B], both at least 1); other rows
        unspecified."""
        raise NotImplementedError

    def padded_grads(self, q, k, v, q_len, kv_len, out, lse, d_out):
        """(dq, dk, dv) of the padded block given the whole attention's out and lse; rows of dq at or after q_len
        and of dk, dv at or after kv_len unspecified."""
        raise NotImplementedError


class XlaBlocks(RingBlocks):
    """The kernel's semantics in plain XLA ops, [B, N, tq, tk] float32 scores at once: what the CPU tests build
    the ring on, to check the decomposition the cuDNN blocks rely on. Where the kernel's results are
    unspecified (rows outside the padding mask, a length of 0) it gives NaN, so that the ring must drop them."""

    @staticmethod
    def _scores(q, k, allowed):
        b, tq, n, h = q.shape
        kv = k.shape[2]
        qg = q.reshape(b, tq, kv, n // kv, h)
        s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(h)
        return jnp.where(allowed[:, None, None], s, _LOWEST)  # [B, K, G, tq, tk]

    def _forward(self, q, k, v, allowed):
        b, tq, n, h = q.shape
        s = self._scores(q, k, allowed)
        lse = jax.nn.logsumexp(s, axis=-1)  # [B, K, G, tq]
        p = jnp.where(allowed[:, None, None], jnp.exp(s - lse[..., None]), 0.0)
        out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(b, tq, n, h).astype(q.dtype), lse.reshape(b, n, tq)

    def _backward(self, q, k, v, allowed, out, lse, d_out):
        b, tq, n, h = q.shape
        kv = k.shape[2]
        s = self._scores(q, k, allowed)
        lse = lse.reshape(b, kv, n // kv, tq)
        p = jnp.where(allowed[:, None, None], jnp.exp(s - lse[..., None]), 0.0)
        do = d_out.reshape(b, tq, kv, n // kv, h)
        delta = jnp.sum(do.astype(jnp.float32) * out.reshape(do.shape).astype(jnp.float32), axis=-1)
        dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(v.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.einsum("btkgh,bskh->bkgts", do, v, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta.transpose(0, 2, 3, 1)[..., None]) / math.sqrt(h)).astype(q.dtype)
        dq = jnp.einsum("bkgts,bskh->btkgh", ds, k, preferred_element_type=jnp.float32).reshape(q.shape)
        dk = jnp.einsum("bkgts,btkgh->bskh", ds, q.reshape(do.shape), preferred_element_type=jnp.float32)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    @staticmethod
    def _diagonal_mask(segment_ids):
        t = segment_ids.shape[1]
        return jnp.tril(jnp.ones((t, t), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])

    @staticmethod
    def _padding(q_len, kv_len, tq: int, tk: int):
        some = (q_len > 0) & (kv_len > 0)  # a length of 0: nothing specified
        rows = (jnp.arange(tq)[None] < q_len[:, None]) & some[:, None]  # [B, tq]
        keys = (jnp.arange(tk)[None] < kv_len[:, None]) & some[:, None]  # [B, tk]
        return rows, keys

    def diagonal(self, q, k, v, segment_ids):
        return self._forward(q, k, v, self._diagonal_mask(segment_ids))

    def diagonal_grads(self, q, k, v, segment_ids, out, lse, d_out):
        return self._backward(q, k, v, self._diagonal_mask(segment_ids), out, lse, d_out)

    def padded(self, q, k, v, q_len, kv_len):
        rows, keys = self._padding(q_len, kv_len, q.shape[1], k.shape[1])
        out, lse = self._forward(q, k, v, rows[:, :, None] & keys[:, None, :])
        return jnp.where(rows[:, :, None, None], out, jnp.nan), jnp.where(rows[:, None], lse, jnp.nan)

    def padded_grads(self, q, k, v, q_len, kv_len, out, lse, d_out):
        rows, keys = self._padding(q_len, kv_len, q.shape[1], k.shape[1])
        dq, dk, dv = self._backward(q, k, v, rows[:, :, None] & keys[:, None, :], out, lse, d_out)
        return (jnp.where(rows[:, :, None, None], dq, jnp.nan), jnp.where(keys[:, :, None, None], dk, jnp.nan),
                jnp.where(keys[:, :, None, None], dv, jnp.nan))


class CudnnBlocks(RingBlocks):
    """cuDNN's flash attention (jax's primitives, `jax._src.cudnn.fused_attention_stablehlo`, a private API):
    its forward with the softmax statistics (the log-sum-exp of the scaled scores, [B, N, T] float32), its
    backward given the ring's global output and statistics. Diagonal: the causal mask type and the document
    mask as an additive bias [B, 1, m, m] in the compute dtype (no bias gradient is asked for); padded: the
    padding mask type with the lengths. GPUs only; its numerics are checked through `XlaBlocks` on CPUs and by
    compiling for H100s, and on a GPU by benchmarks/gpu_session.sh's `ring` step."""

    @staticmethod
    def _module():
        from jax._src.cudnn import fused_attention_stablehlo as cudnn  # local import: private JAX API, GPUs only

        from jaxlm.models import cudnn_batching  # local import: cuDNN's batching rules, for the vmaps around the ring

        cudnn_batching.install()
        return cudnn

    def _params(self, cudnn, q, has_bias: bool, mask_type):
        return dict(scale=1.0 / math.sqrt(q.shape[-1]), seed=42, dropout_rate=0.0, variadic_args=(has_bias, False),
                    mask_type=mask_type, layout=cudnn.AttentionLayout.BTNH.value, sliding_window_length=None)

    def _operands(self, q, bias, q_len, kv_len):
        unused = jnp.zeros(0, q.dtype)
        return (bias if bias is not None else unused, unused if q_len is None else q_len,
                unused if kv_len is None else kv_len, unused, unused, unused, unused)

    def _forward(self, q, k, v, bias, q_len, kv_len, mask_type):
        cudnn = self._module()
        out, lse = cudnn._dot_product_attention_fwd_p_wrapper.bind(
            q, k, v, *self._operands(q, bias, q_len, kv_len), is_training=True,
            **self._params(cudnn, q, bias is not None, mask_type))
        return out, lse

    def _backward(self, q, k, v, bias, q_len, kv_len, out, lse, d_out, mask_type):
        cudnn = self._module()
        dq, dk, dv = cudnn._dot_product_attention_bwd_p_wrapper.bind(
            q, k, v, *self._operands(q, bias, q_len, kv_len), lse, out, d_out,
            **self._params(cudnn, q, bias is not None, mask_type))
        return dq, dk, dv

    def _bias(self, segment_ids, dtype):
        cudnn = self._module()
        same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, m, m]
        return jnp.where(same, jnp.asarray(0, dtype), cudnn.get_large_negative_number(dtype))

    def diagonal(self, q, k, v, segment_ids):
        cudnn = self._module()
        return self._forward(q, k, v, self._bias(segment_ids, q.dtype), None, None, cudnn.MaskType.CAUSAL)

    def diagonal_grads(self, q, k, v, segment_ids, out, lse, d_out):
        cudnn = self._module()
        return self._backward(q, k, v, self._bias(segment_ids, q.dtype), None, None, out, lse, d_out,
                              cudnn.MaskType.CAUSAL)

    def padded(self, q, k, v, q_len, kv_len):
        return self._forward(q, k, v, None, q_len, kv_len, self._module().MaskType.PADDING)

    def padded_grads(self, q, k, v, q_len, kv_len, out, lse, d_out):
        return self._backward(q, k, v, None, q_len, kv_len, out, lse, d_out, self._module().MaskType.PADDING)


# The ring's flash kernel by config.model.attention; any other attention runs the ring's XLA tiles (`_ring`)
RING_BLOCKS: dict[str, RingBlocks] = {"cudnn": CudnnBlocks()}


RING_DIAGONAL = 8192  # the most queries (and keys) of one diagonal call of the ring's flash kernel


def ring_diagonal_tile(local: int) -> int:
    """The side of the diagonal step's tiles for a device's `local` positions (`_diagonal_pieces`)."""
    return _tile_size(local, RING_DIAGONAL)


def _diagonal_pieces(t: int) -> list:
    """The blocks of the ring's diagonal step (the device's own chunk, increasing in global position in local
    order): a chunk longer than RING_DIAGONAL in square tiles (the largest divisor of t up to it), each tile on
    the diagonal a diagonal call and each below it a padded call (its keys all before its queries), those above
    skipped; each (kind, query start, key start, queries, keys, live)."""
    m = ring_diagonal_tile(t)
    return [piece for a in range(t // m) for piece in
            [("diagonal", a * m, a * m, m, m, True)] + [("padded", a * m, b * m, m, m, True) for b in range(a)]]


def _off_diagonal(i, j, t: int, layout: str) -> list:
    """The padded blocks of ring step j != i on device i: (kind, query start, key start, queries, keys, live []
    bool) each; starts may be traced. Contiguous layout: the whole [t, t] square, live when the keys' device
    comes first. Balanced layout: this device's late half of queries against the keys' early half, and the
    halves `_ring_tiles` picks (both early for keys from an earlier device, both late from a later one)."""
    if layout == "contiguous":
        return [("padded", 0, 0, t, t, j < i)]
    half = t // 2
    pick = jnp.where(j < i, 0, half)
    return [("padded", half, 0, half, half, True), ("padded", pick, pick, half, half, True)]


def _shared_document(seg_q, seg_k, live):
    """For an off-diagonal block (every key before every query): the lengths [B] of the queries' prefix and the
    keys' suffix in the one document they share (the queries' first token's, when it is the keys' last one's),
    each at least 1, and whether the row has any allowed pair [B]."""
    doc = seg_q[:, 0]
    shared = (doc == seg_k[:, -1]) & live
    q_len = jnp.sum(seg_q == doc[:, None], axis=1, dtype=jnp.int32)
    kv_len = jnp.sum(seg_k == doc[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(shared, q_len, 1), jnp.where(shared, kv_len, 1), shared


def _padded_rows(q_len, ok, n: int):
    """[B, n]: the rows of a padded block whose results count."""
    return ok[:, None] & (jnp.arange(n)[None] < q_len[:, None])


def _weight(lse, total):
    """[B, n, N, 1]: the share exp(lse - total) of a part's rows ([B, N, n]) in their whole softmax."""
    return jnp.exp(lse - total).transpose(0, 2, 1)[..., None]


def _fold_block(blocks: RingBlocks, piece, q, segment_ids, k_s, v_s, seg_s, out, lse):
    """One block's output and log-sum-exp folded into the running ones (float32 [B, t, N, H], [B, N, t])."""
    kind, q0, k0, nq, nk, live = piece
    q_b, k_b, v_b = _take(q, q0, nq, 1), _take(k_s, k0, nk, 1), _take(v_s, k0, nk, 1)
    if kind == "diagonal":
        o_b, l_b = blocks.diagonal(q_b, k_b, v_b, _take(segment_ids, q0, nq, 1))
        o_b = o_b.astype(jnp.float32)
    else:
        q_len, kv_len, ok = _shared_document(_take(segment_ids, q0, nq, 1), _take(seg_s, k0, nk, 1), live)
        o_b, l_b = blocks.padded(q_b, jnp.flip(k_b, 1), jnp.flip(v_b, 1), q_len, kv_len)
        rows = _padded_rows(q_len, ok, nq)
        l_b = jnp.where(rows[:, None], l_b, -jnp.inf)
        o_b = jnp.where(rows[:, :, None, None], o_b.astype(jnp.float32), 0.0)
    l_old, o_old = _take(lse, q0, nq, 2), _take(out, q0, nq, 1)
    l_new = jnp.logaddexp(l_old, l_b)  # finite: a row's diagonal tile, folded first, has its own key
    out = _put(out, o_old * _weight(l_old, l_new) + o_b * _weight(l_b, l_new), q0, 1)
    return out, _put(lse, l_new, q0, 2)


def _block_grads(blocks: RingBlocks, piece, q, segment_ids, out, lse, d_out, k_s, v_s, seg_s, dq, dk, dv):
    """One block's gradients, given the whole attention's output and log-sum-exp, added to the running float32
    sums of the queries' (dq) and of the held keys' and values' (dk, dv)."""
    kind, q0, k0, nq, nk, live = piece
    q_b, k_b, v_b = _take(q, q0, nq, 1), _take(k_s, k0, nk, 1), _take(v_s, k0, nk, 1)
    given = (_take(out, q0, nq, 1), _take(lse, q0, nq, 2), _take(d_out, q0, nq, 1))
    if kind == "diagonal":
        dq_b, dk_b, dv_b = (x.astype(jnp.float32) for x in
                            blocks.diagonal_grads(q_b, k_b, v_b, _take(segment_ids, q0, nq, 1), *given))
    else:
        q_len, kv_len, ok = _shared_document(_take(segment_ids, q0, nq, 1), _take(seg_s, k0, nk, 1), live)
        dq_b, dk_b, dv_b = blocks.padded_grads(q_b, jnp.flip(k_b, 1), jnp.flip(v_b, 1), q_len, kv_len, *given)
        rows, keys = _padded_rows(q_len, ok, nq), _padded_rows(kv_len, ok, nk)
        dq_b = jnp.where(rows[:, :, None, None], dq_b.astype(jnp.float32), 0.0)
        dk_b = jnp.flip(jnp.where(keys[:, :, None, None], dk_b.astype(jnp.float32), 0.0), 1)
        dv_b = jnp.flip(jnp.where(keys[:, :, None, None], dv_b.astype(jnp.float32), 0.0), 1)
    dq = _put(dq, _take(dq, q0, nq, 1) + dq_b, q0, 1)
    dk = _put(dk, _take(dk, k0, nk, 1) + dk_b, k0, 1)
    return dq, dk, _put(dv, _take(dv, k0, nk, 1) + dv_b, k0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash_ring(q, k, v, segment_ids, context: int, layout: str, blocks: RingBlocks):
    return _flash_ring_fwd(q, k, v, segment_ids, context, layout, blocks)[0]


def _flash_ring_fwd(q, k, v, segment_ids, context: int, layout: str, blocks: RingBlocks):
    b, t, n, h = q.shape  # q [B, t, N, H], k and v [B, t, K, H]
    i = jax.lax.axis_index(CONTEXT_AXIS)
    out = jnp.zeros(q.shape, jnp.float32)  # the running output, normalized by the running log-sum-exp
    lse = jnp.full((b, n, t), -jnp.inf, jnp.float32)
    held = (k, v, segment_ids)
    for step in range(context):
        if step:
            held = _pass_on(held, context)
            held, out, lse = jax.lax.optimization_barrier((held, out, lse))  # one step at a time, as `_ring_fwd`
        j = (i - step) % context
        for piece in _off_diagonal(i, j, t, layout) if step else _diagonal_pieces(t):
            out, lse = _fold_block(blocks, piece, q, segment_ids, *held, out, lse)
    out = out.astype(q.dtype)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_ring_bwd(context: int, layout: str, blocks: RingBlocks, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    t = q.shape[1]
    i = jax.lax.axis_index(CONTEXT_AXIS)
    d_out = d_out.astype(q.dtype)
    dq = jnp.zeros(q.shape, jnp.float32)
    held = (k, v, segment_ids)
    grads = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    # the keys and values travel with their gradients' running sums the other way round (as `_ring_bwd`)
    for step in range(context):
        if step:
            held, grads = _pass_on((held, grads), context, -1)
            held, grads, dq = jax.lax.optimization_barrier((held, grads, dq))
        j = (i + step) % context
        for piece in _off_diagonal(i, j, t, layout) if step else _diagonal_pieces(t):
            dq, *grads = _block_grads(blocks, piece, q, segment_ids, out, lse, d_out, *held, dq, *grads)
    dk, dv = _pass_on(tuple(grads), context, -1)  # c passes in all: the sums are home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash_ring.defvjp(_flash_ring_fwd, _flash_ring_bwd)
