"""A model's parameters quantized and back: which projections hold a 4-bit kernel (`sites`), and the
tree conversions between float kernels and their quantized leaves (`quantize_params`,
`dequantize_params`). The formats themselves (codes, packing, scales) are `jaxlm.quant`'s, which
knows nothing of models; this module knows the model's layout (`layers.Projection.quant`)."""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxlm.models import layers, transformer
from jaxlm.quant import dequantize, quantize


@dataclasses.dataclass(frozen=True)
class Site:
    """One quantized projection of a model, as its parameters are laid out."""

    path: tuple  # of its module in the params tree: ('blocks', 'attn', 'wq'), ('blocks', 0, 'mlp', 'w_down'), ('embed',)
    axis: int  # the grouped axis of one layer's kernel
    stacked: bool  # its leaves carry a leading layers axis (scanned blocks)
    weight: str = "kernel"  # the float leaf its quantized leaves (`<weight>_q`, ...) replace: kernel | embedding


@functools.lru_cache(maxsize=16)
def sites(cfg) -> tuple[Site, ...]:
    """Every quantized weight of the model `cfg` (a `transformer.ModelConfig`) describes: its projections',
    and the token embedding's where `compress.targets` named it."""
    out = []
    model = transformer.abstract_model(cfg)
    for path, projection in layers.projections(model):
        if projection.quant is not None:
            stacked = len(projection.base.shape) == len(projection.kernel_shape) + 1
            out.append(Site(path=tuple(path), axis=projection.quant_axis, stacked=stacked))
    if model.embed.quant is not None:
        out.append(Site(path=("embed",), axis=model.embed.quant_axis, stacked=False, weight="embedding"))
    return tuple(out)


def _node(tree: dict, path: tuple) -> dict:
    for key in path:
        tree = tree[key]
    return tree


def _copy_to(tree: dict, path: tuple) -> dict:
    """`tree` with fresh dicts along `path` (the leaves shared), and the node at its end."""
    out = dict(tree)
    node = out
    for key in path:
        node[key] = dict(node[key])
        node = node[key]
    return out


def quantize_params(params: dict, cfg) -> dict:
    """The float parameters of the model `cfg` without quantization (`kernel` in each projection) ->
    those of `cfg`: each quantized weight replaced by its leaves (`kernel_q`, `kernel_scale`, ...;
    `embedding_q`, ... for the token embedding), each layer of a stacked kernel quantized on its own. Jit it with the
    quantized model's shardings as `out_shardings` (as `init_from` does) to quantize in place, shard by shard."""
    spec = cfg.quant
    for site in sites(cfg):
        params = _copy_to(params, site.path)
        node = _node(params, site.path)
        fn = lambda w, axis=site.axis: quantize(w, spec, axis)  # noqa: E731
        leaves = (jax.vmap(fn) if site.stacked else fn)(node.pop(site.weight))
        node.update({f"{site.weight}_{key}": value for key, value in leaves.items()})
    return params


def dequantize_params(params: dict, cfg, dtype=None) -> dict:
    """The inverse of `quantize_params` (up to the quantization error): each quantized weight's
    leaves replaced by the `kernel` (or `embedding`) they stand for, in `dtype` (default the model's param_dtype).
    Unchanged when `cfg` quantizes nothing."""
    spec = cfg.quant
    if spec is None:
        return params
    dtype = dtype or cfg.param_dtype
    for site in sites(cfg):
        params = _copy_to(params, site.path)
        node = _node(params, site.path)
        leaves = {key: node.pop(f"{site.weight}_{key}") for key in spec.keys}
        fn = lambda x, axis=site.axis: dequantize(x, spec, axis, dtype)  # noqa: E731
        node[site.weight] = (jax.vmap(fn) if site.stacked else fn)(leaves)
    return params


def _fake_quantize_params(params: dict, cfg) -> dict:
    """A QAT model's target kernels (and embedding) replaced by the weights its forward pass computes with."""
    from jaxlm.quant import fake_quantize

    spec = cfg.quant_spec
    model = transformer.abstract_model(cfg)
    found = [(tuple(path), "kernel", p.quant_axis, len(p.kernel_shape))
             for path, p in layers.projections(model) if p.qat is not None]
    if model.embed.qat is not None:
        found.append((("embed",), "embedding", model.embed.quant_axis, 2))
    for path, weight, axis, ndim in found:
        params = _copy_to(params, path)
        node = _node(params, path)
        fn = lambda w, axis=axis: fake_quantize(w, spec, axis)  # noqa: E731
        node[weight] = (jax.vmap(fn) if node[weight].ndim == ndim + 1 else fn)(node[weight])
    return params


def _drop_masks(tree: dict) -> dict:
    return {k: _drop_masks(v) if isinstance(v, dict) else v for k, v in tree.items() if k != "kernel_mask"}


def to_float(params: dict, cfg) -> tuple[dict, transformer.ModelConfig]:
    """The parameters of a compressed model (quantized kernels, pruning masks, or QAT's float kernels)
    as those of the same model with plain float kernels computing the same function, and that model:
    kernels dequantized (in param_dtype) or fake-quantized (QAT), masks dropped (the kernels hold the
    zeros). What an export to another framework writes."""
    if cfg.qat:
        params = _fake_quantize_params(params, cfg)
    params = _drop_masks(dequantize_params(params, cfg))
    return params, dataclasses.replace(cfg, quantize="", quant_targets=(), qat=False, prune_targets=())
