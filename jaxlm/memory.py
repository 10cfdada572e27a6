"""The analytic memory of one train step on each device, and `optim.micro_batches=0` made concrete.

A library: `train_setup.build` resolves micro-batches with it and `python -m jaxlm.plan` reports it; it
imports neither. The train state comes from the code that creates it (`train_state.state_shardings`
on an abstract mesh), so parameters, gradients and optimizer state are exact per device for the
recipe's rules table. Activations come from formulas, per layer, of what the step's jaxpr saves for
the backward pass (`jax.ad_checkpoint.print_saved_residuals`, after XLA's deduplication) and of the
backward pass's peak; the constants below were fitted to XLA's buffer assignment of the compiled
step, and `TOLERANCE` states how far a compiled step may be from the estimate. The peak is what the
step holds throughout plus the larger of its two phases, the passes (activations, working set,
cuDNN's workspace) and the optimizer's update (`Row.phase`). Checked against the real GPU program,
compiled without a GPU (`benchmarks/memory_plan.py --target h100`: the 125m, 350m, 1b and 7b recipes
on one and eight), and against the CPU's (`tests/test_plan.py`). Elements are counted
on one device for one micro-batch of B sequences of T tokens, split as `config.mesh.rules` splits
the activations (`ActivationSizes`). XLA attention keeps [B, N, T, T] scores, which dominate long
sequences; cuDNN flash attention never materializes them, and the CPU's causal blocks (`blocked`) are
counted as it is, except that without remat in one program (layers unrolled, the CPU's default) XLA
keeps what the blocks' backward recomputes, computed ahead. Each kernel's own terms are its entry's
in `attention.KERNELS` (`attention.Kernel`); this module asks them. Under context parallelism (a sequence
split over `mesh.context`) they are its strategy's (`attention.context_kernel`: allgather keeps the gathered
keys and values beside its kernel's own, ring a flash kernel's residuals and one block's working set in its
backward), checked against the compiled step on CPUs and H100s. The measurements
behind all of this are in benchmarks/BENCHMARKS.md ("Memory plan", `benchmarks/memory_plan.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType

from jaxlm import axes, inference, optim, quant, roofline, steps, train_state
from jaxlm import config as config_lib
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.models import attention, layers, pipeline_parallel, transformer
from jaxlm.models.mlps import MLPS
from jaxlm.models.positions import POSITIONS
from jaxlm.objectives import grpo as grpo_objective

GIB = 2**30
F32 = 4
TOLERANCE = 0.15  # |compiled / analytic - 1| stated (GPU programs, small CPU steps: benchmarks/BENCHMARKS.md)
# Fitted to the buffer assignment of the compiled train step (benchmarks/BENCHMARKS.md):
WORKING_SET_NO_REMAT = 1.0  # one layer's backward: its activations' gradients, about its forward once more
WEIGHTS_IN_REMAT_BACKWARD = 0.5  # the share of a layer's full-size weights live at a recomputed layer's peak
UPDATE_COPIES = 1.0  # the optimizer's new values are computed beside the donated state before they replace it
CUDNN_FORWARD_WORKSPACE = 33_536  # bytes, what each cuDNN attention forward call of a real GPU program asks for
AUTO_SHARE = 0.85  # optim.micro_batches=0 plans to use at most this share of a device's memory (1 - TOLERANCE)


def logit_bytes(platform: str, dtype, act_bytes: int, contraction: layers.Contraction | None = None,
                tied: bool = False) -> int:
    """Bytes per logit of the loss at its peak. XLA:CPU: the unembedding's float32 dot output and its copy
    in a narrower compute dtype, both alive as the loss reads them (the peak of the tiny CPU checks of
    tests/test_plan.py and test_pipeline.py, read from XLA's buffer live ranges); in float32 compute, the
    dot output and its softmax's exponential, then the logits' gradient, and a transposed copy of that
    gradient for the unembedding's kernel gradient where the contraction `transposes_logit_gradient` (XLA's
    einsum) or the kernel is the tied embedding table (`tied`: [V, D], either contraction). A GPU: the
    compute-dtype logits alone, XLA fusing the softmax, the loss and its gradient around them (fitted to the
    compiled program's temporaries at three vocabulary sizes). benchmarks/BENCHMARKS.md, "Memory plan"."""
    if platform == "gpu":
        return act_bytes
    if _itemsize(dtype) < F32:
        return F32 + _itemsize(dtype)
    return F32 * (2 + (tied or (contraction is not None and contraction.transposes_logit_gradient)))


# ----------------------------------------------------------------------------- the train state


def cpu_act_bytes() -> int | None:
    """`estimate(act_bytes=)` for a step compiled by XLA:CPU: 4 (float32) with jaxlib < 0.11, whose
    XLA:CPU upcasts bfloat16 matmuls and activations to float32; None (the compute dtype's) from
    jaxlib 0.11 on, whose XLA:CPU keeps them in bfloat16 (measured: benchmarks/BENCHMARKS.md)."""
    return F32 if tuple(int(p) for p in jax.lib.__version__.split(".")[:2]) < (0, 11) else None


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def tree_weights(tree, bits: int = 4) -> tuple[float, float]:
    """(weights on one device, all of them) of a params tree of ShapeDtypeStructs that carry shardings,
    quantized kernels (of `bits`) counted as the weights they stand for (`quant.weights_per_element`)."""
    per_device = total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        n = quant.weights_per_element(getattr(path[-1], "key", None), bits)
        total += n * math.prod(leaf.shape)
        per_device += n * math.prod(leaf.sharding.shard_shape(leaf.shape))
    return per_device, total


def _expert_split_weights(tree, bits: int = 4) -> float:
    """The weights (all of them, as `tree_weights` counts) of the leaves split over the `expert` mesh axis."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if any("expert" in mesh_lib.axes_of(entry) for entry in leaf.sharding.spec):
            total += quant.weights_per_element(getattr(path[-1], "key", None), bits) * math.prod(leaf.shape)
    return total


def tree_bytes(tree) -> tuple[int, int]:
    """(bytes on one device, unsharded bytes) of a tree of ShapeDtypeStructs that carry shardings."""
    per_device = total = 0
    for leaf in jax.tree.leaves(tree):
        size = _itemsize(leaf.dtype)
        total += math.prod(leaf.shape) * size
        per_device += math.prod(leaf.sharding.shard_shape(leaf.shape)) * size
    return per_device, total


@functools.lru_cache(maxsize=8)
def _model_and_shapes(model_cfg, optim_items: tuple, steps: int):
    """ModelSpec, optimizer and the state's abstract shapes: they depend on the model and optimizer only."""
    optim_cfg = ml_collections.ConfigDict(dict(optim_items))
    model_spec = train_state.build_model_spec(model_cfg, optim_cfg.trainable)
    tx, _ = optim.make_optimizer(optim_cfg, steps, model_spec.decay_mask, matrices=model_spec.matrices)
    shapes = jax.eval_shape(train_state.init_fn(model_cfg, model_spec, tx, 0))
    return model_spec, tx, shapes


def _abstract_mesh(mesh_shape: Sequence[int]) -> AbstractMesh:
    return AbstractMesh(tuple(mesh_shape), axes.MESH_AXES, axis_types=(AxisType.Auto,) * len(axes.MESH_AXES))


def abstract_state(cfg: ml_collections.ConfigDict, mesh_shape: Sequence[int], model_cfg):
    """(the train state as ShapeDtypeStructs sharded over an abstract mesh of `mesh_shape`, its
    ModelSpec): the per-device layout `train_setup.build` creates (same rules, same code), without any
    device."""
    # micro-batches do not change the optimizer or the state: one build serves every count tried
    optim_items = tuple(sorted((k, v) for k, v in cfg.optim.to_dict().items() if k != "micro_batches"))
    model_spec, tx, shapes = _model_and_shapes(model_cfg, optim_items, cfg.run.steps)
    mesh = _abstract_mesh(mesh_shape)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    train_state.check_divisible(model_spec, shapes.params, mesh, rules)
    shardings = train_state.state_shardings(shapes, model_spec, tx, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings), model_spec


# ----------------------------------------------------------------------------- activations


@dataclasses.dataclass(frozen=True)
class ActivationSizes:
    """Elements on one device of each activation shape of one micro-batch (a 1-device mesh: all of it)."""

    x: float  # [B, T, D]
    q: float  # [B, T, N, H]
    kv: float  # [B, T, K, H]
    mlp: float  # [B, T, F]
    vocab: float  # [B, T, V]
    scores: float  # [B, N, T, T]: XLA attention's logits
    head_stats: float  # [B, N, T]: cuDNN attention's softmax statistics
    tokens: float  # [B, T]
    # the devices an MoE dispatch exchanges rows with: the expert axis where the rules split the experts and
    # the batch over it (expert parallelism, `moe.dispatch`: rows gathered, or capacity buffers sent by
    # all-to-all, as `MoEMLP.gathers_rows` says), else 1
    gather: int = 1
    # the context axis's size where the rules split the sequence over it (context parallelism: the attention
    # kernel is its strategy's, `attention.context_kernel`), else 1; every other count here is already split
    context: int = 1


def kernel_of(m, s: ActivationSizes) -> attention.Kernel:
    """The attention kernel whose terms count: `m.attention`'s, or under a sequence split over the context
    axis its strategy's (`model.context_attention`, `attention.context_kernel`)."""
    if s.context > 1:
        return attention.context_kernel(m.context_attention, m.attention)
    return attention.KERNELS[m.attention]


def _ways(names: Sequence[str | None], rules, mesh_sizes: dict[str, int]) -> int:
    """How many devices an activation with these logical axis names is split over."""
    pspec = mesh_lib.logical_to_spec(names, rules)
    return math.prod(mesh_sizes[axis] for entry in pspec for axis in mesh_lib.axes_of(entry))


def activation_sizes(m, rows: int, seq_len: int, rules, mesh_sizes: dict[str, int]) -> ActivationSizes:
    """Per-device element counts of one micro-batch of `rows` sequences, split as the rules split them."""
    b, t = "act_batch", "act_seq"
    tokens = rows * seq_len

    def per_device(width: float, names) -> float:
        return tokens * width / _ways(names, rules, mesh_sizes)

    return ActivationSizes(
        x=per_device(m.d_model, (b, t, "act_embed")),
        q=per_device(m.n_heads * m.head_dim, (b, t, "act_heads", None)),
        kv=per_device(m.n_kv_heads * m.head_dim, (b, t, "act_kv_heads", None)),
        mlp=per_device(m.mlp_dim, (b, t, "act_mlp")),
        vocab=per_device(m.vocab_size, (b, t, "act_vocab")),
        scores=per_device(m.n_heads * seq_len, (b, t, "act_heads", None)),
        head_stats=per_device(m.n_heads, (b, t, "act_heads")),
        tokens=per_device(1, (b, t)),
        gather=expert_gather(rules, mesh_sizes),
        context=mesh_sizes.get("context", 1) if "context" in mesh_lib.axes_of(dict(rules).get(t)) else 1,
    )


def expert_gather(rules, mesh_sizes: dict[str, int]) -> int:
    """The expert axis's size where the rules split both the experts and the batch over it (the devices
    whose rows an MoE dispatch gathers, or exchanges capacity buffers with by all-to-all), else 1."""
    table = dict(rules)
    axes = set(mesh_lib.axes_of(table.get("experts"))) & set(mesh_lib.axes_of(table.get("act_batch")))
    return math.prod(mesh_sizes.get(a, 1) for a in axes if a == "expert") or 1


def layer_forward_bytes(m, s: ActivationSizes, act_bytes: int, recomputed: bool = True,
                        norm_outputs: bool = True) -> float:
    """Bytes one block keeps for its backward pass without remat, weights aside (per device): the
    residuals of its jaxpr (`jax.ad_checkpoint.print_saved_residuals`), the norms and activation
    functions recomputed (`layers.recomputed`), which is what XLA keeps whether the layers are scanned,
    a scan unrolled or unrolled in Python (within a few percent of the compiled GPU program's growth per
    layer: benchmarks/BENCHMARKS.md).

    `recomputed=False`: as if the norms and activation functions were not recomputed: what a layer
    holds at its backward's peak (`layer_backward_bytes`).

    `norm_outputs=False`: each norm keeps its input and its rows' float32 statistic, not its output: XLA:TPU
    scales the input inside the next projections' matmul fusions, forward and backward, so the normalized
    activation is never written (`norm_outputs_kept`).
    """
    a, mlp = act_bytes, MLPS[m.mlp]
    if not recomputed:  # every intermediate, as autodiff saves it
        return (layer_forward_bytes(m, s, a, norm_outputs=norm_outputs) + (2 * (2 * F32 + a) - 4 * a) * s.x
                + (mlp.autodiff_hidden - mlp.saved_hidden) * mlp.hidden_copies(m, s.gather) * a * s.mlp)
    # each norm: its input and output (`layers.recomputed` inside), or its input and statistic
    norms = 2 * 2 * a * s.x if norm_outputs else 2 * (a * s.x + F32 * s.tokens)
    if m.qk_norm:  # and the per-head norms of q and k (Qwen3): the projections' q and k and the norms' outputs
        norms += 2 * a * (s.q + s.kv)
    qkv = a * (s.q + 2 * s.kv)  # q and k after rotary embedding, v
    rope = POSITIONS[m.position].saved_bytes_per_token(m.head_dim) * s.tokens  # RoPE: sin and cos, for q and k
    attention_out = a * s.q
    hidden = mlp.saved_hidden * mlp.hidden_copies(m, s.gather) * a * s.mlp  # SwiGLU: gate, up, product; GELU: in, out
    per_x, per_token = mlp.extra_saved(m, a, s.gather)  # an MoE's dispatched rows and routing
    hidden += per_x * s.x + per_token * s.tokens
    return norms + qkv + rope + kernel_of(m, s).forward_bytes(s, a) + attention_out + hidden


def one_program(m) -> bool:
    """Whether the layers' forward and backward passes are one straight program (layers unrolled, or a
    layer scan unrolled whole: XLA removes a loop of one trip), where XLA can merge a recomputation in
    the backward pass with the forward's values and keep those alive instead. Pipeline stages run their
    layers inside the schedule's loop: never one program (the 4-stage tiny step's peak holds no causal
    block's scores; benchmarks/BENCHMARKS.md)."""
    return m.pipeline_stages <= 1 and (not m.scan_layers or m.scan_unroll >= m.n_layers)


def layer_backward_bytes(m, s: ActivationSizes, act_bytes: int, policy: str, full_weights: float,
                         norm_outputs: bool = True) -> float:
    """The peak of one layer's backward pass beyond what is saved (per device); `full_weights`: the
    layer's weights at full size over fsdp, gathered copy and unreduced gradient (f32); `norm_outputs`: as in
    `layer_forward_bytes`."""
    a = act_bytes
    # The backward of a recomputed norm or activation holds its float32 intermediates again, briefly.
    forward = layer_forward_bytes(m, s, a, recomputed=False, norm_outputs=norm_outputs)
    kernel = kernel_of(m, s)
    if policy == "none":  # the gradients of its activations (about its forward once more), or its weights; and
        # what the attention's backward holds beyond them (context parallelism: `Kernel.working_bytes`)
        return max(WORKING_SET_NO_REMAT * forward + kernel.working_bytes(s, a), full_weights)
    # Remat recomputes the layer, then differentiates it: the attention's phase holds the recomputed
    # scores and their gradients, the rest of the layer its recomputed activations; the weights'
    # gather and gradient overlap both.
    rest = layer_forward_bytes(m, s, a, recomputed=False, norm_outputs=norm_outputs) - kernel.forward_bytes(s, a)
    return max(rest, kernel.backward_bytes(s, a)) + WEIGHTS_IN_REMAT_BACKWARD * full_weights


def cpu_merged_bytes(m, s: ActivationSizes, act_bytes: int) -> float:
    """What XLA:CPU keeps beyond `layer_forward_bytes` in a float32 program of unrolled layers without remat
    (per device): there it merges the recomputation of the norms and the activation function
    (`layers.recomputed`, whose `prevent_cse=False` lets it) with the forward's values and keeps those for
    the backward pass: each norm's normalized float32 input and the MLP's `merged_hidden` intermediates.
    It does so with either contraction (`model.matmul`: XLA's einsum, or the accumulating einsum, whose custom
    VJP saves the same operands autodiff saves: the same per-layer values were live at the two programs'
    peaks). bfloat16 programs keep no more than planned (read from XLA's buffer live ranges;
    benchmarks/BENCHMARKS.md, "the CPU plan of float32 programs")."""
    mlp = MLPS[m.mlp]
    return 2 * act_bytes * s.x + mlp.merged_hidden * mlp.hidden_copies(m, s.gather) * act_bytes * s.mlp


def norm_outputs_kept(platform: str) -> bool:
    """Whether a layer keeps its norms' outputs for the backward pass: not on TPUs, where XLA fuses the
    scaling into the projections' matmuls and keeps each norm's input and statistic (read from the 1b
    program compiled for v6e-8: the q, gate and up matmul fusions take the input, its float32 rows'
    statistic and the scale; benchmarks/BENCHMARKS.md)."""
    return platform != "tpu"


def merges_recomputation(m, platform: str) -> bool:
    """Whether `cpu_merged_bytes` applies: XLA:CPU, float32 compute, one program of layers, no remat."""
    return platform == "cpu" and np.dtype(m.dtype) == np.float32 and one_program(m) and m.remat == "none"


def layer_saved_bytes(m, s: ActivationSizes, act_bytes: int, policy: str, merged: bool = False,
                      norm_outputs: bool = True) -> float:
    """Bytes one block keeps for its backward pass under a remat policy, weights aside (per device);
    `merged`: as XLA:CPU keeps them in a float32 program (`merges_recomputation`); `norm_outputs`: as in
    `layer_forward_bytes`."""
    a, kernel = act_bytes, kernel_of(m, s)
    if policy == "none":
        kept = layer_forward_bytes(m, s, a, norm_outputs=norm_outputs) + (
            kernel.kept_in_one_program(s, m.dtype) if one_program(m) else 0.0)
        return kept + (cpu_merged_bytes(m, s, a) if merged else 0.0)
    block_input = a * s.x  # what remat always keeps: the block's input
    if policy == "full":
        return block_input
    mlp_dots = MLPS[m.mlp].hidden_dots() * MLPS[m.mlp].hidden_copies(m, s.gather) * a * s.mlp  # gate and up; GELU: in
    projections = a * (s.q + 2 * s.kv) + a * s.x + mlp_dots  # q, k, v, the attention's output projection
    if m.qk_norm:  # the projections' q and k beside the rotated ones, which the per-head norms' backward reads
        # (grouped-query heads: the joint matmul's whole output, v's part too: `layers.project_qkv`)
        projections += a * (s.q + (2 if m.n_kv_heads < m.n_heads and m.joint_projections else 1) * s.kv)
    # float8 projections (model.matmul=fp8): their float8 inputs too, one byte each (saved with the dots:
    # layers.FP8_OPERANDS): the two norms' outputs (q, k, v and gate, up share theirs), the attention's
    # output and the MLP's product; the float8 weights are counted in `estimate`
    fp8 = m.contraction.saved_operand_bytes * (2 * s.x + s.q + s.mlp)
    if policy in ("dots", "dots_mlp", "dots_no_batch"):  # and the attention kernel's own (`Kernel.dots_saved`)
        attention_saved = kernel.dots_saved(s, a, batched=policy != "dots_no_batch")
        hidden = a * s.mlp if policy == "dots_mlp" else 0.0  # the MLP's hidden activation (layers.MLP_HIDDEN)
        return block_input + projections + attention_saved + fp8 + hidden
    raise ValueError(f"unknown remat policy {policy!r}")


# ----------------------------------------------------------------------------- the estimate


# A component's phase of the step: held throughout, or only in the forward and backward passes (with
# the micro-batches' loop), or only in the optimizer's update after them
ALWAYS, BACKWARD, UPDATE = "always", "backward", "update"


@dataclasses.dataclass(frozen=True)
class Row:
    """One component: bytes on each device, and unsharded (what one device would hold alone); `phase`:
    when it is alive (`ALWAYS`, `BACKWARD`, `UPDATE`)."""

    name: str
    per_device_bytes: float
    total_bytes: float
    note: str = ""
    phase: str = ALWAYS


@dataclasses.dataclass
class Estimate:
    """The analytic memory of one train step on one device, by component."""

    rows: list[Row]
    param_count: int
    mesh_shape: axes.MeshShape
    per_device_batch: int  # sequences per device per micro-batch
    act_bytes: int
    attention: str
    # Pipeline stages (mesh.stage > 1): the schedule, and the bytes each device sends to the next stage per
    # step (activations forward, their gradients backward, every loop iteration of every micro-batch)
    pipeline: pipeline_parallel.Schedule | None = None
    attention_segments: int = 0  # cuDNN's packed layout, its bound of documents per row (0: not used)
    stage_bytes_per_step: float = 0.0

    @property
    def per_device_bytes(self) -> float:
        """The step's peak on one device: what it holds throughout, plus the larger of its two phases (the
        passes' activations and the update's temporaries are never alive together)."""
        return peak_bytes(self.rows)

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    @property
    def bytes_per_param(self) -> float:
        """Parameters + gradients + optimizer state, unsharded, per parameter: 16 for float32 AdamW
        (4 + 4 + 4 + 4), the standard count (a micro-batch accumulator adds 4 more, not counted here)."""
        return sum(self.row(k).total_bytes for k in ("parameters", "gradients", "optimizer state")) / self.param_count


def micro_batch_grad_bytes(model_spec, params, mesh_shape: Sequence[int], rules, act_bytes: int) -> tuple[int, int]:
    """(per device, unsharded) bytes of one micro-batch's gradients, which the step adds to its float32
    sum: every trainable leaf but the kernels whose GEMMs add theirs in place (`steps.compute_kernels` on
    this mesh), in the compute dtype where the forward casts the leaf (`ModelSpec.cast_dtypes`)."""
    with jax.sharding.use_abstract_mesh(_abstract_mesh(mesh_shape)):
        spec = steps.compute_kernels(model_spec, rules, steps.data_replicas(model_spec, rules))
    trainable = model_spec.split(params)[0]
    casts = dict(jax.tree_util.tree_flatten_with_path(model_spec.split(model_spec.cast_dtypes)[0],
                                                      is_leaf=lambda x: x is None)[0])
    per_device = total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainable)[0]:
        if tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path) in spec.grad_kernels:
            continue
        size = act_bytes if casts.get(path) is not None else _itemsize(leaf.dtype)
        total += math.prod(leaf.shape) * size
        per_device += math.prod(leaf.sharding.shard_shape(leaf.shape)) * size
    return per_device, total


