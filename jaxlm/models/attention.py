"""Attention kernels behind one function: causal, grouped-query, packed documents.

`attend` is the only place that knows which kernel runs. Packed documents are given as segment ids
(0 = padding, 1.. = document within the row); a query attends to earlier keys of its own document.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxlm.errors import UserError

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("xla", "cudnn")


def cudnn_unsupported_reason(dtype, head_dim: int) -> str | None:
    """Why cuDNN flash attention cannot run this shape and dtype, or None when it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it needs bfloat16 or float16 compute, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 128:
        return f"it needs a head_dim that is a multiple of 8 and at most 128, not {head_dim}"
    return None


def select_implementation(requested: str, platform: str | None = None, *, dtype=jnp.bfloat16, head_dim: int = 64) -> str:
    """Resolve 'auto' for the backend, dtype and head size; the choice and any fallback are logged.

    An explicit kernel the backend cannot run is a config error (one clear line), never a silent swap.
    """
    platform = platform or jax.default_backend()
    if requested not in ("auto", *IMPLEMENTATIONS):
        raise UserError(f"config.model.attention={requested!r}: use one of auto, {', '.join(IMPLEMENTATIONS)}")
    reason = "the backend is not a GPU" if platform != "gpu" else cudnn_unsupported_reason(dtype, head_dim)
    if requested == "cudnn" and reason:
        raise UserError(f"config.model.attention='cudnn' cannot run here: {reason}; use 'auto' or 'xla'")
    chosen = requested if requested != "auto" else ("xla" if reason else "cudnn")
    if requested == "auto":
        why = f" (cuDNN not used: {reason})" if reason and platform == "gpu" else ""
        (log.warning if why else log.info)("attention: 'auto' chose %r on %s%s", chosen, platform, why)
    return chosen


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids -> [B, 1, T, T] bool: True where query and key are in the same document."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]


def attend(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H], K divides N (grouped-query)
    v: jax.Array,  # [B, S, K, H]
    *,
    segment_ids: jax.Array | None = None,  # [B, T]
    implementation: str = "xla",
) -> jax.Array:  # [B, T, N, H]
    """Causal softmax attention; with segment ids, no attention across documents."""
    mask = None if segment_ids is None else document_mask(segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


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
