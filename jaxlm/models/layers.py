"""Building blocks of the decoder: norms, rotary embedding, projections, attention, embedding (the
MLPs are in `jaxlm.models.mlps`).

Every weight is an `nnx.Param` created with logical axis names (never mesh axes); `jaxlm.mesh`
maps the names onto the device mesh. Every weight matmul goes through one module, `Projection`,
which owns its kernel, the kernel's logical names, the cast to the compute `dtype` and the
contraction: the seam where adapters, quantized or sparse kernels plug in without the attention or
MLP code knowing. Norm statistics and softmax run in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxlm import quant as quant_lib
from jaxlm.mesh import constrain
from jaxlm.models.attention import KVCache, attend, attend_cached

Initializer = Callable[..., jax.Array]


def make_param(
    rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], names: tuple, dtype, *, decay: bool | None = None
) -> nnx.Param:
    """A parameter with its logical axis names (one per dimension, None = never sharded).

    `decay` marks the weights that get weight decay: matrices by default, never norms or biases.
    Sharding is applied where the train state is created (`jaxlm.train_state`), not here, so a model
    can be built on one CPU with no mesh (eager sharding off).
    """
    assert len(shape) == len(names), (shape, names)
    decay = len(shape) >= 2 if decay is None else decay
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, decay=decay, eager_sharding=False)


def normal(std: float) -> Initializer:
    return jax.nn.initializers.normal(stddev=std)


zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


def recomputed(fn: Callable) -> Callable:
    """`fn` with its intermediates recomputed in the backward pass from its inputs.

    For the elementwise pieces between matmuls (norms, activation functions): left to autodiff, an
    RMSNorm keeps two float32 copies of its [B, T, D] input for the backward pass and SwiGLU six
    [B, T, F] tensors, where the bf16 inputs suffice (1b, 8 sequences per device: 21 GiB of 48,
    by the planner). Recomputing them is elementwise work that the backward pass's own kernels
    read the same inputs for anyway. It pays in the layer scan (`model.scan_layers`, every recipe),
    whose saved residuals are stacked buffers; with unrolled layers XLA's buffer assignment came out
    the same either way (measured, `jaxlm.plan`). `prevent_cse=False`: inside a scan XLA cannot
    merge the recomputation with the forward values, and the barrier would only hinder fusion.
    """
    return jax.checkpoint(fn, prevent_cse=False)


class Frozen(nnx.Variable):
    """A leaf of the model's parameters that never trains: not an `nnx.Param`, so no `optim.trainable`
    selects it (`train_state.build_model_spec`), no gradient or optimizer state exists for it."""


class QuantizedParam(Frozen):
    """A quantized weight's leaf (integer codes, scales, zero points): frozen, no gradient of an integer."""


class PruningMask(Frozen):
    """A pruned kernel's mask (bool, the kernel's shape and logical names): False where a weight was
    pruned. The kernel holds zeros there; fine-tuning keeps them zero (`pruning_masks.keep_pruned`), gradual
    pruning rewrites the mask on its schedule."""


