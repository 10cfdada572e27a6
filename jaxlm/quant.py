"""Quantized weights: NF4, int8, int4 and int3 with group scales (symmetric, or asymmetric with zero
points), double quantization of the scales, codes packed into bytes.

The array functions (`quantize`, `dequantize`, `pack`, `unpack`, and for methods that choose their own
codes, GPTQ among them, `group_params`, `encode`, `decode`, `store`) know nothing of models: QLoRA's
frozen base (`config.lora.quantize_base`) and post-training quantization (`jaxlm.compress`) use them
through `layers.Projection`, quantization-aware training through `fake_quantize`.
`models.quantized` converts a model's float parameters to its quantized ones and back.

A weight w (any shape) is grouped along one axis (`axis`: a projection's last input axis), `group`
consecutive values sharing one scale (group 0: the whole axis, a scale per output channel). A group
that does not divide the axis's n values leaves the last group short (688 values in groups of 64: ten
of 64 and one of 48): its values are quantized as if padded with zeros up to a whole group, as
bitsandbytes pads its last block, and the padding is dropped again, so it is never stored. A zero
changes no group's absmax, nor its range max(w, 0) - min(w, 0), so the short group's parameters are
those of its own values, and its error bound is the same. w is stored as

  q       uint8 codes of its own n values, packed along `axis`: int8 one per byte; nf4 and int4 two
          per byte (value 2i in the low nibble of byte i, 2i+1 in the high); int3 eight in three
          bytes (`pack`): w's shape, the logical axes of the float weight, the same bytes whether or
          not the group divides the axis
  scale   float32, w's shape with `axis` ceil(n / group) groups long (`n_groups`)
  zero    uint8, the same shape (asymmetric formats only): the code that stands for 0
  with double quantization (QLoRA's), the scales are centred on an offset and stored as int8 codes
  (`scale`, round(127 (s - offset) / block absmax)) in blocks of `DOUBLE_BLOCK` consecutive scales
  (C order), with each block's float32 absmax (`scale_absmax` [ceil(scales / 256)]) and the offset
  (`scale_offset` [1]): 8.1 bits per scale instead of 32, ~0.37 bits per weight saved at group 64.
  The offset is the midrange, (max + min) / 2, where bitsandbytes takes the mean: a float32 mean's
  sum depends on how the scales are sharded, the midrange does not, so a base quantized on any mesh
  is bit-identical (and the largest |s - offset| is as small as it can be).

w is restored in float32 as

  nf4                NF4[code] * scale, scale = the group's absmax; NF4 is bitsandbytes' NormalFloat4
                     (QLoRA, Dettmers et al. 2023: quantiles of a normal distribution, 7 negative values,
                     0 and 8 positive ones)
  intB symmetric     (code - h - 1) / h * scale, h = 2^(B-1) - 1 (127, 7, 3): the levels -h..h of absmax / h
                     (code 0 never written; int4 is the table INT4)
  intB asymmetric    (code - zero) * scale, scale = (max - min) / (2^B - 1) over a range widened to hold 0,
                     zero = round(-min / scale): 2^B levels, 0 exact

Each value is coded to its nearest level, so the error per element is at most (`error_bound`)

  nf4                absmax * NF4_MAX_GAP / 2  (0.1519 absmax: the gap from -1 to -0.696 is the widest)
  intB symmetric     absmax / (2 h): int8 absmax / 254, int4 absmax / 14, int3 absmax / 6
  intB asymmetric    range / (2 (2^B - 1)), range = max(w, 0) - min(w, 0) over the group
  double quantization adds at most |level| * block absmax / 254 <= block absmax / 254, where
  the block absmax is the largest |scale - offset| in the scale's block of 256

(plus float32 rounding, ~1e-7 relative). Storage per weight at group g (`QuantSpec.bits_per_weight`):
B bits + 32 / g bits of scale (+ 8 / g of zero point); 4-bit at g = 64: 0.5625 bytes, with double
quantization 4 + 8 / g + 32 / (256 g) bits + 4 bytes per tensor (0.5159 bytes). A short last group
costs a whole group's scale: 32 ceil(n / g) / n bits per weight instead of 32 / g.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("nf4", "int8", "int4", "int3")
BITS = {"nf4": 4, "int8": 8, "int4": 4, "int3": 3}
# bitsandbytes' NormalFloat4 (csrc/kernels.cu, the QLoRA paper's appendix E)
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
INT4 = tuple((code - 8) / 7 for code in range(16))  # code 0 (-8/7) is never written: levels -7..7
NF4_MAX_GAP = max(b - a for a, b in zip(NF4, NF4[1:]))  # 0.3038, between -1.0 and -0.696
DOUBLE_BLOCK = 256  # scales per float32 absmax of the double quantization
# The leaves of a quantized weight; `Projection` stores each as `kernel_<key>`.
KEYS = ("q", "scale")
ZERO_KEYS = ("zero",)  # asymmetric integer formats: each group's zero point (uint8)
DOUBLE_KEYS = ("scale_absmax", "scale_offset")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How weights are stored: `format` (nf4 | int8 | int4 | int3), `group` values per scale (at most,
    see `group_size`; 0 = the whole axis, one scale per output channel), `symmetric` (integer formats:
    False stores a zero point per group beside its scale) and `double` quantization of the scales."""

    format: str
    group: int = 64
    double: bool = False
    symmetric: bool = True

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized format {self.format!r}; one of {', '.join(FORMATS)}")
        if self.format == "nf4" and not self.symmetric:
            raise ValueError("nf4 is symmetric by construction (a table of levels in [-1, 1] times the group absmax)")
        if self.group < 0:
            raise ValueError(f"a group of {self.group} values: give a positive number, or 0 for the whole axis")

    @property
    def bits(self) -> int:
        return BITS[self.format]

    @property
    def keys(self) -> tuple[str, ...]:
        return KEYS + (() if self.symmetric else ZERO_KEYS) + (DOUBLE_KEYS if self.double else ())

    def bits_per_weight(self, axis_size: int | None = None) -> float:
        """Storage bits per weight (a tensor's constant 4 bytes of offset aside), at `group_size` along an
        axis of `axis_size` values (a short last group costs a whole group's scale)."""
        g = axis_size / n_groups(self, axis_size) if axis_size else self.group
        scale = 8 / g + 32 / (DOUBLE_BLOCK * g) if self.double else 32 / g
        return self.bits + scale + (0 if self.symmetric else 8 / g)


