"""Hugging Face checkpoints: their config.json as jaxlm model keys and back, and one name map per
architecture between Hugging Face tensors and jaxlm parameters.

A Hugging Face tensor maps onto a jaxlm parameter by a `Part`: the tensor seen as a `view` (each of
its dimensions split into several, e.g. q_proj's [N*H, D] as [N, H, D]), optionally one view
dimension fixed (GPT-2's fused c_attn holds q, k and v side by side), and the remaining dimensions
transposed into jaxlm's order. Layers are stacked on a leading axis when the model scans them, and an
MoE's experts, one Linear per expert in the checkpoint, on the next (`Part.experts`). The
same table serves import (`read_slice`: only the rows and columns one device holds are read, through
safetensors' lazy slices) and export (`hf_tensor`). Llama's q and k need no permutation: Hugging
Face's `rotate_half` is jaxlm's half-split RoPE.

Nothing here executes code from a checkpoint: the config is JSON read as data, the weights are
safetensors (pickled PyTorch files are refused), `auto_map` and custom modeling code are ignored.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from jaxlm.errors import UserError
from jaxlm.models import transformer
from jaxlm.models.layers import rope_attention_factor
from jaxlm.models.mlps import MLPS

MAX_JSON_BYTES = 10_000_000  # config.json, generation_config.json, the index: far below this
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe")  # model_type values jaxlm imports
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")  # their MLP: jaxlm's MoE (model.mlp=moe) in every layer
_CLASS_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
# Buffers some checkpoints carry that are not parameters (recomputed by every implementation).
BUFFERS = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


def read_json(path: pathlib.Path, what: str) -> dict:
    """A JSON object from `path`, read as data with a size limit; one line if it is not that."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise UserError(f"{path} not found: {what} needs it") from None
    if size > MAX_JSON_BYTES:
        raise UserError(f"{path} is {size} bytes, more than the {MAX_JSON_BYTES} a {path.name} can be; "
                        "is it the right file?")
    try:
        value = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); {what} needs Hugging Face's {path.name}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object; {what} needs Hugging Face's "
                        f"{path.name}")
    return value


# ----------------------------------------------------------------------------- config.json


def _get(hf: dict, key: str, kind=int, default: Any = ...) -> Any:
    value = hf.get(key, default)
    if value is ... or value is None and default is ...:
        raise UserError(f"config.json has no {key!r}; a {hf.get('model_type')} config.json needs it")
    if value is not None and kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if value is not None and not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UserError(f"config.json: {key}={value!r} is not a{'n' if kind is int else ''} {kind.__name__}")
    return value


def _refuse(field: str, value: Any, why: str) -> UserError:
    return UserError(f"config.json: {field}={json.dumps(value)}: {why}")