def peak_bytes(rows: Sequence[Row]) -> float:
    """Rows' bytes per device summed as the step holds them: `ALWAYS` + max(`BACKWARD`, `UPDATE`)."""
    phase = {p: sum(r.per_device_bytes for r in rows if r.phase == p) for p in (ALWAYS, BACKWARD, UPDATE)}
    return phase[ALWAYS] + max(phase[BACKWARD], phase[UPDATE])


def cudnn_packed_workspace(slots: float, head_dim: int) -> float:
    """cuDNN's workspace for one backward call of its packed layout, in bytes: two float32 buffers of
    the query gradient's size per document slot and one of the softmax statistics, 4 R H S (2 D + 1) +
    33,536 for R rows x the bound of documents per row, H heads, S tokens, D the head's width; `slots`
    = R H S. Exactly what a real GPU program's calls asked for (benchmarks/BENCHMARKS.md). The calls
    run one after another and share one buffer."""
    return 4 * slots * (2 * head_dim + 1) + CUDNN_FORWARD_WORKSPACE


def estimate(
    cfg: ml_collections.ConfigDict, num_devices: int, *, platform: str = "gpu", act_bytes: int | None = None,
) -> Estimate:
    """The analytic per-device memory of one train step on `num_devices` devices of `platform`.

    `act_bytes` overrides the activations' bytes per element (default: the compute dtype's; on a CPU
    `cpu_act_bytes()`, float32 before jaxlib 0.11, as `resolve_micro_batches` and `check_fits` plan).
    """
    config_lib.validate(cfg)
    if not cfg.optim.micro_batches:  # as few as fit: planned for 80 GB devices (plan() uses its budget)
        cfg = resolve_micro_batches(cfg, num_devices, 80 * GIB, platform)[0]
    derived = config_lib.derive(cfg, num_devices)
    m = transformer.ModelConfig.from_config(cfg.model, platform, log_choice=False, lora=cfg.lora,
                                              compress=cfg.compress, **derived.pipeline)
    a = act_bytes or (cpu_act_bytes() if platform == "cpu" else None) or _itemsize(m.dtype)
    # XLA:CPU recomputes nothing in an unrolled program: remat there keeps what no remat keeps (tiny at 512
    # tokens: 313.5 MiB under none, dots or full alike; benchmarks/BENCHMARKS.md)
    cpu_unrolled = platform == "cpu" and not m.scan_layers and m.remat != "none"
    if axes.sizes_of(derived.mesh_shape)["context"] > 1:
        # a sequence split over context attends by its strategy (`kernel_of`), never in cuDNN's packed layout
        m = dataclasses.replace(m, attention_segments=0)
    if cpu_unrolled:
        m = dataclasses.replace(m, remat="none")
    schedule = None
    if m.pipeline_stages > 1:
        schedule = pipeline_parallel.Schedule(m.pipeline_stages, m.pipeline_microbatches, m.pipeline_repeats)
    # Layer passes whose activations a device keeps, in micro-batches' worth: all layers unpipelined; with
    # stages, its own G = L / (S R) layers on each of the loop's iterations of a 1/M micro-batch (the
    # bubble's idle passes keep theirs too).
    layer_passes = m.n_layers if schedule is None else (
        schedule.iterations * (m.n_layers // (schedule.stages * schedule.repeats)) / schedule.microbatches)
    state, model_spec = abstract_state(cfg, derived.mesh_shape, dataclasses.replace(m, attention="xla", remat="none"))
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    sizes = axes.sizes_of(derived.mesh_shape)
    param_bytes = tree_bytes(state.params)
    # Gradients, the accumulator and the update exist for the trainable parameters only (optim.trainable).
    trainable_bytes = tree_bytes(model_spec.split(state.params)[0])
    opt_bytes = tree_bytes(state.opt_state)
    scalars = [x + y for x, y in zip(tree_bytes(state.step), tree_bytes(state.rng))]
    batch_tokens = cfg.data.global_batch_size * cfg.data.seq_len
    batch = (20 * batch_tokens / _ways(("act_batch", "act_seq"), rules, sizes), 20 * batch_tokens)  # 5 4-byte arrays
    accumulate = cfg.optim.micro_batches > 1  # the scan over micro-batches carries a sum of gradients
    # With micro-batches, one micro-batch's gradients before they join the float32 sum, except the plain
    # projections' kernels whose weight gradients the GEMMs add to it (`steps.compute_kernels`)
    micro_grads = micro_batch_grad_bytes(model_spec, state.params, derived.mesh_shape, rules, a) if accumulate \
        else (0, 0)
    accumulator = [n * F32 / _itemsize(m.param_dtype) for n in trainable_bytes]  # float32 whatever the params

    # Weights that one layer's backward (and the loss) holds at full size over fsdp and data (still
    # split over tensor): the gathered copy and the gradient before its reduce-scatter, in f32.
    tensor = sizes["tensor"]
    bits = m.stored_quant.bits if m.stored_quant else 4
    # Each stack of like layers (`transformer.layer_stacks`: an MoE's dense first layers, then the model's own):
    # its blocks' settings, layers and weights of one layer (per device, all)
    stacks = [(stack.cfg, stack.count,
               [n / stack.count for n in tree_weights(transformer.stack_params(state.params, m, stack), bits)],
               _expert_split_weights(transformer.stack_params(state.params, m, stack), bits) / stack.count)
              for stack in transformer.layer_stacks(m)]
    block_weights = [sum(count * w[i] for _, count, w, _ in stacks) for i in (0, 1)]  # every layer's (per device, all)
    # each stack's one layer's; weights split over the expert axis (expert parallelism) stay split: each device
    # gathers its own experts over fsdp, not the others'
    experts = sizes.get("expert", 1)
    full_weights = [[2 * F32 * (w[1] - e + e / experts) / tensor, 2 * F32 * w[1]] for _, _, w, e in stacks]
    # The loss's: a vocabulary table gathered and its gradient; with micro-batches also each table's
    # gradient of one micro-batch at full size, before it is added to the accumulator.
    copies = 2 + (1 if m.tie_embeddings else 2) * accumulate
    full_embedding = [copies * F32 * m.vocab_size * m.d_model / tensor, copies * F32 * m.vocab_size * m.d_model]
    cast = a < _itemsize(m.param_dtype) and m.remat == "none"  # saved bf16 copies of the weights
    per_logit = logit_bytes(platform, m.dtype, a, m.contraction, m.tie_embeddings)

    def activations(mesh_sizes: dict[str, int], i: int) -> tuple[float, float, float, float]:
        """(saved, one layer's backward, logits and loss, cuDNN's workspace); i = 0 per device, 1 unsharded.
        The vocabulary tables at full size are in neither of the middle two: they are alive through both."""
        s = activation_sizes(m, derived.micro_batch_size, cfg.data.seq_len, rules, mesh_sizes)
        passes = layer_passes if i == 0 or schedule is None else layer_passes * schedule.stages
        # each layer pass keeps its stack's share: the stacks' layers in proportion (one stack when pipelined)
        saved = sum(passes * count / m.n_layers * layer_saved_bytes(
            stack_cfg, activation_sizes(stack_cfg, derived.micro_batch_size, cfg.data.seq_len, rules, mesh_sizes),
            a, m.remat, merges_recomputation(stack_cfg, platform), norm_outputs_kept(platform))
            for stack_cfg, count, *_ in stacks)
        saved += a * block_weights[i] if cast else 0.0
        # each layer's weights as the contraction saves them (float8), gathered
        if m.remat in ("dots", "dots_mlp", "dots_no_batch"):
            operand_bytes = m.contraction.saved_operand_bytes
            saved += operand_bytes * block_weights[1] / mesh_sizes["tensor"]
        saved += (2 * a + 2 * F32) * s.x  # the embedding's output and the final norm
        if kernel_of(m, s).takes_mask:
            saved += s.scores  # the attention mask, one for all layers
        saved += kernel_of(m, s).shared_bytes(s, a)  # what the kernel keeps once for all layers (its own mask)
        whole = s  # the loss runs outside the pipelined stack, on the whole micro-batch
        if schedule is not None:  # the stream of micro-batches (whole on every stage) and the stages' buffer
            saved += 2 * a * s.x * (1 + 1 / schedule.microbatches)
            if schedule.repeats > 1:  # circular: the layer group each iteration picks, kept for its backward
                saved += schedule.iterations * a * block_weights[i] / schedule.repeats
        rows = derived.micro_batch_size // (1 if schedule is None else schedule.microbatches)  # a pipeline's: one
        s = activation_sizes(m, rows, cfg.data.seq_len, rules, mesh_sizes)  # a layer runs on one pipeline micro-batch
        layer = 0.0  # one layer's backward: the largest of the stacks'
        for (stack_cfg, *_), weights in zip(stacks, full_weights):
            stack_sizes = activation_sizes(stack_cfg, rows, cfg.data.seq_len, rules, mesh_sizes)
            one = layer_backward_bytes(stack_cfg, stack_sizes, a, m.remat, weights[i], norm_outputs_kept(platform))
            if i == 0 and _ways(("act_batch",), rules, mesh_sizes) > 1:  # an MoE's experts, whole in its dispatch
                one += F32 * MLPS[stack_cfg.mlp].gathered_params(stack_cfg) / mesh_sizes.get("expert", 1)  # (its own)
            layer = max(layer, one)
        # cuDNN's packed layout: its backward's workspace, sized for the bound of documents in every row
        workspace = cudnn_packed_workspace(m.attention_segments * s.head_stats, m.head_dim) \
            if m.attention_segments else 0.0
        chunk = cfg.model.loss_chunk_len
        fraction = chunk / cfg.data.seq_len if 0 < chunk < cfg.data.seq_len else 1.0  # chunked loss: one chunk alive
        logits = per_logit * whole.vocab * fraction
        return saved, layer, logits, workspace

    saved, layer, logits, workspace = activations(sizes, 0)
    saved_total, layer_total, logits_total, workspace_total = activations({axis: 1 for axis in sizes}, 1)
    selection = cfg.optim.trainable or (train_state.LORA_TRAINABLE if m.lora is not None else "")  # build_model_spec's
    trainable_note = "" if trainable_bytes == param_bytes else f", trainable only (optim.trainable={selection!r})"
    rows = [
        Row("parameters", *param_bytes, _dtype_name(m.param_dtype)
            + (f", {m.quantized.describe()}" if m.stored_quant else "")
            + (", pruning masks (bool)" if m.pruned is not None else "")),
        *([Row("gradients", *accumulator, f"float32, summed over {cfg.optim.micro_batches} micro-batches"
               + trainable_note)] if accumulate else
          [Row("gradients", *trainable_bytes, _dtype_name(m.param_dtype) + trainable_note)]),
        Row("optimizer state", *opt_bytes, optim.OPTIMIZERS[cfg.optim.name].state),
        Row("step, rng, batch", scalars[0] + batch[0], scalars[1] + batch[1]),
        *([Row("micro-batch gradients", *micro_grads, "one micro-batch's, before they join the sum (the plain "
               "projections' kernels add theirs in the GEMMs)", BACKWARD)] if accumulate else []),
        Row("activations saved", saved, saved_total, f"{m.n_layers} layers" + (
            f" ({stacks[0][1]} dense first)" if len(stacks) > 1 else "") + f", remat={cfg.model.remat}" + (
            " (XLA:CPU recomputes nothing when the layers are unrolled: counted as none)" if cpu_unrolled else "") + (
            "" if schedule is None else f"; {m.n_layers // schedule.stages} per stage, {schedule.iterations} "
            f"iterations of 1/{schedule.microbatches} micro-batch"), BACKWARD),
        Row("working set", full_embedding[0] + max(layer, logits), full_embedding[1] + max(layer_total, logits_total),
            f"the vocabulary tables at full size ({format_bytes(full_embedding[0])}), alive through the backward, and "
            f"the larger of one layer's backward ({format_bytes(layer)}) and the logits ({format_bytes(logits)})",
            BACKWARD),
        *([Row("cuDNN workspace", workspace, workspace_total, f"the packed layout's backward, sized for "
               f"{m.attention_segments} documents in every row", BACKWARD)] if workspace else []),
        Row("update temporaries", UPDATE_COPIES * trainable_bytes[0], UPDATE_COPIES * trainable_bytes[1],
            "the optimizer's new values beside the donated state, after the passes", UPDATE),
    ]
    if cfg.objective.name == "distill":
        rows += teacher_rows(cfg, derived.mesh_shape, rules, platform, (logits, logits_total))
    if cfg.objective.name == "grpo" and cfg.grpo.beta > 0 and not grpo_objective.adapters_alone(cfg):
        # the KL's reference in full training: a copy of the parameters laid out as the state's
        rows.append(Row("reference parameters", *param_bytes,
                        "grpo.beta > 0 in full training: the parameters run.init_from started from, held beside the "
                        "state (no gradient, no optimizer state); its forward runs before the step, not in it"))
    stage_bytes = 0.0
    if schedule is not None:  # each iteration hands a stage's output on, forward and (its gradient) backward
        piece = activation_sizes(m, derived.micro_batch_size // schedule.microbatches, cfg.data.seq_len, rules,
                                 sizes).x * a
        stage_bytes = 2 * schedule.iterations * piece * cfg.optim.micro_batches
    return Estimate(
        rows=rows, param_count=transformer.param_count(m)["total"], mesh_shape=derived.mesh_shape,
        per_device_batch=derived.per_device_batch, act_bytes=a, attention=m.attention if sizes["context"] == 1 else
        f"{attention.context_kernel(m.context_attention, m.attention).name}, {m.context_layout} layout over "
        f"context {sizes['context']}", pipeline=schedule,
        attention_segments=m.attention_segments,
        stage_bytes_per_step=stage_bytes,
    )


def teacher_rows(cfg: ml_collections.ConfigDict, mesh_shape: Sequence[int], rules, platform: str,
                 logits: tuple[float, float]) -> list[Row]:
    """A distillation teacher's memory (`jaxlm.objectives.distill`): its parameters, laid out on the student's
    mesh by the student's rules as `TrainSetup.load_run` places them (cast to `distill.teacher_param_dtype`),
    held throughout; and its logits, as many as the student's (`logits`: per device, unsharded; one chunk of
    positions with `model.loss_chunk_len`), alive through the backward (the KL's gradient reads them). Its
    forward's other activations are transient and not counted. A teacher not found yet is named, not counted."""
    teacher = cfg.distill.teacher
    logits_row = Row("teacher logits", *logits, "the teacher's [B, T, V] logits beside the student's", BACKWARD)
    if not teacher or not (pathlib.Path(teacher) / "config.json").is_file():
        return [Row("teacher parameters", 0.0, 0.0, f"not counted: no teacher run at {teacher!r}"), logits_row]
    teacher_cfg = inference.read_config(pathlib.Path(teacher))
    m = inference.model_config(teacher_cfg, platform)
    spec = train_state.build_model_spec(m)
    shapes = jax.eval_shape(train_state.init_fn(m, spec, optax.identity(), 0))
    mesh = _abstract_mesh(mesh_shape)
    shardings = train_state.state_shardings(shapes, spec, optax.identity(), mesh, rules)
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes.params,
                          shardings.params)
    params = inference.cast_abstract(params, cfg.distill.teacher_param_dtype or None)
    dtypes = sorted({_dtype_name(x.dtype) for x in jax.tree.leaves(params)})
    return [Row("teacher parameters", *tree_bytes(params), f"{transformer.param_count(m)['total'] / 1e6:.2f}M, "
                f"{', '.join(dtypes)}, frozen (no gradient, no optimizer state)"), logits_row]


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:.0f} B"


