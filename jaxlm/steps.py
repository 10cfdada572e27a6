"""The train step and the eval step: pure functions of (state, batch), compiled once each.

A batch is a dict of int32 [B, T] arrays: `inputs`, `targets`, `segment_ids` (0 = padding) and
`positions`. Losses are token means over non-padding targets, in float32. Gradient accumulation
scans over micro-batches inside the same compiled function and sums per-token losses, so k
micro-batches give the same update as one batch of k times the size.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm.mesh import Rules, constrain
from jaxlm.train_state import ModelSpec, TrainState

Batch = dict[str, jax.Array]


def token_losses(logits: jax.Array, targets: jax.Array, z_loss: float) -> jax.Array:
    """Per-token cross-entropy in float32 [B, T], plus z_loss * log(Z)^2 when z_loss > 0."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    loss = log_z - target_logit
    if z_loss > 0:
        loss = loss + z_loss * jnp.square(log_z)
    return loss


def chunked_loss_sum(project: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array,
                     weights: jax.Array, z_loss: float, chunk_len: int) -> jax.Array:
    """Sum of weighted token losses, with logits made `chunk_len` positions at a time.

    `x` [B, T, D] are the final hidden states and `project` maps a chunk of them to logits
    [B, chunk_len, V]. Each chunk's logits are rematerialized in the backward pass, so only one
    chunk's float32 logits ([B, chunk_len, V]) is ever alive instead of the whole [B, T, V].
    Equal to `token_losses` over the whole sequence (value and gradient), up to summation order.
    """
    b, t, d = x.shape
    if t % chunk_len:
        raise ValueError(f"the loss chunk length {chunk_len} must divide the sequence length {t}")
    n = t // chunk_len

    def split(a):  # [B, T, ...] -> [n, B, chunk_len, ...]
        return a.reshape(b, n, chunk_len, *a.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_loss(x_c, t_c, w_c):
        return jnp.sum(token_losses(project(x_c), t_c, z_loss) * w_c)

    def body(total, chunk):
        return total + chunk_loss(*chunk), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x), split(targets), split(weights)))[0]


def summed_loss(params, spec: ModelSpec, batch: Batch, dropout_key, z_loss: float, loss_chunk_len: int = 0):
    """(sum of token losses, number of tokens) over the non-padding targets of a batch; with
    `loss_chunk_len`, the logits are made that many positions at a time (`chunked_loss_sum`)."""
    model = nnx.merge(spec.graphdef, params)
    weights = (batch["segment_ids"] > 0).astype(jnp.float32)
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    if loss_chunk_len and loss_chunk_len < batch["inputs"].shape[1]:
        x = model(*args, dropout_key=dropout_key, hidden=True)
        return chunked_loss_sum(model.logits, x, batch["targets"], weights, z_loss, loss_chunk_len), jnp.sum(weights)
    logits = model(*args, dropout_key=dropout_key)
    return jnp.sum(token_losses(logits, batch["targets"], z_loss) * weights), jnp.sum(weights)


def _split_micro(batch: Batch, k: int) -> Batch:
    """[B, T] -> [k, B/k, T], micro-batch i taking rows i, i+k, ...: each device keeps its own rows."""

    def split(x):
        b = x.shape[0]
        x = x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "act_batch", "act_seq"))

    return jax.tree.map(split, batch)


