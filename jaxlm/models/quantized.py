"""A model's parameters quantized and back: which projections hold a 4-bit kernel (`sites`), and the
tree conversions between float kernels and their quantized leaves (`quantize_params`,
`dequantize_params`). The formats themselves (codes, packing, scales) are `jaxlm.quant`'s, which
knows nothing of models; this module knows the model's layout (`transforms.QuantizedKernel`).

`CompressConfig` is the `config.compress` section: the compressed structure of the targeted
projections (quantized kernels here, pruning masks: `jaxlm.pruning_masks`), how `python -m
jaxlm.compress` makes it, and the same in training (quantization-aware training, gradual pruning)."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax

from jaxlm.models import layers, transformer, transforms
from jaxlm.quant import FORMATS, dequantize, fake_quantize, quantize
from jaxlm.section import Section, check, setting


def prune_pattern(text: str) -> tuple[int, int] | None:
    """`compress.pattern` -> (N, M) for N:M semi-structured sparsity, None for unstructured; UserError otherwise."""
    if text == "unstructured":
        return None
    n, _, m = text.partition(":")
    try:
        n, m = int(n), int(m)
    except ValueError:
        n = m = 0
    check(0 < n < m, "compress.pattern", text, "unstructured, or N:M with 0 < N < M (2:4: two of every four kept)")
    return n, m


@dataclasses.dataclass(frozen=True)
class CompressConfig(Section):
    """Compressed models (python -m jaxlm.compress; jaxlm.quant, jaxlm.compress.prune): the structure of the
    targeted projections as a compressed run stores it, how the command makes it, and the same in training
    (quantization-aware training, gradual pruning)."""

    section: ClassVar[str] = "compress"
    targets: str = setting(
        "blocks",
        'comma-separated weight names or shell patterns (wq, w_*, unembed, embed); "blocks" = every '
        'projection of the blocks (the embedding and the unembedding stay in full precision unless named; the'
        ' embedding, a lookup table, is quantized by round to nearest along its width and never pruned)')
    quantize: str = setting(
        "",
        '"" (off) | int8 | int4 | int3 | nf4: the targets\' kernels as packed integer codes + scales')
    group: int = setting(128, "values per scale along each kernel's last input axis; 0 = one scale per output channel")
    symmetric: bool = setting(True, "False: asymmetric integers (a scale and a zero point per group)")
    qat: bool = setting(
        False,
        "training: the targets keep float kernels, fake-quantized to compress.quantize in the forward pass "
        "with a straight-through gradient; python -m jaxlm.compress (method rtn) then writes the integer "
        "model")
    method: str = setting(
        "rtn",
        "how python -m jaxlm.compress quantizes: rtn (round to nearest) | gptq (Frantar et al. 2022)")
    gptq_damp: float = setting(0.01, "GPTQ: this fraction of the Hessian's mean diagonal added to its diagonal")
    gptq_block: int = setting(128, "GPTQ: columns quantized between two lazy batch updates")
    act_order: bool = setting(
        True,
        "GPTQ: columns in order of decreasing Hessian diagonal (the groups' scales stay contiguous)")
    sparsity: float = setting(0.0, "the fraction of the targets' weights pruned to zero; 0 = no pruning")
    pattern: str = setting("unstructured", "unstructured | N:M (e.g. 2:4: N of every M consecutive input weights kept)")
    criterion: str = setting("magnitude", "what is pruned: the smallest |W| (magnitude) or |W| x input norm (wanda)")
    scope: str = setting(
        "layer",
        "unstructured magnitude pruning: per matrix (layer) or over all targets at once (global)")
    calib_samples: int = setting(128, "calibration sequences (GPTQ, Wanda)")
    calib_seq_len: int = setting(2048, "their length (at most model.max_seq_len)")
    calib_corpus: str = setting("", 'the calibration text (data.corpus\'s syntax); "" = the run\'s own training data')
    prune_start: int = setting(
        0,
        "gradual pruning while training (Zhu and Gupta 2017): the sparsity rises from 0 at prune_start to "
        "compress.sparsity at prune_end as 1 - (1 - t)^3, the masks recomputed every prune_every steps")
    prune_end: int = setting(0, "0 = no gradual pruning (the masks stay as the run's checkpoint holds them)")
    prune_every: int = setting(100, "steps between two recomputations of the masks")

    def validate(self) -> None:
        key = self.key
        check(self.quantize in ("", *FORMATS), key("quantize"), self.quantize, "'' (off) or one of " + ", ".join(FORMATS))
        check(self.group >= 0, key("group"), self.group, "a number of values per scale, or 0 (one per output channel)")
        check(self.symmetric or self.quantize != "nf4", key("symmetric"), self.symmetric,
              "True with nf4 (a symmetric table of levels)")
        check(not self.qat or bool(self.quantize), key("qat"), self.qat,
              "False while compress.quantize is '' (set the format)")
        check(self.method in ("rtn", "gptq"), key("method"), self.method, "rtn or gptq")
        check(self.gptq_damp > 0, key("gptq_damp"), self.gptq_damp, "a positive fraction, e.g. 0.01")
        check(self.gptq_block > 0, key("gptq_block"), self.gptq_block, "a positive number of columns, e.g. 128")
        check(0.0 <= self.sparsity < 1.0, key("sparsity"), self.sparsity, "a fraction in [0, 1)")
        check(self.criterion in ("magnitude", "wanda"), key("criterion"), self.criterion, "magnitude or wanda")
        check(self.scope in ("layer", "global"), key("scope"), self.scope, "layer or global")
        nm = prune_pattern(self.pattern)
        check(self.scope == "layer" or (self.criterion == "magnitude" and not nm), key("scope"), self.scope,
              "layer with compress.criterion=wanda or an N:M pattern (global ranks magnitudes, unstructured)")
        if nm:
            check(self.sparsity == 1 - nm[0] / nm[1], key("sparsity"), self.sparsity,
                  f"{1 - nm[0] / nm[1]:g} with compress.pattern={self.pattern} ({nm[0]} of every {nm[1]} kept)")
        check(self.calib_samples > 0, key("calib_samples"), self.calib_samples, "a positive number of sequences")
        check(self.calib_seq_len > 1, key("calib_seq_len"), self.calib_seq_len, "a sequence length of 2 or more")
        check(self.prune_start >= 0, key("prune_start"), self.prune_start, "a step, 0 or more")
        check(self.prune_end == 0 or self.prune_end > self.prune_start, key("prune_end"), self.prune_end,
              f"0 (no gradual pruning) or a step after compress.prune_start={self.prune_start}")
        check(self.prune_end == 0 or self.sparsity > 0, key("prune_end"), self.prune_end,
              "0 while compress.sparsity is 0 (set the sparsity to reach)")
        check(self.prune_every > 0, key("prune_every"), self.prune_every, "a positive number of steps")

    @property
    def active(self) -> bool:
        """Whether the section gives the model a compressed structure (quantized or pruned targets)."""
        return bool(self.quantize) or self.sparsity > 0


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
        if isinstance(projection, transforms.QuantizedKernel):
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
    spec = cfg.stored_quant
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
    spec = cfg.stored_quant
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
    spec = cfg.quantized.spec
    model = transformer.abstract_model(cfg)
    found = [(tuple(path), "kernel", p.quant_axis, len(p.kernel_shape))
             for path, p in layers.projections(model) if isinstance(p, transforms.FakeQuantizedKernel)]
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
    if cfg.quantized is not None and cfg.quantized.fake:
        params = _fake_quantize_params(params, cfg)
    params = _drop_masks(dequantize_params(params, cfg))
    return params, dataclasses.replace(cfg, quantized=None, pruned=None)
