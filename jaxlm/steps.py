"""The train step and the eval step: pure functions of (state, batch), compiled once each.

A batch is a dict of [B, T] arrays: `inputs`, `targets`, `segment_ids` (0 = padding), `positions`
(int32) and `weights` (float32, each target's weight in the loss: 0 for padding, and for whatever
else should not be learned, such as an SFT prompt). Losses are weighted token means, in float32.
Gradients exist for the trainable parameters only (`ModelSpec.trainable`). Gradient accumulation
scans over micro-batches inside the same compiled function and sums per-token losses, so k
micro-batches give the same update as one batch of k times the size. Over the mesh's `data` axis
(where every replica holds the whole parameters) each replica keeps its own running gradient and
the replicas' gradients are reduced once per step, not once per micro-batch
(`_replica_local_grads`); over `fsdp` each micro-batch's gradient is reduce-scattered onto the
parameter shards, as FSDP must (a local copy of the whole gradient would undo its memory saving).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import loss_scale as loss_scale_lib
from jaxlm.mesh import Rules, axes_of, constrain, logical_to_spec
from jaxlm.metrics import MetricsConfig
from jaxlm.models import attention, aux, transformer
from jaxlm.optim import OptimConfig
from jaxlm.train_state import ModelSpec, TrainState

Batch = dict[str, jax.Array]


@jax.custom_vjp
def peak_and_target(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the largest logit, the target's logit) per position [B, T] from logits [B, T, V], in one pass over
    the logits: one reduction of two operands (the logits' maximum beside the sum of the target's masked
    logit), where two reductions read the logits twice (XLA does not fuse a max and a sum of one operand).

    The target's logit is a masked sum, not a gather: with the vocabulary split over `tensor` it is a
    local reduction plus a [B, T] collective, where a gather makes XLA reshard the whole logits. A target
    outside the vocabulary picks nothing (0). The maximum has no gradient: it is logsumexp's shift, which
    the result does not depend on (`jax.nn.logsumexp` stops its gradient too)."""
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.where(vocab == targets[..., None], logits, 0.0)
    init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype))
    return jax.lax.reduce((logits, picked), init, lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]),
                          (logits.ndim - 1,))


def _peak_and_target_fwd(logits, targets):
    # an empty [V, 0] array carries the vocabulary's size and the logits' dtype to the backward pass
    return peak_and_target(logits, targets), (targets, jnp.zeros((logits.shape[-1], 0), logits.dtype))


def _peak_and_target_bwd(residuals, cotangents):
    targets, empty = residuals
    shape = (*targets.shape, empty.shape[0])
    vocab = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    return jnp.where(vocab == targets[..., None], cotangents[1][..., None], 0.0).astype(empty.dtype), None


peak_and_target.defvjp(_peak_and_target_fwd, _peak_and_target_bwd)


def token_losses(logits: jax.Array, targets: jax.Array, z_loss: float) -> jax.Array:
    """Per-token cross-entropy in float32 [B, T], plus z_loss * log(Z)^2 when z_loss > 0.

    log(Z) as `jax.nn.logsumexp` computes it (shifted by the largest logit, a non-finite one shifting
    by 0); the logits are read twice in the forward pass (the largest and the target's logit in one
    pass, `peak_and_target`; the shifted exponentials' sum in another) and once in the backward pass."""
    logits = logits.astype(jnp.float32)
    peak, target_logit = peak_and_target(logits, targets)
    peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    log_z = peak + jnp.log(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))
    loss = log_z - target_logit
    if z_loss > 0:
        loss = loss + z_loss * jnp.square(log_z)
    return loss


def position_chunks(seq_len: int, chunk_len: int) -> Callable[[jax.Array], jax.Array]:
    """The function that cuts a [B, T, ...] array into [T / chunk_len, B, chunk_len, ...] (a scan over its
    chunks of positions); `chunk_len` must divide `seq_len`."""
    if seq_len % chunk_len:
        raise ValueError(f"the loss chunk length {chunk_len} must divide the sequence length {seq_len}")
    n = seq_len // chunk_len

    def split(a):
        return a.reshape(a.shape[0], n, chunk_len, *a.shape[2:]).swapaxes(0, 1)

    return split


