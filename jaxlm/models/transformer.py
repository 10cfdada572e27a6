"""The decoder language model: one module for Llama-style and GPT-2-style variants.

A variant is a named bundle of component choices in `VARIANTS`; each component comes from its own
registry (`NORMS`, `jaxlm.models.mlps.MLPS`, `jaxlm.models.positions.POSITIONS`), each entry with its
own arithmetic, so a new variant or an ablation (say GELU in a Llama) is a config change, never an
if/elif on model names. Parameter count and training FLOPs per token are computed here from the
config alone, from what those entries declare.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import precision
from jaxlm import quant as quant_lib
from jaxlm.errors import UserError
from jaxlm.mesh import constrain
from jaxlm.models import aux, context_parallel, layers, pipeline_parallel, transforms
from jaxlm.models.attention import (
    CACHE_AXES,
    IMPLEMENTATIONS,
    KVCache,
    cache_dtype,
    packed_layout_supported,
    select_implementation,
)
from jaxlm.models.mlps import MLPS, MoESpec
from jaxlm.models.mlps import moe as moe_lib
from jaxlm.models.positions import POSITIONS
from jaxlm.section import Section, check, check_choice, setting


@dataclasses.dataclass(frozen=True)
class Variant:
    norm: str
    mlp: str
    position: str
    use_bias: bool  # biases everywhere: q, k, v, o, the MLP, the norms
    qkv_bias: bool = False  # biases on q, k and v only
    qk_norm: bool = False  # an RMSNorm on each head's queries and keys (`layers.Attention`)


VARIANTS: dict[str, Variant] = {
    "llama": Variant(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False),
    "qwen2": Variant(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, qkv_bias=True),
    "qwen3": Variant(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, qk_norm=True),
    "gpt2": Variant(norm="layernorm", mlp="gelu", position="learned", use_bias=True),
}
NORMS = {cls.name: cls for cls in (layers.RMSNorm, layers.LayerNorm)}


def _fused_attention_saveable(prim, *_, **__) -> bool:
    """cuDNN's fused attention forward (its output and softmax statistics): a matmul pair, saved with
    the dots rather than recomputed (recomputing it adds FLOPs the model's count leaves out)."""
    return prim.name.startswith("dot_product_attention_fwd")


_both = jax.checkpoint_policies.save_from_both_policies
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # the matmuls' outputs saved (fused attention's too), the elementwise work between them recomputed; the
    # attention's rotated inputs saved by name in place of the q and k projections (layers.ATTENTION_INPUTS)
    "dots": _both(_both(jax.checkpoint_policies.dots_saveable, _fused_attention_saveable),
                  jax.checkpoint_policies.save_only_these_names(layers.FP8_OPERANDS, layers.ATTENTION_INPUTS)),
    # dots, and the MLP's hidden activation (the down projection's input: layers.MLP_HIDDEN) kept rather than
    # recomputed: one [B, T, F] tensor per layer more memory, less elementwise work in the backward pass
    "dots_mlp": _both(_both(jax.checkpoint_policies.dots_saveable, _fused_attention_saveable),
                      jax.checkpoint_policies.save_only_these_names(layers.FP8_OPERANDS, layers.ATTENTION_INPUTS,
                                                                    layers.MLP_HIDDEN)),
    "dots_no_batch": _both(_both(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _fused_attention_saveable),
                           jax.checkpoint_policies.save_only_these_names(layers.ATTENTION_INPUTS)),
}
ROPE_SCALING_KEYS = ("rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_max_len", "rope_beta_fast", "rope_beta_slow")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# model.scan_unroll=0 unrolls every layer only up to this many (the deepest open models have 126 or fewer);
# a deeper stack is a loop, whose compile time does not grow with its depth.
UNROLL_AUTO_MAX = 128
MATMUL_IMPLS = ("auto", *layers.CONTRACTIONS)  # config.model.matmul (`ModelConfig.from_config` resolves auto)


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """The model as a recipe states it (`config.model`): a variant, the components that override its
    choices, the sizes, and how it computes; 0, -1 and "" mean the default, which `ModelConfig.from_config`
    resolves."""

    section: ClassVar[str] = "model"
    variant: str = setting("llama", "a name in jaxlm.models.transformer.VARIANTS")
    norm: str = setting("", "rmsnorm | layernorm")
    mlp: str = setting("", 'a name in jaxlm.models.mlps.MLPS (swiglu, gelu, ...); "" = the variant\'s')
    position: str = setting("", "rope | learned")
    use_bias: int = setting(-1, "-1 = the variant's choice, 0 = no biases, 1 = biases")
    qkv_bias: int = setting(-1, "biases on q, k, v alone (Qwen2): -1 = the variant's choice, 0 or 1")
    qk_norm: int = setting(
        -1,
        "an RMSNorm over each head's queries and keys, after their projections and before RoPE (Qwen3): "
        "-1 = the variant's choice, 0 or 1")
    vocab_size: int = setting(2048, "tokens in the vocabulary; linked to data.tokenizer_vocab_size")
    d_model: int = setting(256, "the residual stream's width")
    n_layers: int = setting(4, "decoder blocks")
    n_heads: int = setting(4, "query heads")
    n_kv_heads: int = setting(0, "0 = n_heads (no grouping)")
    head_dim: int = setting(0, "0 = d_model // n_heads")
    mlp_dim: int = setting(
        0,
        "0 = the MLP's default width (its class's `default_dim`: 8/3 d rounded up to 256 for SwiGLU)")
    max_seq_len: int = setting(
        256,
        "the longest sequence (learned positions: the table's rows); linked to data.seq_len")
    tie_embeddings: bool = setting(False, "the unembedding is the token embedding's transpose")
    norm_eps: float = setting(1e-05, "added to the norms' variance")
    rope_theta: float = setting(10000.0, "RoPE's base wavelength")
    rope_scaling: str = setting(
        "none",
        "Context extension of RoPE: none | linear (frequencies / rope_factor) | llama3 (Llama 3.1's: long "
        "wavelengths / rope_factor, short ones kept, blended between, around rope_original_max_len) | yarn "
        "(YaRN's NTK-by-parts, as transformers computes it: frequencies turning more than rope_beta_fast times over "
        "rope_original_max_len kept, fewer than rope_beta_slow times / rope_factor, a ramp between; cos and sin "
        "times 0.1 ln(rope_factor) + 1)")
    rope_factor: float = setting(1.0, "rope_scaling's stretch of the context")
    rope_low_freq_factor: float = setting(
        1.0,
        "llama3: wavelengths above original_max_len / this are divided by rope_factor")
    rope_high_freq_factor: float = setting(4.0, "llama3: wavelengths below original_max_len / this are kept")
    rope_original_max_len: int = setting(0, "llama3, yarn: the context length the model was trained with")
    rope_beta_fast: float = setting(
        32.0, "yarn: frequencies turning more than this many times over rope_original_max_len are kept")
    rope_beta_slow: float = setting(
        1.0, "yarn: frequencies turning fewer than this many times over rope_original_max_len are / rope_factor")
    init_std: float = setting(
        0.02,
        "the weights' initial standard deviation (residual projections: scaled down with depth)")
    dropout: float = setting(0.0, "on the embedding and each block's residual branches, in training")
    dtype: str = setting(
        "auto",
        "compute dtype of matmuls and activations; auto = bfloat16 where the device computes it natively "
        "(TPUs, GPUs of compute capability 8.0+, CPUs with AVX512_BF16, AMX or Arm BF16), float32 on other "
        "CPUs, float16 with dynamic loss scaling on older GPUs (jaxlm.precision)")
    param_dtype: str = setting("float32", "parameters and optimizer state: float32 | bfloat16 | float16")
    scan_layers: bool = setting(True, "one stacked block run by a scan (fast to compile); false: a list of blocks")
    scan_unroll: int = setting(
        0,
        "Layers per iteration of the layer scan (its parameters stay stacked either way): 0 = auto (all of "
        "them on a CPU or GPU without remat, up to 128 layers, which runs faster unrolled: benchmarks/BENCHMARKS.md; "
        "else 1: a loop, whose buffers XLA reuses from layer to layer)")
    remat: str = setting("none", "none | full | dots | dots_mlp | dots_no_batch")
    attention: str = setting(
        "auto",
        "auto (cudnn on GPU, splash on TPU, blocked on CPU, else xla) | xla | blocked (causal blocks: no matmuls "
        "above the diagonal blocks, a FlashAttention-2 backward; plain XLA) | cudnn | pallas (Triton flash "
        "attention) | splash (Pallas TPU splash attention; interpreted off a TPU)")
    context_attention: str = setting(
        "allgather",
        "Attention across a sequence split over mesh.context > 1 (context parallelism, "
        "jaxlm.models.context_parallel): allgather (each device keeps its queries and all-gathers the keys and "
        "values of the whole sequence) | ring (keys and values passed around the axis, one chunk a step, an "
        "online softmax across the steps: a chunk's keys and values in memory instead of the sequence's; each "
        "step's blocks by cuDNN's flash kernel under model.attention=cudnn, else by XLA's einsums)")
    context_layout: str = setting(
        "balanced",
        "Which positions each device holds under mesh.context > 1: balanced (the zig-zag assignment: chunks i "
        "and 2c-1-i of 2c, equal causal attention work on every device; data.seq_len a multiple of 2 x "
        "mesh.context) | contiguous (device i the i-th of c chunks: the last device does the most work)")
    attention_segments: int = setting(
        16,
        "cuDNN attention on Hopper GPUs (compute capability 9.0+) takes packed documents in its packed "
        "layout, compiled for at most this many documents per row; a batch with a row of more takes the "
        "masked kernel (same result, slower). 0: always the document mask "
        "(jaxlm.models.attention.cudnn_packed_attention)")
    matmul: str = setting(
        "auto",
        "The projections' matmuls: auto (accumulate on a CPU, in bfloat16 or float32 compute; else xla) | xla "
        "(jnp.einsum as XLA compiles it) | accumulate (float32 accumulation made explicit, with its own "
        "gradients: on a CPU, the form XLA runs natively in bfloat16, and the faster step in float32 too; "
        "jaxlm.models.layers.accumulating_einsum) | fp8 (float8 operands with per-tensor scales, e4m3 "
        "forward, e5m2 gradients: jaxlm.models.layers.fp8_einsum; GPUs of compute capability 8.9+, emulated "
        "on a CPU)")
    loss_chunk_len: int = setting(
        0,
        "Make the logits and the loss this many positions at a time (0 = the whole sequence at once): only "
        "[batch, loss_chunk_len, vocab] float32 logits are ever alive, instead of [batch, seq_len, vocab].")
    moe_experts: int = setting(8, "model.mlp=moe: experts in each MoE layer, each a SwiGLU of model.mlp_dim hidden units")
    moe_top_k: int = setting(2, "model.mlp=moe: experts each token is routed to")
    moe_shared_experts: int = setting(
        0, "model.mlp=moe: shared experts every token goes through, as one SwiGLU of this many x mlp_dim units")
    moe_router: str = setting(
        "topk_softmax",
        "model.mlp=moe: topk_softmax (the top k logits softmaxed: Mixtral, Qwen3-MoE) | softmax_topk (a softmax "
        "over all experts, the top k as they are: Switch, OLMoE) | sigmoid (DeepSeek-V3's scores with a "
        "per-expert bias on the choice) (jaxlm.models.mlps.moe)")
    moe_impl: str = setting(
        "auto",
        "model.mlp=moe: how tokens reach their experts: auto (tokamax on GPUs where installed, else capacity: "
        "measured, jaxlm.models.mlps.moe.resolve_impl) | ragged (dropless: sorted by expert, jax.lax.ragged_dot, "
        "which jax 0.10 runs as a masked dense dot: E x the routed FLOPs) | tokamax (ragged with tokamax's "
        "grouped GEMM: the routed FLOPs on GPUs; the cuda12 extra) | dense (dropless: every expert on every "
        "token, E/k x the FLOPs) | capacity (at most moe_capacity_factor x the balanced share per expert, the "
        "rest dropped and counted)")
    moe_capacity_factor: float = setting(1.25, "model.mlp=moe, moe_impl=capacity: each expert's room, x its balanced share")
    moe_ep: str = setting(
        "auto",
        "model.mlp=moe with mesh.expert > 1: how rows reach the experts on other devices: auto (alltoall for "
        "capacity, gather for the dropless dispatches) | alltoall (GShard's: each row's [E, C, D] capacity buffers "
        "sent to their experts' devices and back; moe_impl=capacity only) | gather (every device along the axis "
        "gathers all their rows, runs its experts, reduce-scatters the outputs) (jaxlm.models.mlps.moe.dispatch)")
    moe_aux_loss: float = setting(
        0.01, "model.mlp=moe: the load-balancing loss's coefficient (Switch/GShard form; 0 = off, still reported)")
    moe_z_loss: float = setting(0.0, "model.mlp=moe: the router z-loss's coefficient (ST-MoE; 0 = off, still reported)")
    moe_dense_layers: int = setting(
        0,
        "model.mlp=moe: the first this many layers dense, a SwiGLU of model.moe_dense_dim units in place of the "
        "experts (DeepSeek-V3's first_k_dense_replace; Qwen3-MoE's mlp_only_layers of the first layers)")
    moe_dense_dim: int = setting(
        0, "model.mlp=moe: the dense layers' SwiGLU width (0 = the SwiGLU's default for model.d_model)")
    moe_bias_rate: float = setting(
        0.001,
        "model.mlp=moe, moe_router=sigmoid: after each step every expert's choice bias moves this much towards "
        "balance (up if its load was under its share, down if over: DeepSeek-V3's gamma; 0 = fixed)")

    def validate(self) -> None:
        key = self.key
        check_choice(key("variant"), self.variant, sorted(VARIANTS))
        check_choice(key("norm"), self.norm, sorted(NORMS), allow_empty=True)
        check_choice(key("mlp"), self.mlp, sorted(MLPS), allow_empty=True)
        check_choice(key("position"), self.position, sorted(POSITIONS), allow_empty=True)
        check(self.use_bias in (-1, 0, 1), key("use_bias"), self.use_bias, "-1 (variant's choice), 0 or 1")
        check(self.qkv_bias in (-1, 0, 1), key("qkv_bias"), self.qkv_bias, "-1 (variant's choice), 0 or 1")
        check(self.qk_norm in (-1, 0, 1), key("qk_norm"), self.qk_norm, "-1 (variant's choice), 0 or 1")
        check_choice(key("rope_scaling"), self.rope_scaling, layers.ROPE_SCALINGS)
        if self.rope_scaling != "none":
            check(self.rope_factor > 0, key("rope_factor"), self.rope_factor, "a positive number")
        if self.rope_scaling in ("llama3", "yarn"):
            check(self.rope_original_max_len > 0, key("rope_original_max_len"), self.rope_original_max_len,
                  f"the context length the model was trained with, a positive integer (rope_scaling={self.rope_scaling} "
                  f"needs it)")
        if self.rope_scaling == "llama3":
            check(self.rope_high_freq_factor > self.rope_low_freq_factor > 0, key("rope_high_freq_factor"),
                  self.rope_high_freq_factor, f"a number above model.rope_low_freq_factor={self.rope_low_freq_factor} > 0")
        if self.rope_scaling == "yarn":
            check(self.rope_beta_fast > self.rope_beta_slow > 0, key("rope_beta_fast"), self.rope_beta_fast,
                  f"a number above model.rope_beta_slow={self.rope_beta_slow} > 0 (YaRN's defaults: 32 and 1)")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            check(getattr(self, name) > 0, key(name), getattr(self, name), "a positive integer")
        for name in ("n_kv_heads", "head_dim", "mlp_dim"):
            check(getattr(self, name) >= 0, key(name), getattr(self, name), "a positive integer, or 0 for the default")
        if self.head_dim == 0:
            check(self.d_model % self.n_heads == 0, key("d_model"), self.d_model,
                  f"a multiple of model.n_heads={self.n_heads} (or set model.head_dim)")
        kv = self.n_kv_heads or self.n_heads
        check(self.n_heads % kv == 0, key("n_kv_heads"), self.n_kv_heads, f"a divisor of model.n_heads={self.n_heads}")
        check(0.0 <= self.dropout < 1.0, key("dropout"), self.dropout, "a number in [0, 1)")
        check(self.init_std > 0, key("init_std"), self.init_std, "a positive number")
        check_choice(key("dtype"), self.dtype, ("auto", *DTYPES))
        check_choice(key("param_dtype"), self.param_dtype, tuple(DTYPES))
        check_choice(key("remat"), self.remat, ("none", *REMAT_POLICIES))
        check_choice(key("attention"), self.attention, ("auto", *IMPLEMENTATIONS))
        check_choice(key("matmul"), self.matmul, MATMUL_IMPLS)
        check_choice(key("context_attention"), self.context_attention, context_parallel.STRATEGIES)
        check_choice(key("context_layout"), self.context_layout, context_parallel.LAYOUTS)
        check(self.attention_segments >= 0, key("attention_segments"), self.attention_segments,
              "0 (the document mask) or the most documents per row cuDNN's packed layout is compiled for")
        check(self.scan_unroll >= 0, key("scan_unroll"), self.scan_unroll, "0 (auto) or a positive number of layers")
        if self.mlp == "moe":
            check(self.moe_experts >= 2, key("moe_experts"), self.moe_experts, "at least 2 experts")
            check(1 <= self.moe_top_k <= self.moe_experts, key("moe_top_k"), self.moe_top_k,
                  f"between 1 and model.moe_experts={self.moe_experts}")
            check(self.moe_shared_experts >= 0, key("moe_shared_experts"), self.moe_shared_experts,
                  "0 or a positive number")
            check_choice(key("moe_router"), self.moe_router, moe_lib.ROUTERS)
            check_choice(key("moe_impl"), self.moe_impl, ("auto", *moe_lib.IMPLS))
            if self.moe_impl == "tokamax" and not moe_lib.tokamax_available():
                raise UserError(moe_lib.TOKAMAX_MISSING)
            check_choice(key("moe_ep"), self.moe_ep, ("auto", *moe_lib.EP_PATHS))
            check(self.moe_ep != "alltoall" or self.moe_impl in ("capacity", "auto"), key("moe_ep"), self.moe_ep,
                  f"auto or gather with model.moe_impl={self.moe_impl} (the all-to-all exchanges capacity's "
                  f"fixed-size buffers: set model.moe_impl=capacity)")
            check(self.moe_capacity_factor > 0, key("moe_capacity_factor"), self.moe_capacity_factor,
                  "a positive number")
            for name in ("moe_aux_loss", "moe_z_loss", "moe_bias_rate"):
                check(getattr(self, name) >= 0, key(name), getattr(self, name), "0 (off) or a positive coefficient")
            check(0 <= self.moe_dense_layers < self.n_layers, key("moe_dense_layers"), self.moe_dense_layers,
                  f"0 or more, fewer than model.n_layers={self.n_layers} (at least one layer with experts)")
            check(self.moe_dense_dim >= 0, key("moe_dense_dim"), self.moe_dense_dim, "0 (the default width) or more")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model's resolved hyperparameters: variant defaults applied, no zeros meaning 'default'."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_seq_len: int
    norm: str = "rmsnorm"
    mlp: str = "swiglu"
    position: str = "rope"
    use_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm on each head's queries and keys, before RoPE (Qwen3)
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | linear | llama3 | yarn (layers.rope_frequencies)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    init_std: float = 0.02
    dropout: float = 0.0
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    scan_layers: bool = True
    scan_unroll: int = 1  # layers per iteration of the layer scan (config.model.scan_unroll, resolved)
    # Pipeline parallelism (config.pipeline, with mesh.stage stages; jaxlm.models.pipeline_parallel): 1 stage = none
    pipeline_stages: int = 1
    pipeline_microbatches: int = 1
    pipeline_repeats: int = 1
    remat: str = "none"
    # The logits and the loss this many positions at a time (0 = the whole sequence: `steps.summed_loss`)
    loss_chunk_len: int = 0
    # The projections' contraction (`layers.CONTRACTIONS`; config.model.matmul, `from_config` resolving auto to
    # accumulate, float32 accumulation made explicit, on every CPU): xla | accumulate | fp8
    matmul: str = "xla"
    attention: str = "xla"  # a concrete kernel; 'auto' is resolved before the model is built
    # How attention spans a sequence split over mesh.context, and which positions each device holds
    # (config.model.context_attention, context_layout: `jaxlm.models.context_parallel`)
    context_attention: str = "allgather"
    context_layout: str = "balanced"
    # cuDNN's packed layout for packed documents, at most this many per row (0: the document mask instead);
    # config.model.attention_segments where the kernel is cuDNN on a GPU that takes it, else 0 (`from_config`)
    attention_segments: int = 0
    # Projections of one input run as one matmul where they can (q, k and v: `layers.project_qkv`; an MLP's gate
    # and up: `layers.project_gate_up`): everywhere but on TPUs (`from_config`), where XLA:TPU's layouts of the
    # joined outputs cost more in copies than the joined matmul saves (benchmarks/BENCHMARKS.md)
    joint_projections: bool = True
    # The model's transforms (`jaxlm.models.transforms`), None when absent: LoRA adapters (config.lora,
    # `with_lora`), quantized or fake-quantized weights (QLoRA's base, a compressed model, QAT:
    # `with_lora`, `with_compress`) and pruning masks (config.compress.sparsity, `with_compress`)
    lora: transforms.LoRA | None = None
    quantized: transforms.Quantized | None = None
    pruned: transforms.Pruned | None = None
    # The Mixture-of-Experts settings (config.model.moe_*), read by the MoE MLP alone (model.mlp=moe)
    moe: MoESpec = MoESpec()

    @property
    def residual_init_std(self) -> float:
        return layers.residual_init_std(self.init_std, self.n_layers)

    @property
    def transforms(self) -> tuple:
        """The model's transforms, in the order they compose."""
        return tuple(t for t in (self.lora, self.quantized, self.pruned) if t is not None)

    @property
    def stored_quant(self) -> quant_lib.QuantSpec | None:
        """The format the quantized weights are stored in (None: none are, also under QAT)."""
        return self.quantized.stored if self.quantized is not None else None

    @property
    def contraction(self) -> layers.Contraction:
        """How the projections (and the tied unembedding) multiply, with what it asks of the planner and the step."""
        return layers.CONTRACTIONS[self.matmul]

    @property
    def einsum_op(self) -> layers.EinsumOp:
        return self.contraction.einsum

    def projection(self, name: str, equation: str, shape: tuple[int, ...], names: tuple, **kwargs) -> layers.Projection:
        """A projection called `name` (wq, w_down, unembed, ...): a plain `layers.Projection`, or the class of
        the transforms this model gives it (`jaxlm.models.transforms`: a quantized, fake-quantized or masked
        kernel, a LoRA adapter), with the model's contraction. `kwargs`: init, dtype, param_dtype, rngs."""
        parts, extra = set(), {}
        for transform in self.transforms:
            more, arguments = transform.parts(name)
            parts |= more
            extra.update(arguments)
        cls = transforms.projection_class(frozenset(parts))
        return cls(equation, shape, names, einsum_op=self.einsum_op, **extra, **kwargs)

    @classmethod
    def from_config(cls, m, platform: str | None = None, *, attention: str | None = None, log_choice: bool = True,
                    lora=None, compress=None, **overrides) -> ModelConfig:
        """From `config.model` (an ml_collections ConfigDict or dict), applying the variant's choices;
        with `lora` (the `config.lora` section), its adapters (`with_lora`; without it, none); with
        `compress` (the `config.compress` section), its quantized or pruned projections (`with_compress`).

        The attention kernel (`attention`, default `m["attention"]`) is resolved for `platform`
        (default: JAX's backend) by `attention.select_implementation`, which logs its choice unless
        `log_choice` is false; `m["matmul"]='auto'` too (accumulating dots on a CPU, whatever the compute dtype), and
        `m["scan_unroll"]=0` (every layer unrolled on a CPU or GPU without remat, a loop elsewhere)."""
        variant = VARIANTS[m["variant"]]
        mlp = m["mlp"] or variant.mlp
        head_dim = m["head_dim"] or m["d_model"] // m["n_heads"]
        fields = dict(
            vocab_size=m["vocab_size"],
            d_model=m["d_model"],
            n_layers=m["n_layers"],
            n_heads=m["n_heads"],
            n_kv_heads=m["n_kv_heads"] or m["n_heads"],
            head_dim=head_dim,
            mlp_dim=m["mlp_dim"] or MLPS[mlp].default_dim(m["d_model"]),
            max_seq_len=m["max_seq_len"],
            norm=m["norm"] or variant.norm,
            mlp=mlp,
            position=m["position"] or variant.position,
            use_bias=variant.use_bias if m["use_bias"] == -1 else bool(m["use_bias"]),
            qkv_bias=variant.qkv_bias if m.get("qkv_bias", -1) == -1 else bool(m["qkv_bias"]),
            qk_norm=variant.qk_norm if m.get("qk_norm", -1) == -1 else bool(m["qk_norm"]),
            tie_embeddings=m["tie_embeddings"],
            norm_eps=m["norm_eps"],
            rope_theta=m["rope_theta"],
            **{key: m[key] for key in ROPE_SCALING_KEYS if key in m},
            init_std=m["init_std"],
            dropout=m["dropout"],
            dtype=DTYPES.get(m["dtype"]),  # None for "auto": resolved for the platform below
            param_dtype=DTYPES[m["param_dtype"]],
            scan_layers=m["scan_layers"],
            remat=m["remat"],
            loss_chunk_len=m.get("loss_chunk_len", 0),
            context_attention=m.get("context_attention", "allgather"),
            context_layout=m.get("context_layout", "balanced"),
        )
        platform = platform or jax.default_backend()
        fields["moe"] = MoESpec.from_model(m, platform)
        fields.update(overrides)
        if fields["dtype"] is None:  # model.dtype=auto (jaxlm.precision)
            capability = precision.compute_capability() if platform == "gpu" and jax.default_backend() == "gpu" else None
            fields["dtype"] = DTYPES[precision.auto_dtype(platform, capability)[0]]
        matmul = m.get("matmul", "auto")
        if matmul == "auto":
            matmul = "accumulate" if platform == "cpu" else "xla"
        fields["matmul"] = matmul
        if fields["dtype"] == jnp.float16 and platform == "cpu" and jax.default_backend() == "cpu":
            precision.check_float16(platform)
        if matmul == "fp8" and platform == "gpu" and jax.default_backend() == "gpu":
            precision.check_fp8(platform, precision.compute_capability())
        # auto: unrolled on a CPU or GPU, unless remat asks to save memory (an unrolled program keeps more
        # alive). On GPUs the loop's per-layer copies in and out of the stacked buffers and its host-side
        # launches go, for a faster step in less memory (measured: benchmarks/BENCHMARKS.md). Past
        # UNROLL_AUTO_MAX layers, a loop: XLA's compile time grows with the layers unrolled.
        unroll_all = platform in ("cpu", "gpu") and fields["remat"] == "none" and m["n_layers"] <= UNROLL_AUTO_MAX
        fields["scan_unroll"] = min(m.get("scan_unroll", 0) or (m["n_layers"] if unroll_all else 1), m["n_layers"])
        fields["attention"] = select_implementation(attention or m["attention"], platform, dtype=fields["dtype"],
                                                    head_dim=head_dim, log_choice=log_choice)
        fields["attention_segments"] = packed_attention_segments(m, fields["attention"], platform)
        fields.setdefault("joint_projections", platform != "tpu")
        cfg = cls(**fields)
        if lora is not None:
            cfg = with_lora(cfg, lora)
        return cfg if compress is None else with_compress(cfg, compress)