def _rope_keys(hf: dict) -> dict:
    """RoPE theta and scaling from either layout: transformers 5's `rope_parameters`, or the older
    top-level `rope_theta` with `rope_scaling`."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        field = "rope_scaling"
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise _refuse(field, params, "expected an object")
    kind = params.get("rope_type", params.get("type", "default"))
    keys = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        return {**keys, "rope_scaling": "none"}
    if kind == "linear":
        return {**keys, "rope_scaling": "linear", "rope_factor": float(params["factor"])}
    if kind == "llama3":
        return {**keys, "rope_scaling": "llama3", "rope_factor": float(params["factor"]),
                "rope_low_freq_factor": float(params["low_freq_factor"]),
                "rope_high_freq_factor": float(params["high_freq_factor"]),
                "rope_original_max_len": int(params["original_max_position_embeddings"])}
    if kind == "yarn":
        return {**keys, **_yarn_keys(hf, params, field)}
    raise _refuse(f"{field}.rope_type", kind, "jaxlm has RoPE scaling 'default', 'linear', 'llama3' and 'yarn' only")


def _yarn_keys(hf: dict, params: dict, field: str) -> dict:
    """YaRN's settings as transformers reads them (`modeling_rope_utils._compute_yarn_parameters`), those
    Llama- and Qwen-style configs use; an attention factor of its own (given, or DeepSeek's mscale and
    mscale_all_dim) and an untruncated ramp (truncate=false) are refused."""
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise _refuse(f"{field}.original_max_position_embeddings", original,
                      "YaRN needs the context length the model was trained with, a positive integer")
    factor = params.get("factor") or _get(hf, "max_position_embeddings") / original  # transformers' default
    keys = {"rope_scaling": "yarn", "rope_factor": float(factor), "rope_original_max_len": original,
            "rope_beta_fast": float(params.get("beta_fast") or 32), "rope_beta_slow": float(params.get("beta_slow") or 1)}
    if params.get("mscale") and params.get("mscale_all_dim"):
        raise _refuse(f"{field}.mscale_all_dim", params["mscale_all_dim"],
                      "jaxlm's YaRN has the default attention factor 0.1 ln(factor) + 1 only (DeepSeek's mscale is not)")
    attention_factor = params.get("attention_factor")
    default = rope_attention_factor("yarn", float(factor))
    if attention_factor is not None and not math.isclose(attention_factor, default, rel_tol=1e-6):
        raise _refuse(f"{field}.attention_factor", attention_factor,
                      f"jaxlm's YaRN has the default attention factor 0.1 ln(factor) + 1 = {default:.6g} only")
    if params.get("truncate", True) is not True:
        raise _refuse(f"{field}.truncate", params["truncate"], "jaxlm's YaRN rounds its ramp's ends outwards "
                      "(transformers' default, truncate=true) only")
    return keys


# The config.json field each jaxlm key of an import comes from (`model_keys`), by architecture: what an
# import's errors name, so that the user reads the field of the file they gave
_FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "mlp_dim": "intermediate_size", "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
           "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta"}
# An MoE's keys (`_moe_keys`), by architecture; Qwen3-MoE's count of experts in either spelling (`_experts_field`)
_MOE_FIELDS = {"mixtral": {"moe_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok",
                           "moe_aux_loss": "router_aux_loss_coef"},
               "qwen3_moe": {"moe_experts": "num_experts", "moe_top_k": "num_experts_per_tok",
                             "mlp_dim": "moe_intermediate_size", "moe_aux_loss": "router_aux_loss_coef",
                             "moe_dense_layers": "mlp_only_layers", "moe_dense_dim": "intermediate_size"}}
_GPT2_FIELDS = {"vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head",
                "mlp_dim": "n_inner", "max_seq_len": "n_positions", "norm_eps": "layer_norm_epsilon"}
_LINKED = {"data.seq_len": "max_seq_len", "data.tokenizer_vocab_size": "vocab_size"}  # keys set from model keys
_KEY = re.compile(r"(?:config\.)?((?:model|data)\.\w+)")


def _fields(arch: str, hf: dict | None = None) -> dict[str, str]:
    """jaxlm key -> the config.json field of `arch` it comes from (in the spelling of the file `hf`, where
    given)."""
    if arch == "gpt2":
        return _GPT2_FIELDS
    fields = {**_FIELDS, **_MOE_FIELDS.get(arch, {})}
    if arch == "qwen3_moe" and hf is not None:
        fields["moe_experts"] = _experts_field(hf)
    return fields


def in_file_terms(message: str, arch: str, hf: dict | None = None) -> str:
    """A config check's line about an imported model (of the config.json `hf`, where given), with each
    jaxlm key its config.json came from replaced by that field: "config.model.n_kv_heads=3 ...
    model.n_heads=4" becomes "config.json: num_key_value_heads=3 ... num_attention_heads=4"."""
    fields = _fields(arch, hf)

    def field(m: re.Match) -> str:
        key = m.group(1)
        own = _LINKED.get(key, key.removeprefix("model."))
        return fields.get(own, m.group(0)) if key.startswith("model.") or key in _LINKED else m.group(0)

    text = _KEY.sub(field, message)
    return f"config.json: {text}" if text != message else message


def model_keys(hf: dict) -> tuple[str, dict]:
    """(architecture, jaxlm `model` keys) of a Hugging Face config.json; one line naming the field
    for anything jaxlm cannot represent exactly."""
    arch = hf.get("model_type")
    if arch not in ARCHITECTURES:
        raise _refuse("model_type", arch, f"jaxlm imports {', '.join(ARCHITECTURES)}")
    if hf.get("quantization_config"):
        raise _refuse("quantization_config", hf["quantization_config"].get("quant_method", "?"),
                      "the weights are quantized; import the full-precision checkpoint")
    if arch == "gpt2":
        return arch, _gpt2_keys(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "jaxlm's SwiGLU uses silu")
    if hf.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "jaxlm's SwiGLU has no biases")
    window = hf.get("sliding_window")
    # Mistral's and Mixtral's window: one as long as the context is every earlier position, full attention
    if arch in ("mistral", "mixtral") and window is not None and not (
            isinstance(window, int) and window >= _get(hf, "max_position_embeddings")):
        raise _refuse("sliding_window", window, "jaxlm has no sliding-window attention (a window shorter than "
                                                "max_position_embeddings)")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise _refuse("use_sliding_window", True, "jaxlm has no sliding-window attention")
    d, n = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    keys = dict(
        # Qwen3: Llama with an RMSNorm on each head's queries and keys (the qwen3 variant's model.qk_norm)
        variant={"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3"}.get(arch, "llama"),
        vocab_size=_get(hf, "vocab_size"),
        d_model=d,
        n_layers=_get(hf, "num_hidden_layers"),
        n_heads=n,
        n_kv_heads=_get(hf, "num_key_value_heads", int, None) or n,
        head_dim=_get(hf, "head_dim", int, None) or d // n,
        mlp_dim=_get(hf, _fields(arch)["mlp_dim"]),  # an MoE's: each expert's width
        max_seq_len=_get(hf, "max_position_embeddings"),
        norm_eps=_get(hf, "rms_norm_eps", float, 1e-6),
        tie_embeddings=_get(hf, "tie_word_embeddings", bool, False),
        # attention_bias: q, k, v and o biases, what model.use_bias gives a SwiGLU model with RMSNorm
        use_bias=1 if arch in ("llama", "qwen3", "qwen3_moe") and hf.get("attention_bias") else -1,
        **_rope_keys(hf),
    )
    if arch in MOE_ARCHITECTURES:
        keys.update(_moe_keys(hf, arch, keys["n_layers"]))
    return arch, keys


