"""Compressing a model's parameters: prune, then quantize, each targeted projection, layer by layer.

`compress_params` takes a float model's parameters (`cfg`, as a run holds them) and the model it
becomes (`out_cfg`: `transformer.with_compress` applied, its targets quantized and/or masked) and
returns the parameters of `out_cfg`. Each targeted kernel is handled in its matrix view [inputs,
outputs] (`prune.matrix`), one layer at a time:

1. pruning (`compress.sparsity`): a mask from the scores (`prune.scores`: magnitude, or Wanda's
   |W| x input norm), unstructured (per matrix, per output for Wanda, or one global magnitude
   threshold) or N:M along the inputs; the kernel zeroed where the mask is False;
2. quantization (`compress.quantize`): round to nearest (`quant.group_params` + `encode`), or GPTQ
   (`gptq.quantize_matrix`) from the layer's input Hessian; a pruned weight stays exactly 0 (its code
   is re-encoded as 0 after GPTQ's updates, which may have moved it).

GPTQ and Wanda calibrate (`calibrate.LayerRunner`): the layer's inputs are the previous layers'
outputs computed with their weights already compressed, as in the GPTQ paper. The groups of the
matrix view are those of the stored kernel: a group runs along the kernel's last input axis (for wo,
[heads, head_dim] -> the groups lie within each head's head_dim), so the matrix's group size is the
one `quant.group_size` gives for that axis. Where that group does not divide the axis, the matrix view
is padded with zero rows after each run of the axis's values up to a whole number of groups (zero
inputs to GPTQ: dead features, weight 0, coded exactly as 0), quantized, and the padding's codes
dropped: the stored kernel's short last groups (`jaxlm.quant`), by the same quantizer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import quant
from jaxlm.compress import gptq, prune
from jaxlm.compress.calibrate import LayerRunner, layer_of, stack_of
from jaxlm.models import layers, quantized, transformer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Target:
    """One compressed projection of the model, as its parameters are laid out."""

    path: tuple  # its module in the params tree: ('blocks', 'attn', 'wq'), ('blocks', 3, 'attn', 'wq'), ('unembed',)
    name: str  # wq, w_down, unembed, embed (the token embedding: round to nearest, never pruned)
    kernel_shape: tuple  # one layer's kernel
    n_in: int  # its leading input dimensions
    axis: int  # its grouped axis (the last input one)
    stacked: bool  # a leading layers axis (scanned blocks)

    @property
    def in_block(self) -> bool:
        return self.path[0] in transformer.STACKS

    def block_path(self) -> tuple:
        """The path inside one block: ('attn', 'wq')."""
        return tuple(p for p in self.path[1:] if not isinstance(p, int))


def targets(out_cfg: transformer.ModelConfig) -> list[Target]:
    out = []
    for path, projection in layers.projections(transformer.abstract_model(out_cfg)):
        name = path[-1]
        if not any(name in transform.targets for transform in out_cfg.transforms):
            continue
        stacked = out_cfg.scan_layers and path[0] in transformer.STACKS
        out.append(Target(path=tuple(path), name=name, kernel_shape=projection.kernel_shape,
                          n_in=len(projection.in_axes), axis=projection.quant_axis, stacked=stacked))
    # the token embedding [vocab, width], grouped along its width
    if out_cfg.quantized is not None and "embed" in out_cfg.quantized.targets:
        out.append(Target(path=("embed",), name="embed", kernel_shape=(out_cfg.vocab_size, out_cfg.d_model), n_in=1,
                          axis=layers.Embed.quant_axis, stacked=False))
    return out


def _node(tree: dict, path: tuple) -> dict:
    for key in path:
        tree = tree[key]
    return tree


def matrix_spec(spec: quant.QuantSpec, target: Target) -> quant.QuantSpec:
    """The spec of the matrix view: the group the stored kernel has along its grouped axis."""
    g = quant.group_size(spec, target.kernel_shape[target.axis])
    return dataclasses.replace(spec, group=g, double=False)


@dataclasses.dataclass(frozen=True)
class _Padding:
    """The matrix view's rows [runs * n] <-> [runs * padded]: each run of the grouped axis's n values
    (one per index of the input axes before it) padded with zero rows up to `padded`, a multiple of
    the group."""

    runs: int
    n: int
    padded: int

    @classmethod
    def of(cls, target: Target, g: int) -> _Padding:
        n = target.kernel_shape[target.axis]
        return cls(runs=math.prod(target.kernel_shape[:target.axis]), n=n, padded=-(-n // g) * g)

    def rows(self, x: jax.Array) -> jax.Array:
        """[runs * n, ...] -> [runs * padded, ...], zeros (False) in the new rows."""
        x = x.reshape(self.runs, self.n, *x.shape[1:])
        x = jnp.pad(x, [(0, self.padded - self.n if i == 1 else 0) for i in range(x.ndim)])
        return x.reshape(self.runs * self.padded, *x.shape[2:])

    def hessian(self, h: jax.Array) -> jax.Array:
        """[runs * n, runs * n] -> [runs * padded, runs * padded]: the padding's inputs are always 0."""
        h = h.reshape(self.runs, self.n, self.runs, self.n)
        h = jnp.pad(h, ((0, 0), (0, self.padded - self.n), (0, 0), (0, self.padded - self.n)))
        return h.reshape(self.runs * self.padded, self.runs * self.padded)

    def unpad(self, x: jax.Array) -> jax.Array:
        """The inverse of `rows`: the padding's rows dropped."""
        x = x.reshape(self.runs, self.padded, *x.shape[1:])[:, :self.n]
        return x.reshape(self.runs * self.n, *x.shape[2:])


