"""The config schema: every default in one place, command-line overrides, validation, derived values.

A recipe (`configs/<name>.py`) defines `get_config()` that starts from `base_config()` and changes
what differs. Every key is overridable as `--config.a.b=value`. `validate` runs before any device
work and raises `UserError` with one line naming the key, the value and what is allowed.
`derive` computes every value that follows from the config and the device count, in one place.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from jaxlm import init_from, loss_scale, quant
from jaxlm import mesh as mesh_lib
from jaxlm import section as section_lib
from jaxlm.axes import MESH_AXES, MeshShape, describe, sizes_of
from jaxlm.checkpoint import CheckpointConfig
from jaxlm.data import sft, sources, tokenizer
from jaxlm.energy import EnergyConfig
from jaxlm.errors import UserError, in_user_file, run_user_file
from jaxlm.metrics import MetricsConfig
from jaxlm.models import attention, layers, transformer  # registries of variants and components
from jaxlm.models.mlps import MLPS
from jaxlm.models.pipeline_parallel import PipelineConfig
from jaxlm.optim import OptimConfig

# The sections owned by their components as typed dataclasses (`jaxlm.section`), by name
SECTIONS = {cls.name: cls for cls in (
    CheckpointConfig, EnergyConfig, MetricsConfig, OptimConfig, PipelineConfig)}

# Where the recipes live (configs/ beside the package, in an editable install or a checkout).
RECIPES_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"

MATMUL_IMPLS = ("auto", "xla", "accumulate", "fp8")


def default_rules() -> ml_collections.ConfigDict:
    """Logical axis name -> mesh axes ("" = replicated, "a,b" = sharded over both)."""
    return ml_collections.ConfigDict(
        {
            # weights
            "vocab": "tensor",  # the vocabulary axis of the embedding and the unembedding
            "embed": "fsdp",  # the residual stream's width in every weight
            "mlp": "tensor",  # the MLP's hidden units
            "heads": "tensor",  # query heads
            "kv_heads": "tensor",  # key and value heads
            "head_dim": "",  # each head's width
            "norm": "",  # the norms' weights and the residual-width biases
            "layers": "stage",  # the stacked layers: split into pipeline stages (jaxlm.models.pipeline_parallel)
            "lora_rank": "",  # the rank dimension of LoRA adapters: small, never sharded
            # optimizer state: mesh axes Adam's moments are split over beyond their parameter's ("data" = ZeRO-1)
            "opt_state": "",
            # activations
            "act_batch": "data,fsdp",  # the rows of a batch
            "act_seq": "",  # "tensor" = sequence parallelism between the tensor-parallel regions
            "act_embed": "",  # the residual stream's width
            "act_heads": "tensor",  # query heads (attention runs per head)
            "act_kv_heads": "tensor",  # key and value heads
            "act_mlp": "tensor",  # the MLP's hidden activation
            "act_vocab": "tensor",  # the logits' vocabulary axis
            "act_stage": "stage",  # the pipeline's per-stage activations
        }
    )


def base_config() -> ml_collections.ConfigDict:
    """The base recipe: every key jaxlm knows, with its default. Recipes derive from this."""
    c = ml_collections.ConfigDict()
    seq_len = config_dict.FieldReference(256)
    vocab_size = config_dict.FieldReference(2048)

    c.run = dict(
        name="",  # run directory under output_dir; "" = the recipe's name. An existing run there is resumed
        fresh=False,  # true: move an existing run directory aside (kept, renamed) and start over
        output_dir="runs",  # where run directories live (run.name under it)
        seed=0,  # the parameters' initialization and dropout (the data order is data.seed)
        steps=1000,  # optimizer steps
        log_every=10,  # a console line and a metrics.jsonl entry every N steps
        eval_every=0,  # 0 = only at the end
        peak_flops=0.0,  # peak FLOP/s of one device for MFU; 0 = from the table of known devices
        compile_cache_dir=".cache/jaxlm/xla",  # XLA's persistent compilation cache: restarts skip compiling; "" = off
        # "--xla_name=value ..." added to XLA_FLAGS before JAX starts (checked first); "" = XLA's defaults
        xla_flags="",
        # Fine-tuning: a run directory (config.json, tokenizer file, checkpoints/) whose parameters a NEW run
        # starts from (step 0, fresh optimizer and data; a resumed run ignores it). Its architecture (every
        # model key but init_from.COMPUTE_MODEL_KEYS) and tokenizer replace the recipe's. "" = random init
        init_from="",
        init_step=-1,  # run.init_from's checkpoint to read; -1 = the newest that loads (verified)
    )
    c.model = dict(
        variant="llama",  # a name in jaxlm.models.transformer.VARIANTS
        # Components; "" takes the variant's choice, a name overrides it (for ablations).
        norm="",  # rmsnorm | layernorm
        mlp="",  # a name in jaxlm.models.mlps.MLPS (swiglu, gelu, ...); "" = the variant's
        position="",  # rope | learned
        use_bias=-1,  # -1 = the variant's choice, 0 = no biases, 1 = biases
        qkv_bias=-1,  # biases on q, k, v alone (Qwen2): -1 = the variant's choice, 0 or 1
        vocab_size=vocab_size,  # tokens in the vocabulary; linked to data.tokenizer_vocab_size
        d_model=256,  # the residual stream's width
        n_layers=4,  # decoder blocks
        n_heads=4,  # query heads
        n_kv_heads=0,  # 0 = n_heads (no grouping)
        head_dim=0,  # 0 = d_model // n_heads
        mlp_dim=0,  # 0 = the MLP's default width (its class's `default_dim`: 8/3 d rounded up to 256 for SwiGLU)
        max_seq_len=seq_len,  # the longest sequence (learned positions: the table's rows); linked to data.seq_len
        tie_embeddings=False,  # the unembedding is the token embedding's transpose
        norm_eps=1e-5,  # added to the norms' variance
        rope_theta=10000.0,  # RoPE's base wavelength
        # Context extension of RoPE: none | linear (frequencies / rope_factor) | llama3 (Llama 3.1's: long
        # wavelengths / rope_factor, short ones kept, blended between, around rope_original_max_len)
        rope_scaling="none",
        rope_factor=1.0,  # rope_scaling's stretch of the context
        rope_low_freq_factor=1.0,  # llama3: wavelengths above original_max_len / this are divided by rope_factor
        rope_high_freq_factor=4.0,  # llama3: wavelengths below original_max_len / this are kept
        rope_original_max_len=0,  # llama3: the context length the model was trained with
        init_std=0.02,  # the weights' initial standard deviation (residual projections: scaled down with depth)
        dropout=0.0,  # on the embedding and each block's residual branches, in training
        # compute dtype of matmuls and activations; auto = bfloat16 where the device computes it natively (CPUs, TPUs,
        # GPUs of compute capability 8.0+), float16 with dynamic loss scaling on older GPUs (jaxlm.precision)
        dtype="auto",
        param_dtype="float32",  # parameters and optimizer state: float32 | bfloat16 | float16
        scan_layers=True,  # one stacked block run by a scan (fast to compile); false: a list of blocks
        # Layers per iteration of the layer scan (its parameters stay stacked either way): 0 = auto (all of them
        # on a CPU or GPU without remat, which runs faster unrolled: benchmarks/BENCHMARKS.md; else 1: a loop,
        # whose buffers XLA reuses from layer to layer)
        scan_unroll=0,
        remat="none",  # none | full | dots | dots_mlp | dots_no_batch
        # auto (cudnn on GPU, blocked on CPU, else xla) | xla | blocked (causal blocks: no matmuls above the
        # diagonal blocks, a FlashAttention-2 backward; plain XLA) | cudnn | pallas (Triton flash attention)
        attention="auto",
        # cuDNN attention on Hopper GPUs (compute capability 9.0+) takes packed documents in its packed layout,
        # compiled for at most this many documents per row; a batch with a row of more takes the masked kernel
        # (same result, slower). 0: always the document mask (jaxlm.models.attention.cudnn_packed_attention)
        attention_segments=16,
        # The projections' matmuls: auto (accumulate on a CPU with bfloat16 compute, else xla) | xla (jnp.einsum
        # as XLA compiles it) | accumulate (float32 accumulation made explicit, with its own gradients: on a
        # CPU, the form XLA runs natively in bfloat16: a step 1.4x faster; jaxlm.models.layers.accumulating_einsum)
        # | fp8 (float8 operands with per-tensor scales, e4m3 forward, e5m2 gradients: jaxlm.models.layers.fp8_einsum;
        # GPUs of compute capability 8.9+, emulated on a CPU)
        matmul="auto",
        # Make the logits and the loss this many positions at a time (0 = the whole sequence at once):
        # only [batch, loss_chunk_len, vocab] float32 logits are ever alive, instead of [batch, seq_len, vocab].
        loss_chunk_len=0,
    )
    c.data = dict(
        # 'builtin' (the Python standard library's source files, read at run time, never downloaded),
        # 'builtin_chat' (600 short conversations shipped in the package, for SFT: jaxlm/data/builtin_chat.py),
        # or files, directories and globs, comma-separated: .txt/.md (text), .jsonl[.gz], .parquet.
        corpus="builtin",
        # auto (by extension; chat for builtin_chat) | text | jsonl | parquet | hf, or supervised fine-tuning
        # rows of JSONL / Parquet files: chat ({"messages": [{"role", "content"}, ...]}, loss on the assistant's
        # turns) | prompt_completion ({"prompt", "completion"}, loss on the completion and EOS)
        format="auto",
        # data.format=chat: the Jinja template conversations are rendered with. "" = the tokenizer's own
        # (a Hugging Face tokenizer_config.json's), chatml, simple ("### User:" headers, EOS after each
        # answer: for tokenizers without chat tokens, such as one trained here), or a .jinja file
        chat_template="",
        text_field="text",  # jsonl field / parquet column with the text
        separator="",  # text files: "" = one document per file, else split on it (e.g. "\n\n")
        builtin_max_bytes=8_000_000,  # corpus=builtin: read at most this many bytes of the files
        tokenizer_path="",  # "" = train one on the corpus (cached in cache_dir), else a .model file
        tokenizer_train_bytes=100_000_000,  # train the tokenizer on the corpus's first this-many bytes
        val_fraction=0.01,  # documents held out (by a hash of their text) for validation
        val_tokens=65_536,  # the fixed held-out set: the first this-many validation tokens
        seq_len=seq_len,  # tokens per training row; linked to model.max_seq_len
        global_batch_size=32,  # sequences per optimizer step, over all devices
        tokenizer_type="bpe",  # bpe | unigram | char | byte
        tokenizer_vocab_size=vocab_size,  # the trained tokenizer's vocabulary; linked to model.vocab_size
        cache_dir=".cache/jaxlm",  # the tokenizer and the prepared (tokenized) corpus, keyed by their inputs
        num_workers=0,  # grain worker processes (0 = in the main process)
        # The global batch is read as this many independent streams (each a slice of the documents and
        # global_batch_size / shards rows of every batch); each process reads the streams its rows come
        # from. 0 = one per process when the run starts (so the batches follow the process count); a
        # resumed run keeps its count whatever its process count. Any fixed count gives the same batches
        # on 1 process or many; a multiple of every process count you will use (e.g. 8) also spares
        # each process reading rows it drops.
        shards=0,
        # false: tokenize the corpus once into cached token shards (any size; the fastest reads).
        # true: keep the raw documents in host memory and tokenize them in the pipeline (in the
        # workers), with no prepare step: for small corpora and tokenizer ablations.
        tokenize_on_the_fly=False,
        verify_shards=False,  # check every prepared shard's sha256 at start (reads all data); sizes are always checked
        on_damaged_shard="stop",  # a truncated or corrupt shard: 'stop' with its name, or 'skip' it with a warning
        seed=0,  # the order of the documents (shuffling) and of the train/validation split's hash
    )
    c.optim = OptimConfig.defaults()
    # LoRA adapters (jaxlm.lora): y = x W + (alpha / rank) (x A) B on the targeted projections, A random and
    # B zero at the start. With adapters, an empty optim.trainable trains the adapters alone (type:LoRAParam).
    c.lora = dict(
        rank=0,  # the adapters' rank; 0 = no adapters
        alpha=16.0,  # the adapters' update is scaled by alpha / rank (PEFT's lora_alpha)
        # comma-separated projection names (wq wk wv wo, w_gate w_up w_down or w_in w_out, unembed);
        # "all" = every projection but the unembedding
        targets="wq,wk,wv,wo",
        ranks="",  # ranks of single targets, overriding lora.rank: "wq:16,w_down:4"; "" = lora.rank for all
        dropout=0.0,  # dropout on the adapters' input in training (not on the unembedding's)
        # QLoRA (needs lora.rank > 0): every block projection's frozen kernel (all but the unembedding, adapted
        # or not) stored in 4 bits and dequantized in the step: "" (off) | nf4 (QLoRA's NormalFloat4) | int4
        # (symmetric, levels -7..7 of absmax / 7). jaxlm.quant states the error bounds.
        quantize_base="",
        # values per scale (their absmax), along each kernel's last input axis: an axis shorter than this is
        # one group; a longer one must be a multiple of it (else an error naming the projection). Even.
        quant_group=64,
        double_quant=False,  # the scales themselves in int8 (blocks of 256, a float32 each): ~0.37 bits/weight less
    )
    # Compressed models (python -m jaxlm.compress; jaxlm.quant, jaxlm.compress.prune): the structure of the targeted
    # projections as a compressed run stores it, how the command makes it, and the same in training
    # (quantization-aware training, gradual pruning).
    c.compress = dict(
        # comma-separated weight names or shell patterns (wq, w_*, unembed, embed); "blocks" = every projection
        # of the blocks (the embedding and the unembedding stay in full precision unless named; the embedding,
        # a lookup table, is quantized by round to nearest along its width and never pruned)
        targets="blocks",
        quantize="",  # "" (off) | int8 | int4 | int3 | nf4: the targets' kernels as packed integer codes + scales
        group=128,  # values per scale along each kernel's last input axis; 0 = one scale per output channel
        symmetric=True,  # False: asymmetric integers (a scale and a zero point per group)
        # training: the targets keep float kernels, fake-quantized to compress.quantize in the forward pass with a
        # straight-through gradient; python -m jaxlm.compress (method rtn) then writes the integer model
        qat=False,
        method="rtn",  # how python -m jaxlm.compress quantizes: rtn (round to nearest) | gptq (Frantar et al. 2022)
        gptq_damp=0.01,  # GPTQ: this fraction of the Hessian's mean diagonal added to its diagonal
        gptq_block=128,  # GPTQ: columns quantized between two lazy batch updates
        act_order=True,  # GPTQ: columns in order of decreasing Hessian diagonal (the groups' scales stay contiguous)
        sparsity=0.0,  # the fraction of the targets' weights pruned to zero; 0 = no pruning
        pattern="unstructured",  # unstructured | N:M (e.g. 2:4: N of every M consecutive input weights kept)
        criterion="magnitude",  # what is pruned: the smallest |W| (magnitude) or |W| x input norm (wanda)
        scope="layer",  # unstructured magnitude pruning: per matrix (layer) or over all targets at once (global)
        calib_samples=128,  # calibration sequences (GPTQ, Wanda)
        calib_seq_len=2048,  # their length (at most model.max_seq_len)
        calib_corpus="",  # the calibration text (data.corpus's syntax); "" = the run's own training data
        # gradual pruning while training (Zhu and Gupta 2017): the sparsity rises from 0 at prune_start to
        # compress.sparsity at prune_end as 1 - (1 - t)^3, the masks recomputed every prune_every steps
        prune_start=0,
        prune_end=0,  # 0 = no gradual pruning (the masks stay as the run's checkpoint holds them)
        prune_every=100,  # steps between two recomputations of the masks
    )
    c.checkpoint = CheckpointConfig.defaults()  # jaxlm.checkpoint owns the section (a typed one)
    c.metrics = MetricsConfig.defaults()
    c.energy = EnergyConfig.defaults()
    c.profile = dict(
        steps="",  # "start:end": a jax.profiler trace of steps start..end (both included) in <run dir>/profile
    )
    c.mesh = {axis: -1 if axis == "fsdp" else 1 for axis in MESH_AXES}  # -1 = the devices left over
    # "host": data across hosts, fsdp (and tensor) within each host; "process": the same per process.
    # Sets data and fsdp from the run's layout (mesh.data and mesh.fsdp are then ignored); "" = off.
    c.mesh.hybrid = ""
    c.mesh.rules = default_rules()
    c.pipeline = PipelineConfig.defaults()
    return c


# ----------------------------------------------------------------------------- loading


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_recipe(name_or_path: str) -> ml_collections.ConfigDict:
    """Load `configs/<name>.py` (or any path), optionally `path:arg`, and return its locked config."""
    name, _, arg = str(name_or_path).partition(":")
    path = pathlib.Path(name)
    if not path.suffix:
        path = RECIPES_DIR / f"{name}.py"
    if not path.is_file():
        raise UserError(
            f"--config: no recipe file {str(path)!r}; give a path to a .py file "
            f"or one of: {', '.join(recipe_names())}"
        )
    module = run_user_file(path, f"jaxlm_recipe_{path.stem}")
    if not hasattr(module, "get_config"):
        raise UserError(f"--config: {path} defines no get_config(); a recipe must return a ConfigDict from it")
    try:
        cfg = module.get_config(arg) if arg else module.get_config()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- the recipe's own code failed
        raise in_user_file(e, path) from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise UserError(f"--config: {path}: get_config() returned a {type(cfg).__name__}, not a ConfigDict")
    with cfg.unlocked():
        cfg.run.recipe = path.stem
    cfg.lock()
    return cfg


def recipe(name: str, **overrides: Any) -> ml_collections.ConfigDict:
    """Load a recipe and apply `a__b=value` overrides, validated: the library entry for notebooks."""
    cfg = load_recipe(name)
    pairs = [(k.replace("__", "."), v) for k, v in overrides.items()]
    apply_overrides(cfg, pairs)
    resolve_init_from(cfg, pairs)
    validate(cfg)
    return cfg


def run_dir_path(cfg: ml_collections.ConfigDict) -> pathlib.Path:
    """`output_dir/name`; the name defaults to the recipe's, so re-running a command resumes its run."""
    return pathlib.Path(cfg.run.output_dir) / (cfg.run.name or cfg.run.recipe)