def _experts_field(hf: dict) -> str:
    """Qwen3-MoE's count of experts: num_experts on the Hub; transformers 5 writes num_local_experts."""
    return "num_local_experts" if "num_experts" not in hf and "num_local_experts" in hf else "num_experts"


def _moe_keys(hf: dict, arch: str, n_layers: int) -> dict:
    """jaxlm's MoE keys of a Mixtral or Qwen3-MoE config.json: its experts in every layer, or a Qwen3-MoE's
    dense first layers (mlp_only_layers 0 .. n-1: model.moe_dense_layers, intermediate_size wide),
    dropless (`ragged`: the function transformers computes, no token dropped); other dense layers are
    refused."""
    dense: dict = {}
    if arch == "qwen3_moe":
        step, dense_only = _get(hf, "decoder_sparse_step", int, 1), hf.get("mlp_only_layers") or []
        if step < 1:
            raise _refuse("decoder_sparse_step", step, "expected a positive integer")
        if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
            raise _refuse("mlp_only_layers", dense_only, "expected a list of layer numbers")
        listed = sorted({i for i in dense_only if 0 <= i < n_layers})
        if listed and listed != list(range(len(listed))):
            gap = next(i for i in range(n_layers) if i not in listed)  # the first layer with experts
            raise _refuse("mlp_only_layers", dense_only,
                          f"layer {min(i for i in listed if i > gap)} without experts (dense) after layer {gap} "
                          "with experts; jaxlm's MoE model has its dense layers first (model.moe_dense_layers)")
        if len(listed) == n_layers:
            raise _refuse("mlp_only_layers", dense_only, "every layer dense: import it as a Qwen3 (model_type qwen3)")
        if listed:
            dense = dict(moe_dense_layers=len(listed), moe_dense_dim=_get(hf, "intermediate_size"))
        if step > 1:
            raise _refuse("decoder_sparse_step", step,
                          f"experts in one layer of every {step}, the others dense; jaxlm's MoE model has experts in "
                          "every layer")
    # Mixtral renormalizes its top k probabilities: the top k logits softmaxed; Qwen3-MoE where norm_topk_prob
    router = "topk_softmax" if arch == "mixtral" or _get(hf, "norm_topk_prob", bool, False) else "softmax_topk"
    fields = _fields(arch, hf)
    return dict(mlp="moe", moe_experts=_get(hf, fields["moe_experts"]), moe_top_k=_get(hf, fields["moe_top_k"]),
                moe_router=router, moe_shared_experts=0, moe_impl="ragged",
                moe_aux_loss=_get(hf, fields["moe_aux_loss"], float, 0.001), moe_z_loss=0.0, **dense)


def _gpt2_keys(hf: dict) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _refuse("activation_function", act, "jaxlm's GPT-2 MLP uses the tanh GELU (gelu_new)")
    for field, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
        if hf.get(field, wanted) != wanted:
            raise _refuse(field, hf[field], f"jaxlm's GPT-2 needs {json.dumps(wanted)}")
    if not hf.get("tie_word_embeddings", True):
        raise _refuse("tie_word_embeddings", False, "GPT-2's output layer is its embedding")
    d = _get(hf, "n_embd")
    return dict(
        variant="gpt2",
        vocab_size=_get(hf, "vocab_size"),
        d_model=d,
        n_layers=_get(hf, "n_layer"),
        n_heads=_get(hf, "n_head"),
        n_kv_heads=0,
        head_dim=0,
        mlp_dim=_get(hf, "n_inner", int, None) or 4 * d,
        max_seq_len=_get(hf, "n_positions"),
        norm_eps=_get(hf, "layer_norm_epsilon", float, 1e-5),
        tie_embeddings=True,
        use_bias=-1,
    )