@dataclasses.dataclass
class Settings:
    """`config.compress`, read once."""

    quantize: quant.QuantSpec | None
    method: str
    damp: float
    block: int
    act_order: bool
    sparsity: float
    nm: tuple[int, int] | None
    criterion: str
    scope: str

    @classmethod
    def of(cls, co, out_cfg: transformer.ModelConfig) -> Settings:
        return cls(quantize=out_cfg.stored_quant, method=co.method, damp=float(co.gptq_damp), block=int(co.gptq_block),
                   act_order=bool(co.act_order), sparsity=float(co.sparsity),
                   nm=quantized.prune_pattern(co.pattern), criterion=co.criterion, scope=co.scope)

    @property
    def calibrates(self) -> bool:
        return (self.quantize is not None and self.method == "gptq") or (self.sparsity > 0 and self.criterion == "wanda")


def _compress_matrix(w: jax.Array, hessian: jax.Array | None, target: Target, s: Settings,
                     threshold: float | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One layer's kernel -> (the weight it now computes with, as a float matrix view; its stored leaves:
    `kernel` (pruned float), `kernel_mask`, or the quantized `kernel_q`, `kernel_scale`, ...)."""
    shape = w.shape
    m = prune.matrix(jnp.asarray(w, jnp.float32), target.n_in)
    leaves: dict[str, jax.Array] = {}
    mask = None
    if s.sparsity > 0:
        norm = jnp.sqrt(jnp.diagonal(hessian)) if s.criterion == "wanda" else None
        score = prune.scores(m, s.criterion, norm)
        if s.nm:
            mask = prune.nm_mask(score, *s.nm)
        elif threshold is not None:
            mask = score >= threshold
        else:
            mask = prune.unstructured_mask(score, s.sparsity, per_output=s.criterion == "wanda")
        m = jnp.where(mask, m, 0.0)
        leaves["kernel_mask"] = mask.reshape(shape)
    if s.quantize is None:
        leaves["kernel"] = m.reshape(shape).astype(w.dtype)
        return m, leaves
    spec = matrix_spec(s.quantize, target)
    pad = _Padding.of(target, spec.group)
    if pad.padded != pad.n:  # a short last group: whole groups of zero rows in the matrix view
        m = pad.rows(m)
        mask = None if mask is None else pad.rows(mask)
        hessian = None if hessian is None else pad.hessian(hessian)
    if s.method == "gptq":
        codes, params = gptq.quantize_matrix(m, hessian, spec, damp=s.damp, block=s.block, act_order=s.act_order)
        if mask is not None:  # GPTQ's error feedback may have moved a pruned weight: code it as 0 again
            codes = quant.encode(jnp.where(mask, quant.decode(codes, params, spec, 0), 0.0), params, spec, 0)
    else:
        params = quant.group_params(m, spec, 0)
        codes = quant.encode(m, params, spec, 0)
    dequantized = quant.decode(codes, params, spec, 0)
    if pad.padded != pad.n:
        codes, dequantized = pad.unpad(codes), pad.unpad(dequantized)
    kernel_codes = codes.reshape(shape)
    scale_shape = tuple(pad.padded // spec.group if i == target.axis else n for i, n in enumerate(shape))
    kernel_params = {k: v.reshape(scale_shape) for k, v in params.items()}
    stored = quant.store(kernel_codes, kernel_params, s.quantize, target.axis)
    leaves.update({f"kernel_{k}": v for k, v in stored.items()})
    return dequantized, leaves


def _global_threshold(params: dict, cfg, found: list[Target], sparsity: float) -> float:
    kernels = [jnp.abs(_node(params, t.path)["kernel"].astype(jnp.float32)) for t in found]
    return prune.global_threshold(kernels, sparsity)


def compress_params(params: dict, cfg: transformer.ModelConfig, out_cfg: transformer.ModelConfig, co, *,
                    mesh=None, rules=(), calibration: np.ndarray | None = None) -> tuple[dict, dict[str, Any]]:
    """(the parameters of `out_cfg`, what was done: seconds, per-target errors). `params`: the float
    model `cfg`'s; `co`: `config.compress`; `calibration`: token sequences [N, T] (GPTQ, Wanda)."""
    s = Settings.of(co, out_cfg)
    found = targets(out_cfg)
    started = time.time()
    threshold = None
    if s.sparsity > 0 and s.scope == "global" and not s.nm:
        threshold = _global_threshold(params, cfg, found, s.sparsity)
    runner = xs = None
    if s.calibrates:
        if calibration is None or not len(calibration):
            raise ValueError("GPTQ and Wanda need calibration sequences")
        runner = LayerRunner(cfg, params, mesh, rules)
        xs = runner.embed(calibration)
    out = jax.tree.map(lambda x: x, params)  # fresh dicts, the leaves shared until replaced
    per_layer: dict[tuple, list[dict]] = {t.path: [] for t in found if t.stacked}
    block_targets = [t for t in found if t.in_block]
    for i in range(cfg.n_layers):
        stack = stack_of(cfg, i).name
        layer_targets = [t for t in block_targets if (t.path[0] == stack if t.stacked else t.path[1] == i)]
        if not layer_targets:  # (still run, for the next layers' inputs: an MoE's dense layers may have none)
            if runner and any(t.stacked or t.path[1] > i for t in block_targets):
                xs = runner.advance(layer_of(params, cfg, i), xs, stack)
            continue
        block = layer_of(params, cfg, i)
        hessians = runner.statistics(block, xs, stack) if runner else {}
        new_block = jax.tree.map(lambda x: x, block)
        for t in layer_targets:
            kernel = _node(block, t.block_path())["kernel"]
            weight, leaves = _compress_matrix(kernel, hessians.get(t.name), t, s, threshold)
            _node(new_block, t.block_path())["kernel"] = weight.reshape(kernel.shape).astype(kernel.dtype)
            if t.stacked:
                per_layer[t.path].append(leaves)
            else:
                node = _node(out, t.path)
                node.pop("kernel")
                node.update(leaves)
        if runner:
            xs = runner.advance(new_block, xs, stack)
        # One layer in flight at a time: XLA:CPU's collectives can stall when many multi-device programs
        # are queued at once (seen with 8 host devices), and the layer's memory is freed before the next.
        jax.block_until_ready((xs, per_layer, out))
        log.info("compressed layer %d of %d (%.1f s)", i + 1, cfg.n_layers, time.time() - started)
    for path, stacked in per_layer.items():
        node = _node(out, path)
        node.pop("kernel")
        node.update({k: jnp.stack([leaves[k] for leaves in stacked]) for k in stacked[0]})
    for t in (t for t in found if not t.in_block and t.name == "embed"):
        # A lookup table: each row is used as it is stored (no input to weigh errors by), so round to
        # nearest along the width, whatever compress.method says; never pruned (transformer.with_compress).
        node = _node(out, t.path)
        stored = quant.quantize(node.pop("embedding"), s.quantize, t.axis)
        node.update({f"embedding_{k}": v for k, v in stored.items()})
    for t in (t for t in found if not t.in_block and t.name != "embed"):  # the unembedding, when named
        node = _node(out, t.path)
        hessian = runner.final_inputs(xs) if runner else None
        _, leaves = _compress_matrix(node["kernel"], hessian, t, s, threshold)
        node.pop("kernel")
        node.update(leaves)
    return out, {"seconds": time.time() - started, "targets": sorted({t.name for t in found}),
                 "calibration_sequences": 0 if calibration is None else int(len(calibration)),
                 "calibration_seq_len": 0 if calibration is None else int(calibration.shape[1])}


def sparsity_of(params: dict) -> dict[str, float]:
    """{'weights': masked weights, 'zeros': of them pruned, 'sparsity': the fraction} over every kernel_mask."""
    masks = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
             if getattr(path[-1], "key", None) == "kernel_mask"]
    total = sum(math.prod(m.shape) for m in masks)
    kept = sum(int(jnp.sum(m)) for m in masks)
    return {"weights": total, "pruned": total - kept, "sparsity": (total - kept) / total if total else 0.0}
