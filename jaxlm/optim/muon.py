"""Muon: momentum orthogonalized by Newton-Schulz for the weight matrices, AdamW for the rest.

Which parameters are matrices is the model's answer (`train_state.ModelSpec.matrices`, from each
`layers.Projection`'s contraction): the kernels of the attention's and the MLPs' projections. A kernel
of more than two dimensions is the matrix its projection computes with, its input dimensions flattened
into the rows and its output dimensions into the columns: q, k and v, [d_model, heads, head_dim], are
the matrix [d_model, heads x head_dim], and the output projection [heads, head_dim, d_model] the matrix
[heads x head_dim, d_model], as the reference implementations treat fused projections. A scanned stack's
leading layers axis and an MoE's experts axis index independent matrices: each layer's (each expert's)
is orthogonalized on its own. Everything else goes to AdamW, as in Keller Jordan's and Moonshot's
implementations: the token embedding, the output head (the unembedding, or the tied embedding), norms,
biases, an MoE's router (a small [d_model, experts] map to logits, like the head), learned positions and
LoRA's adapters.

Each matrix's update, from its gradient G and momentum M (optax's `scale_by_muon`, same state):

    M <- beta M + (1 - beta) G;   U = beta M^ + (1 - beta) G^  (Nesterov; else U = M^), ^ bias-corrected
    X = U / (|U|_F + eps), transposed to the wide side;  5 times  X <- a X + (b A + c A A) X,  A = X X^T
    update = -lr (s X + weight_decay W),   s = 0.2 sqrt(max(rows, cols))  ("rms": Moonshot's, whose update
             has AdamW's RMS, so the two share peak_lr) or sqrt(max(1, cols / rows))  ("shape": Keller Jordan's)

The iteration acts on each whole matrix, whatever the mesh splits it over. `optim.muon_layout`:
"distributed" (the default) stacks the matrices of one shape from every parameter (a tall one turned
wide), splits the stack over all the mesh's devices, each device iterating on whole matrices of its own,
and sends the results back (an all-to-all each way); "gather" iterates on each whole matrix on every
device that holds a piece of it (a stack's layers and experts stay split as their parameter is), every
device computing every matrix; "sharded" leaves the matmuls of the split matrix to XLA's SPMD partitioner,
which regathers their operands in every iteration. All three compute the same update; "distributed" is the
default because it is the cheapest of the three on the 1b recipe's compiled H100 program (benchmarks/BENCHMARKS.md,
"Muon's update under sharding").
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxlm.mesh import constrain
from jaxlm.optim.adamw import adamw_transforms
from jaxlm.optim.base import (
    Matrix,
    Optimizer,
    increment_unless,
    is_matrix_leaf,
    keep,
    plain_matrices,
    scale_by_learning_rate_unless,
)

LR_SCALES = ("rms", "shape", "none")
LAYOUTS = ("distributed", "gather", "sharded")
RMS = 0.2  # Moonshot's update RMS: AdamW's, measured (Liu et al. 2025, "Muon is Scalable for LLM Training")


def parse_coeffs(text: str) -> tuple[float, float, float]:
    """`optim.muon_ns_coeffs`, "a,b,c", as three numbers (ValueError unless it is)."""
    values = tuple(float(v) for v in text.split(","))
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{text!r} is not three finite numbers")
    return values


def _iterate(x: jax.Array, coeffs: tuple[float, float, float], steps: int, eps: float) -> jax.Array:
    """[..., rows, cols] with rows <= cols: each matrix scaled to unit Frobenius norm, then `steps` quintic
    iterations X <- a X + (b A + c A A) X, A = X X^T."""
    a, b, c = coeffs
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def newton_schulz(x: jax.Array, coeffs: tuple[float, float, float], steps: int, eps: float) -> jax.Array:
    """[..., rows, cols] -> the same, each matrix of the trailing two dimensions approximately
    orthogonalized (U V^T of its SVD, singular values near 1) by `steps` quintic Newton-Schulz
    iterations, on its wide side (X X^T the smaller Gram matrix), after scaling to unit Frobenius norm."""
    if x.shape[-2] > x.shape[-1]:
        return jnp.swapaxes(_iterate(jnp.swapaxes(x, -1, -2), coeffs, steps, eps), -1, -2)
    return _iterate(x, coeffs, steps, eps)


def _to_matrices(x: jax.Array, matrix: Matrix) -> jax.Array:
    """A parameter-shaped array as [*batch, rows, cols] (`Matrix`)."""
    rows, cols = matrix.shape(x.shape)
    return x.transpose((*matrix.batch, *matrix.rows, *matrix.cols)).reshape(
        *(x.shape[i] for i in matrix.batch), rows, cols)


def _from_matrices(y: jax.Array, matrix: Matrix, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `_to_matrices`, back to the parameter's `shape`."""
    order = (*matrix.batch, *matrix.rows, *matrix.cols)
    return y.reshape(tuple(shape[i] for i in order)).transpose(tuple(order.index(i) for i in range(len(shape))))