def packed_attention_segments(m, implementation: str, platform: str) -> int:
    """config.model.attention_segments where cuDNN's packed layout applies (the cuDNN kernel on a GPU of
    compute capability 9.0+; for compile-only GPU devices, `jaxlm.roofline`'s Hopper targets), else 0."""
    segments = int(m.get("attention_segments", 0))
    if implementation != "cudnn" or platform != "gpu" or segments <= 0:
        return 0
    if jax.default_backend() == "gpu" and not packed_layout_supported(precision.compute_capability()):
        return 0
    return segments


def _lora_ranks(text: str) -> dict[str, int]:
    """`config.lora.ranks` ("wq:16,w_down:4") -> {"wq": 16, "w_down": 4}."""
    out = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, _, rank = entry.partition(":")
        try:
            out[name.strip()] = int(rank)
        except ValueError:
            out[name.strip()] = 0
        if out[name.strip()] <= 0:
            raise UserError(f"config.lora.ranks={text!r}: {entry!r} is not name:rank with a positive rank "
                            f"(e.g. 'wq:16,w_down:4')")
    return out


def with_lora(cfg: ModelConfig, lora) -> ModelConfig:
    """`cfg` with the adapters a `config.lora` section asks for (rank, alpha, targets, ranks, dropout;
    a ConfigDict or dict). Target names are the projections' attribute names (`projection_names`);
    "all" is every one but the unembedding. A name the model has no projection of is a UserError
    listing those it has."""
    rank, ranks = int(lora["rank"]), _lora_ranks(lora["ranks"])
    quantize = lora.get("quantize_base", "") or ""
    base = None if not quantize else transforms.Quantized(
        quant_lib.QuantSpec(quantize, int(lora.get("quant_group", 64)), bool(lora.get("double_quant", False))),
        targets=tuple(n for n in projection_names(cfg) if n != "unembed"))
    off = dict(lora=None, quantized=base)
    if rank <= 0:
        if ranks:
            raise UserError(f"config.lora.ranks={lora['ranks']!r} needs config.lora.rank > 0 (the rank of the "
                            f"other targets); set lora.rank")
        if quantize:
            raise UserError(f"config.lora.quantize_base={quantize!r} needs config.lora.rank > 0 (QLoRA: adapters "
                            f"train over the frozen 4-bit base); set lora.rank, or lora.quantize_base=''")
        return dataclasses.replace(cfg, **off)
    if quantize:
        check_quant_groups(dataclasses.replace(cfg, **off), "config.lora.quant_group")
    names = projection_names(cfg)
    requested = [t.strip() for t in lora["targets"].split(",") if t.strip()]
    targets = []
    for name in requested:
        targets += [n for n in names if n != "unembed"] if name == "all" else [name]
    unknown = [t for t in dict.fromkeys(targets) if t not in names]
    if unknown and unknown[0] in MLPS[cfg.mlp].weight_shapes(cfg):  # an MoE's router: no Projection
        raise UserError(f"config.lora.targets={lora['targets']!r}: {unknown[0]!r} is a weight of the "
                        f"model.mlp={cfg.mlp} layer, not a projection, and adapters on it are not built; this "
                        f"model's projections: {', '.join(names)}, or 'all' (every one but unembed)")
    if unknown or not targets:
        raise UserError(f"config.lora.targets={lora['targets']!r}: "
                        f"{repr(unknown[0]) + ' is not a projection of this model' if unknown else 'names nothing'}; "
                        f"its projections: {', '.join(names)}, or 'all' (every one but unembed)")
    outside = [n for n in ranks if n not in targets]
    if outside:
        raise UserError(f"config.lora.ranks={lora['ranks']!r}: {outside[0]!r} is not among config.lora.targets="
                        f"{lora['targets']!r}; add it to the targets, or drop its rank")
    adapters = transforms.LoRA(rank=rank, alpha=float(lora["alpha"]), targets=tuple(dict.fromkeys(targets)),
                               ranks=tuple(sorted(ranks.items())), dropout=float(lora["dropout"]))
    return dataclasses.replace(cfg, **{**off, "lora": adapters})