EinsumOp = Callable[..., jax.Array]  # (equation, x, kernel) -> y, like jnp.einsum


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def accumulating_einsum(equation: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`jnp.einsum(equation, x, kernel)` in low precision as a GPU runs it: the operands' products summed in
    float32, the result rounded to the operands' dtype; and its two gradients computed the same way.

    An `EinsumOp` for XLA:CPU, where it is the fast form: XLA:CPU runs a bfloat16 dot natively (YNNPACK's
    bf16 kernel, AVX512-BF16 where the CPU has it) only when the dot's result is float32. A plain bf16
    einsum (result bf16) it upcasts to a float32 dot instead, at about half the speed, and JAX's own
    gradients of the float32-result form take float32 cotangents and are upcast again: hence the custom
    VJP. In float32 compute it is the faster CPU step too (fewer layout copies around the gradients' dots
    than XLA's own einsum and its joint projections: benchmarks/BENCHMARKS.md), so `model.matmul=auto` takes
    it on every CPU. Every index of each operand must appear in the other operand or the output (true of
    every projection: nothing is summed within one operand)."""
    return jnp.einsum(equation, x, kernel, preferred_element_type=jnp.float32).astype(x.dtype)


def _accumulating_einsum_fwd(equation, x, kernel):
    return accumulating_einsum(equation, x, kernel), (x, kernel)


def _accumulating_einsum_bwd(equation, residuals, g):
    x, kernel = residuals
    lhs, out = equation.split("->")
    x_idx, kernel_idx = lhs.split(",")
    dx = jnp.einsum(f"{out},{kernel_idx}->{x_idx}", g, kernel, preferred_element_type=jnp.float32)
    dkernel = weight_grad(x_idx, out, kernel_idx, x, g)
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


def weight_grad(x_idx: str, out: str, kernel_idx: str, x: jax.Array, g: jax.Array) -> jax.Array:
    """The kernel's gradient in float32: x and g multiplied over the tokens, with the operand of fewer elements
    outside the contraction as the dot's left side. XLA:CPU's matmuls (YNNPACK) take their left operand with the
    contracted dimension minor, so XLA writes a transposed copy of the left operand; both operands here have the
    tokens major, and the narrower is the cheaper to copy (an MLP's down projection: its [tokens, d_model]
    gradient, not its [tokens, mlp_dim] input). The values are the same either way."""
    batch = "".join(i for i in kernel_idx if i in x_idx and i in out)  # indices of all three (stacked kernels)
    x_side = "".join(i for i in x_idx if i in kernel_idx and i not in batch)
    g_side = "".join(i for i in out if i in kernel_idx and i not in batch)
    sizes = {**dict(zip(x_idx, x.shape, strict=True)), **dict(zip(out, g.shape, strict=True))}
    if math.prod(sizes[i] for i in g_side) >= math.prod(sizes[i] for i in x_side):
        return jnp.einsum(f"{x_idx},{out}->{kernel_idx}", x, g, preferred_element_type=jnp.float32)
    swapped = f"{batch}{g_side}{x_side}"
    product = jnp.einsum(f"{out},{x_idx}->{swapped}", g, x, preferred_element_type=jnp.float32)
    # the barrier keeps XLA from folding the transpose into the dot, which it does by swapping the operands back
    return jnp.einsum(f"{swapped}->{kernel_idx}", jax.lax.optimization_barrier(product))


accumulating_einsum.defvjp(_accumulating_einsum_fwd, _accumulating_einsum_bwd)


# float8 formats of the projections' matmuls (Micikevicius et al. 2022, as torchtitan's float8 training and
# MaxText's use them): e4m3 (more precision) for weights and activations, e5m2 (more range) for gradients
FP8_FORWARD, FP8_BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2


def to_fp8(t: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(t scaled so that its largest magnitude is the format's largest finite value, in float8; the scale):
    per-tensor current scaling. t ~= q / scale."""
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    scale = jnp.where(amax > 0, top / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), 1.0)
    q = jnp.clip(t.astype(jnp.float32) * scale, -top, top).astype(dtype)
    return q, scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(equation: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`jnp.einsum(equation, x, kernel)` with float8 operands: x and the kernel in e4m3, each with its own
    per-tensor scale (current scaling: this step's maximum), products summed in float32, the result
    rescaled and rounded to x's dtype; the backward pass's two matmuls take the gradient in e5m2 the same
    way. The `EinsumOp` of `model.matmul=fp8` (Hopper's float8 tensor cores: twice bfloat16's peak; on a
    CPU XLA runs the same program emulated)."""
    return _fp8_forward(equation, x, kernel)[0]


FP8_OPERANDS = "fp8_operands"  # the name remat's "dots" policy saves float8 operands by (transformer.REMAT_POLICIES)
# The name of attention's q, k (after the rotary embedding) and v: remat's "dots" policies save them, so the
# backward pass does not recompute the rotation from the saved projections (the attention's backward needs the
# rotated ones; the rotation's own backward needs neither), at the same memory: the unrotated q and k then have
# no use left in the backward pass and are not kept (transformer.REMAT_POLICIES).
ATTENTION_INPUTS = "attention_inputs"
# The name of the MLP's hidden activation, the down (output) projection's input: remat's "dots_mlp" policy saves
# it as well as the matmuls' outputs, so the backward pass reads it instead of recomputing it from gate and up
# (one [B, T, F] tensor per layer more memory, one less written in each layer's backward pass).
MLP_HIDDEN = "mlp_hidden"


def _fp8_forward(equation, x, kernel):
    xq, sx = jax.tree.map(lambda t: checkpoint_name(t, FP8_OPERANDS), to_fp8(x, FP8_FORWARD))
    kq, sk = jax.tree.map(lambda t: checkpoint_name(t, FP8_OPERANDS), to_fp8(kernel, FP8_FORWARD))
    # the product summed in float32 inside the matmul and written in x's dtype: what remat's "dots" policy saves
    # is then as large as a bfloat16 matmul's output, not twice that
    y = jnp.einsum(equation, xq, kq, preferred_element_type=x.dtype).astype(jnp.float32) / (sx * sk)
    # the float8 operands are what the backward pass reads (a quarter of float32's bytes); an empty array
    # carries the kernel's dtype, which its gradient must have
    return y.astype(x.dtype), (xq, sx, kq, sk, jnp.zeros((0,), kernel.dtype))


def _fp8_einsum_fwd(equation, x, kernel):
    return _fp8_forward(equation, x, kernel)


def _fp8_grads(equation, xq, sx, kq, sk, g) -> tuple[jax.Array, jax.Array]:
    """(x's gradient in g's dtype, the kernel's in float32) from the float8 operands and g, quantized to e5m2."""
    lhs, out = equation.split("->")
    x_idx, kernel_idx = lhs.split(",")
    gq, sg = to_fp8(g, FP8_BACKWARD)
    dx = jnp.einsum(f"{out},{kernel_idx}->{x_idx}", gq, kq, preferred_element_type=jnp.float32) / (sg * sk)
    dkernel = jnp.einsum(f"{x_idx},{out}->{kernel_idx}", xq, gq, preferred_element_type=jnp.float32) / (sx * sg)
    return dx.astype(g.dtype), dkernel


def _fp8_einsum_bwd(equation, residuals, g):
    xq, sx, kq, sk, kernel_dtype = residuals
    dx, dkernel = _fp8_grads(equation, xq, sx, kq, sk, g)
    return dx, dkernel.astype(kernel_dtype.dtype)


fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


class Fp8Weight(NamedTuple):
    """A kernel in float8 (e4m3) and its per-tensor scale (`to_fp8`): what a train step with micro-batches
    hands a float8 projection in its `ComputeKernel`, quantized once per step rather than in every
    micro-batch (the weights do not change within a step: the same operands, one amax and cast per step)."""

    q: jax.Array
    scale: jax.Array


def fp8_weight(kernel: jax.Array) -> Fp8Weight:
    return Fp8Weight(*to_fp8(kernel, FP8_FORWARD))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_weight_grad_einsum(equation: str, x: jax.Array, kq: jax.Array, sk: jax.Array, grad: jax.Array) -> jax.Array:
    """`fp8_einsum(equation, x, kernel)` with the kernel already in float8 (`Fp8Weight`: kq, sk); the kernel's
    gradient comes back in float32 as `grad`'s cotangent, added to the step's accumulator in the GEMM's
    epilogue, as `weight_grad_einsum`'s does (`grad`'s value is not read; kq and sk get none)."""
    return _fp8_weight_forward(equation, x, kq, sk)[0]


def _fp8_weight_forward(equation, x, kq, sk):
    xq, sx = jax.tree.map(lambda t: checkpoint_name(t, FP8_OPERANDS), to_fp8(x, FP8_FORWARD))
    y = jnp.einsum(equation, xq, kq, preferred_element_type=x.dtype).astype(jnp.float32) / (sx * sk)
    return y.astype(x.dtype), (xq, sx, kq, sk)


def _fp8_weight_grad_einsum_fwd(equation, x, kq, sk, grad):
    return _fp8_weight_forward(equation, x, kq, sk)


def _fp8_weight_grad_einsum_bwd(equation, residuals, g):
    dx, dkernel = _fp8_grads(equation, *residuals, g)
    return dx, None, None, dkernel


fp8_weight_grad_einsum.defvjp(_fp8_weight_grad_einsum_fwd, _fp8_weight_grad_einsum_bwd)



@dataclasses.dataclass(frozen=True)
class Contraction:
    """How the projections multiply (config.model.matmul; `ModelConfig.matmul`), with what the memory planner
    (`jaxlm.memory`) asks of it."""

    einsum: EinsumOp
    # Bytes per element of the operands it saves for the backward pass under remat's dots policies, beside
    # the dots' outputs: float8's inputs and weights (`FP8_OPERANDS`), one byte each; 0 = none
    saved_operand_bytes: int = 0
    # What a train step with micro-batches makes of a `ComputeKernel`'s weight once per step (in the compute
    # dtype), for every micro-batch's matmuls: float8's quantized kernel (`fp8_weight`); None: the weight itself
    prepare_kernel: Callable[[jax.Array], Any] | None = None
    # Whether XLA:CPU, in float32 compute, makes a transposed copy of the logits' gradient for the untied
    # unembedding's kernel gradient: XLA's einsum does, one more float32 [tokens, vocab] buffer at the loss
    # (`memory.logit_bytes`); the accumulating einsum's own gradient dots read it as it is (a tied
    # unembedding's [V, D] kernel gets the copy with either)
    transposes_logit_gradient: bool = False


# By name: XLA's einsum, the float32 accumulation made explicit (CPUs, in bfloat16 or float32), float8
# operands with per-tensor scales
CONTRACTIONS = {"xla": Contraction(jnp.einsum, transposes_logit_gradient=True),
                "accumulate": Contraction(accumulating_einsum),
                "fp8": Contraction(fp8_einsum, saved_operand_bytes=1, prepare_kernel=fp8_weight)}


@jax.tree_util.register_pytree_node_class
class ComputeKernel:
    """A projection's kernel as a train step with micro-batches hands it to the model
    (`train_state.ModelSpec.model_params`): `w`, cast to the compute dtype once per step, and `grad`, a
    float32 array of `w`'s shape whose value is never read. The projection's matmul (`einsum`) takes its
    weight gradient in float32 straight from the GEMM and returns it as `grad`'s cotangent, so the step's
    float32 accumulator adds it in the GEMM's epilogue (XLA fuses `acc + g` into a GEMM that makes
    float32), instead of a bfloat16 gradient per micro-batch that a separate kernel widens and adds.

    `joined`: `w` is a group's kernels joined as the model runs them in one matmul (`Joint`), kept in the
    group's first projection; the others hold an empty `ComputeKernel(None, None, joined=True)`.
    """

    def __init__(self, w, grad, joined: bool = False):
        self.w, self.grad, self.joined = w, grad, joined

    def tree_flatten(self):
        return (self.w, self.grad), self.joined

    @classmethod
    def tree_unflatten(cls, joined, children):
        return cls(*children, joined=joined)

    def einsum(self, equation: str, x: jax.Array, dtype) -> jax.Array:
        """`einsum(equation, x, w)` with `w` in `dtype` (the projection's compute dtype: a no-op cast when
        the step cast it already); with float8 operands when `w` is an `Fp8Weight` (quantized once per step)."""
        if isinstance(self.w, Fp8Weight):
            return fp8_weight_grad_einsum(equation, x, self.w.q, self.w.scale, self.grad)
        return weight_grad_einsum(equation, x, self.w.astype(dtype), self.grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def weight_grad_einsum(equation: str, x: jax.Array, kernel: jax.Array, grad: jax.Array) -> jax.Array:
    """`jnp.einsum(equation, x, kernel)`, whose kernel gradient comes back, in float32, as `grad`'s
    cotangent (`grad`'s value is not read; `kernel`'s cotangent is zero: `ComputeKernel`)."""
    return jnp.einsum(equation, x, kernel)


def _weight_grad_einsum_fwd(equation, x, kernel, grad):
    return jnp.einsum(equation, x, kernel), (x, kernel)


def _weight_grad_einsum_bwd(equation, residuals, g):
    x, kernel = residuals
    inputs, out = equation.split("->")
    x_idx, kernel_idx = inputs.split(",")
    dx = jnp.einsum(f"{out},{kernel_idx}->{x_idx}", g, kernel)
    dkernel = jnp.einsum(f"{x_idx},{out}->{kernel_idx}", x, g, preferred_element_type=jnp.float32)
    return dx, None, dkernel


weight_grad_einsum.defvjp(_weight_grad_einsum_fwd, _weight_grad_einsum_bwd)
class Projection(nnx.Module):
    """One weight matmul, `einsum(equation, x, kernel)`: q, k, v, o, the MLP's and the unembedding.

    A plain kernel: it owns the kernel (stored in `param_dtype`, with its logical axis names), the
    kernel's cast to the compute `dtype` (`weight()`) and the contraction (`einsum_op`, `jnp.einsum` by
    default, as `flax.nnx.Einsum` takes one; the CPU's accumulating matmul or float8 are others). The
    features that change how a projection stores or computes its weight, or add to its output
    (quantized kernels, QAT, pruning masks, LoRA adapters), are its subclasses in
    `jaxlm.models.transforms`, which override `store_kernel`, `weight`, `__call__` and the properties
    below. `projections` finds every one in a model by path.
    """

    def __init__(self, equation: str, shape: tuple[int, ...], names: tuple, *, init: Initializer, dtype,
                 param_dtype, rngs: nnx.Rngs, einsum_op: EinsumOp = jnp.einsum):
        self.equation, self.dtype, self.einsum_op = equation, dtype, einsum_op
        # One layer's kernel: its shape and logical names, however it is stored.
        self.kernel_shape, self.kernel_names = tuple(shape), tuple(names)
        self.store_kernel(make_param(rngs, init, shape, names, param_dtype))

    def store_kernel(self, kernel: nnx.Param) -> None:
        """Keep the freshly drawn kernel: as it is here; quantized, or with a mask beside it, in a transform."""
        self.kernel = kernel

    @property
    def base(self) -> nnx.Variable:
        """The stored base weight: `kernel` (a quantized kernel's codes `kernel_q`, with the same logical names)."""
        return self.kernel

    @property
    def in_axes(self) -> tuple[int, ...]:
        """The kernel's dimensions that are contracted with the input (the rest are the output's)."""
        (x, kernel), out = self.equation.split("->")[0].split(","), self.equation.split("->")[1]
        return tuple(i for i, c in enumerate(kernel) if c in x and c not in out)

    @property
    def batch_axes(self) -> tuple[int, ...]:
        """The kernel's dimensions that the input and the output share, one matrix per index: an MoE's
        experts, [E, inputs, outputs] in "end,edf->enf" (none in a dense projection)."""
        (x, kernel), out = self.equation.split("->")[0].split(","), self.equation.split("->")[1]
        return tuple(i for i, c in enumerate(kernel) if c in x and c in out)

    @property
    def quant_axis(self) -> int:
        """The kernel's last input axis: the one a quantized format groups its values along."""
        return max(self.in_axes)

    def weight(self) -> jax.Array:
        """The kernel as the contraction uses it, in the compute dtype."""
        return self.kernel[...].astype(self.dtype)

    def effective_weight(self) -> jax.Array:
        """The one kernel, in the compute dtype, whose contraction gives this projection's output: `weight()`
        (dequantized, fake-quantized), with what a transform adds to the output folded in (LoRA's adapter,
        `transforms.Adapted`). What an MoE hands its experts' grouped matmuls (`mlps.moe`)."""
        return self.weight()

    @property
    def compute_kernel(self) -> ComputeKernel | None:
        """The kernel's `ComputeKernel`, when a train step with micro-batches put one in its place."""
        value = self.kernel.get_raw_value()
        return value if isinstance(value, ComputeKernel) else None

    @property
    def plain(self) -> bool:
        """Whether the contraction sees the stored kernel cast to the compute dtype and nothing else: no
        transform that changes its weight or adds to its output (the transforms say False), and no batch axes
        (an MoE's experts go to the dispatch's grouped matmuls whole)."""
        return not self.batch_axes

    @property
    def fusable(self) -> bool:
        """Whether this projection is a plain `jnp.einsum` of its cast kernel (`plain`, not float8 with its
        per-tensor scales nor the CPU's accumulating matmul), so that it can share one matmul with others of
        the same input (`project_qkv`)."""
        return self.plain and self.einsum_op is jnp.einsum

    @property
    def takes_compute_kernel(self) -> bool:
        """Whether a train step with micro-batches can hand it a `ComputeKernel`: a plain kernel (`plain`) of
        XLA's contraction or float8's (`fp8_einsum`, whose weight is then quantized once per step)."""
        return self.plain and (self.einsum_op is jnp.einsum or self.einsum_op is fp8_einsum)

    def cast_leaves(self) -> dict[str, object]:
        """The leaves whose forward use is a plain cast to the compute dtype, with that dtype (`kernel`).
        A train step with micro-batches casts these once per step (`steps.make_train_step`) instead of
        in every micro-batch: the same weights, the same gradients."""
        return {"kernel": self.dtype}

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """`dropout_key`: for a transform's own dropout (LoRA's); the kernel's contraction has none."""
        if (kernel := self.compute_kernel) is not None:
            return kernel.einsum(self.equation, x, self.dtype)
        return self.einsum_op(self.equation, x, self.weight())


def cast_leaves(module: nnx.Module) -> dict[tuple, object]:
    """{a parameter's path: the compute dtype its forward use casts it to, and nothing else} over
    `module` (the projections' kernels and adapters, the embedding table: `cast_leaves` of each)."""
    out = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, (Projection, Embed)):
            out.update({(*path, name): dtype for name, dtype in node.cast_leaves().items()})
    return out


def projections(module: nnx.Module) -> Iterator[tuple[tuple, Projection]]:
    """Every `Projection` in `module`, with its path (e.g. `('blocks', 'attn', 'wq')`)."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, Projection):
            yield path, node


@dataclasses.dataclass(frozen=True)
class Joint:
    """Projections the model runs as one matmul (`project_qkv`, `project_gate_up`): `kind` ("qkv" or
    "gate_up") and the paths of their kernels, in the order the join takes them (`joints`)."""

    kind: str
    paths: tuple[tuple, ...]

    def join(self, parts: Sequence[jax.Array]) -> jax.Array:
        return {"qkv": join_qkv, "gate_up": join_gate_up}[self.kind](*parts)

    def split(self, joint: jax.Array) -> tuple[jax.Array, ...]:
        return {"qkv": split_qkv, "gate_up": split_gate_up}[self.kind](joint)

    def names(self, part_names: Sequence[tuple]) -> tuple:
        """The joined kernel's logical names, from its parts' (k's for qkv: the key-value heads lead)."""
        if self.kind == "qkv":
            k = part_names[1]
            return (*k[:-1], None, k[-1])
        return (*part_names[0], None)


def joints(module: nnx.Module) -> list[Joint]:
    """The groups of projections in `module` that its forward runs as one matmul, with their kernels' paths."""
    out = []
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):  # the attention's q, k, v; an MLP's (jaxlm.models.mlps)
            for kind, names in getattr(node, "joined_projections", ()):
                out.append(Joint(kind, tuple((*path, name, "kernel") for name in names)))
    return out


def split_keys(key: jax.Array | None, n: int) -> tuple:
    """`n` keys from `key`, or `n` Nones without one (no dropout)."""
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, in float32 (config.model.norm=rmsnorm)."""

    name = "rmsnorm"

    @staticmethod
    def params(dim: int, use_bias: bool) -> int:
        return dim

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, use_bias: bool, rngs: nnx.Rngs,
                 axis: str = "norm"):
        """`axis`: the scale's logical axis name ("norm" for the residual width; "head_dim" for the attention's
        per-head norms of queries and keys, whose width is a head's)."""
        del use_bias  # RMSNorm has no bias
        self.eps, self.dtype = eps, dtype
        self.scale = make_param(rngs, ones, (dim,), (axis,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        @recomputed
        def norm(x, scale):
            x32 = x.astype(jnp.float32)
            x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            return (x32 * scale.astype(jnp.float32)).astype(self.dtype)

        return norm(x, self.scale[...])


class LayerNorm(nnx.Module):
    """(x - mean) / std * scale (+ bias, with the model's biases), in float32 (config.model.norm=layernorm)."""

    name = "layernorm"

    @staticmethod
    def params(dim: int, use_bias: bool) -> int:
        return dim * (2 if use_bias else 1)

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, use_bias: bool, rngs: nnx.Rngs):
        self.eps, self.dtype = eps, dtype
        self.scale = make_param(rngs, ones, (dim,), ("norm",), param_dtype)
        self.bias = make_param(rngs, zeros, (dim,), ("norm",), param_dtype) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        @recomputed
        def norm(x, scale, bias):
            x32 = x.astype(jnp.float32)
            mean = jnp.mean(x32, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
            y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * scale.astype(jnp.float32)
            if bias is not None:
                y = y + bias.astype(jnp.float32)
            return y.astype(self.dtype)

        return norm(x, self.scale[...], None if self.bias is None else self.bias[...])


ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


def rope_frequencies(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     original_max_len: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> jax.Array:
    """The rotary embedding's inverse frequencies [head_dim / 2], float32, with context-extension scaling:

    none    theta^(-2i / head_dim)
    linear  all of them divided by `factor` (position interpolation)
    llama3  Llama 3.1's: wavelengths longer than original_max_len / low_freq_factor divided by
            `factor`, shorter than original_max_len / high_freq_factor kept, a smooth blend between
    yarn    YaRN's NTK-by-parts (arXiv:2309.00071, as transformers computes it): frequencies that turn
            more than `beta_fast` times over original_max_len kept, fewer than `beta_slow` times divided
            by `factor`, a linear ramp over the (whole) dimensions between; its attention factor is
            `rope_attention_factor`'s
    """
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling == "linear":
        return inv_freq / factor
    if scaling == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = original_max_len / low_freq_factor, original_max_len / high_freq_factor
        smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), blended, scaled)
    if scaling == "yarn":
        # The dimension index at which a frequency turns `rotations` times over original_max_len, rounded
        # outwards (transformers' `truncate=True`, the default every Llama- and Qwen-style config uses)
        def dimension(rotations: float) -> float:
            return head_dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dimension(beta_fast)), 0)
        high = min(math.ceil(dimension(beta_slow)), head_dim - 1)
        high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
        interpolated = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0, 1)
        return inv_freq / factor * interpolated + inv_freq * (1 - interpolated)
    return inv_freq


def rope_attention_factor(scaling: str, factor: float) -> float:
    """What `apply_rope` multiplies cos and sin by, so q.k by its square: YaRN's 0.1 ln(factor) + 1
    (1 for a factor up to 1); 1 for the other scalings."""
    if scaling != "yarn" or factor <= 1:
        return 1.0
    return 0.1 * math.log(factor) + 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array | float,
               attention_factor: float = 1.0) -> jax.Array:
    """Rotary embedding (half-split convention, Hugging Face's `rotate_half`) of x [B, T, N, H] at
    integer positions [B, T], with inverse frequencies [H/2] (`rope_frequencies`; a number is theta),
    cos and sin times `attention_factor` (`rope_attention_factor`)."""
    if not hasattr(inv_freq, "shape"):
        inv_freq = rope_frequencies(x.shape[-1], inv_freq)
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if attention_factor != 1.0:
        sin, cos = sin * attention_factor, cos * attention_factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; a no-op without a key (evaluation) or at rate 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def tensor_parallel_entry(x: jax.Array) -> jax.Array:
    """The input [B, T, D] of a tensor-parallel region (attention, MLP) with its sequence whole.

    Without sequence parallelism this is the layout activations have anyway. With it
    (`rules.act_seq=tensor`), it is Megatron's all-gather of the normed activations at the region's
    entry; the region's output, constrained back to `act_seq`, becomes the reduce-scatter. Without
    it, GSPMD keeps the sequence split into the projections and reshards q, k and v to heads with
    all-to-alls (measured: 2-2.5x the bytes, benchmarks/BENCHMARKS.md). Under context parallelism
    the sequence stays split over `context` (rule act_seq_region): only attention reaches across it, for its
    keys and values (`context_parallel.context_attention`).
    """
    return constrain(x, ("act_batch", "act_seq_region", "act_embed"))


def project_qkv(x: jax.Array, wq: Projection, wk: Projection, wv: Projection, keys,
                joint: bool = True) -> tuple[jax.Array, ...]:
    """q [B, T, N, H], k and v [B, T, K, H] from x [B, T, D]: with `joint` (`ModelConfig.joint_projections`),
    grouped-query heads (K < N) and three plain projections (`Projection.fusable`) one matmul; otherwise each
    on its own (`keys`: their adapters' dropout keys).

    The one matmul takes the three kernels concatenated per key-value head, [D, K, N/K + 2, H]: that
    head's N/K query heads, its key and its value (the query heads a key-value head serves are
    consecutive). Splitting the heads over `tensor` splits this kernel along K the same way, so the
    concatenation and the slices stay on each device. It saves memory traffic, not FLOPs: x is read
    once instead of three times, and in the backward pass x's gradient comes out of one matmul instead
    of three partial products summed; it costs a copy of v out of the joint output and the assembly of
    the joint gradient, small when K is. With grouped-query heads (1b) the GPU program's roofline-bound
    MFU rises; with every head its own key and value (125m, 350m, 7b) the copies cost what the reads save,
    so those stay three matmuls, as they do with the CPU's accumulating matmul (`accumulating_einsum`,
    XLA:CPU in bfloat16), which ran the joint one slower per step (all measured: benchmarks/BENCHMARKS.md).
    The parameters stay three (checkpoints, conversion, adapters and quantization see q, k and v as
    before); the concatenation of their compute-dtype kernels, small beside the matmul, is counted in
    those measurements. A train step with micro-batches joins them once per step instead (`ComputeKernel`,
    `Joint`), and the matmul then takes the joined kernel as a [D, K (N/K + 2) H] matrix.
    """
    if not (joint and joins_qkv(wq, wk, wv)):
        return tuple(p(x, key) for p, key in zip((wq, wk, wv), keys))
    n, group = wq.kernel_shape[1], wq.kernel_shape[1] // wk.kernel_shape[1]
    if (joined := wq.compute_kernel) is not None:  # joined once per step (`ComputeKernel`)
        # As a [D, K (N/K + 2) H] matrix: the joined kernel is made outside the micro-batch loop, where XLA
        # would otherwise pick it a layout that makes the backward pass transpose the gradient instead
        shape = joined.w.shape
        flat = ComputeKernel(joined.w.reshape(shape[0], -1), joined.grad.reshape(shape[0], -1))
        y = flat.einsum("btd,de->bte", x, wq.dtype).reshape(*x.shape[:2], *shape[1:])
    else:
        y = jnp.einsum("btd,dkgh->btkgh", x, join_qkv(wq.weight(), wk.weight(), wv.weight()))  # [B, T, K, N/K + 2, H]
    return y[:, :, :, :group].reshape(*y.shape[:2], n, y.shape[-1]), y[:, :, :, group], y[:, :, :, group + 1]


def joins_qkv(wq: Projection, wk: Projection, wv: Projection) -> bool:
    """Whether `project_qkv` runs q, k and v as one matmul: grouped-query heads, three plain projections."""
    return wk.kernel_shape[1] < wq.kernel_shape[1] and wq.fusable and wk.fusable and wv.fusable


def join_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [..., D, N, H], k and v [..., D, K, H] -> [..., D, K, N/K + 2, H] (`project_qkv`'s one kernel)."""
    *lead, d, n, h = q.shape
    kv = k.shape[-2]
    return jnp.concatenate([q.reshape(*lead, d, kv, n // kv, h), k.reshape(*lead, d, kv, 1, h),
                            v.reshape(*lead, d, kv, 1, h)], axis=-2)


def split_qkv(joint: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The inverse of `join_qkv`."""
    *lead, d, kv, g2, h = joint.shape
    return joint[..., : g2 - 2, :].reshape(*lead, d, kv * (g2 - 2), h), joint[..., g2 - 2, :], joint[..., g2 - 1, :]


class Attention(nnx.Module):
    """Multi-head attention with grouped-query heads, optional rotary positions and optional per-head RMSNorms
    of the queries and keys (Qwen3's q_norm and k_norm: `ModelConfig.qk_norm`)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pd, std = cfg.param_dtype, cfg.init_std
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, param_dtype=pd, rngs=rngs)
        self.wq = cfg.projection("wq", "btd,dnh->btnh", (d, n, h), ("embed", "heads", "head_dim"), init=normal(std),
                                 **kw)
        self.wk = cfg.projection("wk", "btd,dkh->btkh", (d, k, h), ("embed", "kv_heads", "head_dim"),
                                 init=normal(std), **kw)
        self.wv = cfg.projection("wv", "btd,dkh->btkh", (d, k, h), ("embed", "kv_heads", "head_dim"),
                                 init=normal(std), **kw)
        # Residual projections start smaller so the residual stream's variance does not grow with depth.
        self.wo = cfg.projection("wo", "btnh,nhd->btd", (n, h, d), ("heads", "head_dim", "embed"),
                                 init=normal(cfg.residual_init_std), **kw)
        self.qkv_bias = cfg.use_bias or cfg.qkv_bias  # Qwen2: biases on q, k and v only
        if self.qkv_bias:
            self.bq = make_param(rngs, zeros, (n, h), ("heads", "head_dim"), pd, decay=False)
            self.bk = make_param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), pd, decay=False)
            self.bv = make_param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), pd, decay=False)
        if cfg.use_bias:
            self.bo = make_param(rngs, zeros, (d,), ("norm",), pd)
        # Qwen3: each head's queries and keys RMS-normalized over the head's width, one scale for all heads
        # (q_norm and k_norm), after the projections (and their biases) and before the rotary embedding
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            norm = dict(eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=pd, use_bias=False, rngs=rngs, axis="head_dim")
            self.q_norm, self.k_norm = RMSNorm(h, **norm), RMSNorm(h, **norm)

    @property
    def joined_projections(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The projections its forward runs as one matmul (`joints`)."""
        joint = self.cfg.joint_projections and joins_qkv(self.wq, self.wk, self.wv)
        return (("qkv", ("wq", "wk", "wv")),) if joint else ()

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, cache: KVCache | None = None,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """[B, T, D] -> [B, T, D]; with a cache (decoding), also the cache holding this chunk's keys.
        `dropout_key`: the projections' adapters' dropout (LoRA), training only."""
        cfg, dt = self.cfg, self.cfg.dtype
        x = tensor_parallel_entry(x)
        key_q, key_k, key_v, key_o = split_keys(dropout_key, 4)
        q, k, v = project_qkv(x, self.wq, self.wk, self.wv, (key_q, key_k, key_v), cfg.joint_projections)
        if self.qkv_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.position == "rope":
            inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor,
                                        cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len,
                                        cfg.rope_beta_fast, cfg.rope_beta_slow)
            # The same rotation for training, evaluation and each decoding step (the cache holds rotated keys)
            factor = rope_attention_factor(cfg.rope_scaling, cfg.rope_factor)
            q = apply_rope(q, positions, inv_freq, factor)
            k = apply_rope(k, positions, inv_freq, factor)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", None))
        q, k, v = (checkpoint_name(t, ATTENTION_INPUTS) for t in (q, k, v))
        if cache is None:
            out = attend(q, k, v, segment_ids=segment_ids, implementation=cfg.attention,  # [B, T, N, H]
                         max_segments=cfg.attention_segments, context_strategy=cfg.context_attention,
                         context_layout=cfg.context_layout)
        else:
            out, cache = attend_cached(q, k, v, cache)
        # Heads stay split into the output projection, and (the constraint's transpose) its
        # gradient arrives head-split in the backward pass instead of being resharded from sequence.
        out = constrain(out, ("act_batch", "act_seq", "act_heads", None))
        y = self.wo(out, key_o)
        if cfg.use_bias:
            y = y + self.bo[...].astype(dt)
        y = constrain(y, ("act_batch", "act_seq", "act_embed"))
        return y if cache is None else (y, cache)


def project_gate_up(x: jax.Array, w_gate: Projection, w_up: Projection, keys) -> tuple[jax.Array, jax.Array]:
    """gate and up [B, T, F] from x [B, T, D]: with two plain projections (`Projection.fusable`) one matmul;
    otherwise each on its own (`keys`: their adapters' dropout keys).

    The one matmul takes the two kernels interleaved, [D, F, 2] (each hidden unit's gate and up column side
    by side), so its output's gate and up values of a unit are neighbours: SwiGLU reads both from one place
    and its gradient writes both to one place, and splitting the hidden units over `tensor` splits this
    kernel the same way as the two. In the backward pass x's gradient then comes out of one matmul instead
    of two partial products that the norm's backward reads twice each. SwiGLU takes it where the hidden
    activation is saved (`mlps.swiglu.GatedMLP.joint_gate_up`); the parameters stay two (checkpoints,
    conversion, adapters and quantization see gate and up as before). A train step with micro-batches interleaves them
    once per step instead of in every micro-batch (`ComputeKernel`, `Joint`).
    """
    if not (w_gate.fusable and w_up.fusable):
        return w_gate(x, keys[0]), w_up(x, keys[1])
    if (joined := w_gate.compute_kernel) is not None:  # joined once per step (`ComputeKernel`)
        y = joined.einsum("btd,dfc->btfc", x, w_gate.dtype)
    else:
        y = jnp.einsum("btd,dfc->btfc", x, join_gate_up(w_gate.weight(), w_up.weight()))
    return y[..., 0], y[..., 1]


def join_gate_up(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gate and up [..., D, F] -> [..., D, F, 2] (`project_gate_up`'s one kernel)."""
    return jnp.stack([gate, up], axis=-1)


def split_gate_up(joint: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The inverse of `join_gate_up`."""
    return joint[..., 0], joint[..., 1]


class Embed(nnx.Module):
    """Token embedding [vocab, dim]; `attend` is the tied unembedding, with a projection's hooks (`weight`,
    `einsum_op`).

    With `quant` (a compressed model whose `compress.targets` name `embed`), the table is stored as
    integer codes grouped along its width (`quant_axis`, the axis the tied unembedding contracts):
    `embedding_q` (uint8, packed), `embedding_scale` (and `embedding_zero`), `QuantizedParam`s, never
    trained. A lookup gathers its rows' codes and scales and dequantizes those rows alone; the tied
    unembedding dequantizes the whole table, like a projection. With `qat`, the float table trains and
    both uses see it fake-quantized."""

    quant_axis = 1

    def __init__(self, vocab_size: int, dim: int, *, init_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 einsum_op: EinsumOp = jnp.einsum, quant: quant_lib.QuantSpec | None = None,
                 qat: quant_lib.QuantSpec | None = None):
        self.dtype, self.einsum_op, self.quant, self.qat = dtype, einsum_op, quant, qat
        names = ("vocab", "embed")
        table = make_param(rngs, normal(init_std), (vocab_size, dim), names, param_dtype)
        if quant is None:
            self.embedding = table
        else:  # a fresh model's random table quantized (`quantized.quantize_params` does it for loaded ones)
            for key, value in quant_lib.quantize(table[...], quant, self.quant_axis).items():
                leaf_names = {"q": names, "scale": ("vocab", None), "zero": ("vocab", None)}.get(key, (None,))
                setattr(self, f"embedding_{key}", QuantizedParam(value, out_sharding=leaf_names, decay=False,
                                                                 eager_sharding=False))

    def _leaves(self) -> dict[str, jax.Array]:
        return {key: getattr(self, f"embedding_{key}")[...] for key in self.quant.keys}

    def cast_leaves(self) -> dict[str, object]:
        """As `Projection.cast_leaves`: the float table, neither quantized nor fake-quantized."""
        return {} if self.quant is not None or self.qat is not None else {"embedding": self.dtype}

    def weight(self) -> jax.Array:
        """The table in the compute dtype: cast, dequantized, or fake-quantized (QAT)."""
        if self.quant is not None:
            return quant_lib.dequantize(self._leaves(), self.quant, self.quant_axis, self.dtype)
        if self.qat is not None:
            return quant_lib.fake_quantize(self.embedding[...], self.qat, self.quant_axis).astype(self.dtype)
        return self.embedding[...].astype(self.dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.quant is not None and not self.quant.double:  # the rows' codes, then those rows dequantized
            rows = {key: jnp.take(constrain(leaf, (None, None)), ids, axis=0) for key, leaf in self._leaves().items()}
            return quant_lib.dequantize(rows, self.quant, -1, self.dtype)
        # Gather from the whole table in the compute dtype, as FSDP gathers every weight before use:
        # a gather from a vocab- and fsdp-sharded table makes XLA replicate it the slow way.
        return jnp.take(gathered(self.weight()), ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return self.einsum_op("btd,vd->btv", x, self.weight())


def gathered(table: jax.Array) -> jax.Array:
    """A lookup table constrained to be whole on every device (rows replicated, width as activations)."""
    return constrain(table, (None, "act_embed"))


def residual_init_std(init_std: float, n_layers: int) -> float:
    """GPT-2's scaled init: residual projections get std / sqrt(2 * layers)."""
    return init_std / math.sqrt(2 * n_layers)