def _pin(x: jax.Array, spec: P) -> jax.Array:
    """`x` constrained to `spec` on the mesh in scope; as it is outside one."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def orthogonalize(x: jax.Array, matrix: Matrix, coeffs, steps: int, eps: float, layout: str) -> jax.Array:
    """A parameter-shaped array orthogonalized as the matrices `matrix` says it holds, in `layout` "gather" or
    "sharded" (`orthogonalize_all` takes "distributed")."""
    y = _to_matrices(x, matrix)
    if layout == "gather":  # each matrix whole on every device; its stack's layers and experts split as the param's
        names = (*matrix.batch_names, None, None)
        y = constrain(newton_schulz(constrain(y, names), coeffs, steps, eps), names)
    else:
        y = newton_schulz(y, coeffs, steps, eps)
    return _from_matrices(y, matrix, x.shape)


def orthogonalize_all(matrices: list[Matrix], xs: list[jax.Array], coeffs, steps: int, eps: float,
                      layout: str) -> list[jax.Array]:
    """Parameter-shaped arrays orthogonalized as their `matrices` say. "distributed": the matrices of one shape
    (after turning the tall ones wide), from every parameter, stacked and split over all the mesh's devices,
    each device iterating on whole matrices of its own (the stack padded with zeros to a multiple of the devices;
    a zero matrix stays zero); then each back to its parameter's layout."""
    if layout != "distributed":
        return [orthogonalize(x, m, coeffs, steps, eps, layout) for m, x in zip(matrices, xs, strict=True)]
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    devices = math.prod(mesh.shape[a] for a in axes)
    wide = []
    for m, x in zip(matrices, xs, strict=True):
        y = _to_matrices(x, m)
        y = y.reshape(-1, *y.shape[-2:])
        wide.append(jnp.swapaxes(y, -1, -2) if y.shape[-2] > y.shape[-1] else y)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, y in enumerate(wide):
        groups.setdefault(y.shape[-2:], []).append(i)
    out: list[jax.Array | None] = [None] * len(xs)
    for members in groups.values():
        stack = jnp.concatenate([wide[i] for i in members])
        count = stack.shape[0]
        stack = jnp.pad(stack, ((0, -count % devices), (0, 0), (0, 0)))
        spec = P(axes or None, None, None)
        stack = _pin(_iterate(_pin(stack, spec), coeffs, steps, eps), spec)[:count]
        start = 0
        for i in members:
            y = stack[start:start + wide[i].shape[0]]
            start += y.shape[0]
            m, x = matrices[i], xs[i]
            rows, cols = m.shape(x.shape)
            y = jnp.swapaxes(y, -1, -2) if rows > cols else y
            out[i] = _from_matrices(y.reshape(*(x.shape[j] for j in m.batch), rows, cols), m, x.shape)
    return out