def resolve_init_from(cfg: ml_collections.ConfigDict, overrides: Sequence[tuple[str, Any]] = ()) -> None:
    """With `run.init_from`: the source run's architecture and tokenizer, in place (`jaxlm.init_from`);
    `overrides` (the command line's) may repeat the source's values but never contradict them."""
    if cfg.run.init_from:
        init_from.resolve_config(cfg, overrides, base_config().model, run_dir_path(cfg))


# ----------------------------------------------------------------------------- overrides


def _parse_value(key: str, value: Any, current: Any) -> Any:
    """Parse a command-line string to the type of the field it overrides (`1e3` is a fine int)."""
    expected = type(current)
    if isinstance(value, str) and expected is not str:
        if expected is bool:
            value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
                value.lower(), value
            )
        elif expected in (int, float):
            try:
                number = float(value.replace("_", ""))
                value = int(number) if expected is int and number.is_integer() else number
            except ValueError:
                pass
        else:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                pass
    if expected is float and type(value) is int:
        value = float(value)
    if type(value) is not expected:
        names = {bool: "a bool (true or false)", int: f"an integer (e.g. {current})", float: f"a number (e.g. {current})"}
        raise UserError(f"--config.{key}={value}: expected {names.get(expected, 'a ' + expected.__name__)}")
    return value