def architecture_of(cfg) -> str:
    """The Hugging Face model_type a jaxlm model exports as; one line if it has no counterpart."""
    counterparts = MLPS[cfg.mlp].hf_architectures
    if not counterparts:
        others = ", ".join(f"{name} ({', '.join(c.hf_architectures)})" for name, c in MLPS.items() if c.hf_architectures)
        raise UserError(f"this model's MLP (model.mlp={cfg.mlp}) has no Hugging Face counterpart, so it cannot be "
                        f"exported; the MLPs that have one: {others}")
    if cfg.norm == "layernorm" and "gpt2" in counterparts and cfg.position == "learned" and cfg.use_bias \
            and cfg.tie_embeddings and not cfg.qk_norm:
        return "gpt2"
    unsupported = MLPS[cfg.mlp].hf_unsupported(cfg)
    if unsupported:
        raise UserError(f"this model's MLP (model.mlp={cfg.mlp}) has {unsupported}, which no Hugging Face "
                        f"architecture holds, so it cannot be exported")
    llama_like = cfg.norm == "rmsnorm" and cfg.position == "rope"
    if llama_like and not cfg.qk_norm and "llama" in counterparts and not cfg.use_bias:
        return "qwen2" if cfg.qkv_bias else "llama"
    if llama_like and not cfg.qk_norm and "mixtral" in counterparts and not cfg.use_bias and not cfg.qkv_bias:
        if cfg.moe.dense_layers:
            raise UserError(f"this MoE model has dense first layers (model.moe_dense_layers={cfg.moe.dense_layers}), "
                            "which Mixtral (an MoE without q/k norms) does not: it exports as Qwen3-MoE, with q/k "
                            "norms (model.qk_norm=1)")
        if cfg.moe.router != "topk_softmax":  # Mixtral renormalizes its top k; softmax_topk: Qwen3-MoE's alone
            raise UserError(f"this MoE model routes with model.moe_router={cfg.moe.router}, which Mixtral (an MoE without "
                            "q/k norms) does not: it exports with moe_router=topk_softmax, or as Qwen3-MoE with q/k "
                            "norms (model.qk_norm=1)")
        return "mixtral"
    # Qwen3's attention_bias is q, k, v and o biases together: model.use_bias where the MLP has no biases
    if llama_like and cfg.qk_norm and (cfg.use_bias or not cfg.qkv_bias) and not MLPS[cfg.mlp].biases:
        for arch in ("qwen3", "qwen3_moe"):
            if arch in counterparts:
                return arch
    raise UserError(f"this model (norm={cfg.norm}, mlp={cfg.mlp}, position={cfg.position}, use_bias={cfg.use_bias}, "
                    f"qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}, tie_embeddings={cfg.tie_embeddings}) has no "
                    "Hugging Face architecture: Llama, Qwen2, Qwen3 (q/k norms; q/k/v biases only with the output's: "
                    "model.use_bias), GPT-2 (with tied embeddings), and with model.mlp=moe Mixtral (no biases) and "
                    "Qwen3-MoE (Qwen3's attention) are exported")


def hf_config(cfg, arch: str, *, bos_id: int, eos_id: int, pad_id: int | None, dtype: str) -> dict:
    """The config.json `transformers` builds this model from (`cfg`: a ModelConfig)."""
    ids = {"bos_token_id": None if bos_id < 0 else bos_id, "eos_token_id": None if eos_id < 0 else eos_id,
           "pad_token_id": pad_id}
    common = {"architectures": [_CLASS_NAMES[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
              "torch_dtype": dtype, "dtype": dtype, "use_cache": True, **ids}
    if arch == "gpt2":
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                "n_inner": cfg.mlp_dim, "n_positions": cfg.max_seq_len, "activation_function": "gelu_new",
                "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": True, "scale_attn_weights": True,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=cfg.rope_factor)
    elif cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
    elif cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_factor, original_max_position_embeddings=cfg.rope_original_max_len,
                    beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
    out = {**common, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
           "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
           # Both layouts of the RoPE settings: transformers 5 reads rope_parameters, older ones the rest.
           "rope_parameters": rope, "rope_theta": cfg.rope_theta,
           "rope_scaling": None if rope["rope_type"] == "default" else rope}
    if arch == "llama":
        out.update(attention_bias=cfg.use_bias, mlp_bias=False)
    elif arch == "mixtral":
        out.update(sliding_window=None)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    if arch in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=cfg.use_bias)
    if arch in MOE_ARCHITECTURES:
        out.update(_moe_config(cfg, arch))
    return out


