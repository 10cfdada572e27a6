"""`python -m jaxlm.plan --config=configs/7b.py --devices=8 --device_memory_gib=80 [--compile] [--json]`

Will a run fit in device memory, by how much, and which knob would make it fit. Two figures:

* **analytic** (always, in about a second, no devices needed): the train state from the same code
  that creates it (`train_state.abstract_state` on an abstract mesh), so parameters, gradients and
  optimizer state are exact per device for the recipe's rules table; activations from the formulas
  below. `--platform` (default gpu) picks the attention kernel `model.attention=auto` would.
* **compiled** (`--compile`): the real train step compiled ahead of time for `--devices` devices,
  `jax.jit(...).lower(...).compile().memory_analysis()`: on the accelerators here when there are
  enough of them, else on that many fake CPU devices (set up by `main` before JAX starts its
  backends; no memory is allocated for the state). Its peak per device is
  `argument + output - alias + temp` bytes: the donated state (arguments, aliased by the outputs)
  plus XLA's preallocated temporaries (one buffer sized to the peak of all intermediates).
  `memory_analysis()` of an SPMD program is per device (measured: the tiny recipe's arguments are
  15.0 MiB on 1 device and 1.9 MiB = 15.0 / 8 on 8). Its `peak_memory_in_bytes` leaves the
  temporaries out on CPU, so it is not used.

The verdict uses the compiled figure when it was compiled on the platform planned for, else the
analytic one. When the run does not fit, the analytic estimate is re-run with one knob changed
(FSDP over all devices, a cheaper remat policy, more micro-batches, a smaller global batch), then
two or three together, and the changes that fit are listed as `--config` overrides. Exit code 0:
fits; 1: does not fit; 2: a user error (config, flags).

Per device, with `a` the compute dtype's bytes, x = [B, T, D], q = [B, T, N, H], kv = [B, T, K, H],
f = [B, T, F], v = [B, T, V] and s = [B, N, T, T] counted in elements on one device (one
micro-batch of B sequences of T tokens, split as `config.mesh.rules` split the activations), and W
one layer's weights at full size over fsdp and data (still split over tensor) in float32, bytes:

    parameters, optimizer state   the abstract state's shard shapes: exact
    gradients                     the parameters' bytes (param_dtype), exact
    grad accumulator              the parameters' bytes again, with micro-batches > 1
    update temporaries            the parameters' bytes: AdamW's new values beside the donated state
    activations saved             n_layers * saved(remat) + (2a + 8) x (embedding output, final norm)
                                  + s (the attention mask, shared by the layers; XLA attention)
    working set                   max(one layer's backward, the logits and loss)
      the logits and loss         (a + 6) v + 2 * 4 V D: logits, f32 softmax and gradient; a
                                  vocabulary table gathered and its gradient (with micro-batches
                                  + 4 V D per table: a micro-batch's gradient before accumulating)
      one layer's backward        remat none: max(forward, 2 W): its activations' gradients
                                  remat: max(forward - attention, attention') + W: recomputed, then
                                  differentiated; attention' = (12 + a) s on XLA (recomputed f32
                                  logits and softmax, probabilities, their gradients), on cuDNN
                                  2a (2q + 2kv) + 4 [B, N, T]

    forward (one block without remat) =
        4 a x                     two norms: each its input and output (`layers.recomputed`)
      + a (q + 2 kv) + a q        q and k (after rotary), v; the attention output
      + attention                 XLA: (4 + a) s, the f32 softmax and the probabilities;
                                  cuDNN flash attention: 4 [B, N, T], its softmax statistics
      + 3 a f                     SwiGLU: gate, up, their product (GELU: 2 a f, in and out)
                                  unrolled layers (scan_layers=False): 2 (8 + a) x and 6 a f, the
                                  norms' f32 copies and the activations' intermediates (XLA's
                                  buffers come out as if nothing were recomputed, measured)
      + 8 H [B, T]                rotary sin and cos
    saved(none) = forward + a * one layer's weights per device (their compute-dtype copy, a < 4)
    saved(full) = a x (the block's input)
    saved(dots_no_batch) = a x + a (q + 2 kv) + a x + (2a f SwiGLU | a f GELU): input, projections
    saved(dots) = saved(dots_no_batch) + 4 s + a q: XLA attention's batched matmuls too

These are what the step's jaxpr saves (`jax.ad_checkpoint.print_saved_residuals`, with XLA's
deduplication: the mask once, two of the three score-sized softmax tensors); the working-set
shapes and the update copy were fitted to XLA's buffer assignment of the compiled step. On XLA
attention the [B, N, T, T] scores dominate long sequences (125m at T=2048 without remat: 51 of 53
GiB per device); cuDNN flash attention never materializes them. On the CPU, XLA keeps activations
and gathered weights in float32 whatever the compute dtype (a bf16 and an f32 step have the same
temporaries, measured; jaxlib 0.11's XLA:CPU keeps bfloat16 instead, `cpu_act_bytes`), and attention
is XLA's, so the compiled CPU figure is compared with the analytic one for that program: `a` =
`cpu_act_bytes()` and XLA attention. Over 39 CPU compiles (tiny to 7b; remat
none, dots, dots_no_batch, full; micro-batches; data, fsdp and tensor meshes; 1 to 64 devices;
long sequences, large vocabularies, GELU) compiled / analytic was 0.92 to 1.11: TOLERANCE states
15%. The cuDNN terms are not checked against a compile (no GPU here). benchmarks/BENCHMARKS.md
has the recipes' figures (`benchmarks/memory_plan.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
from typing import Any, Sequence

import ml_collections

from jaxlm import config as config_lib
from jaxlm.errors import UserError

GIB = 2**30
F32 = 4
FLASH = ("cudnn", "pallas")  # kernels that keep no [T, S] scores (Pallas's repeated key/value heads not counted)
TOLERANCE = 0.15  # |compiled / analytic - 1| stated for CPU compiles (0.92 to 1.11 measured)
REMAT_ORDER = ("none", "dots", "dots_no_batch", "full")  # most memory first
# Calibrated against the buffer assignment of the compiled train step (module docstring):
WORKING_SET_NO_REMAT = 1.0  # one layer's backward: its activations' gradients, about its forward once more
WEIGHTS_IN_REMAT_BACKWARD = 0.5  # the share of a layer's full-size weights live at a recomputed layer's peak
LOGITS_EXTRA_BYTES = 6  # per logit, besides the compute-dtype logits: f32 softmax and gradient, partly fused
UPDATE_COPIES = 1.0  # AdamW's new values are computed beside the donated state before they replace it
AUTO_SHARE = 0.85  # optim.micro_batches=0 plans to use at most this share of a device's memory (1 - TOLERANCE)


# ----------------------------------------------------------------------------- the train state


def cpu_act_bytes() -> int | None:
    """`estimate(act_bytes=)` for a step compiled by XLA:CPU: 4 (float32) with jaxlib < 0.11, whose
    XLA:CPU upcasts bfloat16 matmuls and activations to float32; None (the compute dtype's) from
    jaxlib 0.11 on, whose XLA:CPU keeps them in bfloat16 (measured, the tiny recipe on 8 CPU devices:
    a bf16 step's temporaries are 0.90 to 0.96 of the f32 step's on jaxlib 0.10.2, 0.68 to 0.78 on 0.11.2)."""
    import jax

    return F32 if tuple(int(p) for p in jax.lib.__version__.split(".")[:2]) < (0, 11) else None


def _itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def _dtype_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


def tree_bytes(tree) -> tuple[int, int]:
    """(bytes on one device, unsharded bytes) of a tree of ShapeDtypeStructs that carry shardings."""
    import jax

    per_device = total = 0
    for leaf in jax.tree.leaves(tree):
        size = _itemsize(leaf.dtype)
        total += math.prod(leaf.shape) * size
        per_device += math.prod(leaf.sharding.shard_shape(leaf.shape)) * size
    return per_device, total


@functools.lru_cache(maxsize=8)
def _model_and_shapes(model_cfg, optim_items: tuple, steps: int):
    """Model spec, optimizer and the state's abstract shapes: they depend on the model and optimizer only."""
    import jax

    from jaxlm import optim, train_state

    spec = train_state.model_spec(model_cfg)
    tx, _ = optim.make_optimizer(ml_collections.ConfigDict(dict(optim_items)), steps, spec.decay_mask)
    shapes = jax.eval_shape(train_state.init_fn(model_cfg, spec, tx, 0))
    return spec, tx, shapes


def abstract_state(cfg: ml_collections.ConfigDict, mesh_shape: Sequence[int], model_cfg):
    """The train state as ShapeDtypeStructs sharded over an abstract mesh of `mesh_shape`: the
    per-device layout the trainer creates (same rules, same code), without any device."""
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from jaxlm import mesh as mesh_lib
    from jaxlm import train_state

    spec, tx, shapes = _model_and_shapes(model_cfg, tuple(sorted(cfg.optim.to_dict().items())), cfg.run.steps)
    mesh = AbstractMesh(tuple(mesh_shape), mesh_lib.MESH_AXES, axis_types=(AxisType.Auto,) * len(mesh_shape))
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    train_state.check_divisible(spec, shapes.params, mesh, rules)
    shardings = train_state.state_shardings(shapes, spec, tx, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


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


def _ways(names: Sequence[str | None], rules, mesh_sizes: dict[str, int]) -> int:
    """How many devices an activation with these logical axis names is split over."""
    from jaxlm import mesh as mesh_lib

    ways = 1
    for axes in mesh_lib.logical_to_spec(names, rules):
        for axis in (axes,) if isinstance(axes, str) else tuple(axes or ()):
            ways *= mesh_sizes[axis]
    return ways


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
    )


def attention_forward_bytes(m, s: ActivationSizes, act_bytes: int) -> float:
    """What the attention kernel itself keeps for its backward pass (per device)."""
    if m.attention in FLASH:
        return F32 * s.head_stats  # flash attention keeps only its softmax statistics
    return (F32 + act_bytes) * s.scores  # XLA: the f32 softmax and the probabilities


def _mlp_saved(m) -> int:
    return 3 if m.mlp == "swiglu" else 2


def layer_forward_bytes(m, s: ActivationSizes, act_bytes: int, recomputed: bool = True) -> float:
    """Bytes one block keeps for its backward pass without remat, weights aside (per device).

    `recomputed=False`: as if the norms and activation functions were not recomputed (what unrolled
    layers come to, and what a recomputed layer holds at its peak under remat).
    """
    a = act_bytes
    if not recomputed:  # every intermediate, as autodiff saves it
        return layer_forward_bytes(m, s, a) + (2 * (2 * F32 + a) - 4 * a) * s.x + (6 - _mlp_saved(m)) * a * s.mlp
    norms = 2 * 2 * a * s.x  # each norm: its input and output (`layers.recomputed` inside)
    qkv = a * (s.q + 2 * s.kv)  # q and k after rotary embedding, v
    rope = 4 * F32 * m.head_dim / 2 * s.tokens if m.position == "rope" else 0.0  # sin and cos, for q and k
    attention_out = a * s.q
    mlp = _mlp_saved(m) * a * s.mlp  # gate, up, product / GELU's input and output
    return norms + qkv + rope + attention_forward_bytes(m, s, a) + attention_out + mlp


def layer_backward_bytes(m, s: ActivationSizes, act_bytes: int, policy: str, full_weights: float) -> float:
    """The peak of one layer's backward pass beyond what is saved (per device); `full_weights`: the
    layer's weights at full size over fsdp, gathered copy and unreduced gradient (f32)."""
    a = act_bytes
    # The backward of a recomputed norm or activation holds its float32 intermediates again, briefly.
    forward = layer_forward_bytes(m, s, a, recomputed=False)
    if policy == "none":  # the gradients of its activations (about its forward once more), or its weights
        return max(WORKING_SET_NO_REMAT * forward, full_weights)
    # Remat recomputes the layer, then differentiates it: the attention's phase holds the recomputed
    # scores and their gradients, the rest of the layer its recomputed activations; the weights'
    # gather and gradient overlap both.
    if m.attention in FLASH:  # q, k, v, the output, their gradients, the softmax statistics
        attention = 2 * a * (2 * s.q + 2 * s.kv) + F32 * s.head_stats
    else:  # f32 logits and softmax, the probabilities, and the gradients of both
        attention = (3 * F32 + a) * s.scores
    rest = layer_forward_bytes(m, s, a, recomputed=False) - attention_forward_bytes(m, s, a)
    return max(rest, attention) + WEIGHTS_IN_REMAT_BACKWARD * full_weights


def layer_saved_bytes(m, s: ActivationSizes, act_bytes: int, policy: str) -> float:
    """Bytes one block keeps for its backward pass under a remat policy, weights aside (per device)."""
    a = act_bytes
    if policy == "none":
        return layer_forward_bytes(m, s, a, recomputed=m.scan_layers)
    block_input = a * s.x  # what remat always keeps: the block's input
    if policy == "full":
        return block_input
    mlp_dots = (2 if m.mlp == "swiglu" else 1) * a * s.mlp  # gate and up / in
    projections = a * (s.q + 2 * s.kv) + a * s.x + mlp_dots  # q, k, v, the attention's output projection
    if policy == "dots_no_batch":
        return block_input + projections
    if policy == "dots":  # also the attention's batched matmuls (XLA attention only)
        batched = (F32 * s.scores + a * s.q) if m.attention not in FLASH else 0.0
        return block_input + projections + batched
    raise ValueError(f"unknown remat policy {policy!r}")


# ----------------------------------------------------------------------------- the estimate


@dataclasses.dataclass(frozen=True)
class Row:
    """One component: bytes on each device, and unsharded (what one device would hold alone)."""

    name: str
    per_device_bytes: float
    total_bytes: float
    note: str = ""


@dataclasses.dataclass
class Estimate:
    """The analytic memory of one train step on one device, by component."""

    rows: list[Row]
    param_count: int
    mesh_shape: tuple[int, int, int]
    per_device_batch: int  # sequences per device per micro-batch
    act_bytes: int
    attention: str

    @property
    def per_device_bytes(self) -> float:
        return sum(r.per_device_bytes for r in self.rows)

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    @property
    def bytes_per_param(self) -> float:
        """Parameters + gradients + optimizer state, unsharded, per parameter: 16 for float32 AdamW
        (4 + 4 + 4 + 4), the standard count (a micro-batch accumulator adds 4 more, not counted here)."""
        return sum(self.row(k).total_bytes for k in ("parameters", "gradients", "optimizer state")) / self.param_count


def resolve_attention(requested: str, platform: str, dtype, head_dim: int) -> str:
    """'auto' as the trainer resolves it on `platform`: cuDNN flash attention on GPUs where it can run."""
    from jaxlm.models import attention

    if requested != "auto":
        return requested
    if platform == "gpu" and attention.cudnn_unsupported_reason(dtype, head_dim) is None:
        return "cudnn"
    return "xla"


def estimate(
    cfg: ml_collections.ConfigDict, num_devices: int, *, platform: str = "gpu", act_bytes: int | None = None,
) -> Estimate:
    """The analytic per-device memory of one train step on `num_devices` devices of `platform`.

    `act_bytes` overrides the activations' bytes per element (default: the compute dtype's):
    `cpu_act_bytes()` to compare with a CPU compile (float32 activations before jaxlib 0.11).
    """
    from jaxlm import mesh as mesh_lib
    from jaxlm.models import transformer

    config_lib.validate(cfg)
    if not cfg.optim.micro_batches:  # as few as fit: planned for 80 GB devices (plan() uses its budget)
        cfg = resolve_micro_batches(cfg, num_devices, 80 * GIB, platform)[0]
    derived = config_lib.derive(cfg, num_devices)
    m = transformer.ModelConfig.from_config(cfg.model)
    m = dataclasses.replace(m, attention=resolve_attention(cfg.model.attention, platform, m.dtype, m.head_dim))
    a = act_bytes or _itemsize(m.dtype)
    state = abstract_state(cfg, derived.mesh_shape, dataclasses.replace(m, attention="xla", remat="none"))
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    sizes = dict(zip(mesh_lib.MESH_AXES, derived.mesh_shape))
    param_bytes = tree_bytes(state.params)
    opt_bytes = tree_bytes(state.opt_state)
    scalars = [x + y for x, y in zip(tree_bytes(state.step), tree_bytes(state.rng))]
    batch_tokens = cfg.data.global_batch_size * cfg.data.seq_len
    batch = (16 * batch_tokens / _ways(("act_batch", "act_seq"), rules, sizes), 16 * batch_tokens)  # 4 int32 arrays
    accumulate = cfg.optim.micro_batches > 1  # the scan over micro-batches carries a sum of gradients

    # Weights that one layer's backward (and the loss) holds at full size over fsdp and data (still
    # split over tensor): the gathered copy and the gradient before its reduce-scatter, in f32.
    tensor = sizes["tensor"]
    blocks_bytes = tree_bytes(state.params["blocks"])
    layer_params = [b / _itemsize(m.param_dtype) / m.n_layers for b in blocks_bytes]  # (per device, all)
    full_weights = [2 * F32 * layer_params[1] / tensor, 2 * F32 * layer_params[1]]
    # The loss's: a vocabulary table gathered and its gradient; with micro-batches also each table's
    # gradient of one micro-batch at full size, before it is added to the accumulator.
    copies = 2 + (1 if m.tie_embeddings else 2) * accumulate
    full_embedding = [copies * F32 * m.vocab_size * m.d_model / tensor, copies * F32 * m.vocab_size * m.d_model]
    cast = a < _itemsize(m.param_dtype) and m.remat == "none"  # saved bf16 copies of the weights

    def activations(mesh_sizes: dict[str, int], i: int) -> tuple[float, float, float]:
        """(saved, one layer's backward, logits and loss); i = 0 per device, 1 unsharded."""
        s = activation_sizes(m, derived.micro_batch_size, cfg.data.seq_len, rules, mesh_sizes)
        saved = m.n_layers * (layer_saved_bytes(m, s, a, m.remat) + (a * layer_params[i] if cast else 0.0))
        saved += (2 * a + 2 * F32) * s.x  # the embedding's output and the final norm
        if m.attention != "cudnn":
            saved += s.scores  # the attention mask, one for all layers
        layer = layer_backward_bytes(m, s, a, m.remat, full_weights[i])
        chunk = cfg.model.loss_chunk_len
        fraction = chunk / cfg.data.seq_len if 0 < chunk < cfg.data.seq_len else 1.0  # chunked loss: one chunk alive
        logits = (a + LOGITS_EXTRA_BYTES) * s.vocab * fraction + full_embedding[i]
        return saved, layer, logits

    saved, layer, logits = activations(sizes, 0)
    saved_total, layer_total, logits_total = activations({axis: 1 for axis in sizes}, 1)
    rows = [
        Row("parameters", *param_bytes, _dtype_name(m.param_dtype)),
        Row("gradients", *param_bytes, _dtype_name(m.param_dtype)),
        Row("optimizer state", *opt_bytes, "AdamW mu and nu (float32), step counts"),
        *([Row("grad accumulator", *param_bytes, f"{cfg.optim.micro_batches} micro-batches")] if accumulate else []),
        Row("update temporaries", UPDATE_COPIES * param_bytes[0], UPDATE_COPIES * param_bytes[1],
            "AdamW's new values beside the donated state"),
        Row("activations saved", saved, saved_total, f"{m.n_layers} layers, remat={m.remat}"),
        Row("working set", max(layer, logits), max(layer_total, logits_total),
            f"the larger of one layer's backward ({format_bytes(layer)}) and the logits ({format_bytes(logits)})"),
        Row("step, rng, batch", scalars[0] + batch[0], scalars[1] + batch[1]),
    ]
    return Estimate(
        rows=rows, param_count=transformer.param_count(m)["total"], mesh_shape=derived.mesh_shape,
        per_device_batch=derived.per_device_batch, act_bytes=a, attention=m.attention,
    )


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:.0f} B"


