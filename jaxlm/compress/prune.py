"""Pruning: which weights to zero (magnitude, Wanda, N:M). Array functions only; `jaxlm.compress`
applies them to a model's projections. How training keeps pruned weights zero, and gradual pruning in
the train step, is `jaxlm.pruning_masks`.

A projection's kernel is pruned in its matrix view [inputs, outputs] (`matrix`: the contracted input
dimensions flattened first, as every projection of jaxlm lays them out), with a score per weight:

  magnitude   |W|
  wanda       |W| x the L2 norm of the weight's input feature over calibration tokens (Sun et al. 2023),
              compared within each output (the paper's per-output groups)

`unstructured_mask` removes the lowest-scoring fraction (of the matrix, of each output, or, given a
threshold, of all targets at once: `global_threshold`); `nm_mask` keeps the N highest of every M
consecutive inputs (2:4: the pattern sparse tensor cores execute). Masks are bool, True = kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def matrix(kernel: jax.Array, n_in_dims: int) -> jax.Array:
    """A kernel [in dims..., out dims...] as [prod(in dims), prod(out dims)]."""
    return kernel.reshape(math.prod(kernel.shape[:n_in_dims]), -1)


def _lowest(score: jax.Array, k: int, axis: int | None) -> jax.Array:
    """True at the `k` lowest scores (along `axis`, or of the whole array), ties broken by position."""
    if axis is None:
        flat = score.reshape(-1)
        ranks = jnp.zeros(flat.shape, jnp.int32).at[jnp.argsort(flat, stable=True)].set(
            jnp.arange(flat.size, dtype=jnp.int32))
        return (ranks < k).reshape(score.shape)
    order = jnp.argsort(score, axis=axis, stable=True)
    ranks = jnp.argsort(order, axis=axis, stable=True)
    return ranks < k


def unstructured_mask(score: jax.Array, sparsity: float, *, per_output: bool = False) -> jax.Array:
    """A [in, out] score -> mask keeping all but floor(sparsity x n) weights: the lowest of the whole
    matrix, or (`per_output`) of each output's column."""
    if per_output:
        return ~_lowest(score, int(math.floor(sparsity * score.shape[0])), axis=0)
    return ~_lowest(score, int(math.floor(sparsity * score.size)), axis=None)


def global_threshold(scores: Sequence[jax.Array], sparsity: float, iterations: int = 64) -> float:
    """The score below which `sparsity` of all `scores` (any shapes) lie: a bisection on counts, so
    the scores are never concatenated (a global magnitude threshold over a whole model)."""
    total = sum(s.size for s in scores)
    target = math.floor(sparsity * total)
    count = jax.jit(lambda t: sum(jnp.sum(s < t, dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
                                  for s in scores))
    lo, hi = 0.0, float(max(jnp.max(s) for s in scores)) * 2 + 1e-30
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if int(count(mid)) < target:
            lo = mid
        else:
            hi = mid
    return hi


def nm_mask(score: jax.Array, n: int, m: int) -> jax.Array:
    """A [in, out] score -> mask keeping the `n` highest of every `m` consecutive inputs of each output."""
    n_in = score.shape[0]
    if n_in % m:
        raise ValueError(f"{n_in} inputs are not a multiple of {m}")
    grouped = score.reshape(n_in // m, m, -1)
    return (~_lowest(grouped, m - n, axis=1)).reshape(score.shape)


def scores(w: jax.Array, criterion: str, input_norm: jax.Array | None = None) -> jax.Array:
    """The score of each weight of a [in, out] matrix: |W|, or |W| x ||x_in|| (wanda; `input_norm` [in])."""
    s = jnp.abs(jnp.asarray(w, jnp.float32))
    if criterion == "wanda":
        return s * input_norm[:, None]
    return s