def _moe_config(cfg, arch: str) -> dict:
    """The MoE's fields of a Mixtral or Qwen3-MoE config.json (`_moe_keys` read back): experts in every layer;
    the router's balancing loss coefficient, which transformers applies where asked (output_router_logits)."""
    spec = cfg.moe
    out = {"num_experts_per_tok": spec.top_k, "router_aux_loss_coef": spec.aux_loss, "output_router_logits": False}
    if arch == "mixtral":  # intermediate_size: each expert's width
        return {**out, "num_local_experts": spec.experts, "router_jitter_noise": 0.0}
    # Qwen3-MoE: num_experts as the Hub's checkpoints spell it (transformers 5 reads it as num_local_experts)
    return {**out, "num_experts": spec.experts, "moe_intermediate_size": cfg.mlp_dim,
            "norm_topk_prob": spec.router == "topk_softmax", "decoder_sparse_step": 1,
            # the dense first layers' (model.moe_dense_layers): intermediate_size wide
            "mlp_only_layers": list(range(spec.dense_layers)),
            **({"intermediate_size": spec.dense_dim} if spec.dense_layers else {})}


# ----------------------------------------------------------------------------- the name map


@dataclasses.dataclass(frozen=True)
class Part:
    """One jaxlm parameter (of one layer) as (a part of) one Hugging Face tensor.

    `groups[i]` splits the tensor's dimension i into view dimensions; `select` fixes view
    dimensions (by their index in the view) to one index; `perm` gives jaxlm's dimensions as
    indices into the view dimensions that remain. `experts` > 0: the parameter is that many
    tensors (one per expert, "{expert}" in `hf`) stacked on its first axis, each laid out as the rest
    of the Part says."""

    hf: str  # the tensor's name; "{layer}" where it is per layer, "{expert}" per expert
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    select: tuple[tuple[int, int], ...] = ()
    experts: int = 0

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def view(self) -> tuple[int, ...]:
        return tuple(size for g in self.groups for size in g)

    @property
    def kept(self) -> tuple[int, ...]:
        """The view dimensions left once `select` has fixed its own."""
        fixed = dict(self.select)
        return tuple(i for i in range(len(self.view)) if i not in fixed)

    @property
    def shape(self) -> tuple[int, ...]:
        """jaxlm's shape of the parameter (of one layer; every expert's)."""
        kept = self.kept
        one = tuple(self.view[kept[p]] for p in self.perm)
        return (self.experts, *one) if self.experts else one


def _same(name: str, *shape: int) -> Part:
    return Part(name, tuple((s,) for s in shape), tuple(range(len(shape))))


def _transposed(name: str, rows: int, cols: int) -> Part:
    """A PyTorch Linear's [out, in] weight as jaxlm's [in, out] kernel."""
    return Part(name, ((rows,), (cols,)), (1, 0))


def _mlp_parts(cfg, arch: str, prefix: str, conv1d: bool) -> dict[tuple, Part]:
    """The MLP's weights under the layer's `prefix`, by the modules its class gives them in `arch`
    (`MLP.hf_modules`): GPT-2's Conv1D stores a kernel as jaxlm does, [in, out]; a PyTorch Linear as
    [out, in]; an MoE's experts one Linear each (a module with "{expert}"), stacked on jaxlm's first axis."""
    mlp = MLPS[cfg.mlp]
    shapes = mlp.projection_shapes(cfg)
    biases = mlp.bias_shapes(cfg)
    others = mlp.weight_shapes(cfg)
    experts = mlp.expert_shapes(cfg)
    out = {}
    for name, module in mlp.hf_modules(arch).items():
        hf = prefix + module
        if name in shapes:
            i, o = shapes[name]
            out["mlp", name, "kernel"] = _same(hf + ".weight", i, o) if conv1d else _transposed(hf + ".weight", o, i)
        elif name in biases:
            out["mlp", name] = _same(hf + ".bias", biases[name])
        elif name in experts:  # "{expert}": one Linear per expert
            e, i, o = experts[name]
            out["mlp", name, "kernel"] = dataclasses.replace(_transposed(hf + ".weight", o, i), experts=e)
        elif name in others:
            i, o = others[name]
            out["mlp", name] = _transposed(hf + ".weight", o, i)
    return out


