"""Batching rules for jax's cuDNN attention primitives that fold every batch dimension into the kernel's.

jaxlm vmaps the gradient over the mesh's `data` replicas (`jaxlm.steps`: each replica accumulates its
micro-batches' gradients locally and they are reduced once per step) and over pipeline stages. jax's
own rules for its cuDNN attention (`jax._src.cudnn.fused_attention_stablehlo`, jax 0.10-0.11) reshape a
document mask's bias [R, B, 1, T, S] to [R * B, N, T, S], which fails, and the packed layout's
per-row segment lengths [R, B, M] to [R * B], which fails too: a train step with `mesh.data` > 1 and
cuDNN attention did not compile (found compiling 1b for 8 H100s with data=2). Attention is independent
per row, so the rule here moves the vmapped dimension to the front of every per-row operand (query,
key, value, bias, segment lengths and offsets, the backward's statistics, output and its cotangent),
merges it with the batch, calls the primitive once and splits the results again. Operands that are
absent (jax passes empty placeholders) or broadcast over the batch (a bias of batch 1) are left alone.

`install()` registers the rules, once, before the first trace that uses cuDNN attention.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

_installed = False

# Operand positions of the primitives (jax's order): query, key, value, bias, q_seqlen, kv_seqlen,
# q_offsets, kv_offsets, page_table_k, page_table_v[, activation, fwd_output, grad_output (backward)]
BIAS, SEQLENS_AND_OFFSETS, BACKWARD_ROWS = 3, (4, 5, 6, 7), (10, 11, 12)


def _front(x, dim, size: int):
    """x with its vmapped dimension first (broadcast to `size` where it has none)."""
    return jnp.broadcast_to(x, (size, *x.shape)) if dim is None else jnp.moveaxis(x, dim, 0)


def _is_per_row(i: int, x, has_bias: bool) -> bool:
    """Whether operand i carries the batch as its leading dimension (so must be folded with the vmap)."""
    if i < BIAS or i in BACKWARD_ROWS:
        return True
    if i == BIAS:
        return has_bias and x.shape[0] != 1  # a bias of batch 1 is broadcast over the rows by the kernel
    return i in SEQLENS_AND_OFFSETS and x.size > 0  # empty: the placeholder for an absent operand


def _fold_call(primitive, args, dims, params):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    has_bias = params["variadic_args"][0]
    folded, bias_folded = [], False
    for i, (x, d) in enumerate(zip(args, dims)):
        if d is not None or _is_per_row(i, x, has_bias):
            x = _front(x, d, size)
            x = x.reshape((-1, *x.shape[2:]))
            bias_folded |= i == BIAS
        folded.append(x)
    outs = primitive.bind(*folded, **params)
    results, out_dims = [], []
    for j, out in enumerate(outs):
        if j == BIAS and not bias_folded:  # the gradient of a bias broadcast over the batch: already summed
            results.append(out)
            out_dims.append(None)
            continue
        out = out.reshape((size, -1, *out.shape[1:]))
        if j == BIAS and dims[BIAS] is None:  # a per-row bias shared by the replicas: their gradients summed
            results.append(out.sum(0))
            out_dims.append(None)
            continue
        results.append(out)
        out_dims.append(0)
    return results, out_dims


def install() -> None:
    """Register the folding rules for jax's cuDNN attention forward and backward primitives (idempotent)."""
    global _installed
    if _installed:
        return
    try:  # jax internals: a jax that renamed them keeps its own rules (fine where nothing is vmapped)
        # local import: private JAX API, guarded, only needed where cuDNN attention runs (GPUs)
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
        from jax._src.interpreters import batching

        primitives = (cudnn._dot_product_attention_fwd_p_wrapper, cudnn._dot_product_attention_bwd_p_wrapper)
    except (ImportError, AttributeError) as e:
        warnings.warn(f"jaxlm: cuDNN attention keeps jax's own batching rules ({e}): runs with mesh.data > 1 "
                      "or pipeline stages may not compile with model.attention=cudnn", stacklevel=2)
        _installed = True
        return
    for primitive in primitives:
        batching.primitive_batchers[primitive] = (
            lambda args, dims, _p=primitive, **params: _fold_call(_p, args, dims, params))
    _installed = True
