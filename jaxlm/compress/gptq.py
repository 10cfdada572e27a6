"""GPTQ (Frantar et al. 2022, "OPTQ: accurate post-training quantization for generative pre-trained
transformers"): a projection's weight quantized one input feature at a time, each feature's rounding
error fed back into the features not yet quantized, so that the layer's output on its calibration
inputs moves as little as it can.

For a projection y = x w (w [n_in, n_out], inputs first: the paper's W is our w transposed, its
columns our rows) and its input Hessian H = sum over calibration tokens of x x^T, the output error
||X w - X w_q||^2 = tr((w - w_q)^T H (w - w_q)). Each output channel (our columns) is independent
given H, so all of them are handled at once, and a weight sharded along n_out needs no gather.
With U the upper Cholesky factor of H^-1 (H^-1 = U^T U), quantizing feature i (row w[i]) to q_i
and moving the later features by

    e_i = (w[i] - q_i) / U[i, i],    w[j] -= U[i, j] e_i   (j > i)

is the optimal (OBS) compensation of that rounding, given the features already fixed. The updates
are applied in blocks of `block` features: within a block at once, to the rows beyond it as one
matrix product after the block (w[i2:] -= U[i1:i2, i2:]^T E, E the block's e_i): the same result,
a fraction of the memory traffic.

Details as the reference implementation (and AutoGPTQ) has them:
  dead inputs     features that never fire (H_jj = 0) get H_jj = 1 and weight 0
  dampening       H += damp * mean(diag H) * I, which makes H positive definite
  groups          a group's params (`quant.group_params`) are computed when the first feature of the
                  group is reached, from the weights as the error feedback has left them (the rows of
                  the current block with its updates so far; later rows with those of earlier blocks)
  act_order       features in order of decreasing H_jj (the most active first, while most of the other
                  features can still absorb their error), with static groups (AutoGPTQ's
                  static_groups=True): every group's params computed up front from the original weight,
                  in the natural contiguous groups, each feature quantized with its own group's params,
                  so the stored layout is unchanged
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxlm import quant

_HIGHEST = lax.Precision.HIGHEST  # no TF32 in the float32 products (GPUs use it for float32 by default)


def inverse_cholesky(h: jax.Array) -> jax.Array:
    """The upper triangular U with H^-1 = U^T U (positive diagonal), for a positive definite H.

    One Cholesky factorization, of H with its features reversed (J H J = L L^T, J the reversal), gives
    H = V V^T with V = J L J upper triangular; then H^-1 = V^-T V^-1, and U = V^-1 (upper triangular,
    one triangular solve): the factor the reference computes as cholesky(inverse(H)), upper, without
    forming H^-1."""
    n = h.shape[0]
    low = jnp.linalg.cholesky(h[::-1, ::-1])
    v = low[::-1, ::-1]
    return jax.scipy.linalg.solve_triangular(v, jnp.eye(n, dtype=h.dtype), lower=False)


def _params_of_rows(rows: jax.Array, spec: quant.QuantSpec) -> dict[str, jax.Array]:
    """One group's params [1, n_out] from its rows [g, n_out] (`quant.group_params` over the whole
    axis; rows repeated up to a multiple of 8, which leaves absmax, min and max as they are, where
    `quant.group_size` wants one for 3 bits)."""
    extra = (-rows.shape[0]) % 8
    if extra:
        rows = jnp.concatenate([rows, jnp.broadcast_to(rows[:1], (extra, rows.shape[1]))])
    return quant.group_params(rows, dataclasses.replace(spec, group=0, double=False), 0)


@functools.partial(jax.jit, static_argnames=("spec", "damp", "block", "act_order"))
def quantize_matrix(w: jax.Array, hessian: jax.Array, spec: quant.QuantSpec, *, damp: float = 0.01, block: int = 128,
                    act_order: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
    """w [n_in, n_out] (a projection's kernel flattened: input features first, the contracted ones),
    hessian [n_in, n_in] = sum over calibration tokens of x x^T (x the projection's input, float32).

    Returns (codes uint8 [n_in, n_out], unpacked; group params {"scale": [n_in / g, n_out] float32,
    "zero": the same, uint8, where asymmetric}) in the layout `quant.group_params(w, spec, 0)` has,
    g = quant.group_size(spec, n_in): `quant.store(codes, params, spec, 0)` writes the stored leaves,
    `quant.decode(codes, params, spec, 0)` gives the quantized weight. `damp`: the fraction of the
    mean diagonal added to H's diagonal; `block`: features between two lazy batch updates;
    `act_order`: features in order of decreasing H_jj, with static groups (module docstring)."""
    w = jnp.asarray(w, jnp.float32)
    h = jnp.asarray(hessian, jnp.float32)
    n_in, n_out = w.shape
    if h.shape != (n_in, n_in):
        raise ValueError(f"a Hessian of shape {h.shape} for a weight of {n_in} inputs: give [{n_in}, {n_in}]")
    g = quant.group_size(spec, n_in)
    n_groups = n_in // g
    b = max(1, min(block, n_in))
    n_blocks = -(-n_in // b)
    n = n_blocks * b  # padded with features that do nothing (U's identity, weight 0)

    dead = jnp.diagonal(h) == 0
    h = h + jnp.diag(dead.astype(jnp.float32))
    w = jnp.where(dead[:, None], 0.0, w)
    params = quant.group_params(w, spec, 0)  # act_order: final (static groups); else overwritten group by group
    if act_order:
        perm = jnp.argsort(-jnp.diagonal(h))  # stable: ties keep their order
        w = jnp.take(w, perm, axis=0)
        h = h[perm][:, perm]
        group_of = perm // g
    else:
        group_of = jnp.arange(n_in) // g
    h = h + (damp * jnp.mean(jnp.diagonal(h))) * jnp.eye(n_in, dtype=jnp.float32)
    u = inverse_cholesky(h)

    pad = n - n_in
    if pad:
        w = jnp.pad(w, ((0, pad), (0, 0)))
        u = jnp.pad(u, ((0, pad), (0, pad))) + jnp.diag(jnp.arange(n) >= n_in).astype(jnp.float32)
        group_of = jnp.concatenate([group_of, jnp.full((pad,), n_groups - 1, group_of.dtype)])

    def fresh_params(params, wq, w1, i, r):
        """The params of the group starting at feature r (= i1 + i): rows r.. of the current weights."""
        rows = lax.dynamic_slice_in_dim(wq, r, g, 0)  # later blocks' rows (r + g <= n_in)
        m = min(g, b)  # the first m rows may lie in the current block: w1[i:]
        current = lax.dynamic_slice_in_dim(jnp.concatenate([w1, jnp.zeros_like(w1)]), i, b, 0)[:m]
        head = jnp.where((jnp.arange(m) < b - i)[:, None], current, rows[:m])
        rows = jnp.concatenate([head, rows[m:]]) if m < g else head
        new = _params_of_rows(rows, spec)
        return {k: lax.dynamic_update_slice_in_dim(v, new[k].astype(v.dtype), r // g, 0) for k, v in params.items()}

    def block_step(k, carry):
        wq, codes, params = carry
        i1 = k * b
        ub = lax.dynamic_slice(u, (i1, i1), (b, b))
        later = jnp.arange(b)

        def feature_step(i, inner):
            w1, err, codes1, params = inner
            r = i1 + i
            if not act_order:
                starts = (r % g == 0) & (r < n_in)
                params = lax.cond(starts, lambda p: fresh_params(p, wq, w1, i, r), lambda p: p, params)
            own = {key: lax.dynamic_slice_in_dim(v, group_of[r], 1, 0) for key, v in params.items()}
            row = w1[i][None]
            code = quant.encode(row, own, spec, 0)
            e = (row - quant.decode(code, own, spec, 0))[0] / ub[i, i]
            w1 = w1 - jnp.where(later > i, ub[i], 0.0)[:, None] * e[None, :]
            return w1, err.at[i].set(e), codes1.at[i].set(code[0]), params

        w1 = lax.dynamic_slice_in_dim(wq, i1, b, 0)
        init = (w1, jnp.zeros_like(w1), jnp.zeros_like(w1, jnp.uint8), params)
        w1, err, codes1, params = lax.fori_loop(0, b, feature_step, init)
        # the lazy batch update of every later feature: w[j] -= sum_i U[i, j] e_i (U is upper triangular,
        # so earlier rows get nothing; the block's own rows, which have theirs, are written back after)
        wq = wq - jnp.matmul(lax.dynamic_slice_in_dim(u, i1, b, 0).T, err, precision=_HIGHEST)
        wq = lax.dynamic_update_slice_in_dim(wq, w1, i1, 0)
        codes = lax.dynamic_update_slice_in_dim(codes, codes1, i1, 0)
        return wq, codes, params

    codes = jnp.zeros_like(w, jnp.uint8)  # (zeros_like: w's sharding, where it has one)
    _, codes, params = lax.fori_loop(0, n_blocks, block_step, (w, codes, params))
    codes = codes[:n_in]
    if act_order:
        codes = jnp.take(codes, jnp.argsort(perm), axis=0)
    return codes, params
