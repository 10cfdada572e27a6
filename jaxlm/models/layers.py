"""Building blocks of the decoder: norms, rotary embedding, projections, attention, MLPs, embedding.

Every weight is an `nnx.Param` created with logical axis names (never mesh axes); `jaxlm.mesh`
maps the names onto the device mesh. Every weight matmul goes through one module, `Projection`,
which owns its kernel, the kernel's logical names, the cast to the compute `dtype` and the
contraction: the seam where adapters, quantized or sparse kernels plug in without the attention or
MLP code knowing. Norm statistics and softmax run in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

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


EinsumOp = Callable[..., jax.Array]  # (equation, x, kernel) -> y, like jnp.einsum


class Projection(nnx.Module):
    """One weight matmul, `einsum(equation, x, kernel)`: q, k, v, o, the MLP's and the unembedding.

    It owns the kernel (stored in `param_dtype`, with its logical axis names), the kernel's cast to
    the compute `dtype` (`weight()`) and the contraction (`einsum_op`, `jnp.einsum` by default, as
    `flax.nnx.Einsum` takes one). What comes next plugs in here: a quantized kernel overrides
    `weight()` (dequantize, fake-quantize, apply a sparsity mask), a different contraction replaces
    `einsum_op` (an int8 matmul), an adapter adds its own parameters beside `kernel`. `projections`
    finds every one in a model by path.
    """

    def __init__(self, equation: str, shape: tuple[int, ...], names: tuple, *, init: Initializer, dtype,
                 param_dtype, rngs: nnx.Rngs, einsum_op: EinsumOp = jnp.einsum):
        self.equation, self.dtype, self.einsum_op = equation, dtype, einsum_op
        self.kernel = make_param(rngs, init, shape, names, param_dtype)

    @property
    def in_axes(self) -> tuple[int, ...]:
        """The kernel's dimensions that are contracted with the input (the rest are the output's)."""
        x, kernel = self.equation.split("->")[0].split(",")
        return tuple(i for i, c in enumerate(kernel) if c in x)

    def weight(self) -> jax.Array:
        """The kernel as the contraction uses it: cast to the compute dtype."""
        return self.kernel[...].astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.einsum_op(self.equation, x, self.weight())


def projections(module: nnx.Module) -> Iterator[tuple[tuple, Projection]]:
    """Every `Projection` in `module`, with its path (e.g. `('blocks', 'attn', 'wq')`)."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, Projection):
            yield path, node


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, use_bias: bool, rngs: nnx.Rngs):
        del use_bias  # RMSNorm has no bias
        self.eps, self.dtype = eps, dtype
        self.scale = make_param(rngs, ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        @recomputed
        def norm(x, scale):
            x32 = x.astype(jnp.float32)
            x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            return (x32 * scale.astype(jnp.float32)).astype(self.dtype)

        return norm(x, self.scale[...])


class LayerNorm(nnx.Module):
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


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (half-split convention) of x [B, T, N, H] at integer positions [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
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
    all-to-alls (measured: 2-2.5x the bytes, benchmarks/BENCHMARKS.md).
    """
    return constrain(x, ("act_batch", None, "act_embed"))


class Attention(nnx.Module):
    """Multi-head attention with grouped-query heads and optional rotary positions."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pd, std = cfg.param_dtype, cfg.init_std
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, param_dtype=pd, rngs=rngs)
        self.wq = Projection("btd,dnh->btnh", (d, n, h), ("embed", "heads", "head_dim"), init=normal(std), **kw)
        self.wk = Projection("btd,dkh->btkh", (d, k, h), ("embed", "kv_heads", "head_dim"), init=normal(std), **kw)
        self.wv = Projection("btd,dkh->btkh", (d, k, h), ("embed", "kv_heads", "head_dim"), init=normal(std), **kw)
        # Residual projections start smaller so the residual stream's variance does not grow with depth.
        self.wo = Projection("btnh,nhd->btd", (n, h, d), ("heads", "head_dim", "embed"),
                             init=normal(cfg.residual_init_std), **kw)
        if cfg.use_bias:
            self.bq = make_param(rngs, zeros, (n, h), ("heads", "head_dim"), pd, decay=False)
            self.bk = make_param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), pd, decay=False)
            self.bv = make_param(rngs, zeros, (k, h), ("kv_heads", "head_dim"), pd, decay=False)
            self.bo = make_param(rngs, zeros, (d,), ("norm",), pd)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, cache: KVCache | None = None
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """[B, T, D] -> [B, T, D]; with a cache (decoding), also the cache holding this chunk's keys."""
        cfg, dt = self.cfg, self.cfg.dtype
        x = tensor_parallel_entry(x)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if cfg.use_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        if cfg.position == "rope":
            q = apply_rope(q, positions, cfg.rope_theta)
            k = apply_rope(k, positions, cfg.rope_theta)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", None))
        if cache is None:
            out = attend(q, k, v, segment_ids=segment_ids, implementation=cfg.attention)  # [B, T, N, H]
        else:
            out, cache = attend_cached(q, k, v, cache)
        # Heads stay split into the output projection, and (the constraint's transpose) its
        # gradient arrives head-split in the backward pass instead of being resharded from sequence.
        out = constrain(out, ("act_batch", "act_seq", "act_heads", None))
        y = self.wo(out)
        if cfg.use_bias:
            y = y + self.bo[...].astype(dt)
        y = constrain(y, ("act_batch", "act_seq", "act_embed"))
        return y if cache is None else (y, cache)


class GatedMLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.w_gate = Projection("btd,df->btf", (d, f), ("embed", "mlp"), init=normal(cfg.init_std), **kw)
        self.w_up = Projection("btd,df->btf", (d, f), ("embed", "mlp"), init=normal(cfg.init_std), **kw)
        self.w_down = Projection("btf,fd->btd", (f, d), ("mlp", "embed"), init=normal(cfg.residual_init_std), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = tensor_parallel_entry(x)
        gate, up = self.w_gate(x), self.w_up(x)
        h = constrain(recomputed(lambda g, u: jax.nn.silu(g) * u)(gate, up), ("act_batch", "act_seq", "act_mlp"))
        return constrain(self.w_down(h), ("act_batch", "act_seq", "act_embed"))


class GeluMLP(nnx.Module):
    """GPT-2 MLP: out(gelu(in(x)))."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.mlp_dim, cfg.param_dtype
        self.dtype, self.use_bias = cfg.dtype, cfg.use_bias
        kw = dict(dtype=cfg.dtype, param_dtype=pd, rngs=rngs)
        self.w_in = Projection("btd,df->btf", (d, f), ("embed", "mlp"), init=normal(cfg.init_std), **kw)
        self.w_out = Projection("btf,fd->btd", (f, d), ("mlp", "embed"), init=normal(cfg.residual_init_std), **kw)
        if cfg.use_bias:
            self.b_in = make_param(rngs, zeros, (f,), ("mlp",), pd)
            self.b_out = make_param(rngs, zeros, (d,), ("norm",), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        x = tensor_parallel_entry(x)
        h = self.w_in(x)
        if self.use_bias:
            h = h + self.b_in[...].astype(dt)
        h = constrain(recomputed(lambda h: jax.nn.gelu(h, approximate=True))(h), ("act_batch", "act_seq", "act_mlp"))
        y = self.w_out(h)
        if self.use_bias:
            y = y + self.b_out[...].astype(dt)
        return constrain(y, ("act_batch", "act_seq", "act_embed"))


class Embed(nnx.Module):
    """Token embedding; `attend` is the tied unembedding, with a projection's hooks (`weight`, `einsum_op`)."""

    def __init__(self, vocab_size: int, dim: int, *, init_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 einsum_op: EinsumOp = jnp.einsum):
        self.dtype, self.einsum_op = dtype, einsum_op
        self.embedding = make_param(rngs, normal(init_std), (vocab_size, dim), ("vocab", "embed"), param_dtype)

    def weight(self) -> jax.Array:
        return self.embedding[...].astype(self.dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
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