def name_map(cfg, arch: str) -> tuple[dict[tuple, Part], dict[tuple, Part]]:
    """(parts of one layer keyed by the path inside a block, parts outside the blocks keyed by path)."""
    d, n, k, h, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    if arch == "gpt2":
        p = "transformer.h.{layer}."
        layer = {
            ("attn_norm", "scale"): _same(p + "ln_1.weight", d), ("attn_norm", "bias"): _same(p + "ln_1.bias", d),
            ("mlp_norm", "scale"): _same(p + "ln_2.weight", d), ("mlp_norm", "bias"): _same(p + "ln_2.bias", d),
            ("attn", "wo", "kernel"): Part(p + "attn.c_proj.weight", ((n, h), (d,)), (0, 1, 2)),
            ("attn", "bo"): _same(p + "attn.c_proj.bias", d),
            **_mlp_parts(cfg, arch, p, conv1d=True),
        }
        for i, name in enumerate(("q", "k", "v")):  # Conv1D's c_attn: [D, 3D], x @ W, q | k | v along columns
            layer[("attn", f"w{name}", "kernel")] = Part(p + "attn.c_attn.weight", ((d,), (3, n, h)), (0, 1, 2),
                                                         select=((1, i),))
            layer[("attn", f"b{name}")] = Part(p + "attn.c_attn.bias", ((3, n, h),), (0, 1), select=((0, i),))
        outside = {("embed", "embedding"): _same("transformer.wte.weight", v, d),
                   ("pos_embed",): _same("transformer.wpe.weight", cfg.max_seq_len, d),
                   ("final_norm", "scale"): _same("transformer.ln_f.weight", d),
                   ("final_norm", "bias"): _same("transformer.ln_f.bias", d)}
        return layer, outside
    p = "model.layers.{layer}."
    layer = {
        ("attn_norm", "scale"): _same(p + "input_layernorm.weight", d),
        ("mlp_norm", "scale"): _same(p + "post_attention_layernorm.weight", d),
        ("attn", "wq", "kernel"): Part(p + "self_attn.q_proj.weight", ((n, h), (d,)), (2, 0, 1)),
        ("attn", "wk", "kernel"): Part(p + "self_attn.k_proj.weight", ((k, h), (d,)), (2, 0, 1)),
        ("attn", "wv", "kernel"): Part(p + "self_attn.v_proj.weight", ((k, h), (d,)), (2, 0, 1)),
        ("attn", "wo", "kernel"): Part(p + "self_attn.o_proj.weight", ((d,), (n, h)), (1, 2, 0)),
        **_mlp_parts(cfg, arch, p, conv1d=False),
    }
    if cfg.use_bias or cfg.qkv_bias:
        layer[("attn", "bq")] = Part(p + "self_attn.q_proj.bias", ((n, h),), (0, 1))
        layer[("attn", "bk")] = Part(p + "self_attn.k_proj.bias", ((k, h),), (0, 1))
        layer[("attn", "bv")] = Part(p + "self_attn.v_proj.bias", ((k, h),), (0, 1))
    if cfg.use_bias:
        layer[("attn", "bo")] = _same(p + "self_attn.o_proj.bias", d)
    if cfg.qk_norm:  # Qwen3: one RMSNorm scale over a head's width for all the query heads, one for the key heads
        layer[("attn", "q_norm", "scale")] = _same(p + "self_attn.q_norm.weight", h)
        layer[("attn", "k_norm", "scale")] = _same(p + "self_attn.k_norm.weight", h)
    outside = {("embed", "embedding"): _same("model.embed_tokens.weight", v, d),
               ("final_norm", "scale"): _same("model.norm.weight", d)}
    if not cfg.tie_embeddings:
        outside[("unembed", "kernel")] = _transposed("lm_head.weight", v, d)
    return layer, outside


def param_parts(params: dict, cfg, arch: str) -> Iterator[tuple[tuple, Part, tuple[int, ...], bool]]:
    """(path, part, layers, stacked) for every leaf of `params` (a nested dict of the model's
    parameters, arrays or abstract): `layers` the model layers the leaf holds (an unscanned block's
    one; a stacked block's, its stack's (`transformer.layer_stacks`); none outside the blocks), `stacked`
    whether the leaf holds them on its first axis. A leaf the map lacks is an error in the map, never
    skipped."""
    outside = name_map(cfg, arch)[1]
    stacks = {stack.name: stack for stack in transformer.layer_stacks(cfg)}
    maps = {name: name_map(stack.cfg, arch)[0] for name, stack in stacks.items()}
    stack_of = [stack for stack in stacks.values() for _ in range(stack.count)]  # each layer's
    for path, _ in leaves(params):
        if path[0] in stacks and cfg.scan_layers:
            stack = stacks[path[0]]
            yield path, maps[stack.name][path[1:]], tuple(range(stack.first, stack.first + stack.count)), True
        elif path[0] == "blocks":
            layer = int(path[1])
            yield path, maps[stack_of[layer].name][path[2:]], (layer,), False
        else:
            yield path, outside[path], (), False


def layer_parts(cfg, arch: str, path: tuple) -> dict[tuple, Part]:
    """The parts of one layer (keyed by the path inside a block) of the block at `path` (in the params
    tree: a stack's name first, or ('blocks', layer) unscanned): its stack's (`transformer.layer_stacks`)."""
    stacks = transformer.layer_stacks(cfg)
    if len(path) > 1 and isinstance(path[1], int):
        stack = [s for s in stacks for _ in range(s.count)][path[1]]
    else:
        stack = next(s for s in stacks if s.name == path[0])
    return name_map(stack.cfg, arch)[0]