def format_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- the compiled figure


def compile_devices(num_devices: int):
    """`num_devices` accelerators when there are enough, else that many CPU devices (fake ones, set
    up by `use_cpu_devices` before JAX started its backends)."""
    import jax

    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if len(accelerators) >= num_devices:
        return accelerators[:num_devices]
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:
        cpus = []
    if len(cpus) >= num_devices:
        return cpus[:num_devices]
    raise UserError(
        f"--compile needs {num_devices} devices; this process has {len(accelerators)} accelerators and "
        f"{len(cpus)} CPU devices (JAX was started before the planner could add CPU devices); run "
        f"`python -m jaxlm.plan` in its own process, or compile for --devices={max(len(accelerators), len(cpus))}"
    )


def use_cpu_devices(num_devices: int) -> None:
    """Give JAX's CPU backend `num_devices` devices, if its backends have not started yet (else no-op)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:  # backends already initialized (an in-process caller): use what is there
        pass


def compiled_memory(cfg: ml_collections.ConfigDict, devices) -> dict[str, Any]:
    """Compile the real train step ahead of time on `devices` (an abstract state: nothing allocated)
    and read XLA's per-device memory analysis."""
    import time

    from jaxlm.trainer import build_trainer

    trainer = build_trainer(cfg, devices, abstract=True)
    start = time.perf_counter()
    analysis = trainer.compile_train_step().memory_analysis()
    seconds = time.perf_counter() - start
    if analysis is None:
        raise UserError(f"--compile: XLA gives no memory analysis on {devices[0].platform}; use the analytic figure")
    figures = {
        "argument_bytes": analysis.argument_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes,
        "alias_bytes": analysis.alias_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
    }
    peak = figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
    return {
        **figures, "per_device_bytes": peak, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "num_devices": len(devices), "attention": trainer.model_cfg.attention, "compile_s": round(seconds, 2),
    }


