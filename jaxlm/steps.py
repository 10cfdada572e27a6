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


def summed_loss(params, spec: ModelSpec, batch: Batch, dropout_key, z_loss: float):
    """(sum of token losses, number of tokens) over the non-padding targets of a batch."""
    model = nnx.merge(spec.graphdef, params)
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"], dropout_key=dropout_key)
    weights = (batch["segment_ids"] > 0).astype(jnp.float32)
    return jnp.sum(token_losses(logits, batch["targets"], z_loss) * weights), jnp.sum(weights)


def _split_micro(batch: Batch, k: int) -> Batch:
    """[B, T] -> [k, B/k, T], micro-batch i taking rows i, i+k, ...: each device keeps its own rows."""

    def split(x):
        b = x.shape[0]
        x = x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "act_batch", "act_seq"))

    return jax.tree.map(split, batch)


def make_train_step(
    spec: ModelSpec,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    micro_batches: int = 1,
    z_loss: float = 0.0,
    dropout: bool = False,
    rules: Rules = (),
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The uncompiled train step; `compile_train_step` jits it with shardings and donation."""
    grad_fn = jax.value_and_grad(summed_loss, has_aux=True)

    def step_fn(state: TrainState, batch: Batch):
        with spmd.logical_axis_rules(rules):
            key = jax.random.fold_in(state.rng, state.step) if dropout else None
            if micro_batches == 1:
                (loss_sum, tokens), grads = grad_fn(state.params, spec, batch, key, z_loss)
            else:
                micro = _split_micro(batch, micro_batches)
                keys = jax.random.split(key, micro_batches) if dropout else None

                def accumulate(carry, xs):
                    loss_acc, tok_acc, grad_acc = carry
                    mb, mkey = xs
                    (l, t), g = grad_fn(state.params, spec, mb, mkey, z_loss)
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
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return step_fn


def make_eval_step(spec: ModelSpec, rules: Rules = ()):
    """(params, batch) -> (sum of token losses, tokens): summed so batches combine exactly."""

    def eval_fn(params, batch: Batch):
        with spmd.logical_axis_rules(rules):
            return summed_loss(params, spec, batch, None, 0.0)

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