def hf_tensors(params: dict, cfg, arch: str, dtype, *, to_host=np.asarray,
               build: bool = True) -> Iterator[tuple[str, np.ndarray | None]]:
    """Each Hugging Face tensor of `params` (the model `cfg`, as `arch` names and lays it out), in
    `dtype`, one at a time: the leaves of one tensor (every layer's) are read with `to_host` together
    and dropped before the next. `build=False` (a process that writes nothing) still reads each leaf,
    for reads that gather across processes, and yields None for the tensor."""
    by_tensor: dict[tuple[str, int | None], list] = {}  # each layer's own where the blocks are a list
    for path, part, layers, stacked in param_parts(params, cfg, arch):
        by_tensor.setdefault((part.hf, layers), []).append((path, part, layers, stacked))
    all_leaves = dict(leaves(params))
    for entries in by_tensor.values():
        host = {path: to_host(all_leaves[path]) for path, *_ in entries}
        _, part0, layers0, _ = entries[0]
        for i, name in enumerate(hf_names(part0, layers0)):
            values = {part: one_per_tensor(host[path], part, stacked)[i] for path, part, _, stacked in entries}
            yield name, hf_tensor(values, dtype) if build else None
        del host


def one_per_tensor(value: np.ndarray, part: Part, stacked: bool) -> np.ndarray:
    """A leaf as one array per Hugging Face tensor of it, in `hf_names`' order: its leading axes (the
    layers where `stacked`, the experts where `part` has them) flattened into one."""
    lead = int(stacked) + bool(part.experts)
    return value.reshape(-1, *value.shape[lead:]) if lead else value[None]