# ----------------------------------------------------------------------------- knobs


def _with(cfg: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
    new = ml_collections.ConfigDict(cfg.to_dict())
    with new.unlocked():
        config_lib.apply_overrides(new, list(overrides.items()))
    return new


def knob_candidates(cfg: ml_collections.ConfigDict, num_devices: int) -> list[list[dict[str, Any]]]:
    """Per knob (fsdp, remat, micro-batches, batch size), the changes to try, least disruptive first."""
    derived = config_lib.derive(cfg, num_devices)
    data, fsdp, tensor = derived.mesh_shape
    knobs = []
    if data > 1:  # shard the state over the data-parallel devices too
        knobs.append([{"mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": tensor}])
    policies = REMAT_ORDER[REMAT_ORDER.index(cfg.model.remat) + 1:] if cfg.model.remat in REMAT_ORDER else ()
    knobs.append([{"model.remat": p} for p in policies])
    micro, options = cfg.optim.micro_batches, []
    while derived.per_device_batch * cfg.optim.micro_batches // (micro * 2) >= 1 and len(options) < 4:
        micro *= 2
        options.append({"optim.micro_batches": micro})
    knobs.append(options)
    batch, options = cfg.data.global_batch_size, []
    while len(options) < 3 and batch % 2 == 0:
        batch //= 2
        options.append({"data.global_batch_size": batch})
    knobs.append(options)
    return [k for k in knobs if k]


def suggest(
    cfg: ml_collections.ConfigDict, num_devices: int, budget_bytes: float, platform: str, limit: int = 8
) -> list[dict[str, Any]]:
    """Changes that make the analytic estimate fit in `budget_bytes`: single knobs first, then two or
    three together when no single one fits. Of the settings that fit, only the least disruptive are
    kept: none that another fitting setting beats on every knob (each knob's options go from mild
    to strong: fewer micro-batches before more, dots before full remat)."""
    knobs = knob_candidates(cfg, num_devices)
    found: list[dict[str, Any]] = []
    for n_knobs in range(1, min(3, len(knobs)) + 1):
        for group in itertools.combinations(knobs, n_knobs):
            fitting = []  # (option index per knob, suggestion)
            for index in itertools.product(*(range(len(options)) for options in group)):
                overrides = {k: v for options, i in zip(group, index) for k, v in options[i].items()}
                try:
                    per_device = estimate(_with(cfg, overrides), num_devices, platform=platform).per_device_bytes
                except UserError:  # e.g. a batch that no longer splits over the devices
                    continue
                if per_device <= budget_bytes:
                    fitting.append((index, {"overrides": overrides, "per_device_bytes": per_device,
                                            "spare_bytes": budget_bytes - per_device}))
            for index, suggestion in fitting:
                if not any(other != index and all(o <= i for o, i in zip(other, index)) for other, _ in fitting):
                    found.append(suggestion)
        if found:
            break
    return found[:limit]


# ----------------------------------------------------------------------------- micro-batches=0


def device_memory_bytes(device=None) -> float:
    """What one device can hold: an accelerator's own limit (`memory_stats()['bytes_limit']`); on a
    CPU the host's memory shared by its local devices."""
    import jax

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends have no memory statistics
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, sum(d.platform == device.platform for d in jax.local_devices()))


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
    data, fsdp, _ = config_lib.mesh_shape(cfg, num_devices)
    shards, batch = data * fsdp, cfg.data.global_batch_size
    if batch % shards:
        raise UserError(
            f"config.data.global_batch_size={batch} does not divide over data*fsdp={shards} devices; use a "
            f"multiple of {shards}"
        )
    budget = AUTO_SHARE * memory_bytes
    per_shard = batch // shards
    act_bytes = cpu_act_bytes() if platform == "cpu" else None  # XLA:CPU: float32 before jaxlib 0.11
    for k in (k for k in range(1, per_shard + 1) if per_shard % k == 0):
        trial = _with(cfg, {"optim.micro_batches": k})
        need = estimate(trial, num_devices, platform=platform, act_bytes=act_bytes).per_device_bytes
        if need <= budget:
            break
    fits = need <= budget
    line = (f"optim.micro_batches=0 (as few as fit): {k} micro-batch(es) of {per_shard // k} sequence(s) per "
            f"device, planned {format_bytes(need)} of {format_bytes(memory_bytes)} per device"
            + ("" if fits else f"; that is over {AUTO_SHARE:.0%}: see python -m jaxlm.plan for what would fit"))
    return trial, line