def with_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
    """A copy of `cfg` with {"a.b": value} overrides applied."""
    new = ml_collections.ConfigDict(cfg.to_dict())
    with new.unlocked():
        config_lib.apply_overrides(new, list(overrides.items()))
    return new


# ----------------------------------------------------------------------------- micro-batches=0


def device_memory_bytes(device=None) -> float:
    """What one device can hold: an accelerator's own limit (`memory_stats()['bytes_limit']`); for a
    compile-only device, its target's memory (`jaxlm.roofline.TARGETS`); on a CPU the host's memory
    shared by its local devices."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends have no memory statistics
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    if device.platform != "cpu":  # a compile-only device (jaxlm.roofline's targets) has no statistics
        for target in roofline.TARGETS.values():
            if target.device_kind == device.device_kind:
                return float(target.memory_bytes)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, sum(d.platform == device.platform for d in jax.local_devices()))


def micro_batch_options(cfg: ml_collections.ConfigDict, num_devices: int) -> list[int]:
    """The micro-batch counts a run can take, ascending: the divisors of its sequences per batch shard
    (the act_batch axes: data x fsdp x expert; the last is one sequence each; with pipeline stages, enough
    sequences for at least as many pipeline micro-batches). UserError when the batch does not divide over
    the shards."""
    shape, batch = config_lib.mesh_shape(cfg, num_devices), cfg.data.global_batch_size
    shards, named = mesh_lib.MeshConfig.from_config(cfg.mesh).batch_split(shape)
    if batch % shards:
        raise UserError(
            f"config.data.global_batch_size={batch} does not divide over the {shards} devices of the batch axes "
            f"{named}; use a multiple of {shards}"
        )
    per_shard = batch // shards
    stages = axes.sizes_of(shape)["stage"]

    return [k for k in range(1, per_shard + 1) if per_shard % k == 0
            and (stages == 1 or config_lib.pipeline_microbatch_choices(per_shard // k, stages))]


def resolve_micro_batches(
    cfg: ml_collections.ConfigDict, num_devices: int, memory_bytes: float, platform: str,
) -> tuple[ml_collections.ConfigDict, str]:
    """`optim.micro_batches=0` made concrete: the fewest micro-batches whose analytic estimate uses
    at most `AUTO_SHARE` of `memory_bytes` per device, and a line that says what was chosen.

    Unchanged (and "") when micro_batches is set. Micro-batches change the summation order of the
    gradient, not the update, so the choice may differ between machines (a resumed run on other
    devices chooses again). When even one sequence per device does not fit, that is chosen and the
    line says to run `python -m jaxlm.plan`.
    """
    if cfg.optim.micro_batches:
        return cfg, ""
    options = micro_batch_options(cfg, num_devices)
    budget = AUTO_SHARE * memory_bytes
    per_shard = options[-1]
    act_bytes = cpu_act_bytes() if platform == "cpu" else None  # XLA:CPU: float32 before jaxlib 0.11
    for k in options:
        trial = with_overrides(cfg, {"optim.micro_batches": k})
        need = estimate(trial, num_devices, platform=platform, act_bytes=act_bytes).per_device_bytes
        if need <= budget:
            break
    fits = need <= budget
    line = (f"optim.micro_batches=0 (as few as fit): {k} micro-batch(es) of {per_shard // k} sequence(s) per "
            f"device, planned {format_bytes(need)} of {format_bytes(memory_bytes)} per device"
            + ("" if fits else f"; that is over {AUTO_SHARE:.0%}: see python -m jaxlm.plan for what would fit"))
    return trial, line


REFUSE_OVER = 1.5  # check_fits refuses a run planned at more than this times a device's memory
HOST_BATCH_BUFFERS = 4  # batches the input pipeline holds at once (prefetch, the one being read, the one on device)


def check_fits(cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device]) -> None:
    """Refuse, before anything is allocated, a run that certainly cannot fit: planned at more than
    `REFUSE_OVER` times a device's memory (the estimate is close to the compiled GPU program,
    benchmarks/BENCHMARKS.md), or whose input batches alone exceed the host's memory."""
    platform = devices[0].platform
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    batch_bytes = 20 * cfg.data.global_batch_size // jax.process_count() * cfg.data.seq_len  # 5 4-byte arrays
    advice = ("lower data.seq_len or data.global_batch_size, raise optim.micro_batches (or 0: as few as fit), "
              "set model.remat=full, or use more devices; python -m jaxlm.plan shows what fits")
    if HOST_BATCH_BUFFERS * batch_bytes > host:
        raise UserError(
            f"the input batches alone need {format_bytes(HOST_BATCH_BUFFERS * batch_bytes)} of host memory "
            f"(data.global_batch_size={cfg.data.global_batch_size} x data.seq_len={cfg.data.seq_len}, "
            f"{HOST_BATCH_BUFFERS} batches in flight) and this host has {format_bytes(host)}; {advice}"
        )
    capacity = device_memory_bytes(local[0])
    need = estimate(cfg, len(devices), platform=platform,
                    act_bytes=cpu_act_bytes() if platform == "cpu" else None).per_device_bytes
    if need > REFUSE_OVER * capacity:
        raise UserError(
            f"this run needs about {format_bytes(need)} per device (the planner's estimate) and a {platform} device "
            f"here holds {format_bytes(capacity)}; {advice}"
        )


def for_gpus(cfg: ml_collections.ConfigDict, num_devices: int, memory_gib: float = 80.0) -> ml_collections.ConfigDict:
    """`cfg` with `optim.micro_batches=0` resolved as on `num_devices` GPUs of `memory_gib`: for
    compiling a GPU run's program on fake CPU devices (whose own choice would follow host memory)."""
    return resolve_micro_batches(cfg, num_devices, memory_gib * GIB, "gpu")[0]
