"""LoRA: low-rank adapters on the projections, and what to do with them after training.

The adapters themselves live in the model: `layers.Projection.add_adapter` gives a projection
`lora_a` [the kernel's input dims..., rank] and `lora_b` [rank, its output dims...], `nnx.LoRAParam`s,
and computes y = x W + (alpha / rank) (x A) B. `config.lora` says which projections get one (by
attribute name), with what rank and alpha (`transformer.with_lora`, carried by the ModelConfig); with
adapters, an empty `optim.trainable` trains them alone (`train_state.LORA_TRAINABLE`), so gradients,
optimizer state and the checkpoint's optimizer moments exist for them only, and the frozen base is
stored once, in `params`.

QLoRA (`config.lora.quantize_base`) stores the frozen base's block kernels in 4 bits (`jaxlm.quant`,
`Projection`'s `kernel_q` and `kernel_scale`); `merge` and `base_weights` dequantize it.

This module works on the parameters as the train state and checkpoints hold them (nested dicts, the
scanned layers stacked on a leading axis):

- `merge` folds every adapter into its kernel, W + (alpha / rank) A B: the parameters of the same
  model without adapters (`without_lora`), for export or for a run that starts from them.
- `adapter_params` / `base_params` split the adapters from the rest; `fill_missing` completes
  parameters read from a checkpoint without adapters with freshly initialised ones (`init_adapters`),
  which is how a LoRA run starts from a base run (`run.init_from`).
- `adapters` and the transform's `peft_settings` (`ModelConfig.lora`) give, per adapted projection and
  layer, A and B shaped like the kernel's input and output dimensions, and the rank, alpha and
  targets: what an exporter to PEFT's format (adapter_config.json, adapter_model.safetensors) needs.
  PEFT's lora_A.weight is [rank, inputs] and lora_B.weight [outputs, rank] with its scaling
  lora_alpha / r per module, the same as here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import quant
from jaxlm.errors import UserError
from jaxlm.models import layers, quantized, transformer
from jaxlm.models.transformer import ModelConfig, abstract_model
from jaxlm.models.transforms.lora import Adapted, lora_equations
from jaxlm.section import Section, check, setting
from jaxlm.train_state import build_model


@dataclasses.dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA adapters: y = x W + (alpha / rank) (x A) B on the targeted projections, A random and B zero at
    the start (`transformer.with_lora`). With adapters, an empty optim.trainable trains the adapters alone
    (type:LoRAParam)."""

    section: ClassVar[str] = "lora"
    rank: int = setting(0, "the adapters' rank; 0 = no adapters")
    alpha: float = setting(16.0, "the adapters' update is scaled by alpha / rank (PEFT's lora_alpha)")
    targets: str = setting(
        "wq,wk,wv,wo",
        'comma-separated projection names (wq wk wv wo, w_gate w_up w_down or w_in w_out, an MoE\'s expert_gate '
        'expert_up expert_down, unembed); "all" = every projection but the unembedding')
    ranks: str = setting("", 'ranks of single targets, overriding lora.rank: "wq:16,w_down:4"; "" = lora.rank for all')
    dropout: float = setting(0.0, "dropout on the adapters' input in training (not on the unembedding's nor an "
                                  "MoE's experts', whose adapters are merged into their weights)")
    quantize_base: str = setting(
        "",
        "QLoRA (needs lora.rank > 0): every block projection's frozen kernel (all but the unembedding, "
        'adapted or not) stored in 4 bits and dequantized in the step: "" (off) | nf4 (QLoRA\'s NormalFloat4) '
        '| int4 (symmetric, levels -7..7 of absmax / 7). jaxlm.quant states the error bounds.')
    quant_group: int = setting(
        64,
        "values per scale (their absmax), along each kernel's last input axis: an axis shorter than this is "
        "one group; a longer one it does not divide ends with a short group (padded with zeros, as "
        "bitsandbytes pads its last block). Even.")
    double_quant: bool = setting(
        False,
        "the scales themselves in int8 (blocks of 256, a float32 each): ~0.37 bits/weight less")

    def validate(self) -> None:
        check(self.rank >= 0, self.key("rank"), self.rank, "0 (no adapters) or a positive integer")
        check(self.alpha > 0, self.key("alpha"), self.alpha, "a positive number")
        check(0.0 <= self.dropout < 1.0, self.key("dropout"), self.dropout, "a number in [0, 1)")
        check(self.quantize_base in ("", *quant.FORMATS), self.key("quantize_base"), self.quantize_base,
              "'' (off) or one of " + ", ".join(quant.FORMATS))
        check(self.quant_group >= 2 and self.quant_group % 2 == 0, self.key("quant_group"), self.quant_group,
              "an even number of values per scale (64 as in QLoRA)")

    @property
    def active(self) -> bool:
        """Whether the section asks for anything (adapters, per-target ranks or a quantized base)."""
        return self.rank > 0 or bool(self.ranks.strip()) or bool(self.quantize_base)