def norms_by_group(tree, logical_names) -> dict[str, jax.Array]:
    """L2 norms of `tree` (params or grads) per layer and per top-level group.

    Keys: `layer_NN` for each decoder block (scanned blocks are split along their `layers` axis,
    unrolled ones are found by their index), and the name of every other top-level entry
    (`embed`, `final_norm`, `unembed`, ...).
    """
    squares: dict[str, jax.Array] = {}

    def add(key: str, value: jax.Array) -> None:
        squares[key] = squares.get(key, 0.0) + value

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = jax.tree_util.tree_leaves(logical_names, is_leaf=lambda x: isinstance(x, tuple))
    for (path, leaf), axes in zip(leaves, names, strict=True):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        sq = jnp.square(leaf.astype(jnp.float32))
        if "layers" in axes:  # scanned blocks: one leading slice per layer
            layer_axis = axes.index("layers")
            per_layer = jnp.sum(sq, axis=tuple(a for a in range(leaf.ndim) if a != layer_axis))
            for i in range(leaf.shape[layer_axis]):
                add(f"layer_{i:02d}", per_layer[i])
        elif len(keys) > 1 and isinstance(keys[1], int):  # unrolled blocks: blocks/<i>/...
            add(f"layer_{keys[1]:02d}", jnp.sum(sq))
        else:
            add(str(keys[0]), jnp.sum(sq))
    return {key: jnp.sqrt(value) for key, value in sorted(squares.items())}


def make_train_step(
    spec: ModelSpec,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    micro_batches: int = 1,
    z_loss: float = 0.0,
    dropout: bool = False,
    rules: Rules = (),
    grad_norm_per_layer: bool = False,
    loss_chunk_len: int = 0,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The uncompiled train step; `compile_train_step` jits it with shardings and donation.

    Metrics: loss, grad_norm (before clipping), param_norm (after the update), lr, tokens, skipped
    (1 when a non-finite update was dropped), and with `grad_norm_per_layer` a `grad_norm/<group>`
    per layer and top-level group (`norms_by_group`).
    """
    grad_fn = jax.value_and_grad(summed_loss, has_aux=True)

    def step_fn(state: TrainState, batch: Batch):
        with spmd.logical_axis_rules(rules):
            key = jax.random.fold_in(state.rng, state.step) if dropout else None
            if micro_batches == 1:
                (loss_sum, tokens), grads = grad_fn(state.params, spec, batch, key, z_loss, loss_chunk_len)
            else:
                micro = _split_micro(batch, micro_batches)
                keys = jax.random.split(key, micro_batches) if dropout else None

                def accumulate(carry, xs):
                    loss_acc, tok_acc, grad_acc = carry
                    mb, mkey = xs
                    (l, t), g = grad_fn(state.params, spec, mb, mkey, z_loss, loss_chunk_len)
                    return (loss_acc + l, tok_acc + t, jax.tree.map(jnp.add, grad_acc, g)), None

                zeros = jax.tree.map(jnp.zeros_like, state.params)
                init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
                loss_sum, tokens, grads = jax.lax.scan(accumulate, init, (micro, keys))[0]
            denom = jnp.maximum(tokens, 1.0)
            grads = jax.tree.map(lambda g: g / denom, grads)
            loss, grad_norm = loss_sum / denom, optax.tree.norm(grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            # A non-finite loss or gradient never reaches the state: the update is dropped (the
            # select fuses into the elementwise optimizer update), and the host applies the policy.
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "tokens": tokens,
            "skipped": (~finite).astype(jnp.int32),
            "param_norm": optax.tree.norm(params),
        }
        if grad_norm_per_layer:
            metrics.update({f"grad_norm/{k}": v for k, v in norms_by_group(grads, spec.logical_names).items()})
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return step_fn


def make_eval_step(spec: ModelSpec, rules: Rules = (), loss_chunk_len: int = 0):
    """(params, batch) -> (sum of token losses, tokens): summed so batches combine exactly."""

    def eval_fn(params, batch: Batch):
        with spmd.logical_axis_rules(rules):
            return summed_loss(params, spec, batch, None, 0.0, loss_chunk_len)

    return eval_fn


def compile_train_step(step_fn, state_shardings: TrainState, batch_sharding: NamedSharding):
    """jit with explicit shardings; the state is donated so its buffers are reused in place."""
    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def compile_eval_step(eval_fn, params_shardings, batch_sharding: NamedSharding):
    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(eval_fn, in_shardings=(params_shardings, batch_sharding), out_shardings=replicated)

