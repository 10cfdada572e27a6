"""4-bit weights: NF4 and int4 with group scales, double quantization of the scales, two codes per byte.

The array functions (`quantize`, `dequantize`, `pack`, `unpack`) know nothing of models: QLoRA's
frozen base uses them through `layers.Projection` (`config.lora.quantize_base`), and post-training
quantization can use them as they are. `quantize_params` / `dequantize_params` convert a model's
float parameters to its quantized ones and back (every quantized projection found by an abstract
build of the model).

A weight w (any shape) is grouped along one axis (`axis`: a projection's last input axis), `group`
consecutive values sharing one scale, and stored as

  q       uint8, w's shape with `axis` halved: 4-bit codes, value 2i in the low nibble of byte i, 2i+1 in the high
  scale   float32, w's shape with `axis` divided by the group: each group's absmax
  with double quantization (QLoRA's), the scales are centred on an offset and stored as int8 codes
  (`scale`, round(127 (s - offset) / block absmax)) in blocks of `DOUBLE_BLOCK` consecutive scales
  (C order), with each block's float32 absmax (`scale_absmax` [ceil(scales / 256)]) and the offset
  (`scale_offset` [1]): 8.1 bits per scale instead of 32, ~0.37 bits per weight saved at group 64.
  The offset is the midrange, (max + min) / 2, where bitsandbytes takes the mean: a float32 mean's
  sum depends on how the scales are sharded, the midrange does not, so a base quantized on any mesh
  is bit-identical (and the largest |s - offset| is as small as it can be).

w is restored as TABLE[code] * scale, computed in float32: NF4's TABLE is bitsandbytes' NormalFloat4
(QLoRA, Dettmers et al. 2023: quantiles of a normal distribution, -1 ... 0 ... 1, 7 negative and 8
positive values); int4's is symmetric, (code - 8) / 7, the levels -7..7 of absmax / 7 (code 0, -8/7,
never written). Each value is coded to its nearest level, so the error per element is at most

  nf4     absmax * NF4_MAX_GAP / 2  (0.1519 absmax: the gap from -1 to -0.696 is the widest)
  int4    absmax / 14
  double quantization adds at most |TABLE[code]| * block absmax / 254 <= block absmax / 254, where
  the block absmax is the largest |scale - offset| in the scale's block of 256

(plus float32 rounding, ~1e-7 relative). Storage per weight at group g: 4 bits + 32 / g bits of scale
(0.5625 bytes at g = 64), with double quantization 4 + 8 / g + 32 / (256 g) bits + 4 bytes per
tensor (0.5159 bytes at g = 64).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("nf4", "int4")
# bitsandbytes' NormalFloat4 (csrc/kernels.cu, the QLoRA paper's appendix E)
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
INT4 = tuple((code - 8) / 7 for code in range(16))  # code 0 (-8/7) is never written: levels -7..7
TABLES = {"nf4": NF4, "int4": INT4}
NF4_MAX_GAP = max(b - a for a, b in zip(NF4, NF4[1:]))  # 0.3038, between -1.0 and -0.696
DOUBLE_BLOCK = 256  # scales per float32 absmax of the double quantization
# The leaves of a quantized weight; `Projection` stores each as `kernel_<key>`.
KEYS = ("q", "scale")
DOUBLE_KEYS = ("scale_absmax", "scale_offset")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How weights are stored: `format` (nf4 | int4), `group` values per scale (at most; see
    `group_size`), and `double` quantization of the scales."""

    format: str
    group: int = 64
    double: bool = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown 4-bit format {self.format!r}; one of {', '.join(FORMATS)}")

    @property
    def keys(self) -> tuple[str, ...]:
        return KEYS + (DOUBLE_KEYS if self.double else ())

    def bits_per_weight(self, axis_size: int | None = None) -> float:
        """Storage bits per weight (a tensor's constant 4 bytes of offset aside), at `group_size`."""
        g = group_size(self.group, axis_size) if axis_size else self.group
        return 4 + (8 / g + 32 / (DOUBLE_BLOCK * g) if self.double else 32 / g)


def group_size(group: int, axis_size: int) -> int:
    """The group along an axis of `axis_size` values: `group`, or the whole axis where it is shorter.
    ValueError (saying why) where `group` does not divide a longer axis, or the group is odd (two
    codes share a byte, both from one group)."""
    g = min(group, axis_size)
    if axis_size % g:
        raise ValueError(f"{group} does not divide its {axis_size} values")
    if g % 2:
        raise ValueError(f"a group of {g} values is odd (two 4-bit codes share a byte)")
    return g


# ----------------------------------------------------------------------------- packing


