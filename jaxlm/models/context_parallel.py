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
              saved log-sum-exp). Each step's scores are computed in square blocks of at most RING_TILE
              queries by as many keys (a scan over the blocks; the steps run one after another), skipping
              those the causal mask empties: on the diagonal step those above the diagonal, and under the
              balanced layout half of every other step's square (the same work on every device). Memory:
              two chunks' keys and values and one block's float32 scores at a time. About four times
              allgather's traffic (the chunks pass again in the backward, their gradient sums in float32),
              in pieces that XLA overlaps with the blocks' matmuls (benchmarks/BENCHMARKS.md, "Context
              parallelism on 8 H100s").

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
        local = functools.partial(_ring_local, context=context, layout=layout)
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


def _ring_local(q, k, v, segment_ids, *, context: int, layout: str):
    b, t, n, h = q.shape
    kv = k.shape[2]
    dtype = q.dtype
    if dtype == jnp.float16 and trace_platform() == "cpu":  # no float16 dot with float32 sums on XLA:CPU
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
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