def for_gpus(cfg: ml_collections.ConfigDict, num_devices: int, memory_gib: float = 80.0) -> ml_collections.ConfigDict:
    """`cfg` with `optim.micro_batches=0` resolved as on `num_devices` GPUs of `memory_gib`: for
    compiling a GPU run's program on fake CPU devices (whose own choice would follow host memory)."""
    return resolve_micro_batches(cfg, num_devices, memory_gib * GIB, "gpu")[0]


# ----------------------------------------------------------------------------- the plan


def plan(
    cfg: ml_collections.ConfigDict, num_devices: int, device_memory_bytes: float, *, platform: str = "gpu",
    compile: bool = False, devices=None,
) -> dict[str, Any]:
    """The whole report as plain data (what `--json` prints)."""
    cfg, auto = resolve_micro_batches(cfg, num_devices, device_memory_bytes, platform)
    est = estimate(cfg, num_devices, platform=platform)
    report: dict[str, Any] = {
        "recipe": cfg.run.get("recipe", ""),
        "num_devices": num_devices,
        "mesh": dict(zip(("data", "fsdp", "tensor"), est.mesh_shape)),
        "platform": platform,
        "device_memory_bytes": device_memory_bytes,
        "param_count": est.param_count,
        "bytes_per_param": est.bytes_per_param,
        "global_batch_size": cfg.data.global_batch_size,
        "seq_len": cfg.data.seq_len,
        "micro_batches": cfg.optim.micro_batches,
        "micro_batches_auto": auto,
        "per_device_batch": est.per_device_batch,
        "remat": cfg.model.remat,
        "dtype": cfg.model.dtype,
        "param_dtype": cfg.model.param_dtype,
        "attention": est.attention,
        "analytic": {"per_device_bytes": est.per_device_bytes, "rows": [dataclasses.asdict(r) for r in est.rows]},
        "compiled": None,
    }
    decided_by, per_device = "analytic", est.per_device_bytes
    if compile:
        devices = devices if devices is not None else compile_devices(num_devices)
        compiled = compiled_memory(cfg, devices)
        cpu = compiled["platform"] == "cpu"
        same = estimate(cfg, num_devices, platform=compiled["platform"], act_bytes=cpu_act_bytes() if cpu else None)
        compiled["analytic_same_program_bytes"] = same.per_device_bytes
        compiled["ratio"] = compiled["per_device_bytes"] / same.per_device_bytes
        compiled["within_tolerance"] = abs(compiled["ratio"] - 1) <= TOLERANCE
        report["compiled"] = compiled
        if compiled["platform"] == platform:
            decided_by, per_device = "compiled", compiled["per_device_bytes"]
    report["decided_by"] = decided_by
    report["per_device_bytes"] = per_device
    report["fits"] = per_device <= device_memory_bytes
    report["margin_bytes"] = device_memory_bytes - per_device
    report["suggestions"] = [] if report["fits"] else suggest(cfg, num_devices, device_memory_bytes, platform)
    return report