def chunked_loss_sum(project: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array,
                     weights: jax.Array, z_loss: float, chunk_len: int,
                     groups: tuple[jax.Array, int] | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Sum of weighted token losses, with logits made `chunk_len` positions at a time.

    `x` [B, T, D] are the final hidden states and `project` maps a chunk of them to logits
    [B, chunk_len, V]. Each chunk's logits are rematerialized in the backward pass, so only one
    chunk's float32 logits ([B, chunk_len, V]) is ever alive instead of the whole [B, T, V].
    Equal to `token_losses` over the whole sequence (value and gradient), up to summation order.
    `groups`: (each token's group [B, T], the number of groups); then (the sum, the sums by group
    [groups], not differentiated: `group_sums`).
    """
    split = position_chunks(x.shape[1], chunk_len)
    if groups is not None:
        ids, count = groups

        @jax.checkpoint
        def chunk_sums(x_c, t_c, w_c, g_c):
            losses = token_losses(project(x_c), t_c, z_loss) * w_c
            return jnp.sum(losses), jax.lax.stop_gradient(group_sums(losses, g_c, count))

        def grouped(carry, chunk):
            total, by_group = chunk_sums(*chunk)
            return (carry[0] + total, carry[1] + by_group), None

        init = (jnp.zeros((), jnp.float32), jnp.zeros((count,), jnp.float32))
        return jax.lax.scan(grouped, init, (split(x), split(targets), split(weights), split(ids)))[0]

    @jax.checkpoint
    def chunk_loss(x_c, t_c, w_c):
        return jnp.sum(token_losses(project(x_c), t_c, z_loss) * w_c)

    def body(total, chunk):
        return total + chunk_loss(*chunk), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x), split(targets), split(weights)))[0]


def group_sums(values: jax.Array, ids: jax.Array, count: int) -> jax.Array:
    """Sums of `values` [B, T] by each position's group `ids` [B, T] (0 .. count - 1) -> [count], float32: a
    data mixture's loss and tokens by source (`ids`: the batch's `source_ids`)."""
    member = ids[..., None] == jnp.arange(count, dtype=ids.dtype)  # [B, T, count]
    return jnp.sum(jnp.where(member, values[..., None].astype(jnp.float32), 0.0), axis=(0, 1))


SOURCE_LOSS, SOURCE_TOKENS = "mixture/loss_sum", "mixture/tokens"  # a data mixture's sums by source


def summed_loss(params, model_spec: ModelSpec, batch: Batch, dropout_key, z_loss: float, loss_chunk_len: int = 0,
                with_aux: bool = False, sources: int = 0):
    """(weighted sum of token losses, sum of weights) over a batch; with `loss_chunk_len`, the
    logits are made that many positions at a time (`chunked_loss_sum`).

    `with_aux` (training): the blocks' auxiliary outputs (`jaxlm.models.aux`) too, each times the sum
    of weights, so that they add up over micro-batches as the loss does: (the sum plus the auxiliary loss
    terms times the sum of weights, (sum of weights, the auxiliary outputs times it)). With `sources` (a data
    mixture's count; the batch's `source_ids` say each token's), also `SOURCE_LOSS` and `SOURCE_TOKENS`: the
    weighted token losses (z-loss included, the blocks' auxiliary terms not) and the weights summed by source
    [sources], from the same forward pass."""
    model = nnx.merge(model_spec.graphdef, params)
    weights = batch["weights"]
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    by_source = with_aux and sources > 0
    if loss_chunk_len and loss_chunk_len < batch["inputs"].shape[1]:
        x, out = model(*args, dropout_key=dropout_key, hidden=True, with_aux=True)
        groups = (batch["source_ids"], sources) if by_source else None
        total = chunked_loss_sum(model.logits, x, batch["targets"], weights, z_loss, loss_chunk_len, groups)
        if by_source:
            total, source_loss = total
    else:
        logits, out = model(*args, dropout_key=dropout_key, with_aux=True)
        losses = token_losses(logits, batch["targets"], z_loss) * weights
        total = jnp.sum(losses)
        if by_source:
            source_loss = jax.lax.stop_gradient(group_sums(losses, batch["source_ids"], sources))
    tokens = jnp.sum(weights)
    if not with_aux:
        return total, tokens
    for term in aux.loss_terms(out):
        total = total + term * tokens
    out = aux.scale(out, tokens)
    if by_source:
        out = {**out, SOURCE_LOSS: source_loss, SOURCE_TOKENS: group_sums(weights, batch["source_ids"], sources)}
    return total, (tokens, out)


def trainable_loss(trainable, frozen, model_spec: ModelSpec, batch: Batch, dropout_key, z_loss: float,
                   loss_chunk_len: int = 0, *, sources: int = 0):
    """`summed_loss` with the auxiliary outputs, as a function of the trainable parameters, the frozen
    ones held fixed (and with `sources`, a data mixture's sums by source)."""
    return summed_loss(model_spec.merge(trainable, frozen), model_spec, batch, dropout_key, z_loss, loss_chunk_len,
                       with_aux=True, sources=sources)


def _split_micro(batch: Batch, k: int) -> Batch:
    """[B, T] -> [k, B/k, T], micro-batch i taking rows i, i+k, ...: each device keeps its own rows."""

    def split(x):
        b = x.shape[0]
        x = x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "act_batch", "act_seq"))

    return jax.tree.map(split, batch)


def _without(rules: Rules, axis: str) -> Rules:
    """`rules` with the mesh axis `axis` removed from every entry."""
    out = []
    for name, axes in rules:
        kept = tuple(a for a in axes_of(axes) if a != axis)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


def data_replicas(model_spec: ModelSpec, rules: Rules) -> int:
    """How many `data` replicas the current mesh has, for replica-local gradient accumulation:
    1 (use the plain accumulation) outside a mesh, without a `data` axis > 1, or when a rule puts a
    parameter's dimension on `data` (then replicas do not hold whole parameters).

    Only `data`: the other batch axes' devices reduce their gradients in every micro-batch, fsdp's
    because they hold slices of the parameters, expert's because an MoE model's expert weights are
    split over it (a dense model that wants replica-local sums puts those devices on `data`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "data" not in mesh.axis_names or mesh.shape["data"] == 1:
        return 1
    for names in jax.tree.leaves(model_spec.logical_names, is_leaf=lambda x: isinstance(x, tuple)):
        if any("data" in axes_of(a) for a in logical_to_spec(names, rules)):
            return 1
    return mesh.shape["data"]


def _replica_local_grads(grad_fn, params, frozen, model_spec: ModelSpec, batch: Batch, keys, k: int, replicas: int,
                         rules: Rules, z_loss: float, loss_chunk_len: int, aux_shapes: aux.Shapes | None = None,
                         inputs: tuple = ()):
    """Sum of k micro-batches' (loss sum, tokens, auxiliary outputs, gradients), each `data` replica
    accumulating its own rows' gradient locally and the replicas reduced once at the end. `inputs`: the
    objective's frozen inputs (`Objective.frozen_inputs`), the loss's last arguments, the same for every
    replica (not vmapped: a distillation teacher's parameters, sharded as the student's).

    The batch [B, T] becomes [k, R, B/(kR), T]: replica r's rows are the ones it already holds
    (rows are split over the act_batch axes, data first: data x fsdp x expert) and micro-batch i
    takes the same rows as `_split_micro`. The gradient is vmapped over R with
    `spmd_axis_name="data"`, so its leading axis lives on `data` and XLA never needs to reduce across
    replicas inside the scan; inside the vmap the rules leave `data` out (the vmap owns it).
    """
    inner = _without(rules, "data") + (("replica", "data"),)
    row_names = (None, "replica", "act_batch", "act_seq")

    def split(x):
        b = x.shape[0]
        x = x.reshape(replicas, b // (replicas * k), k, *x.shape[1:]).transpose(2, 0, 1, *range(3, x.ndim + 2))
        return jax.lax.with_sharding_constraint(x, logical_to_spec(row_names[: x.ndim], inner))

    def acc_spec(names):  # [R, *param]: replicas over data, the rest as the parameter
        return logical_to_spec(("replica", *names), inner)

    acc_specs = jax.tree.map(acc_spec, model_spec.compute_names(), is_leaf=lambda x: isinstance(x, tuple))
    micro = jax.tree.map(split, batch)
    weights, fixed, kernels = _compute_inputs(model_spec, params)

    def replica_grad(diff, mb, mkey):
        return grad_fn(diff, fixed, frozen, model_spec, mb, mkey, z_loss, loss_chunk_len, *inputs)

    def accumulate(carry, xs):
        mb, mkey = xs
        loss_acc, tok_acc, aux_acc, grad_acc = carry
        # the kernels' float32 arrays are the accumulator's own (their values unread: `layers.ComputeKernel`)
        diff = jax.tree.map(lambda k, a, w: a if k else w, kernels, grad_acc, weights)
        diff_axes = jax.tree.map(lambda k: 0 if k else None, kernels)
        with spmd.logical_axis_rules(_without(rules, "data")), attention.whole_batch_segments(mb["segment_ids"]):
            in_axes = (diff_axes, 0, None if mkey is None else 0)
            (loss, (tokens, out)), g = jax.vmap(replica_grad, in_axes=in_axes, spmd_axis_name="data")(diff, mb, mkey)
        g = jax.tree.map(jax.lax.with_sharding_constraint, g, acc_specs)
        return (loss_acc + loss, tok_acc + tokens, aux.add(aux_acc, out), jax.tree.map(jnp.add, grad_acc, g)), None

    zeros = jax.tree.map(
        lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros((replicas, *p.shape), jnp.float32), s),
        model_spec.compute_layout(params, cast=False), acc_specs,
    )
    aux_zeros = aux.zeros(dict(model_spec.aux_shapes) if aux_shapes is None else aux_shapes, lead=(replicas,))
    init = (jnp.zeros((replicas,), jnp.float32), jnp.zeros((replicas,), jnp.float32), aux_zeros, zeros)
    keys = None if keys is None else jax.random.split(keys, (k, replicas))
    (loss_sum, tokens, aux_sums, grads), _ = jax.lax.scan(accumulate, init, (micro, keys))
    grads = model_spec.param_layout(jax.tree.map(lambda g: jnp.sum(g, axis=0), grads))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return jnp.sum(loss_sum), jnp.sum(tokens), {name: jnp.sum(v, axis=0) for name, v in aux_sums.items()}, grads


def compute_kernels(model_spec: ModelSpec, rules: Rules, replicas: int) -> ModelSpec:
    """`model_spec` as the micro-batches use it: with its `layers.ComputeKernel`s (float32 weight gradients
    from the matmuls, joints joined once per step) where a micro-batch's weight gradients are whole on
    every device, none where the batch is split over mesh axes whose gradients are reduced in every
    micro-batch (fsdp, expert; data, unless its replicas accumulate locally: `replicas` > 1). There a float32
    gradient would double the bytes of every reduce-scatter, for a lower roofline (benchmarks/BENCHMARKS.md)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = axes_of(dict(rules).get("act_batch"))
    split = 1 if mesh.empty else math.prod(
        mesh.shape[a] for a in batch_axes if a in mesh.axis_names and not (a == "data" and replicas > 1))
    if split == 1:
        return model_spec
    return dataclasses.replace(model_spec, grad_kernels=frozenset(), joints=())


def _compute_inputs(model_spec: ModelSpec, trainable):
    """Once per step, for the micro-batches: the trainable parameters in the compute layout
    (`ModelSpec.compute_layout`: cast to the compute dtype, a joint's kernels joined); the same with only
    the `layers.ComputeKernel` weights (None elsewhere), which are not differentiated, as the contraction
    takes them (`layers.Contraction.prepare_kernel`: float8's quantized); and where those are
    (`ModelSpec.kernel_mask`)."""
    weights = model_spec.compute_layout(trainable)
    kernels = model_spec.kernel_mask(weights)
    prepare = (model_spec.cfg and model_spec.cfg.contraction.prepare_kernel) or (lambda w: w)  # float8's, once
    fixed = jax.tree.map(lambda k, w: prepare(w) if k else None, kernels, weights)
    return weights, fixed, kernels


def micro_batch_loss(loss_fn):
    """`loss_fn(trainable, frozen, model_spec, batch, ...)` as a micro-batch differentiates it:
    `(diff, fixed, frozen, model_spec, batch, ...)`, the trainable parameters in the compute layout split
    in two (`ModelSpec.model_params`), whose gradient is `diff`'s: float32 weight gradients where the
    model takes a `layers.ComputeKernel`, the others' as the forward uses them."""

    def loss(diff, fixed, frozen, model_spec: ModelSpec, *rest):
        return loss_fn(model_spec.model_params(diff, fixed), frozen, model_spec, *rest)

    return loss


def norms_by_group(tree, logical_names, cfg=None) -> dict[str, jax.Array]:
    """L2 norms of `tree` (params or grads) per layer and per top-level group.

    Keys: `layer_NN` for each decoder block (scanned blocks are split along their `layers` axis, each
    stack's from its first layer on: `transformer.layer_stacks` of `cfg`, the model's settings; unrolled
    ones are found by their index), and the name of every other top-level entry (`embed`, `final_norm`,
    `unembed`, ...).
    """
    firsts = {stack.name: stack.first for stack in transformer.layer_stacks(cfg)} if cfg is not None else {}
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
                add(f"layer_{firsts.get(keys[0], 0) + i:02d}", per_layer[i])
        elif len(keys) > 1 and isinstance(keys[1], int):  # unrolled blocks: blocks/<i>/...
            add(f"layer_{keys[1]:02d}", jnp.sum(sq))
        else:
            add(str(keys[0]), jnp.sum(sq))
    return {key: jnp.sqrt(value) for key, value in sorted(squares.items())}


class StepHook(Protocol):
    """What a model transform or component adds to the train step (`jaxlm.pruning_masks.PruningHook`,
    `jaxlm.models.mlps.moe.RouterBiasHook`): its optimizer transforms (`optim.make_optimizer`'s
    `extra`), keyword arguments of their update, a change to the parameters after the update (given the
    step's auxiliary outputs, means over its tokens, and whether the step was finite), and metrics."""

    def optimizer_transforms(self) -> list[optax.GradientTransformation]: ...

    def update_args(self, trainable: dict, frozen: dict) -> dict: ...

    def after_update(self, trainable: dict, frozen: dict, step: jax.Array, aux: dict[str, jax.Array],
                     finite: jax.Array) -> tuple[dict, dict]: ...

    def metrics(self, trainable: dict, frozen: dict) -> dict[str, jax.Array]: ...


def make_train_step(
    model_spec: ModelSpec,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    optim: OptimConfig | None = None,
    metrics: MetricsConfig | None = None,
    rules: Rules = (),
    hooks: Sequence[StepHook] = (),
    objective=None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """The uncompiled train step; `jit_train_step` jits it with shardings and donation.
    `tx` updates the trainable parameters (`model_spec.split`); the frozen ones pass through unchanged.

    What it does follows from the model (`model_spec.cfg`: dropout, the loss in chunks, cuDNN's packed
    documents), the `optim` section (`micro_batches`, resolved: accumulated by a scan; `z_loss`;
    `loss_scale_period`) and the `metrics` section (which diagnostics it computes), their defaults when
    None; it takes no other flag.

    Metrics: loss (the blocks' auxiliary loss terms included, `jaxlm.models.aux`), grad_norm (before
    clipping), param_norm (after the update), lr, tokens, skipped (1 when a non-finite update was
    dropped), `aux/<name>` for each of the model's auxiliary outputs, and with `metrics.grad_norm_per_layer`
    a `grad_norm/<group>` per layer and top-level group (`norms_by_group`). With cuDNN's packed layout
    (`ModelConfig.attention_segments`), `attention_masked`: the fraction of micro-batches with a row of more
    documents than that, whose attention fell back to the masked kernel. The step's `packed` argument
    (static) compiles one of cuDNN's two kernels for the whole step, chosen by the caller on the host's
    copy of the batch (`TrainSetup.attention_choice`), instead of a conditional per layer that makes a
    GPU wait for the host (`attention.packed_kernel`); `attention_masked` is then 0 or 1.

    `hooks`: the model's transforms' parts of the update (`StepHook`; a pruned model's
    `pruning_masks.PruningHook`): arguments of `tx.update`, a change after the update, metrics.

    `objective`: what the step minimises (`jaxlm.objectives`: its `loss`, with `trainable_loss`'s signature
    and sums over examples that add up over micro-batches, and its `aux_shapes`); None, the language
    model's loss (`trainable_loss`). Then `loss` is the objective's mean over its examples, `tokens` their
    count (pairs, for DPO), and each auxiliary entry named `<objective>/<metric>` a metric under that name
    (a mean over the examples). An objective with frozen inputs (`has_frozen_inputs`: a distillation
    teacher's parameters) makes a step of four arguments, `(state, batch, packed, inputs)`: `inputs` reaches
    its `loss` as the last argument, in every micro-batch, never differentiated, donated or kept in the state
    (`jit_train_step` gives its shardings); without, the step is `(state, batch[, packed])` as before.

    A state with a `loss_scale` (float16 compute, `jaxlm.loss_scale`) differentiates the summed loss
    times scale / positions (per micro-batch: relative to the mean loss) and divides the gradients by
    it; an overflow skips the update (metric `overflow`, not `skipped`) and the scale adapts, doubling
    after `optim.loss_scale_period` finite steps. Metric `loss_scale`. With `metrics.grad_numerics`, the fractions of
    the step's gradient entries that are exactly zero (`grad_zero_fraction`: flushed to zero, or a true
    zero) and not finite (`grad_nonfinite_fraction`), over the trainable parameters.
    """
    optim, metrics = optim or OptimConfig(), metrics or MetricsConfig()
    if optim.micro_batches < 1:
        raise ValueError("optim.micro_batches=0 must be resolved first (jaxlm.train_setup.resolve_config)")
    micro_batches, z_loss, loss_scale_period = optim.micro_batches, optim.z_loss, optim.loss_scale_period
    cfg = model_spec.cfg
    dropout = cfg is not None and (cfg.dropout > 0 or (cfg.lora is not None and cfg.lora.dropout > 0))
    loss_chunk_len = cfg.loss_chunk_len if cfg is not None else 0
    attention_segments = cfg.attention_segments if cfg is not None else 0
    grad_numerics, grad_norm_per_layer = metrics.grad_numerics, metrics.grad_norm_per_layer
    objective_loss = trainable_loss if objective is None else objective.loss
    aux_shapes = dict(model_spec.aux_shapes) if objective is None else objective.aux_shapes(model_spec)

    if getattr(objective, "has_frozen_inputs", False):
        def step_fn(state: TrainState, batch: Batch, packed: bool | None, inputs):
            with attention.packed_kernel(packed):
                return _step(state, batch, packed, (inputs,))
    else:
        def step_fn(state: TrainState, batch: Batch, packed: bool | None = None):
            with attention.packed_kernel(packed):
                return _step(state, batch, packed)

    def _step(state: TrainState, batch: Batch, packed: bool | None, inputs: tuple = ()):
        scaling = state.loss_scale
        if scaling is None:
            loss_fn = objective_loss
        else:
            def loss_fn(trainable, frozen, model_spec, batch, *rest):
                # The backward pass starts from scale / positions (the micro-batch's token slots): the scale is
                # relative to the mean loss, as in PyTorch's GradScaler, whatever the micro-batch's size
                total, stats = objective_loss(trainable, frozen, model_spec, batch, *rest)
                return total * (scaling.scale / batch["inputs"].size), stats

        grad_fn = jax.value_and_grad(loss_fn if micro_batches == 1 else micro_batch_loss(loss_fn), has_aux=True)
        with spmd.logical_axis_rules(rules):
            key = jax.random.fold_in(state.rng, state.step) if dropout else None
            trainable, frozen = model_spec.split(state.params)
            if micro_batches == 1:
                positions = batch["inputs"].size
                (loss_sum, (tokens, aux_sums)), grads = grad_fn(trainable, frozen, model_spec, batch, key, z_loss,
                                                                loss_chunk_len, *inputs)
            elif (replicas := data_replicas(model_spec, rules)) > 1:
                positions = batch["inputs"].size // (micro_batches * replicas)
                loss_sum, tokens, aux_sums, grads = _replica_local_grads(
                    grad_fn, trainable, frozen, compute_kernels(model_spec, rules, replicas), batch, key,
                    micro_batches, replicas, rules, z_loss, loss_chunk_len, aux_shapes, inputs,
                )
            else:
                spec = compute_kernels(model_spec, rules, 1)
                positions = batch["inputs"].size // micro_batches
                micro = _split_micro(batch, micro_batches)
                keys = jax.random.split(key, micro_batches) if dropout else None
                # The weights the forward casts to the compute dtype, cast once per step (and a joint's
                # kernels joined once): each micro-batch then reads them in that dtype (half of float32's
                # bytes in bfloat16). A plain projection's weight gradient comes from its GEMM in float32,
                # added to the accumulator in the GEMM's epilogue (`layers.ComputeKernel`); the others'
                # come in the compute dtype, as before the cast's transpose, and add up in float32.
                weights, fixed, kernels = _compute_inputs(spec, trainable)

                def accumulate(carry, xs):
                    loss_acc, tok_acc, aux_acc, grad_acc = carry
                    mb, mkey = xs
                    diff = jax.tree.map(lambda k, a, w: a if k else w, kernels, grad_acc, weights)
                    (loss, (tokens, out)), g = grad_fn(diff, fixed, frozen, spec, mb, mkey, z_loss, loss_chunk_len,
                                                       *inputs)
                    return (loss_acc + loss, tok_acc + tokens, aux.add(aux_acc, out),
                            jax.tree.map(jnp.add, grad_acc, g)), None

                zeros = jax.tree.map(
                    lambda k, p, n: constrain(jnp.zeros(p.shape, jnp.float32 if k else p.dtype), n),
                    kernels, spec.compute_layout(trainable, cast=False), spec.compute_names(),
                )
                init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), aux.zeros(aux_shapes), zeros)
                loss_sum, tokens, aux_sums, grads = jax.lax.scan(accumulate, init, (micro, keys))[0]
                grads = jax.tree.map(lambda g, p: g.astype(p.dtype), spec.param_layout(grads), trainable)
            denom = jnp.maximum(tokens, 1.0)
            if scaling is not None:  # back to the loss's own units, in float32
                multiplier = scaling.scale / positions
                loss_sum, denom_grads = loss_sum / multiplier, denom * multiplier
            else:
                denom_grads = denom
            grads = jax.tree.map(lambda g: g / denom_grads, grads)
            loss, grad_norm = loss_sum / denom, optax.tree.norm(grads)
            # A non-finite loss or gradient never reaches the state: the optimizer keeps its state
            # (selected inside it, so XLA updates the moments in place: jaxlm.optim), the update is
            # dropped, and the host applies the policy.
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            skipped = ~finite
            if scaling is not None:  # a finite loss whose scaled gradient overflowed: expected, the scale adapts
                overflow = jnp.isfinite(loss) & ~finite & (scaling.scale > loss_scale_lib.MIN_SCALE)
                skipped = skipped & ~overflow
                scaling = scaling.update(finite, loss_scale_period)
            extra = {}
            for hook in hooks:
                extra.update(hook.update_args(trainable, frozen))
            updates, opt_state = tx.update(grads, state.opt_state, trainable, finite=finite, **extra)
            trainable = jax.tree.map(lambda p, u: jnp.where(finite, p + u, p), trainable, updates)
            aux_means = {name: value / denom for name, value in aux_sums.items()}
            for hook in hooks:
                trainable, frozen = hook.after_update(trainable, frozen, state.step, aux_means, finite)
            params = model_spec.merge(trainable, frozen)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(state.step), jnp.float32),
            "tokens": tokens,
            "skipped": skipped.astype(jnp.int32),
            "param_norm": optax.tree.norm(params),
        }
        # the blocks' auxiliary outputs, means over the step's tokens (its loss terms are in `loss`); an
        # objective's own metrics (`<objective>/<metric>`) under their names
        metrics.update({name if "/" in name else f"aux/{name}": value for name, value in aux_means.items()})
        if state.loss_scale is not None:
            metrics["loss_scale"], metrics["overflow"] = state.loss_scale.scale, overflow.astype(jnp.int32)
        for hook in hooks:
            metrics.update(hook.metrics(trainable, frozen))
        if grad_numerics:
            leaves = jax.tree.leaves(grads)
            size = sum(g.size for g in leaves)
            metrics["grad_zero_fraction"] = sum(jnp.sum(g == 0, dtype=jnp.float32) for g in leaves) / size
            metrics["grad_nonfinite_fraction"] = sum(jnp.sum(~jnp.isfinite(g), dtype=jnp.float32) for g in leaves) / size
        if grad_norm_per_layer:
            metrics.update({f"grad_norm/{k}": v for k, v in norms_by_group(grads, model_spec.trainable_names,
                                                                                model_spec.cfg).items()})
        if attention_segments:  # the micro-batches whose cuDNN attention fell back to the masked kernel
            if packed is None:
                rows = _split_micro({"s": batch["segment_ids"]}, micro_batches)["s"]
                fits = jax.vmap(lambda r: attention.packed_fits(r, attention_segments))(rows)
                metrics["attention_masked"] = 1.0 - jnp.mean(fits.astype(jnp.float32))
            else:  # the caller's choice, for every micro-batch
                metrics["attention_masked"] = jnp.asarray(0.0 if packed else 1.0, jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=scaling)
        return new_state, metrics

    return step_fn