ADAPTER_KEYS = ("lora_a", "lora_b")


def without_lora(cfg: ModelConfig) -> ModelConfig:
    """The same model without adapters, and without QLoRA's quantization of the base: what `merge`
    returns the parameters of (float kernels)."""
    return dataclasses.replace(cfg, lora=None, quantized=None)


@dataclasses.dataclass(frozen=True)
class Site:
    """One adapted projection of the model, as its parameters are laid out."""

    path: tuple  # of its module in the params tree: ('blocks', 'attn', 'wq'), ('blocks', 0, 'attn', 'wq'), ('unembed',)
    name: str  # its attribute name: wq, w_down, unembed
    equation: str  # the kernel's contraction, e.g. "btd,dnh->btnh"
    rank: int
    scale: float  # alpha / rank
    stacked: bool  # its parameters carry a leading layers axis (scanned blocks)
    input_names: tuple  # logical names of the kernel's input (contracted) dimensions
    output_names: tuple  # and of its output dimensions
    first: int = 0  # stacked: the model layer its leading axis starts at (its stack's first: `transformer.layer_stacks`)

    @property
    def layer(self) -> int | None:
        """The decoder layer of an unscanned block's projection (None: stacked, or not in a block)."""
        return next((p for p in self.path if isinstance(p, int)), None)


@functools.lru_cache(maxsize=16)
def sites(cfg: ModelConfig) -> tuple[Site, ...]:
    """Every adapted projection of the model `cfg` describes, from an abstract build."""
    out = []
    for path, projection in layers.projections(abstract_model(cfg)):
        if not isinstance(projection, Adapted) or projection.lora_a is None:
            continue
        names = tuple(projection.base.get_metadata()["out_sharding"])
        stacked = names[0] == "layers" and len(names) == len(projection.equation.split("->")[0].split(",")[1]) + 1
        names = names[1:] if stacked else names
        ins = projection.in_axes
        out.append(Site(path=tuple(path), name=path[-1], equation=projection.equation,
                        rank=cfg.lora.rank_of(path[-1]), scale=projection.lora_scale, stacked=stacked,
                        input_names=tuple(names[i] for i in ins),
                        output_names=tuple(n for i, n in enumerate(names) if i not in ins),
                        first=transformer.layer_number(cfg, tuple(path), 0) if stacked else 0))
    return tuple(out)


def _get(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _filter(tree: dict, keep) -> dict:
    """The leaves of a nested dict whose key `keep(key)` accepts, with the dicts leading to them."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            part = _filter(value, keep)
            if part:
                out[key] = part
        elif keep(key):
            out[key] = value
    return out


def adapter_params(params: dict) -> dict:
    """The adapters' leaves alone (`lora_a`, `lora_b`), nested as in `params`."""
    return _filter(params, lambda key: key in ADAPTER_KEYS)


def base_params(params: dict) -> dict:
    """Everything but the adapters: the parameters a model without them has."""
    return _filter(params, lambda key: key not in ADAPTER_KEYS)


def fill_missing(loaded: dict, fresh: dict) -> dict:
    """`loaded` with every leaf it lacks taken from `fresh` (same nesting): parameters read from a
    checkpoint without adapters, completed with freshly initialised adapters."""
    out = dict(loaded)
    for key, value in fresh.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict):
            out[key] = fill_missing(out[key], value)
    return out