def format_report(report: dict[str, Any]) -> str:
    r = report
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"jaxlm plan: {r['recipe'] or 'config'}, {format_count(r['param_count'])} parameters, on {r['num_devices']} "
        f"devices ({mesh}), {format_bytes(r['device_memory_bytes'])} each",
        f"  batch {r['global_batch_size']} x {r['seq_len']} tokens, {r['micro_batches']} micro-batch(es) of "
        f"{r['per_device_batch']} sequence(s) per device; remat={r['remat']}; compute {r['dtype']}, params "
        f"{r['param_dtype']}; attention {r['attention']} (planned for {r['platform']})",
        *([f"  {r['micro_batches_auto']}"] if r.get("micro_batches_auto") else []),
        "",
        f"  {'component':<22}{'per device':>14}{'unsharded':>14}",
    ]
    for row in r["analytic"]["rows"]:
        lines.append(f"  {row['name']:<22}{format_bytes(row['per_device_bytes']):>14}"
                     f"{format_bytes(row['total_bytes']):>14}   {row['note']}")
    lines.append(f"  {'total (analytic)':<22}{format_bytes(r['analytic']['per_device_bytes']):>14}")
    lines.append(f"  parameters + gradients + optimizer state: {r['bytes_per_param']:.1f} bytes per parameter")
    c = r["compiled"]
    if c:
        lines += [
            "",
            f"  compiled (XLA, {c['num_devices']} {c['platform']} devices, {c['compile_s']} s): "
            f"{format_bytes(c['per_device_bytes'])} per device = arguments {format_bytes(c['argument_bytes'])}"
            f" + outputs not aliased {format_bytes(c['output_bytes'] - c['alias_bytes'])}"
            f" + temporaries {format_bytes(c['temp_bytes'])}",
            f"  analytic for the same program ({c['attention']} attention"
            + (", float32 activations as the CPU keeps them" if c["platform"] == "cpu" else "")
            + f"): {format_bytes(c['analytic_same_program_bytes'])}; compiled / analytic = {c['ratio']:.3f} "
            + ("(within " if c["within_tolerance"] else "(OUTSIDE ") + f"the stated ±{TOLERANCE:.0%})",
        ]
    lines.append("")
    verdict = f"{format_bytes(r['per_device_bytes'])} of {format_bytes(r['device_memory_bytes'])} per device ({r['decided_by']})"
    if r["fits"]:
        lines.append(f"fits: {verdict}, {format_bytes(r['margin_bytes'])} to spare")
    else:
        lines.append(f"does not fit: {verdict}, short by {format_bytes(-r['margin_bytes'])}")
        if r["suggestions"]:
            lines.append("these changes would fit (analytic):")
            for s in r["suggestions"]:
                flags = " ".join(f"--config.{k}={v}" for k, v in s["overrides"].items())
                lines.append(f"  {flags:<64} {format_bytes(s['per_device_bytes']):>12}"
                             f"  ({format_bytes(s['spare_bytes'])} to spare)")
        else:
            lines.append("no change of fsdp, remat, micro-batches or batch size tried fits: use more devices, "
                         "tensor parallelism (config.mesh.tensor) or a smaller model")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2, like every jaxlm user error
        raise UserError(message)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="python -m jaxlm.plan", description=__doc__.splitlines()[2], allow_abbrev=False)
    parser.add_argument("--devices", type=int, required=True, help="number of devices the run uses")
    parser.add_argument("--device_memory_gib", type=float, default=80.0, help="memory of one device (default 80)")
    parser.add_argument("--platform", choices=("gpu", "tpu", "cpu"), default="gpu",
                        help="the accelerator planned for: picks the kernel model.attention=auto would (default gpu)")
    parser.add_argument("--compile", action="store_true",
                        help="also compile the train step ahead of time and report XLA's memory analysis")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    try:
        config_args = [a for a in argv if a.startswith("--config")]
        args = parser.parse_args([a for a in argv if not a.startswith("--config")])
        if args.devices < 1:
            raise UserError(f"--devices={args.devices}: give a positive number of devices")
        if args.device_memory_gib <= 0:
            raise UserError(f"--device_memory_gib={args.device_memory_gib}: give a positive size in GiB")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # planning never needs device memory
        if args.compile:
            use_cpu_devices(args.devices)
        elif "jax" not in sys.modules:  # the analytic figure needs no device: keep JAX off the accelerators
            os.environ["JAX_PLATFORMS"] = "cpu"
        cfg = config_lib.parse_cli(config_args)
        report = plan(cfg, args.devices, args.device_memory_gib * GIB, platform=args.platform, compile=args.compile)
    except UserError as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, default=float) if args.json else format_report(report), flush=True)
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