def group_size(spec: QuantSpec | int, axis_size: int) -> int:
    """The group along an axis of `axis_size` values: `spec.group` (or a plain number), or the whole
    axis where it is shorter or the group is 0. A group that does not divide the axis leaves the last
    one short (`n_groups`; module docstring). ValueError (saying why) where a 4-bit axis or group is odd
    (two codes share a byte, both from one group), a 3-bit format's axis is not a multiple of 8 (eight
    codes share three bytes), or a 3-bit group that leaves a short last one is not a multiple of 8."""
    spec = spec if isinstance(spec, QuantSpec) else QuantSpec("int4", spec)
    g = min(spec.group, axis_size) if spec.group else axis_size
    if spec.bits == 4 and axis_size % 2:
        raise ValueError(f"its {axis_size} values are odd (two 4-bit codes share a byte)")
    if spec.bits == 4 and g % 2:
        raise ValueError(f"a group of {g} values is odd (two 4-bit codes share a byte)")
    if spec.bits == 3 and axis_size % 8:
        raise ValueError(f"its {axis_size} values are not a multiple of 8 (eight 3-bit codes share three bytes)")
    if spec.bits == 3 and axis_size % g and g % 8:
        raise ValueError(f"a group of {g} values is not a multiple of 8 and leaves a short last group of "
                         f"its {axis_size} values (eight 3-bit codes share three bytes)")
    return g


