"""cuDNN's fused attention kernels as float32 XLA on a CPU, for testing what jaxlm builds around them.

jax's cuDNN attention is two primitives (forward, backward) lowered to cuDNN custom calls on CUDA
only. `install()` gives them a CPU lowering that computes what the kernels compute, from the same
operands after jax's own preprocessing (`_fix_seqlen_offsets`: the packed layout's segment lengths
and offsets flattened across rows, shifted left, offsets in elements of a [B*T, N, H] buffer):
softmax(scale * q k^T + bias) v with the mask type's causal and padding masks and, for the packed
layout, attention only within each segment. The backward is the forward's float32 VJP (the saved
softmax statistics, which only the real kernel reads, are returned as zeros).

So everything around the kernels can run here: jax's own wrappers and partitioning, jaxlm's packed
layout and its fallback conditional, the batching rules of `jaxlm.models.cudnn_batching` under the
data-replica and pipeline-stage vmaps, shard_map per shard. Numbers match the real kernels to the
precision of their inputs, not bit for bit. It needs jax's CUDA plugin installed (the H100 compiler
environment, `make h100-env`): without it jax refuses cuDNN attention before lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _segments(offsets, seqlens, rows: int, length: int, stride: int):
    """[rows, length] segment index (1-based, 0 = none) of each token, from flattened, left-shifted
    offsets (in elements, `stride` per token) and lengths."""
    starts = offsets.reshape(-1)[: seqlens.size] // stride
    lengths = seqlens.reshape(-1)
    token = jnp.arange(rows * length)[:, None]
    inside = (token >= starts[None]) & (token < starts[None] + lengths[None]) & (lengths[None] > 0)
    return jnp.where(inside.any(1), jnp.argmax(inside, 1) + 1, 0).reshape(rows, length)


def _forward(q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale, mask_type, has_bias):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    b, t, n, h = q.shape
    s = k.shape[1]
    groups = n // k.shape[2]
    kf = jnp.repeat(k, groups, axis=2).astype(jnp.float32)
    vf = jnp.repeat(v, groups, axis=2).astype(jnp.float32)
    scores = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kf) * scale
    if has_bias:
        scores = scores + bias.astype(jnp.float32)
    allowed = jnp.ones((b, 1, t, s), bool)
    if mask_type in (cudnn.MaskType.CAUSAL, cudnn.MaskType.PADDING_CAUSAL):
        allowed &= jnp.tril(jnp.ones((t, s), bool))[None, None]
    packed = q_offsets.ndim == 2 and q_offsets.shape[1] > 2
    if packed:  # jax's packed layout: segments of the rows, flattened (see the module's docstring)
        q_seg = _segments(q_offsets, q_seqlen, b, t, n * h)
        k_seg = _segments(kv_offsets, kv_seqlen, b, s, n * h)
        allowed &= ((q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] > 0))[:, None]
    elif mask_type in (cudnn.MaskType.PADDING, cudnn.MaskType.PADDING_CAUSAL):
        allowed &= ((jnp.arange(t)[None, :, None] < q_seqlen.reshape(b, 1, 1))
                    & (jnp.arange(s)[None, None, :] < kv_seqlen.reshape(b, 1, 1)))[:, None]
    scores = jnp.where(allowed, scores, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), vf)


def _fwd_rule(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v,
              *, scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length, is_training):
    out = _forward(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale=scale,
                   mask_type=mask_type, has_bias=variadic_args[0]).astype(query.dtype)
    if not is_training:
        return [out]
    segments = q_offsets.shape[1] - 1 if q_offsets.ndim == 2 and q_offsets.shape[1] > 2 else 1
    return [out, jnp.zeros((query.shape[0] * segments, query.shape[2], query.shape[1]), jnp.float32)]


def _bwd_rule(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v,
              activation, fwd_output, grad_output, *, scale, seed, dropout_rate, variadic_args, mask_type, layout,
              sliding_window_length):
    has_bias, has_dbias = variadic_args

    def f(q, k, v, bias):
        return _forward(q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale=scale,
                        mask_type=mask_type, has_bias=has_bias)

    _, vjp = jax.vjp(f, query, key, value, bias)
    dq, dk, dv, dbias = vjp(grad_output.astype(jnp.float32))
    grads = [dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)]
    return grads + [dbias.astype(bias.dtype)] if has_dbias else grads


def install() -> None:
    """Lower jax's cuDNN attention primitives on the CPU with the emulation above."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    from jax._src.interpreters import mlir

    mlir.register_lowering(cudnn._dot_product_attention_fwd_p, mlir.lower_fun(_fwd_rule, multiple_results=True),
                           platform="cpu")
    mlir.register_lowering(cudnn._dot_product_attention_bwd_p, mlir.lower_fun(_bwd_rule, multiple_results=True),
                           platform="cpu")
