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


def select_implementation(requested: str, platform: str | None = None) -> str:
    """Resolve 'auto' for the backend; refuse kernels the backend cannot run, with one clear line."""
    platform = platform or jax.default_backend()
    if requested == "auto":
        chosen = "cudnn" if platform == "gpu" else "xla"
        log.info("attention: model.attention='auto' chose %r on %s", chosen, platform)
        return chosen
    if requested == "cudnn" and platform != "gpu":
        raise UserError(
            f"config.model.attention='cudnn' needs a GPU but the backend is {platform!r}; use 'auto' or 'xla'"
        )
    if requested not in IMPLEMENTATIONS:
        raise UserError(f"config.model.attention={requested!r}: use one of auto, {', '.join(IMPLEMENTATIONS)}")
    return requested


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