def n_groups(spec: QuantSpec | int, axis_size: int) -> int:
    """The groups along an axis of `axis_size` values, a short last one included: ceil(n / group)."""
    return -(-axis_size // group_size(spec, axis_size))


def error_bound(spec: QuantSpec) -> float:
    """The largest |w - dequantize(quantize(w))| per element, as a fraction of its group's absmax
    (symmetric formats) or of its group's range, max(w, 0) - min(w, 0) (asymmetric ones); without
    double quantization, which adds at most its block absmax / 254."""
    if spec.format == "nf4":
        return NF4_MAX_GAP / 2
    levels = 2 ** spec.bits - 1
    return 1 / (2 * (levels // 2)) if spec.symmetric else 1 / (2 * levels)


# ----------------------------------------------------------------------------- packing


def pack(codes: jax.Array, axis: int, bits: int = 4) -> jax.Array:
    """Codes (uint8, each < 2**bits) -> uint8 bytes along `axis`: 8 bits as they are; 4 bits two to a
    byte (codes 2i and 2i+1 in the low and high nibble of byte i); 3 bits eight to three bytes (codes
    8i..8i+7 as one little-endian 24-bit number, code 8i + k in bits 3k..3k+2, in bytes 3i..3i+2)."""
    codes = jnp.asarray(codes, jnp.uint8)
    axis = axis % codes.ndim
    n = codes.shape[axis]
    if bits == 8:
        return codes
    per = {4: 2, 3: 8}[bits]
    if n % per:
        raise ValueError(f"cannot pack an axis of {n} {bits}-bit codes ({'odd' if per == 2 else 'not a multiple of 8'})")
    grouped = codes.reshape(*codes.shape[:axis], n // per, per, *codes.shape[axis + 1:])
    part = lambda k: jnp.take(grouped, k, axis=axis + 1)  # noqa: E731
    if bits == 4:
        return part(0) | (part(1) << 4)
    word = sum(part(k).astype(jnp.uint32) << (3 * k) for k in range(8))  # 24 bits
    out = jnp.stack([(word >> (8 * b)) & 0xFF for b in range(3)], axis=axis + 1).astype(jnp.uint8)
    return out.reshape(*codes.shape[:axis], n // 8 * 3, *codes.shape[axis + 1:])


def unpack(packed: jax.Array, axis: int, bits: int = 4) -> jax.Array:
    """The inverse of `pack`: uint8 codes with `axis` restored."""
    axis = axis % packed.ndim
    if bits == 8:
        return packed
    if bits == 4:
        pairs = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
        return pairs.reshape(*packed.shape[:axis], 2 * packed.shape[axis], *packed.shape[axis + 1:])
    n = packed.shape[axis] // 3
    triples = packed.reshape(*packed.shape[:axis], n, 3, *packed.shape[axis + 1:]).astype(jnp.uint32)
    word = sum(jnp.take(triples, b, axis=axis + 1) << (8 * b) for b in range(3))
    codes = jnp.stack([(word >> (3 * k)) & 7 for k in range(8)], axis=axis + 1).astype(jnp.uint8)
    return codes.reshape(*packed.shape[:axis], 8 * n, *packed.shape[axis + 1:])


# ----------------------------------------------------------------------------- quantize, dequantize


def _grouped(x: jax.Array, axis: int, g: int) -> jax.Array:
    """[..., n, ...] -> [..., ceil(n / g), g, ...], a short last group padded with zeros."""
    n = x.shape[axis]
    if n % g:
        x = jnp.pad(x, [(0, -n % g if i == axis else 0) for i in range(x.ndim)])
    return x.reshape(*x.shape[:axis], x.shape[axis] // g, g, *x.shape[axis + 1:])


def _group_of(spec: QuantSpec, n: int, groups: int) -> int:
    """The values per group of group params that hold `groups` groups along an axis of `n` values:
    `group_size`'s where it makes that many (a short last group included), else n / groups (params
    grouped otherwise by their caller: GPTQ encodes one row with its group's params)."""
    g = min(spec.group, n) if spec.group else n
    if -(-n // g) == groups:
        return g
    if n % groups:
        raise ValueError(f"{groups} groups of params for an axis of {n} values in groups of {spec.group}")
    return n // groups


def _repeat(x: jax.Array, axis: int, g: int, n: int) -> jax.Array:
    """A per-group value [..., ceil(n / g), ...] repeated to each of the axis's n elements [..., n, ...].
    With a short last group, each element takes its group's value (a gather of constant indices) rather
    than the repeat cut to n: the cut would move values between the shards of an axis sharded like the
    weight's (a collective permute in every step)."""
    if x.shape[axis] * g == n:
        return jnp.repeat(x, g, axis=axis)
    return jnp.take(x, np.arange(n) // g, axis=axis)


def group_params(w: jax.Array, spec: QuantSpec, axis: int) -> dict[str, jax.Array]:
    """Each group's float32 `scale` (and, asymmetric, uint8 `zero`), w's shape with `axis` `n_groups`
    long: symmetric formats store the group's absmax; asymmetric ones the step
    (max - min) / (2**bits - 1) of a range widened to hold 0, and the code of 0 (round(-min / step)).
    A short last group is padded with zeros, which leave both as its own values give them."""
    w = jnp.asarray(w, jnp.float32)
    axis = axis % w.ndim
    grouped = _grouped(w, axis, group_size(spec, w.shape[axis]))
    if spec.symmetric:
        return {"scale": jnp.max(jnp.abs(grouped), axis=axis + 1)}
    lo = jnp.minimum(jnp.min(grouped, axis=axis + 1), 0.0)
    hi = jnp.maximum(jnp.max(grouped, axis=axis + 1), 0.0)
    step = (hi - lo) / (2 ** spec.bits - 1)
    zero = jnp.clip(jnp.round(-lo / jnp.where(step > 0, step, 1.0)), 0, 2 ** spec.bits - 1)
    return {"scale": step, "zero": zero.astype(jnp.uint8)}


def encode(w: jax.Array, params: dict[str, jax.Array], spec: QuantSpec, axis: int) -> jax.Array:
    """w -> its codes (uint8, unpacked) under given group `params` (`group_params`' keys, float32 scales):
    each value to the nearest level of its group."""
    w = jnp.asarray(w, jnp.float32)
    axis = axis % w.ndim
    n = w.shape[axis]
    g = _group_of(spec, n, params["scale"].shape[axis])
    scale = _repeat(params["scale"], axis, g, n)
    safe = jnp.where(scale > 0, scale, 1.0)
    if spec.format == "nf4":
        table = np.asarray(NF4, np.float32)
        midpoints = (table[1:] + table[:-1]) / 2  # nearest level: count the midpoints below the value
        normalized = w / safe
        return sum((normalized > m).astype(jnp.uint8) for m in midpoints)
    top = 2 ** spec.bits - 1
    if spec.symmetric:
        half = top // 2  # levels -half..half of absmax / half; code = level + half + 1 (code 0 never written)
        return (jnp.clip(jnp.round(w / safe * half), -half, half) + half + 1).astype(jnp.uint8)
    zero = _repeat(params["zero"], axis, g, n).astype(jnp.float32)
    return jnp.clip(jnp.round(w / safe) + zero, 0, top).astype(jnp.uint8)


def decode(codes: jax.Array, params: dict[str, jax.Array], spec: QuantSpec, axis: int, dtype=jnp.float32) -> jax.Array:
    """Codes (uint8, unpacked) and group `params` (float32 scales) -> the weight, computed in float32,
    then cast to `dtype`: NF4[code] * scale, (code - half - 1) / half * scale (symmetric integers,
    half = 2**(bits-1) - 1) or (code - zero) * scale (asymmetric ones)."""
    axis = axis % codes.ndim
    n = codes.shape[axis]
    g = _group_of(spec, n, params["scale"].shape[axis])
    scale = _repeat(params["scale"], axis, g, n)
    if spec.format == "nf4" or spec.symmetric:  # a table of the levels, each rounded once to float32
        values = jnp.take(jnp.asarray(levels(spec), jnp.float32), codes.astype(jnp.int32))
    else:
        values = codes.astype(jnp.float32) - _repeat(params["zero"], axis, g, n).astype(jnp.float32)
    return (values * scale).astype(dtype)


def levels(spec: QuantSpec) -> np.ndarray:
    """The value of each code of a symmetric format, in units of the group's absmax: NF4, or
    (code - h - 1) / h for the integers (INT4 at 4 bits; code 0 is never written)."""
    if spec.format == "nf4":
        return np.asarray(NF4, np.float32)
    half = (2 ** spec.bits - 1) // 2
    return np.asarray([(code - half - 1) / half for code in range(2 ** spec.bits)], np.float32)


def quantize(w: jax.Array, spec: QuantSpec, axis: int) -> dict[str, jax.Array]:
    """w (any float dtype) -> its quantized leaves (`spec.keys`), grouped along `axis`."""
    params = group_params(w, spec, axis)
    return store(encode(w, params, spec, axis), params, spec, axis)


def store(codes: jax.Array, params: dict[str, jax.Array], spec: QuantSpec, axis: int) -> dict[str, jax.Array]:
    """Codes (unpacked) and their group params -> the stored leaves: codes packed, scales double-quantized
    where asked (how `quantize` and GPTQ, which chooses its own codes, both write a weight)."""
    out = {"q": pack(codes, axis, spec.bits), **params}
    if spec.double:
        out.update(_quantize_scales(params["scale"]))
    return out


def fake_quantize(w: jax.Array, spec: QuantSpec, axis: int) -> jax.Array:
    """w quantized and dequantized (in w's dtype, computed in float32), with a straight-through gradient:
    the forward pass sees the weight the integer format will hold, the backward pass treats the rounding
    as the identity (quantization-aware training)."""
    params = group_params(jax.lax.stop_gradient(w), spec, axis)
    rounded = decode(encode(w, params, spec, axis), params, spec, axis, w.dtype)
    return w + jax.lax.stop_gradient(rounded - w)


def _block_index(shape: tuple[int, ...], block: int) -> jax.Array:
    """For each element of an array of `shape`, its C-order index // `block` (elementwise: an iota per
    dimension, no reshape of a possibly sharded array)."""
    index, stride = jnp.zeros(shape, jnp.int32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.int32, shape, axis) * stride
        stride *= shape[axis]
    return index // block


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
    """The weight the leaves of `quantize` stand for, computed in float32, then cast to `dtype`.

    Elementwise after the unpacking (a table lookup or an affine map, the scale repeated along the
    groups), so XLA fuses it into one pass from the packed bytes to the weight in `dtype`."""
    codes = unpack(leaves["q"], axis, spec.bits)
    params = {"scale": dequantize_scales(leaves)}
    if not spec.symmetric:
        params["zero"] = leaves["zero"]
    return decode(codes, params, spec, axis, dtype)


# ----------------------------------------------------------------------------- a model's parameters


# The float weights that may be stored quantized, by their leaf names: a projection's `kernel`, the
# token embedding's `embedding`; their quantized leaves are `<weight>_q`, `<weight>_scale`, ...
WEIGHTS = ("kernel", "embedding")


def quantized_leaf_of(key: Any) -> tuple[str, str] | None:
    """(the weight, the quantized key) a leaf's name stands for (`kernel_q` -> ('kernel', 'q'),
    `embedding_scale` -> ('embedding', 'scale')), None for any other leaf."""
    if not isinstance(key, str):
        return None
    for weight in WEIGHTS:
        rest = key[len(weight) + 1:]
        if key.startswith(weight + "_") and rest in KEYS + ZERO_KEYS + DOUBLE_KEYS:
            return weight, rest
    return None


def is_quantized_leaf(key: Any) -> bool:
    """A leaf of a quantized weight in a params tree (`kernel_q`, `kernel_scale`, `embedding_q`, ...)."""
    return quantized_leaf_of(key) is not None


def weights_per_element(key: Any, bits: int = 4) -> float:
    """How many of the model's weights one element of the leaf named `key` holds: 8 / `bits` in packed
    codes (`kernel_q`, `embedding_q`: 2 at 4 bits), none in a quantized weight's scales or a pruning
    mask, 1 in any other parameter (how `count` and `transformer.param_count` count a compressed model:
    by the weights it stands for)."""
    if key == "kernel_mask":  # a pruning mask (jaxlm.compress.prune): no weights of its own
        return 0
    found = quantized_leaf_of(key)
    if found is None:
        return 1
    return 8 / bits if found[1] == "q" else 0


def count(tree, bits: int = 4) -> int:
    """The weights a params tree (arrays or ShapeDtypeStructs) stands for (`weights_per_element`), its
    quantized kernels stored in `bits`."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return round(sum(weights_per_element(getattr(path[-1], "key", None), bits) * math.prod(x.shape) for path, x in flat))