@functools.lru_cache(maxsize=32)
def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model `cfg` describes, built abstractly (shapes only: nothing allocated, no device touched)."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))


def _plain(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without adapters or quantization (the projections' names and kernels are the same)."""
    return dataclasses.replace(cfg, lora=None, quantized=None, pruned=None, attention="xla")


def projection_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The attribute names of the model's projections (`layers.Projection`: wq, ..., w_down, unembed),
    sorted, from an abstract build (nothing allocated, no device touched)."""
    return tuple(sorted({path[-1] for path, _ in layers.projections(abstract_model(_plain(cfg)))}))


def check_quant_groups(cfg: ModelConfig, key: str) -> None:
    """Each quantized projection's grouped axis (its kernel's last input axis; the embedding's width)
    takes `cfg.quantized.spec.group` values per scale (a shorter axis is one group, a longer one that
    the group does not divide ends with a short group, `quant.group_size`): UserError naming the weight
    and the config `key` where the packing refuses the axis or the group (an odd one at 4 bits)."""
    spec, targets = cfg.quantized.spec, cfg.quantized.targets
    axes = [(f"projection {path[-1]}", p.kernel_shape[p.quant_axis], p.kernel_names[p.quant_axis])
            for path, p in layers.projections(abstract_model(_plain(cfg))) if path[-1] in targets]
    if "embed" in targets:
        axes.append(("the token embedding (embed)", cfg.d_model, "embed"))
    for weight, size, name in axes:
        try:
            quant_lib.group_size(spec, size)
        except ValueError as e:
            group = min(spec.group, size) if spec.group else size
            fix = ("use an even group" if spec.bits == 4 and size % 2 == 0 and group % 2 else
                   f"use a group that divides {size} or is a multiple of 8" if spec.bits == 3 and size % 8 == 0 else
                   "choose a format that takes this width (int8 takes any)")
            raise UserError(f"{key}={spec.group}: {weight} is grouped along its {name!r} axis "
                            f"and {e} ({spec.format}); {fix}") from None


def resolve_targets(cfg: ModelConfig, text: str, key: str) -> tuple[str, ...]:
    """Weight names from comma-separated names or shell patterns (`w_*`): the projections' and `embed`
    (the token embedding, quantized only); "blocks" = every projection of the blocks (all but the
    embedding and the unembedding). A pattern that matches none is a UserError naming `key`. An MoE's
    expert projections are not among them (compress's methods take a matrix per projection, not one per
    expert: not built; QLoRA's lora.quantize_base quantizes them); a pattern naming one is a UserError."""
    experts = MLPS[cfg.mlp].expert_shapes(cfg)
    names = (*(n for n in projection_names(cfg) if n not in experts), "embed")
    out = []
    for pattern in (t.strip() for t in text.split(",") if t.strip()):
        matched = ([n for n in names if n not in ("embed", "unembed")] if pattern == "blocks"
                   else fnmatch.filter(names, pattern))
        if not matched and fnmatch.filter(experts, pattern):
            raise UserError(f"{key}={text!r}: {pattern!r} names the MoE's expert projections, which compression "
                            f"does not take (not built; lora.quantize_base quantizes them for QLoRA); leave them out")
        if not matched:
            raise UserError(f"{key}={text!r}: {pattern!r} matches no weight of this model; its weights: "
                            f"{', '.join(names)}, or 'blocks' (every projection but unembed)")
        out += matched
    if not out:
        raise UserError(f"{key}={text!r} names nothing; give weight names or patterns, e.g. 'blocks' or 'wq,w_*'")
    return tuple(sorted(dict.fromkeys(out)))


def with_compress(cfg: ModelConfig, c) -> ModelConfig:
    """`cfg` with the structure a `config.compress` section gives its targets: quantized kernels
    (`compress.quantize`, stored, or fake-quantized in training with `compress.qat`) and pruning masks
    (`compress.sparsity` > 0)."""
    quantize, sparsity = c["quantize"] or "", float(c["sparsity"])
    if not quantize and sparsity <= 0:
        return cfg
    if quantize and cfg.quantized is not None:
        raise UserError(f"config.compress.quantize={quantize!r} and config.lora.quantize_base="
                        f"{cfg.quantized.spec.format!r} both "
                        f"quantize the base; keep one (a compressed run with LoRA adapters keeps its own format: "
                        f"set lora.quantize_base='')")
    targets = resolve_targets(cfg, c["targets"], "config.compress.targets")
    fields: dict[str, Any] = {}
    if quantize:
        fields["quantized"] = transforms.Quantized(
            quant_lib.QuantSpec(quantize, int(c["group"]), False, bool(c["symmetric"])), targets, fake=bool(c["qat"]))
    if sparsity > 0:
        if "embed" in targets:
            raise UserError(f"config.compress.targets={c['targets']!r} names embed with config.compress.sparsity="
                            f"{sparsity:g}: the token embedding can be quantized, not pruned (a pruned row is a token "
                            f"lost); leave embed out of the targets")
        fields["pruned"] = transforms.Pruned(targets)
    out = dataclasses.replace(cfg, **fields)
    if quantize:
        check_quant_groups(out, "config.compress.group")
    return out


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        norm = NORMS[cfg.norm]
        kw = dict(eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, use_bias=cfg.use_bias, rngs=rngs)
        self.dropout_rate = cfg.dropout
        self.attn_norm = norm(cfg.d_model, **kw)
        self.attn = layers.Attention(cfg, rngs=rngs)
        self.mlp_norm = norm(cfg.d_model, **kw)
        self.mlp = MLPS[cfg.mlp](cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, dropout_key, cache: KVCache | None = None):
        """[B, T, D] -> [B, T, D]; with a cache (decoding), also the cache holding this chunk's keys."""
        x, cache, _ = self._forward(x, positions, segment_ids, dropout_key, cache)
        return x if cache is None else (x, cache)

    def with_aux(self, x, positions, segment_ids, dropout_key) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the block's output, its auxiliary outputs: an `aux.Aux` keyed by `Transformer.aux_names`)."""
        x, _, out = self._forward(x, positions, segment_ids, dropout_key, None)
        return x, out

    def _forward(self, x, positions, segment_ids, dropout_key, cache):
        k1, k2 = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        # The adapters' dropout keys (LoRA), apart from the residual dropout's.
        adapter_keys = layers.split_keys(None if dropout_key is None else jax.random.fold_in(dropout_key, 1), 2)
        attn = self.attn(self.attn_norm(x), positions, segment_ids, cache, dropout_key=adapter_keys[0])
        if cache is not None:
            attn, cache = attn
        x = x + layers.dropout(attn, self.dropout_rate, k1)
        y = self.mlp(self.mlp_norm(x), adapter_keys[1])
        y, out = y if self.mlp.aux_names else (y, {})  # an MLP with auxiliary outputs returns (y, them)
        x = x + layers.dropout(y, self.dropout_rate, k2)
        x = constrain(x, ("act_batch", "act_seq", "act_embed"))
        return x, cache, aux.as_float32(out)


# An MLP of the dense first layers of an MoE (model.moe_dense_layers): the experts' own kind
DENSE_MLP = "swiglu"


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Consecutive layers of one kind. Under model.scan_layers the model holds each stack as one stacked
    block, the attribute `name` (its weights with a leading layers axis); unrolled, every layer's block is
    in one list, `blocks`, in layer order (its index is the layer's number)."""

    name: str
    first: int  # its first layer's number in the model
    count: int
    cfg: ModelConfig  # its blocks' settings


# The model's layer stacks, in layer order: an MoE's dense first layers (when asked), then the layers of the
# model's own MLP. Every layer of a stack has the same parameters' shapes, so a stack is scanned or pipelined
# as one; a second kind of layer is a second stack.
STACKS = ("dense_blocks", "blocks")


def layer_number(cfg: ModelConfig, path: tuple, index: int | None = None) -> int | None:
    """The model layer of a parameter at `path` in the params tree (keys, as `jax.tree_util` paths give them
    or plain): an unrolled block's ('blocks', i, ...) is layer i; a stacked block's (a stack's name first),
    whose leading axis holds its layers, is its stack's first layer plus `index` (that axis's index);
    None outside the blocks."""
    keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
    if not keys or keys[0] not in STACKS:
        return None
    if len(keys) > 1 and isinstance(keys[1], int):
        return keys[1]
    first = next(s.first for s in layer_stacks(cfg) if s.name == keys[0])
    return None if index is None else first + index


def stack_params(params: dict, cfg: ModelConfig, stack: LayerStack) -> Any:
    """The parameters of one stack's layers in a params tree (a pure dict: `nnx.to_pure_dict`, or the
    state's): its stacked block, or (unrolled) its blocks of the list."""
    if cfg.scan_layers:
        return params[stack.name]
    blocks = params["blocks"]
    return [blocks[i] for i in range(stack.first, stack.first + stack.count)]


def layer_stacks(cfg: ModelConfig) -> tuple[LayerStack, ...]:
    """The model's stacks of layers (`STACKS`), each with its blocks' config: the dense first layers of an
    MoE (model.moe_dense_layers: a `DENSE_MLP` of model.moe_dense_dim units), then the model's own."""
    dense = cfg.moe.dense_layers if cfg.mlp == "moe" else 0
    main = LayerStack("blocks", dense, cfg.n_layers - dense, cfg)
    if not dense:
        return (main,)
    return LayerStack("dense_blocks", 0, dense, dataclasses.replace(cfg, mlp=DENSE_MLP, mlp_dim=cfg.moe.dense_dim)), main


def add_adapters(block: Block, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    """LoRA adapters on the block's projections that `cfg.lora` names (`transforms.Adapted`)."""
    for path, projection in list(layers.projections(block)):
        if isinstance(projection, transforms.Adapted):
            projection.add_adapter(cfg.lora.rank_of(path[-1]), cfg.lora.alpha, rngs=rngs, dropout=cfg.lora.dropout)


def _stacked_blocks(stack: LayerStack, rngs: nnx.Rngs) -> Block:
    """One stacked Block of a stack's layers, its weights with a leading 'layers' axis, run by a scan."""

    @nnx.split_rngs(splits=stack.count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs):
        block = Block(stack.cfg, rngs=rngs)
        add_adapters(block, stack.cfg, rngs)  # each layer's stream: its base weights first, then adapters
        return block

    return make_blocks(rngs)


def _pipelined_block(x, block, key, positions, segment_ids):
    """One block as a pipeline stage runs it: positions and segment ids are its micro-batch's."""
    return block.with_aux(x, positions, segment_ids, key)


def _remat(fn, policy: str, scanned: bool):
    """`fn` rematerialized under `policy`. Inside a scan XLA cannot merge the recomputation with the
    forward, so CSE may stay on (fewer barriers); unrolled, it must be prevented, or XLA merges the two
    and the policy saves nothing."""
    if policy == "none":
        return fn
    return nnx.remat(fn, policy=REMAT_POLICIES[policy], prevent_cse=not scanned)


class Transformer(nnx.Module):
    """Decoder-only LM: tokens [B, T] -> logits [B, T, vocab] in the compute dtype."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = layers.Embed(
            cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs,
            quant=cfg.quantized.stored_of("embed") if cfg.quantized else None,
            qat=cfg.quantized.fake_of("embed") if cfg.quantized else None, einsum_op=cfg.einsum_op,
        )
        if cfg.position == "learned":
            self.pos_embed = layers.make_param(
                rngs, layers.normal(cfg.init_std), (cfg.max_seq_len, cfg.d_model), (None, "embed"), cfg.param_dtype
            )
        if cfg.scan_layers:  # each stack one stacked Block (`STACKS`)
            for stack in layer_stacks(cfg):
                setattr(self, stack.name, _stacked_blocks(stack, rngs))
        else:  # a list of every layer's block, in layer order, whatever its stack
            self.blocks = nnx.List([Block(stack.cfg, rngs=rngs) for stack in layer_stacks(cfg) for _ in range(stack.count)])
        self.final_norm = NORMS[cfg.norm](
            cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, use_bias=cfg.use_bias, rngs=rngs
        )
        if not cfg.tie_embeddings:
            self.unembed = cfg.projection(
                "unembed", "btd,dv->btv", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                init=layers.normal(cfg.init_std), dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs,
            )
        # LoRA adapters, drawn after every base weight, so that these are the same with or without
        # adapters (one seed, one base model). The unembedding's (when lora.targets names it) has no dropout.
        if not cfg.scan_layers:
            for block, block_cfg in zip(self.blocks, (s.cfg for s in layer_stacks(cfg) for _ in range(s.count))):
                add_adapters(block, block_cfg, rngs)
        if not cfg.tie_embeddings and isinstance(self.unembed, transforms.Adapted):
            self.unembed.add_adapter(cfg.lora.rank_of("unembed"), cfg.lora.alpha, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int
        positions: jax.Array | None = None,  # [B, T], restarting at 0 in each packed document
        segment_ids: jax.Array | None = None,  # [B, T], 0 = padding
        dropout_key: jax.Array | None = None,  # dropout is active only when a key is given
        cache: KVCache | None = None,  # decoding: keys and values of earlier tokens (see `init_cache`)
        last_only: bool = False,  # logits of the last position only, [B, 1, vocab] (a prefill needs no more)
        hidden: bool = False,  # the final normed hidden states [B, T, D] instead of logits (see `logits`)
        with_aux: bool = False,  # also the blocks' auxiliary outputs (`aux`), training only
    ) -> jax.Array | tuple[jax.Array, KVCache] | tuple[jax.Array, aux.Aux]:
        """Logits; with a `cache`, (logits, the cache with this chunk's keys and values added); with
        `with_aux`, (logits, the blocks' auxiliary outputs summed over the layers: `jaxlm.models.aux`).

        With a cache, `tokens` is the next chunk of every row (the prompts at prefill, one token per
        decode step), written at the cache's `index`; `positions` must then be given, and
        `segment_ids` is unused (the cache's `start` masks each row's left padding).
        """
        cfg = self.cfg
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        # Under context parallelism the blocks see the sequence in the layout's order, each token with its own
        # position and document; the final hidden states come back in the sequence's order (below)
        layout = cfg.context_layout if cache is None else "contiguous"
        tokens, positions, segment_ids = (context_parallel.to_layout(a, layout) for a in (tokens, positions, segment_ids))
        x = self.embed_tokens(tokens, positions)
        keys = None
        if dropout_key is not None and (cfg.dropout > 0 or (cfg.lora is not None and cfg.lora.dropout > 0)):
            dropout_key, embed_key = jax.random.split(dropout_key)
            x = layers.dropout(x, cfg.dropout, embed_key)
            keys = jax.random.split(dropout_key, cfg.n_layers)

        def run_block(x, block, key):
            return block.with_aux(x, positions, segment_ids, key)

        run_block = _remat(run_block, cfg.remat, cfg.scan_layers and cfg.scan_unroll == 1)
        if cache is not None:
            if with_aux:
                raise ValueError("auxiliary outputs are for training: decoding with a cache has none")
            x, cache = self._blocks_with_cache(x, positions, cache)
        elif cfg.pipeline_stages > 1:
            x, out = pipeline_parallel.run(self.pipeline_schedule, self.blocks, x, positions, segment_ids, keys,
                                           _remat(_pipelined_block, cfg.remat, True), aux_shapes=self.aux_shapes)
        elif cfg.scan_layers:
            for stack in layer_stacks(cfg):  # the last stack's blocks are the model's MLP's, whose outputs these are
                stack_keys = None if keys is None else keys[stack.first:stack.first + stack.count]
                x, out = self._scan_stack(stack, x, stack_keys, run_block)
        else:
            outs = []
            for i, block in enumerate(self.blocks):
                x, layer_out = run_block(x, block, None if keys is None else keys[i])
                outs.append(layer_out)
            outs = outs[layer_stacks(cfg)[-1].first:]  # the layers of the model's MLP (not an MoE's dense first ones)
            out = aux.over_layers({name: jnp.stack([o[name] for o in outs]) for name in self.aux_shapes})
        x = context_parallel.from_layout(x, layout)
        if last_only:
            x = x[:, -1:]
        x = self.final_norm(x)
        result = x if hidden else self.logits(x)
        if cache is not None:
            return result, cache
        return (result, out) if with_aux else result

    def _scan_stack(self, stack: LayerStack, x: jax.Array, keys: jax.Array | None, run_block):
        """x through one stack's stacked block, scanned: (x, the blocks' auxiliary outputs over its layers)."""

        @nnx.scan(
            in_axes=(nnx.Carry, 0, None if keys is None else 0),
            out_axes=(nnx.Carry, 0),
            unroll=min(self.cfg.scan_unroll, stack.count),
            transform_metadata={nnx.PARTITION_NAME: "layers"},
        )
        def scan_blocks(x, block, key):
            return run_block(x, block, key)

        x, per_layer = scan_blocks(x, getattr(self, stack.name), keys)
        return x, aux.over_layers(per_layer)

    @property
    def aux_names(self) -> tuple[str, ...]:
        """The auxiliary outputs its blocks return (`jaxlm.models.aux`): its MLP's."""
        return MLPS[self.cfg.mlp].aux_names

    @property
    def aux_shapes(self) -> aux.Shapes:
        """Each auxiliary output's shape as the model returns it: a layer's, or [n_layers, ...] kept per layer."""
        return aux_shapes(self.cfg)

    @property
    def pipeline_schedule(self) -> pipeline_parallel.Schedule:
        c = self.cfg
        return pipeline_parallel.Schedule(c.pipeline_stages, c.pipeline_microbatches, c.pipeline_repeats)

    def embed_tokens(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Tokens [B, T] -> the first block's input [B, T, D]: the embedding (and learned positions)."""
        x = self.embed(tokens)
        if self.cfg.position == "learned":
            x = x + jnp.take(layers.gathered(self.pos_embed[...].astype(self.cfg.dtype)), positions, axis=0)
        return constrain(x, ("act_batch", "act_seq", "act_embed"))

    def logits(self, x: jax.Array) -> jax.Array:
        """Final hidden states [B, T, D] -> logits [B, T, vocab]: the unembedding (or the tied embedding)."""
        x = layers.tensor_parallel_entry(x)  # vocab-parallel: the sequence whole, as in the blocks
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = self.unembed(x)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab"))

    def _blocks_with_cache(self, x: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The blocks in order, each reading and writing its layer of the cache; then advance `index`."""
        if self.cfg.scan_layers:
            start = cache  # its index and start, the same for every layer

            # The stacked cache rides in the carry: each layer updates its slice in place.
            def run_block(carry, block, layer):
                x, k, v = carry
                x, c = block(x, positions, None, None, start._replace(k=k, v=v, layer=layer))
                return x, c.k, c.v

            for stack in layer_stacks(self.cfg):
                scan_blocks = nnx.scan(run_block, in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry,
                                       unroll=min(self.cfg.scan_unroll, stack.count),
                                       transform_metadata={nnx.PARTITION_NAME: "layers"})
                layer_numbers = jnp.arange(stack.first, stack.first + stack.count, dtype=jnp.int32)
                x, k, v = scan_blocks((x, cache.k, cache.v), getattr(self, stack.name), layer_numbers)
                cache = cache._replace(k=k, v=v)
        else:
            for i, block in enumerate(self.blocks):
                x, cache = block(x, positions, None, None, cache._replace(layer=i))
        return x, cache._replace(index=cache.index + x.shape[1], layer=0)


def aux_shapes(cfg: ModelConfig) -> aux.Shapes:
    """The model's auxiliary outputs' shapes (`Transformer.aux_shapes`), from the config alone."""
    layers_with = layer_stacks(cfg)[-1].count  # the model's MLP's layers (an MoE's: not its dense first ones)
    return {name: (layers_with, *shape) if aux.by_layer(name) else shape
            for name, shape in MLPS[cfg.mlp].aux_shapes(cfg).items()}


def init_cache(cfg: ModelConfig, batch: int, length: int, start: jax.Array) -> KVCache:
    """An empty cache of `length` slots for `batch` rows whose prompts begin at slots `start` [B]."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    zeros = constrain(jnp.zeros(shape, cache_dtype(cfg.dtype)), CACHE_AXES)
    return KVCache(k=zeros, v=zeros, index=jnp.zeros((), jnp.int32), start=jnp.asarray(start, jnp.int32), layer=0)


# ----------------------------------------------------------------------------- size and cost


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by group, from the config alone (equal to the built model's count; tested). A
    quantized kernel counts as the weights it stands for, its scales not at all (`quant.count`), so
    QLoRA's model has the count of the same model unquantized."""
    d, n, k, h, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    norm = NORMS[cfg.norm].params(d, cfg.use_bias)
    attn = sum(i * o for i, o in _attention_shapes(cfg).values())
    if cfg.use_bias or cfg.qkv_bias:
        attn += h * (n + 2 * k)
    if cfg.use_bias:
        attn += d
    if cfg.qk_norm:
        attn += 2 * layers.RMSNorm.params(h, False)  # the queries' and the keys' norms, shared by the heads
    layer_params = sum(stack.count * (attn + MLPS[stack.cfg.mlp].params(stack.cfg) + 2 * norm)
                       for stack in layer_stacks(cfg))
    counts = {
        "embedding": v * d,
        "positions": POSITIONS[cfg.position].params(cfg.max_seq_len, d),
        "layers": layer_params,
        "final_norm": norm,
        "unembedding": 0 if cfg.tie_embeddings else d * v,
        "lora": lora_param_count(cfg),
    }
    counts["total"] = sum(counts.values())
    return counts


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a token goes through: all of them but the experts it is not routed to (an MoE's;
    the total for a dense model). What peers report as an MoE's active size."""
    return param_count(cfg)["total"] - sum(stack.count * MLPS[stack.cfg.mlp].unrouted_params(stack.cfg)
                                           for stack in layer_stacks(cfg))


def _attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each of the attention's projections."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return {"wq": (d, n * h), "wk": (d, k * h), "wv": (d, k * h), "wo": (n * h, d)}


def layer_projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """(inputs, outputs) of each projection of a block: the attention's and the MLP's; (experts, inputs,
    outputs) of an MoE's expert projections."""
    return {**_attention_shapes(cfg), **MLPS[cfg.mlp].projection_shapes(cfg), **MLPS[cfg.mlp].expert_shapes(cfg)}


def lora_param_count(cfg: ModelConfig) -> int:
    """The LoRA adapters' parameters: rank x (inputs + outputs) of each adapted projection."""
    if cfg.lora is None:
        return 0
    stacks = layer_stacks(cfg)
    return sum(cfg.lora.param_count(layer_projection_shapes(stack.cfg), stack.count,
                                    None if cfg.tie_embeddings or stack is not stacks[-1] else (cfg.d_model, cfg.vocab_size))
               for stack in stacks)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every layer's attention and MLP (an MoE: the experts a
    token is routed to, its router and shared experts: the active weights) plus the unembedding."""
    attention = sum(i * o for i, o in _attention_shapes(cfg).values())
    return (sum(stack.count * (attention + MLPS[stack.cfg.mlp].matmul_params(stack.cfg)) for stack in layer_stacks(cfg))
            + cfg.d_model * cfg.vocab_size)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward = 3x forward), without rematerialization.

    Forward: 2 FLOPs per matmul weight, plus causal attention: QK^T and AV cost 2 * 2 * T * N * H per
    token for the full T x T square, half of that with the causal mask. Total:
        6 * matmul_params + 6 * n_layers * seq_len * n_heads * head_dim.

    Checked against XLA (tests/test_flops.py): the dots of the compiled train step sum exactly to
    this plus the masked half of attention, which XLA computes anyway (the full T x T square);
    `cost_analysis()['flops']` adds 1-5% of elementwise work (norms, softmax, loss, optimizer, CPU
    bf16 converts) on small models, less on wider ones.
    """
    attention = 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6 * matmul_params(cfg) + attention