def pack(codes: jax.Array, axis: int) -> jax.Array:
    """4-bit codes (uint8 0..15) -> uint8 with `axis` halved: codes 2i and 2i+1 along `axis` in the low
    and high nibble of byte i."""
    codes = jnp.asarray(codes, jnp.uint8)
    axis = axis % codes.ndim
    n = codes.shape[axis]
    if n % 2:
        raise ValueError(f"cannot pack an axis of {n} codes (odd) two to a byte")
    pairs = codes.reshape(*codes.shape[:axis], n // 2, 2, *codes.shape[axis + 1:])
    low, high = jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
    return low | (high << 4)


def unpack(packed: jax.Array, axis: int) -> jax.Array:
    """The inverse of `pack`: uint8 codes 0..15 with `axis` doubled."""
    axis = axis % packed.ndim
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
    return pairs.reshape(*packed.shape[:axis], 2 * packed.shape[axis], *packed.shape[axis + 1:])


# ----------------------------------------------------------------------------- quantize, dequantize


def _grouped(x: jax.Array, axis: int, g: int) -> jax.Array:
    """[..., n, ...] -> [..., n / g, g, ...]."""
    return x.reshape(*x.shape[:axis], x.shape[axis] // g, g, *x.shape[axis + 1:])


def _codes(normalized: jax.Array, fmt: str) -> jax.Array:
    """Values in [-1, 1] -> the index of the nearest level of the format's table (uint8)."""
    if fmt == "int4":
        return (jnp.clip(jnp.round(normalized * 7), -7, 7) + 8).astype(jnp.uint8)
    table = np.asarray(NF4, np.float32)
    midpoints = (table[1:] + table[:-1]) / 2  # nearest level: count the midpoints below the value
    return sum((normalized > m).astype(jnp.uint8) for m in midpoints)


def _block_index(shape: tuple[int, ...], block: int) -> jax.Array:
    """For each element of an array of `shape`, its C-order index // `block` (elementwise: an iota per
    dimension, no reshape of a possibly sharded array)."""
    index, stride = jnp.zeros(shape, jnp.int32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.int32, shape, axis) * stride
        stride *= shape[axis]
    return index // block


def quantize(w: jax.Array, spec: QuantSpec, axis: int) -> dict[str, jax.Array]:
    """w (any float dtype) -> its quantized leaves (`spec.keys`), grouped along `axis`."""
    w = jnp.asarray(w, jnp.float32)
    axis = axis % w.ndim
    g = group_size(spec.group, w.shape[axis])
    grouped = _grouped(w, axis, g)
    absmax = jnp.max(jnp.abs(grouped), axis=axis + 1, keepdims=True)
    normalized = grouped / jnp.where(absmax > 0, absmax, 1.0)
    codes = _codes(normalized, spec.format).reshape(w.shape)
    scale = jnp.squeeze(absmax, axis + 1)
    out = {"q": pack(codes, axis), "scale": scale}
    if spec.double:
        out.update(_quantize_scales(scale))
    return out


def _quantize_scales(scale: jax.Array) -> dict[str, jax.Array]:
    """Double quantization: the scales minus their midrange, int8 in blocks of DOUBLE_BLOCK with a float32 absmax each."""
    offset = (jnp.max(scale) + jnp.min(scale)) / 2
    flat = (scale - offset).reshape(-1)
    blocks = math.ceil(flat.size / DOUBLE_BLOCK)
    padded = jnp.pad(flat, (0, blocks * DOUBLE_BLOCK - flat.size)).reshape(blocks, DOUBLE_BLOCK)
    absmax = jnp.max(jnp.abs(padded), axis=1)
    codes = jnp.round(padded / jnp.where(absmax > 0, absmax, 1.0)[:, None] * 127)
    codes = codes.reshape(-1)[: flat.size].reshape(scale.shape).astype(jnp.int8)
    return {"scale": codes, "scale_absmax": absmax, "scale_offset": offset.reshape(1)}


def dequantize_scales(leaves: dict[str, jax.Array]) -> jax.Array:
    """The group scales (float32), undoing double quantization where there is one."""
    scale = leaves["scale"]
    if "scale_absmax" not in leaves:
        return scale.astype(jnp.float32)
    block_absmax = jnp.take(leaves["scale_absmax"], _block_index(scale.shape, DOUBLE_BLOCK))
    return scale.astype(jnp.float32) * (block_absmax / 127) + leaves["scale_offset"][0]


def dequantize(leaves: dict[str, jax.Array], spec: QuantSpec, axis: int, dtype=jnp.float32) -> jax.Array:
    """The weight the leaves of `quantize` stand for: TABLE[code] * scale in float32, then cast to `dtype`.

    Elementwise after the unpacking (a table lookup, the scale repeated along the groups), so XLA fuses
    it into one pass from the packed bytes to the weight in `dtype`."""
    q = leaves["q"]
    axis = axis % q.ndim
    codes = unpack(q, axis)
    values = jnp.take(jnp.asarray(TABLES[spec.format], jnp.float32), codes.astype(jnp.int32))
    scale = dequantize_scales(leaves)
    g = codes.shape[axis] // scale.shape[axis]
    return (values * jnp.repeat(scale, g, axis=axis)).astype(dtype)


def error_bound(spec: QuantSpec) -> float:
    """The largest |w - dequantize(quantize(w))| per element, as a fraction of its group's absmax
    (without double quantization, which adds at most its block absmax / 254)."""
    return NF4_MAX_GAP / 2 if spec.format == "nf4" else 1 / 14


# ----------------------------------------------------------------------------- a model's parameters


def is_quantized_leaf(key: Any) -> bool:
    """A leaf of a quantized weight in a params tree (`kernel_q`, `kernel_scale`, ...)."""
    return isinstance(key, str) and key.startswith("kernel_") and key[len("kernel_"):] in KEYS + DOUBLE_KEYS


def weights_per_element(key: Any) -> int:
    """How many of the model's weights one element of the leaf named `key` holds: 2 in a packed
    `kernel_q`, none in a quantized weight's scales, 1 in any other parameter (how `count` and
    `transformer.param_count` count a quantized model: by the weights it stands for)."""
    if not is_quantized_leaf(key):
        return 1
    return 2 if key == "kernel_q" else 0


def count(tree) -> int:
    """The weights a params tree (arrays or ShapeDtypeStructs) stands for (`weights_per_element`)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sum(weights_per_element(getattr(path[-1], "key", None)) * math.prod(x.shape) for path, x in flat)