def make_eval_step(model_spec: ModelSpec, rules: Rules = ()):
    """(params, batch[, packed]) -> (sum of token losses, tokens): summed so batches combine exactly.
    `packed`: the attention kernel chosen on the host, as for the train step (`attention.packed_kernel`)."""
    loss_chunk_len = model_spec.cfg.loss_chunk_len if model_spec.cfg is not None else 0

    def eval_fn(params, batch: Batch, packed: bool | None = None):
        with spmd.logical_axis_rules(rules), attention.packed_kernel(packed):
            return summed_loss(params, model_spec, batch, None, 0.0, loss_chunk_len)

    return eval_fn


def jit_train_step(step_fn, state_shardings: TrainState, batch_sharding: NamedSharding, inputs_shardings=None):
    """jit with explicit shardings; the state is donated so its buffers are reused in place. The third
    argument, `packed` (positional and static: one program per value), is the attention kernel chosen
    on the host, or None (`attention.packed_kernel`). With `inputs_shardings` (an objective's frozen inputs:
    `make_train_step`), a fourth argument with those shardings, neither donated nor static."""
    replicated = NamedSharding(batch_sharding.mesh, P())
    extra = () if inputs_shardings is None else (inputs_shardings,)
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_sharding, *extra),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
        static_argnums=2,
    )


def jit_eval_step(eval_fn, params_shardings, batch_sharding: NamedSharding, inputs_shardings=None):
    """(params, batch, packed[, inputs]) as `jit_train_step`: `inputs` an objective's frozen inputs."""
    replicated = NamedSharding(batch_sharding.mesh, P())
    extra = () if inputs_shardings is None else (inputs_shardings,)
    return jax.jit(eval_fn, in_shardings=(params_shardings, batch_sharding, *extra), out_shardings=replicated,
                   static_argnums=2)