def _unknown_key(key: str, leaf: str, parent: ml_collections.ConfigDict, prefix: str) -> UserError:
    """`leaf` is the part of `key` that `parent` (at `prefix`) does not have."""
    keys = sorted(parent.keys())
    close = difflib.get_close_matches(leaf, keys, n=1) or sorted(
        (k for k in keys if leaf.strip("_") in k), key=lambda k: -difflib.SequenceMatcher(None, leaf, k).ratio()
    )[:1]
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    where = f"keys under {prefix[:-1]!r}" if prefix else "top-level keys"
    return UserError(f"unknown config key {key!r}{hint}; {where}: {', '.join(keys)}")


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[tuple[str, Any]]) -> None:
    """Apply (dotted key, value) pairs; values given as strings are parsed to the field's type.

    Keys linked to one value (`FieldReference`s: model.vocab_size and data.tokenizer_vocab_size,
    data.seq_len and model.max_seq_len) may be set through either; set to different values by the
    same overrides, they contradict each other, which is refused naming both.
    """
    applied = []
    for key, text in overrides:
        parts = key.split(".")
        node = cfg
        for depth, part in enumerate(parts):
            prefix = ".".join(parts[:depth]) + ("." if depth else "")
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                if not isinstance(node, ml_collections.ConfigDict):
                    raise UserError(f"--config.{key}: {prefix[:-1]!r} is a value, not a group of keys")
                raise _unknown_key(key, part, node, prefix)
            if depth < len(parts) - 1:
                node = node[part]
        current = node[parts[-1]]
        if isinstance(current, ml_collections.ConfigDict):
            raise UserError(f"--config.{key}: {key!r} is a group of keys, set one of: {', '.join(sorted(current))}")
        node[parts[-1]] = value = _parse_value(key, text, current)
        applied.append((key, text, value, node, parts[-1]))
    for i, (key, text, value, node, leaf) in enumerate(applied):
        later = [a for a in applied[i + 1:] if a[0] == key]
        if not later and node[leaf] != value:  # a later override of a linked key changed it
            other = next(a for a in reversed(applied[i + 1:]) if a[2] == node[leaf])
            raise UserError(
                f"--config.{key}={text} and --config.{other[0]}={other[1]} contradict each other: the two keys are "
                f"linked to one value, which either sets; give only one of them (drop --config.{other[0]}={other[1]} "
                f"to set both to {value!r})"
            )