def shape_scale(matrix: Matrix, shape: tuple[int, ...], lr_scale: str) -> float:
    """The factor on a matrix's orthogonalized update (`optim.muon_lr_scale`)."""
    rows, cols = matrix.shape(shape)
    if lr_scale == "rms":
        return RMS * math.sqrt(max(rows, cols))
    if lr_scale == "shape":
        return math.sqrt(max(1.0, cols / rows))
    return 1.0


def _resolve(matrices, tree):
    return matrices(tree) if callable(matrices) else matrices


def scale_by_muon_unless(matrices, coeffs: tuple[float, float, float], steps: int, beta: float, nesterov: bool,
                         eps: float, lr_scale: str, layout: str) -> optax.GradientTransformationExtraArgs:
    """`optax.contrib.scale_by_muon` (same state, same momentum and orthogonalization) whose count and
    momentum stay unchanged when `finite` is false, followed by the shape's scale (`shape_scale`).
    `matrices`: a tree like the updates of `Matrix` (None: not one; optax's `MaskedNode` where `partition`
    gives this transform none), or a function of the updates that returns one."""

    def init_fn(params):
        return optax.contrib.scale_by_muon(coeffs, steps, beta, eps, nesterov=nesterov).init(params)

    def update_fn(updates, state, params=None, *, finite=True, **extra):
        del params, extra
        mu = keep(finite, optax.tree.update_moment(updates, state.mu, beta, 1), state.mu)
        count = increment_unless(finite, state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)

        # the matrices' momenta (optax's MaskedNode in place of another transform's parameter)
        is_leaf = lambda x: is_matrix_leaf(x) or isinstance(x, optax.MaskedNode)  # noqa: E731
        specs, treedef = jax.tree.flatten(_resolve(matrices, updates), is_leaf=is_leaf)
        momenta = treedef.flatten_up_to(mu_hat)
        mine = [i for i, m in enumerate(specs) if isinstance(m, Matrix)]
        done = orthogonalize_all([specs[i] for i in mine], [momenta[i] for i in mine], coeffs, steps, eps, layout)
        for i, x in zip(mine, done, strict=True):
            momenta[i] = shape_scale(specs[i], x.shape, lr_scale) * x
        return treedef.unflatten(momenta), optax.contrib.MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def labels(matrices) -> Any:
    """"muon" for the matrices, "adamw" for the others: `optax.partition`'s labels."""
    return jax.tree.map(lambda m: "muon" if m is not None else "adamw", matrices, is_leaf=is_matrix_leaf)


class Muon(Optimizer):
    """Muon for the weight matrices (module docstring), AdamW (`b1`, `b2`, `eps`) for the other parameters at
    `muon_adam_lr_ratio` times the schedule's learning rate; `weight_decay` on the decay mask's parameters of both."""

    name = "muon"
    state = "Muon's momentum of the matrices, AdamW's mu and nu of the rest (float32), step counts"

    @classmethod
    def transforms(cls, o, schedule, decay_mask, matrices):
        matrices = plain_matrices if matrices is None else matrices
        coeffs = parse_coeffs(o.muon_ns_coeffs)
        ratio = o.muon_adam_lr_ratio
        muon = optax.chain(
            scale_by_muon_unless(matrices, coeffs, o.muon_ns_steps, o.muon_momentum, o.muon_nesterov, o.eps,
                                 o.muon_lr_scale, o.muon_layout),
            optax.add_decayed_weights(o.weight_decay, decay_mask),
            scale_by_learning_rate_unless(schedule),
        )
        adamw = optax.chain(*adamw_transforms(o.b1, o.b2, o.eps, o.weight_decay, decay_mask,
                                              lambda count: ratio * schedule(count)))
        return [optax.partition({"muon": muon, "adamw": adamw},
                                lambda tree: labels(_resolve(matrices, tree)))]