def leaves(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def hf_names(part: Part, layers: tuple[int, ...]) -> list[str]:
    """The Hugging Face tensors of one leaf: of each of its `layers` (`param_parts`), and within a layer of
    each expert."""
    if "{layer}" not in part.hf:
        return [part.hf]
    return [part.hf.format(layer=i, expert=e) for i in layers for e in range(part.experts or 1)]


def read_block(sources: list, part: Part, stacked: bool, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` of a leaf of `shape` from its Hugging Face tensors `sources` (sliceable, in
    `hf_names`' order): of each layer and expert the block covers, only its rows and columns
    (`read_slice`), stacked on the leaf's leading axes."""
    lead = int(stacked) + bool(part.experts)
    if not lead:
        return read_slice(sources[0], part, index)
    ranges = [range(size)[s] for size, s in zip(shape[:lead], index[:lead])]
    blocks = [read_slice(sources[int(np.ravel_multi_index(at, shape[:lead]))], part, index[lead:])
              for at in itertools.product(*ranges)]
    return np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape)


def read_slice(tensor, part: Part, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` (slices of jaxlm's dimensions of one layer) of `part`, read from `tensor`
    (anything sliceable like a safetensors slice or an array, shaped `part.hf_shape`): only the rows
    and columns that hold it are read."""
    view, kept = part.view, part.kept
    wanted = [slice(None)] * len(view)
    for dim, i in part.select:
        wanted[dim] = slice(i, i + 1)
    for target_dim, view_dim in enumerate(part.perm):
        wanted[kept[view_dim]] = index[target_dim]
    wanted = [s if isinstance(s, slice) else slice(s, s + 1) for s in wanted]
    wanted = [slice(*s.indices(size)) for s, size in zip(wanted, view)]
    reads, inner_slices, first = [], [], 0
    for group in part.groups:
        outer = wanted[first]
        inner = math.prod(group[1:])
        reads.append(slice(outer.start * inner, outer.stop * inner))
        inner_slices += [slice(None)] + wanted[first + 1:first + len(group)]
        first += len(group)
    block = np.asarray(tensor[tuple(reads)])
    shape = []
    for group, read in zip(part.groups, reads):
        shape += [(read.stop - read.start) // math.prod(group[1:]), *group[1:]]
    block = block.reshape(shape)[tuple(inner_slices)]
    block = block.reshape(tuple(size for i, size in enumerate(block.shape) if i in kept))
    return block.transpose(part.perm)


def hf_tensor(values: dict[Part, np.ndarray], dtype) -> np.ndarray:
    """The Hugging Face tensor made of `values` (each part's jaxlm-shaped array of one layer; all
    parts of the tensor, e.g. q, k and v of GPT-2's c_attn), in `dtype`."""
    parts = list(values)
    view = np.zeros(parts[0].view, dtype)
    for part, value in values.items():
        inverse = np.argsort(part.perm)
        block = np.asarray(value).transpose(inverse)  # the kept view dimensions, in view order
        index = [slice(None)] * len(part.view)
        for dim, i in part.select:
            index[dim] = i
        view[tuple(index)] = block.astype(dtype)
    return view.reshape(parts[0].hf_shape)


def peft_matrices(part: Part, in_axes: tuple[int, ...], a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A LoRA adapter of the kernel `part` maps (jaxlm: A [the kernel's input dims..., r], B [r, its
    output dims...]) as PEFT stores it for the Hugging Face Linear: lora_A.weight [r, in_features] and
    lora_B.weight [out_features, r], each side's dimensions flattened in the Hugging Face tensor's
    order. `in_axes`: the kernel's input dimensions (jaxlm order). A Linear weight is [out, in]."""
    if part.select or len(part.groups) != 2:
        raise UserError(f"{part.hf} is not one Linear weight (a fused or 1-D tensor): its adapters have no PEFT "
                        "form; export the run with --adapters=merge")
    kept = part.kept
    view_dim = [kept[p] for p in part.perm]  # jaxlm kernel dim t -> its view dimension
    out_group = set(range(len(part.groups[0])))  # view dims of the tensor's first dim: the outputs
    ins = sorted(in_axes, key=lambda t: view_dim[t])
    outs = sorted((t for t in range(len(view_dim)) if t not in in_axes), key=lambda t: view_dim[t])
    if any(view_dim[t] in out_group for t in ins) or any(view_dim[t] not in out_group for t in outs):
        raise UserError(f"{part.hf} is stored [in, out] (a Conv1D): its adapters are exported merged; "
                        "use --adapters=merge")
    a_in = [sorted(in_axes).index(t) for t in ins]  # A's leading dims, reordered as the tensor orders them
    a = np.asarray(a).transpose(*a_in, a.ndim - 1).reshape(-1, a.shape[-1])
    outs_sorted = sorted(t for t in range(len(view_dim)) if t not in in_axes)
    b_out = [1 + outs_sorted.index(t) for t in outs]
    b = np.asarray(b).transpose(0, *b_out).reshape(b.shape[0], -1)
    return a.T, b.T


# An MoE's experts as transformers (5 and later) holds them once loaded, whatever the checkpoint's layout:
# one module per layer (Mixtral's and Qwen3-MoE's `mlp.experts`) with two 3-D parameters, `gate_up_proj`
# [E, 2F, D] (each expert's gate rows, then its up rows) and `down_proj` [E, D, F], in the order the module
# registers them. PEFT adapts them as parameters (`target_parameters`: its `ParamWrapper`).
EXPERTS_MODULE = "mlp.experts"
FUSED_EXPERTS = {"gate_up_proj": ("expert_gate", "expert_up"), "down_proj": ("expert_down",)}


def peft_expert_matrices(adapters: dict[str, tuple[np.ndarray, np.ndarray, float]],
                         sizes: dict[str, int]) -> dict[str, tuple[np.ndarray, np.ndarray, int, float]]:
    """One layer's expert adapters (jaxlm: name -> (A [E, in, r], B [E, r, out], alpha / r)) as PEFT's
    adapters of the fused parameters (`FUSED_EXPERTS`): parameter -> (lora_A.weight [r' E, in], lora_B.weight
    [out, r' E], r', lora_alpha'), PEFT's per-expert layout (row e r' + k of lora_A and column k E + e of
    lora_B are expert e's k-th rank) and scale lora_alpha' / r'. gate_up_proj's adapter is gate's and up's
    side by side, rank r_gate + r_up, block-diagonal (each one's B on its own rows, zero on the other's:
    the same update, exactly); its scale is the first one's, the second's B rescaled to it. `sizes`:
    the outputs of each expert weight (F for gate and up), for the zero rows of one not adapted."""
    out = {}
    for param, names in FUSED_EXPERTS.items():
        present = [n for n in names if n in adapters]
        if not present:
            continue
        scale = adapters[present[0]][2]
        e = adapters[present[0]][0].shape[0]
        rank = sum(adapters[n][0].shape[-1] for n in present)
        a = np.concatenate([np.asarray(adapters[n][0]) for n in present], axis=-1)  # [E, in, r']
        b = np.zeros((e, rank, sum(sizes[n] for n in names)), np.float32)  # [E, r', out]
        r0, o0 = 0, 0
        for n in names:
            if n in adapters:
                la, lb, s = adapters[n]
                b[:, r0:r0 + la.shape[-1], o0:o0 + sizes[n]] = np.asarray(lb, np.float32) * (s / scale)
                r0 += la.shape[-1]
            o0 += sizes[n]
        lora_a = a.transpose(0, 2, 1).reshape(e * rank, -1)  # [E, r', in] -> [E r', in]
        lora_b = b.transpose(2, 1, 0).reshape(b.shape[2], rank * e)  # [out, r', E] -> [out, r' E]
        out[param] = (lora_a, lora_b, rank, scale * rank)
    return out