_FLAG = re.compile(r"^--config(\.(?P<key>[A-Za-z0-9_.]+))?=(?P<value>.*)$", re.S)


def parse_cli(argv: Sequence[str], default_recipe: str | None = None) -> ml_collections.ConfigDict:
    """`--config=path[:arg]` then any number of `--config.a.b=value`; anything else is an error."""
    recipe_arg = default_recipe
    overrides = []
    for arg in argv:
        m = _FLAG.match(arg)
        if not m:
            raise UserError(
                f"unrecognised argument {arg!r}; use --config=configs/<recipe>.py and --config.<key>=<value>"
            )
        if m.group("key") is None:
            recipe_arg = m.group("value")
        else:
            overrides.append((m.group("key"), m.group("value")))
    if recipe_arg is None:
        raise UserError(f"--config is required: --config=configs/<recipe>.py, recipes: {', '.join(recipe_names())}")
    cfg = load_recipe(recipe_arg)
    apply_overrides(cfg, overrides)
    resolve_init_from(cfg, overrides)
    return cfg


# ----------------------------------------------------------------------------- validation


_check = section_lib.check  # the one line every config check raises, typed section or not


def _check_choice(cfg: ml_collections.ConfigDict, key: str, choices: Sequence[str], allow_empty=False) -> None:
    section_lib.check_choice(key, cfg[key.split(".")[0]][key.split(".")[1]], choices, allow_empty)


