"""Pruning masks in training: what keeps pruned weights zero, and gradual magnitude pruning inside the
train step.

A pruned projection holds a bool `kernel_mask` beside its kernel (`layers.PruningMask`, frozen; True =
kept). `keep_pruned`, an optimizer transform, zeroes the updates of pruned weights, so fine-tuning a
pruned model keeps them zero. `gradual_step` (config.compress.prune_start/end/every) tightens the masks
on the schedule of `sparsity_at` (Zhu and Gupta 2017) after the update. `PruningHook` brings both to the
train step (`steps.StepHook`). Which weights the offline tool prunes, and how it scores them, is
`jaxlm.compress.prune`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxlm.models import layers, transformer
from jaxlm.models.transforms.prune import MaskedKernel


@dataclasses.dataclass(frozen=True)
class PruningHook:
    """A pruned model's part of the train step (a `steps.StepHook`): `keep_pruned` among the optimizer's
    transforms, the masks passed to it, and with a schedule (`gradual`: `gradual_step`'s final, start,
    end, every) the masks tightened after each update, with the metric `sparsity`."""

    gradual: dict | None = None

    def optimizer_transforms(self) -> list[optax.GradientTransformation]:
        return [keep_pruned()]

    def update_args(self, trainable: dict, frozen: dict) -> dict:
        masks = mask_tree(trainable, frozen)
        return {} if masks is None else {"masks": masks}

    def after_update(self, trainable: dict, frozen: dict, step: jax.Array, aux: dict, finite: jax.Array
                     ) -> tuple[dict, dict]:
        if not self.gradual:
            return trainable, frozen
        return gradual_step(trainable, frozen, step, **self.gradual)

    def metrics(self, trainable: dict, frozen: dict) -> dict[str, jax.Array]:
        if not self.gradual:
            return {}
        kept = [m for m in jax.tree.leaves(mask_tree(trainable, frozen)) if m is not None]
        return {"sparsity": 1 - sum(jnp.sum(m, dtype=jnp.float32) for m in kept) / sum(m.size for m in kept)}


def step_hooks(model_cfg: transformer.ModelConfig, compress) -> list[PruningHook]:
    """The train step's hooks for a model with pruned projections (none without): gradual pruning when
    the `config.compress` section schedules it (compress.prune_end > 0)."""
    if model_cfg.pruned is None:
        return []
    gradual = dict(final=compress.sparsity, start=compress.prune_start, end=compress.prune_end,
                   every=compress.prune_every) if compress.prune_end > 0 else None
    return [PruningHook(gradual)]


def sparsity_at(step: jax.Array, final: float, start: int, end: int) -> jax.Array:
    """Gradual pruning's target (Zhu and Gupta 2017): 0 before `start`, final x (1 - (1 - t)^3) with
    t = (step - start) / (end - start) between, `final` from `end` on."""
    t = jnp.clip((jnp.asarray(step, jnp.float32) - start) / (end - start), 0.0, 1.0)
    return final * (1 - (1 - t) ** 3)


def keep_pruned() -> optax.GradientTransformationExtraArgs:
    """An optax transform that zeroes the updates of pruned weights, so they stay exactly zero: its
    update takes `masks=`, a tree like the updates where each masked kernel's leaf is its bool mask and
    every other leaf None (`mask_tree`); without masks it passes the updates through."""

    def update_fn(updates, state, params=None, *, masks=None, **extra):
        del params, extra
        if masks is None:
            return updates, state
        return jax.tree.map(lambda u, m: u if m is None else jnp.where(m, u, jnp.zeros_like(u)), updates, masks,
                            is_leaf=lambda x: x is None), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def mask_tree(trainable: dict, params: dict) -> dict | None:
    """For a trainable params tree, a tree of its shape holding, at each `kernel` whose module has a
    `kernel_mask` in `params`, that mask, and None elsewhere (what `keep_pruned` takes); None when no
    module is masked."""
    found = False

    def walk(t, p):
        nonlocal found
        out = {}
        for key, value in t.items():
            if isinstance(value, dict):
                out[key] = walk(value, p.get(key, {}) if isinstance(p, dict) else {})
            elif key == "kernel" and isinstance(p, dict) and "kernel_mask" in p:
                out[key], found = p["kernel_mask"], True
            else:
                out[key] = None
        return out

    tree = walk(trainable, params)
    return tree if found else None


def magnitude_mask(kernel: jax.Array, sparsity: jax.Array, stacked: bool) -> jax.Array:
    """Keep all but the floor(sparsity x n) smallest |w| of the kernel (of each layer's, `stacked`: a
    leading layers axis); `sparsity` may be traced (gradual pruning's schedule)."""

    def one(k):
        flat = jnp.abs(k.astype(jnp.float32)).reshape(-1)
        drop = jnp.floor(sparsity * flat.size).astype(jnp.int32)
        ranks = jnp.zeros(flat.shape, jnp.int32).at[jnp.argsort(flat, stable=True)].set(
            jnp.arange(flat.size, dtype=jnp.int32))
        return (ranks >= drop).reshape(k.shape)

    return jax.vmap(one)(kernel) if stacked else one(kernel)


def gradual_step(trainable: dict, frozen: dict, step: jax.Array, *, final: float, start: int, end: int, every: int,
                 stacked_prefixes: tuple[str, ...] = transformer.STACKS) -> tuple[dict, dict]:
    """Gradual magnitude pruning inside the train step: at step `start` and every `every` steps up to
    `end`, each masked kernel's mask becomes its old mask and the magnitude mask at `sparsity_at(step)`
    (per matrix: per layer of the scanned blocks under `stacked_prefixes`, whose kernels lead with a
    layers axis), and the kernel is zeroed where the mask is False. Between those steps nothing
    changes; the work runs under a `lax.cond`, only at pruning steps."""
    masks = mask_tree(trainable, frozen)
    if masks is None:
        return trainable, frozen
    step = jnp.asarray(step)
    due = (step >= start) & (step <= end) & ((step - start) % every == 0)
    target = sparsity_at(step, final, start, end)

    def prune(args):
        t, f = args
        return _apply(t, f, target, stacked_prefixes)

    return jax.lax.cond(due, prune, lambda args: args, (trainable, frozen))


def _apply(trainable: dict, frozen: dict, target: jax.Array, stacked_prefixes: tuple[str, ...],
           path: tuple = ()) -> tuple[dict, dict]:
    """`gradual_step`'s pruning: every (kernel, kernel_mask) pair in the two trees, recomputed."""
    t_out, f_out = dict(trainable), dict(frozen)
    for key, value in trainable.items():
        if isinstance(value, dict):
            t_out[key], f_out[key] = _apply(value, frozen.get(key, {}), target, stacked_prefixes, path + (key,))
            if not f_out[key] and key not in frozen:
                del f_out[key]
        elif key == "kernel" and "kernel_mask" in frozen:
            stacked = bool(path) and path[0] in stacked_prefixes and not any(isinstance(p, int) for p in path)
            mask = frozen["kernel_mask"] & magnitude_mask(value, target, stacked)
            t_out[key] = jnp.where(mask, value, jnp.zeros_like(value))
            f_out["kernel_mask"] = mask
    return t_out, f_out


def add_masks(params: dict, cfg, shardings: dict, mesh) -> dict:
    """Dense parameters of the model `cfg` without its masks -> with them, all True (nothing pruned yet),
    sharded as `shardings` (the masked model's) says."""
    out = jax.tree.map(lambda x: x, params)  # fresh dicts, shared leaves
    for path, projection in layers.projections(transformer.abstract_model(cfg)):
        if not isinstance(projection, MaskedKernel):
            continue
        node, where = out, shardings
        for key in path:
            node, where = node[key], where[key]
        kernel = node["kernel"]
        with jax.set_mesh(mesh):
            node["kernel_mask"] = jax.jit(lambda k: jnp.ones(k.shape, bool),
                                          out_shardings=where["kernel_mask"])(kernel)
    return out