def delta(site: Site, a: jax.Array, b: jax.Array) -> jax.Array:
    """The adapter's update of the kernel, (alpha / rank) A B, shaped like the kernel, in float32."""
    to_h, to_y = lora_equations(site.equation)
    a_sub, b_sub = to_h.split("->")[0].split(",")[1], to_y.split("->")[0].split(",")[1]
    kernel_sub = site.equation.split("->")[0].split(",")[1]
    if site.stacked:  # a leading layers axis on A, B and the kernel
        layer = next(c for c in "LSZYXW" if c not in site.equation + a_sub + b_sub)
        a_sub, b_sub, kernel_sub = layer + a_sub, layer + b_sub, layer + kernel_sub
    product = jnp.einsum(f"{a_sub},{b_sub}->{kernel_sub}", jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
    return site.scale * product


def base_weights(params: dict, cfg: ModelConfig) -> dict:
    """The frozen base of `params` (of the model `cfg`) as float parameters of `without_lora(cfg)`:
    the adapters dropped, a QLoRA base dequantized (`quantized.dequantize_params`, in param_dtype)."""
    return base_params(quantized.dequantize_params(params, cfg))


def merge(params: dict, cfg: ModelConfig) -> dict:
    """`params` of the model `cfg` (with adapters) -> the parameters of `without_lora(cfg)`: each
    adapted kernel becomes W + (alpha / rank) A B (computed in float32, stored in the kernel's dtype),
    the adapters are dropped; a QLoRA base is dequantized first (the merged kernels are float).
    Stacked (scanned) and unscanned layers alike; params without adapters (cfg without LoRA) come
    back unchanged."""
    params = quantized.dequantize_params(params, cfg)
    merged = base_params(params)
    for site in sites(cfg):
        node = _get(params, site.path)
        module = _get(merged, site.path)
        kernel = node["kernel"]
        module["kernel"] = (jnp.asarray(kernel, jnp.float32) + delta(site, node["lora_a"], node["lora_b"])).astype(
            kernel.dtype)
    return merged


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One projection's adapter in one layer, for export (PEFT: lora_A.weight = A reshaped to
    [rank, prod(input dims)], lora_B.weight = B reshaped to [prod(output dims), rank] and transposed)."""

    name: str  # the projection's attribute name: wq, wk, wv, wo, w_gate, w_up, w_down, w_in, w_out, unembed
    layer: int | None  # the decoder layer; None for the unembedding
    a: jax.Array  # [the kernel's input dims..., rank], e.g. wq: [d_model, rank]; wo: [n_heads, head_dim, rank]
    b: jax.Array  # [rank, the kernel's output dims...], e.g. wq: [rank, n_heads, head_dim]; wo: [rank, d_model]
    rank: int
    alpha: float  # the update is (alpha / rank) A B
    input_names: tuple  # the logical names of A's leading dims (the kernel's input dims): ('embed',), ('heads', 'head_dim')
    output_names: tuple  # and of B's trailing dims (the kernel's output dims)


def adapters(params: dict, cfg: ModelConfig) -> list[Adapter]:
    """Every adapter of `params` (of the model `cfg`), one per projection and layer, in layer order."""
    out = []
    for site in sites(cfg):
        node = _get(params, site.path)
        a, b = node["lora_a"], node["lora_b"]
        per_layer = [(site.first + i, a[i], b[i]) for i in range(a.shape[0])] if site.stacked else [(site.layer, a, b)]
        out += [Adapter(name=site.name, layer=layer, a=la, b=lb, rank=site.rank, alpha=cfg.lora.alpha,
                        input_names=site.input_names, output_names=site.output_names) for layer, la, lb in per_layer]
    return sorted(out, key=lambda x: (x.layer is None, x.layer or 0, x.name))


def init_adapters(cfg: ModelConfig, param_shardings: dict, mesh: jax.sharding.Mesh, seed: int = 0) -> dict:
    """The adapters of a new model of `cfg` initialised with `seed` (the values `train_state.create`
    gives them), directly into their shardings (`param_shardings`: the whole model's); the base
    weights' initialisation is dead code that XLA drops."""
    def init():
        return adapter_params(nnx.to_pure_dict(nnx.state(build_model(cfg, seed))))

    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=adapter_params(param_shardings))()


def check_source(saved_config: dict, where: str) -> None:
    """Refuse to start a run from parameters with adapters (`run.init_from` reads the base weights
    alone, so the source's adapters would be silently lost): merge them into the base first."""
    lora = saved_config.get("lora") or {}
    if int(lora.get("rank", 0) or 0) > 0:
        raise UserError(f"{where} was trained with LoRA adapters (lora.rank={lora['rank']}), which a run started "
                        f"from it would not read; merge them into its weights first (python -m jaxlm.hf export "
                        f"--adapters=merge, then python -m jaxlm.hf import of that) and start from the merged run")