def profile_steps(cfg: ml_collections.ConfigDict) -> tuple[int, int] | None:
    """`profile.steps` "start:end" as (start, end), both included; None when empty."""
    text = cfg.profile.steps.strip()
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        first, last = int(start), int(end if sep else start)
    except ValueError:
        first, last = 0, -1
    _check(1 <= first <= last, "profile.steps", text, "'start:end' with 1 <= start <= end, e.g. '10:12'")
    return first, last


def prune_pattern(text: str) -> tuple[int, int] | None:
    """`compress.pattern` -> (N, M) for N:M semi-structured sparsity, None for unstructured; UserError otherwise."""
    if text == "unstructured":
        return None
    n, _, m = text.partition(":")
    try:
        n, m = int(n), int(m)
    except ValueError:
        n = m = 0
    _check(0 < n < m, "compress.pattern", text, "unstructured, or N:M with 0 < N < M (2:4: two of every four kept)")
    return n, m


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Check everything that needs no device. Raises UserError naming the key, value, and what is allowed."""
    m, d, o, r = cfg.model, cfg.data, cfg.optim, cfg.run
    _check_choice(cfg, "model.variant", sorted(transformer.VARIANTS))
    _check_choice(cfg, "model.norm", sorted(transformer.NORMS), allow_empty=True)
    _check_choice(cfg, "model.mlp", sorted(MLPS), allow_empty=True)
    _check_choice(cfg, "model.position", sorted(transformer.POSITIONS), allow_empty=True)
    _check(m.use_bias in (-1, 0, 1), "model.use_bias", m.use_bias, "-1 (variant's choice), 0 or 1")
    _check(m.qkv_bias in (-1, 0, 1), "model.qkv_bias", m.qkv_bias, "-1 (variant's choice), 0 or 1")
    _check_choice(cfg, "model.rope_scaling", layers.ROPE_SCALINGS)
    if m.rope_scaling != "none":
        _check(m.rope_factor > 0, "model.rope_factor", m.rope_factor, "a positive number")
    if m.rope_scaling == "llama3":
        _check(m.rope_original_max_len > 0, "model.rope_original_max_len", m.rope_original_max_len,
               "the context length the model was trained with, a positive integer (rope_scaling=llama3 needs it)")
        _check(m.rope_high_freq_factor > m.rope_low_freq_factor > 0, "model.rope_high_freq_factor",
               m.rope_high_freq_factor, f"a number above model.rope_low_freq_factor={m.rope_low_freq_factor} > 0")
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
        _check(m[key] > 0, f"model.{key}", m[key], "a positive integer")
    for key in ("n_kv_heads", "head_dim", "mlp_dim"):
        _check(m[key] >= 0, f"model.{key}", m[key], "a positive integer, or 0 for the default")
    if m.head_dim == 0:
        _check(m.d_model % m.n_heads == 0, "model.d_model", m.d_model,
               f"a multiple of model.n_heads={m.n_heads} (or set model.head_dim)")
    kv = m.n_kv_heads or m.n_heads
    _check(m.n_heads % kv == 0, "model.n_kv_heads", m.n_kv_heads, f"a divisor of model.n_heads={m.n_heads}")
    _check(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "a number in [0, 1)")
    _check(m.init_std > 0, "model.init_std", m.init_std, "a positive number")
    _check_choice(cfg, "model.dtype", ("auto", *transformer.DTYPES))
    _check_choice(cfg, "model.param_dtype", tuple(transformer.DTYPES))
    _check_choice(cfg, "model.remat", ("none", *transformer.REMAT_POLICIES))
    _check_choice(cfg, "model.attention", ("auto", *attention.IMPLEMENTATIONS))
    _check_choice(cfg, "model.matmul", MATMUL_IMPLS)
    _check(m.attention_segments >= 0, "model.attention_segments", m.attention_segments,
           "0 (the document mask) or the most documents per row cuDNN's packed layout is compiled for")
    _check(m.scan_unroll >= 0, "model.scan_unroll", m.scan_unroll, "0 (auto) or a positive number of layers")
    pl = cfg.pipeline
    PipelineConfig.from_config(pl).validate()
    if cfg.mesh.stage > 1 or cfg.mesh.stage == -1:
        _check(m.scan_layers, "model.scan_layers", m.scan_layers,
               f"true with mesh.stage={cfg.mesh.stage} (the stages split the stacked layers)")
        _check(cfg.mesh.stage == -1 or m.n_layers % (cfg.mesh.stage * pl.repeats) == 0, "model.n_layers", m.n_layers,
               f"a multiple of mesh.stage x pipeline.repeats = {cfg.mesh.stage} x {pl.repeats}")
        _check(pl.microbatches == 0 or pl.microbatches >= cfg.mesh.stage, "pipeline.microbatches", pl.microbatches,
               f"0 (auto) or at least mesh.stage={cfg.mesh.stage}: every stage needs a micro-batch to work on")
    _check(m.loss_chunk_len >= 0 and (m.loss_chunk_len == 0 or cfg.data.seq_len % m.loss_chunk_len == 0),
           "model.loss_chunk_len", m.loss_chunk_len, f"0 (off) or a divisor of data.seq_len={cfg.data.seq_len}")

    _check(d.seq_len > 0, "data.seq_len", d.seq_len, "a positive integer")
    _check(d.seq_len <= m.max_seq_len, "data.seq_len", d.seq_len, f"at most model.max_seq_len={m.max_seq_len}")
    _check(d.global_batch_size > 0, "data.global_batch_size", d.global_batch_size, "a positive integer")
    _check(0.0 <= d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "a number in [0, 1)")
    _check(d.num_workers >= 0, "data.num_workers", d.num_workers, "0 or more")
    _check(d.shards >= 0 and (d.shards == 0 or d.global_batch_size % d.shards == 0), "data.shards", d.shards,
           f"0 (one per process) or a divisor of data.global_batch_size={d.global_batch_size}")
    formats = sources.FORMATS + sft.FORMATS
    _check(d.format in formats, "data.format", d.format, "one of " + ", ".join(formats))
    if d.format in sft.FORMATS or d.corpus == sources.BUILTIN_CHAT:
        _check(d.corpus != "builtin", "data.corpus", d.corpus,
               f"SFT rows (data.format={d.format}): builtin_chat, or JSONL / Parquet files")
        _check(d.format in sft.FORMATS + ("auto",), "data.format", d.format,
               f"chat (or auto) for data.corpus={sources.BUILTIN_CHAT}")
    _check(d.chat_template in ("", *sft.TEMPLATES) or d.chat_template.endswith(".jinja"), "data.chat_template",
           d.chat_template, "'' (the tokenizer's own), " + ", ".join(sft.TEMPLATES) + " or a .jinja file")
    _check(d.tokenizer_type in tokenizer.MODEL_TYPES, "data.tokenizer_type", d.tokenizer_type,
           "one of " + ", ".join(tokenizer.MODEL_TYPES))
    _check(d.tokenizer_train_bytes > 0, "data.tokenizer_train_bytes", d.tokenizer_train_bytes, "a positive integer")
    _check(d.on_damaged_shard in ("stop", "skip"), "data.on_damaged_shard", d.on_damaged_shard, "'stop' or 'skip'")
    _check(d.val_tokens >= 0, "data.val_tokens", d.val_tokens, "0 (no evaluation) or more")
    _check(d.tokenizer_vocab_size == m.vocab_size, "data.tokenizer_vocab_size", d.tokenizer_vocab_size,
           f"equal to model.vocab_size={m.vocab_size}")

    OptimConfig.from_config(o).validate()
    _check(o.micro_batches == 0 or d.global_batch_size % o.micro_batches == 0, "optim.micro_batches",
           o.micro_batches, f"a divisor of data.global_batch_size={d.global_batch_size}")
    lo = cfg.lora
    _check(lo.rank >= 0, "lora.rank", lo.rank, "0 (no adapters) or a positive integer")
    _check(lo.alpha > 0, "lora.alpha", lo.alpha, "a positive number")
    _check(0.0 <= lo.dropout < 1.0, "lora.dropout", lo.dropout, "a number in [0, 1)")
    _check(lo.quantize_base in ("", *quant.FORMATS), "lora.quantize_base", lo.quantize_base,
           "'' (off) or one of " + ", ".join(quant.FORMATS))
    _check(lo.quant_group >= 2 and lo.quant_group % 2 == 0, "lora.quant_group", lo.quant_group,
           "an even number of values per scale (64 as in QLoRA)")
    co = cfg.compress
    _check(co.quantize in ("", *quant.FORMATS), "compress.quantize", co.quantize,
           "'' (off) or one of " + ", ".join(quant.FORMATS))
    _check(co.group >= 0, "compress.group", co.group, "a number of values per scale, or 0 (one per output channel)")
    _check(co.symmetric or co.quantize != "nf4", "compress.symmetric", co.symmetric,
           "True with nf4 (a symmetric table of levels)")
    _check(not co.qat or bool(co.quantize), "compress.qat", co.qat, "False while compress.quantize is '' (set the format)")
    _check(co.method in ("rtn", "gptq"), "compress.method", co.method, "rtn or gptq")
    _check(co.gptq_damp > 0, "compress.gptq_damp", co.gptq_damp, "a positive fraction, e.g. 0.01")
    _check(co.gptq_block > 0, "compress.gptq_block", co.gptq_block, "a positive number of columns, e.g. 128")
    _check(0.0 <= co.sparsity < 1.0, "compress.sparsity", co.sparsity, "a fraction in [0, 1)")
    _check(co.criterion in ("magnitude", "wanda"), "compress.criterion", co.criterion, "magnitude or wanda")
    _check(co.scope in ("layer", "global"), "compress.scope", co.scope, "layer or global")
    nm = prune_pattern(co.pattern)
    _check(co.scope == "layer" or (co.criterion == "magnitude" and not nm), "compress.scope", co.scope,
           "layer with compress.criterion=wanda or an N:M pattern (global ranks magnitudes, unstructured)")
    if nm:
        _check(co.sparsity == 1 - nm[0] / nm[1], "compress.sparsity", co.sparsity,
               f"{1 - nm[0] / nm[1]:g} with compress.pattern={co.pattern} ({nm[0]} of every {nm[1]} kept)")
    _check(co.calib_samples > 0, "compress.calib_samples", co.calib_samples, "a positive number of sequences")
    _check(co.calib_seq_len > 1, "compress.calib_seq_len", co.calib_seq_len, "a sequence length of 2 or more")
    _check(co.prune_start >= 0, "compress.prune_start", co.prune_start, "a step, 0 or more")
    _check(co.prune_end == 0 or co.prune_end > co.prune_start, "compress.prune_end", co.prune_end,
           f"0 (no gradual pruning) or a step after compress.prune_start={co.prune_start}")
    _check(co.prune_end == 0 or co.sparsity > 0, "compress.prune_end", co.prune_end,
           "0 while compress.sparsity is 0 (set the sparsity to reach)")
    _check(co.prune_every > 0, "compress.prune_every", co.prune_every, "a positive number of steps")
    if lo.rank > 0 or lo.ranks.strip() or lo.quantize_base or co.quantize or co.sparsity > 0:
        # targets and groups against the projections (an abstract build)
        transformer.ModelConfig.from_config(m, "cpu", attention="xla", log_choice=False, lora=lo, compress=co)

    _check(r.steps > 0, "run.steps", r.steps, "a positive integer")
    _check(r.log_every > 0, "run.log_every", r.log_every, "a positive integer")
    _check(r.init_step >= -1, "run.init_step", r.init_step, "-1 (the newest checkpoint that loads) or a step")
    _check(r.init_step == -1 or bool(r.init_from), "run.init_step", r.init_step,
           "-1 while run.init_from is empty (set run.init_from to the run directory to read that step of)")
    ck = cfg.checkpoint
    CheckpointConfig.from_config(ck).validate()
    _check(not ck.keep_best or d.val_tokens > 0, "checkpoint.keep_best", ck.keep_best,
           "0 when data.val_tokens=0 (no validation loss to rank checkpoints by)")
    _check(r.peak_flops >= 0, "run.peak_flops", r.peak_flops, "0 (known devices) or the FLOP/s of one device")
    _check(r.eval_every >= 0, "run.eval_every", r.eval_every, "0 (only at the end) or more")
    MetricsConfig.from_config(cfg.metrics).validate()
    profile_steps(cfg)
    EnergyConfig.from_config(cfg.energy).validate()
    loss_scale.validate(cfg)

    _check_choice(cfg, "mesh.hybrid", ("process", "host"), allow_empty=True)
    sizes = [cfg.mesh[a] for a in MESH_AXES]
    for axis, size in zip(MESH_AXES, sizes):
        _check(size == -1 or size >= 1, f"mesh.{axis}", size, "a positive integer or -1 (the devices left over)")
    _check(sizes.count(-1) <= 1, "mesh", tuple(sizes), "at most one axis set to -1")
    for name, axes in cfg.mesh.rules.items():
        for axis in parse_rule(axes):
            _check(axis in MESH_AXES, f"mesh.rules.{name}", axes,
                   f"'' or comma-separated mesh axes from {', '.join(MESH_AXES)}")


def parse_rule(axes: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in axes.split(",") if a.strip())


# ----------------------------------------------------------------------------- derived values


@dataclasses.dataclass(frozen=True)
class Derived:
    """Everything that follows from the config and the number of devices, computed once."""

    mesh_shape: MeshShape  # one size per axis of MESH_AXES
    num_devices: int
    batch_shards: int  # devices a batch is split over: data * fsdp
    micro_batch_size: int  # sequences per micro-batch, over all devices
    per_device_batch: int  # sequences per device per micro-batch
    tokens_per_step: int
    pipeline_microbatches: int = 1  # micro-batches in flight through the pipeline's stages (1 = no pipeline)
    pipeline_repeats: int = 1  # layer groups per stage (circular schedule)

    @property
    def pipeline(self) -> dict:
        """The model's pipeline fields (`ModelConfig.from_config` overrides): none without stages."""
        stages = sizes_of(self.mesh_shape)["stage"]
        return {} if stages == 1 else dict(pipeline_stages=stages, pipeline_microbatches=self.pipeline_microbatches,
                                           pipeline_repeats=self.pipeline_repeats)


def inert_settings(cfg: ml_collections.ConfigDict, derived: Derived) -> list[str]:
    """Lines for settings that change nothing in this run (set, but what they act on is absent)."""
    default = base_config().pipeline
    changed = [f"pipeline.{key}={cfg.pipeline[key]}" for key in default if cfg.pipeline[key] != default[key]]
    if changed and sizes_of(derived.mesh_shape)["stage"] == 1:
        return [f"{', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect with one pipeline "
                f"stage (mesh.stage={cfg.mesh.stage}): set mesh.stage to the number of stages to pipeline"]
    return []


def mesh_shape(cfg: ml_collections.ConfigDict, num_devices: int, groups: int | None = None) -> MeshShape:
    """The size of each mesh axis for `num_devices`; with mesh.hybrid, data = `groups` (the hosts or
    processes of the run, from the live layout when not given) and fsdp the devices left in each."""
    if cfg.mesh.hybrid:
        groups = groups or mesh_lib.hybrid_groups(cfg.mesh.hybrid)
        inner = {a: max(cfg.mesh[a], 1) for a in MESH_AXES if a not in ("data", "fsdp")}  # -1 counts as 1
        if num_devices % (groups * math.prod(inner.values())):
            raise UserError(
                f"config.mesh.hybrid={cfg.mesh.hybrid!r}: {num_devices} devices do not split into {groups} "
                f"{cfg.mesh.hybrid}(s) x {' x '.join(f'mesh.{a}={s}' for a, s in inner.items())}; every "
                f"{cfg.mesh.hybrid} needs the same device count"
            )
        fsdp = num_devices // groups // math.prod(inner.values())
        return tuple({"data": groups, "fsdp": fsdp, **inner}[a] for a in MESH_AXES)
    sizes = [cfg.mesh[a] for a in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    described = describe(sizes, ", ")
    if -1 in sizes:
        if num_devices % fixed:
            raise UserError(
                f"config.mesh ({described}): the fixed axes use {fixed} devices, which does not divide "
                f"the {num_devices} available; change mesh sizes so their product divides {num_devices}"
            )
        sizes[sizes.index(-1)] = num_devices // fixed
    elif fixed != num_devices:
        raise UserError(
            f"config.mesh ({described}) needs {fixed} devices but {num_devices} are available; "
            f"set one axis to -1 or make the product {num_devices}"
        )
    return tuple(sizes)


def pipeline_microbatch_choices(rows: int, stages: int) -> list[int]:
    """The pipeline micro-batch counts `pipeline.microbatches=0` chooses among, for a micro-batch of `rows`
    sequences per data x fsdp shard: from `stages` up to 4 x stages, dividing the rows (auto takes the last)."""
    return [n for n in range(stages, 4 * stages + 1) if rows % n == 0]


def derive(cfg: ml_collections.ConfigDict, num_devices: int, groups: int | None = None) -> Derived:
    """Resolve the mesh and the batch split for `num_devices` (and, with mesh.hybrid, `groups`
    hosts or processes); UserError when they do not fit."""
    shape = mesh_shape(cfg, num_devices, groups)
    sizes = sizes_of(shape)
    tensor = sizes["tensor"]
    m = cfg.model
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % tensor or kv % tensor:
        raise UserError(
            f"config.model.n_heads={m.n_heads} / n_kv_heads={kv} must be divisible by the tensor axis "
            f"mesh.tensor={tensor}; choose a tensor size that divides {math.gcd(m.n_heads, kv)}"
        )
    batch_shards = sizes["data"] * sizes["fsdp"]
    if not cfg.optim.micro_batches:
        raise ValueError("optim.micro_batches=0 must be resolved first (jaxlm.train_setup.resolve_config)")
    micro = cfg.data.global_batch_size // cfg.optim.micro_batches
    if micro % batch_shards:
        raise UserError(
            f"config.data.global_batch_size={cfg.data.global_batch_size} with optim.micro_batches="
            f"{cfg.optim.micro_batches} gives {micro} sequences per micro-batch, which does not divide over "
            f"data*fsdp={batch_shards} devices; use a global batch that is a multiple of "
            f"{batch_shards * cfg.optim.micro_batches}"
        )
    stages = sizes["stage"]
    pipeline_microbatches = 1
    if stages > 1:
        pl = cfg.pipeline
        if m.n_layers % (stages * pl.repeats):
            raise UserError(f"config.model.n_layers={m.n_layers} does not split into mesh.stage={stages} stages x "
                            f"pipeline.repeats={pl.repeats}; choose a stage count and repeats whose product divides it")
        rows = micro // batch_shards  # each pipeline micro-batch splits over data x fsdp too
        fits = pipeline_microbatch_choices(rows, stages)
        pipeline_microbatches = pl.microbatches or (fits[-1] if fits else 0)
        if pipeline_microbatches < stages or rows % pipeline_microbatches:
            raise UserError(
                f"config.pipeline.microbatches={pl.microbatches or 'auto'}: a micro-batch of {micro} sequences has "
                f"{rows} per data x fsdp shard, which does not split into "
                f"{pipeline_microbatches or f'at least {stages}'} pipeline micro-batches of whole rows for "
                f"mesh.stage={stages}; use a global batch that is a "
                f"multiple of {batch_shards * cfg.optim.micro_batches * stages} or set pipeline.microbatches "
                f"to a divisor of {rows} of at least {stages}")
    return Derived(
        mesh_shape=shape,
        num_devices=num_devices,
        batch_shards=batch_shards,
        micro_batch_size=micro,
        per_device_batch=micro // batch_shards,
        tokens_per_step=cfg.data.global_batch_size * cfg.data.seq_len,
        pipeline_microbatches=pipeline_microbatches,
        pipeline_repeats=cfg.pipeline.repeats if stages > 1 else 1,
    )
