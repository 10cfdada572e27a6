"""`run.init_from`: a new run that starts from another run's parameters (fine-tuning).

The source is a run directory as `python -m jaxlm.train` writes it: config.json, its tokenizer file,
checkpoints/<step>/. For a NEW run (no checkpoint of its own yet):

- `resolve_config` (run by the commands' `config_from_cli` and by `explore.make_config`, so `jaxlm.plan`
  plans the model that will train) takes the architecture from the source's config.json: every model key but
  `COMPUTE_MODEL_KEYS` (and max_seq_len with learned positions), replacing the recipe's; a
  command-line value that contradicts the source is refused in one line. The RoPE settings
  (`POSITION_MODEL_KEYS`) are the source's unless the recipe or the command line sets them, and the
  model's context (max_seq_len) the source's unless the command line gives it or the recipe sets it
  apart from data.seq_len: a context extension (configs/long_tiny.py, docs/parallelism.md). The source's tokenizer
  file becomes `data.tokenizer_path`, unless one is given, which must then have the source's
  vocabulary size.
- `load_state` reads the parameters of checkpoint `run.init_step` (default: the newest that loads
  and matches its manifest; a damaged one is skipped with a warning) onto the new run's mesh, in
  its `model.param_dtype`: step 0, a fresh optimizer state, the data from the start. Only the
  parameters are read, never the source's optimizer state. A QLoRA run (`lora.quantize_base`) reads
  the float kernels onto the same model unquantized, then quantizes them once (`quantize_base`).
- A compressed source (`python -m jaxlm.compress`) passes on its structure (`compressed_structure`:
  quantized kernels, pruning masks), read as they are; a pruning run (config.compress.sparsity with a
  gradual schedule) from a dense source starts with masks that keep everything.

A RESUMED run (its own checkpoints exist) ignores the source: its architecture is its own
config.json's and its tokenizer its own, so it resumes even after the source has moved or changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import optax

from jaxlm import checkpoint, lora, pruning_masks, quant, train_state
from jaxlm import config as config_lib
from jaxlm.data import tokenizer
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError
from jaxlm.models import quantized, transformer
from jaxlm.run_dir import run_dir_path

# The model keys that change only how the model computes (precision, memory, kernels) or how it is
# initialised, never its parameters' shapes or the function they compute. Every OTHER model key is the
# architecture, which a run started from another's parameters (run.init_from) takes from that run;
# a new model key is architecture unless it is listed here. max_seq_len is architecture only with
# learned positions (a [max_seq_len, d_model] table); scan_layers is (it stacks the layers' parameters).
COMPUTE_MODEL_KEYS = ("dtype", "param_dtype", "dropout", "remat", "attention", "context_attention", "context_layout",
                      "matmul", "loss_chunk_len", "init_std", "max_seq_len", "scan_unroll")
# The RoPE scaling settings: architecture (the source's) unless the new run sets them, since they shape no
# parameter. A key the recipe sets to other than its default, or the command line gives, is the new run's own: a
# context extension rescales the source's RoPE (configs/long_tiny.py); a fine-tune that names none keeps the
# source's (Llama 3.1's scaling).
POSITION_MODEL_KEYS = transformer.ROPE_SCALING_KEYS


def _get(cfg: ml_collections.ConfigDict, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _read_config(run_dir: pathlib.Path, flag: str) -> dict:
    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{flag} is not a run directory (no config.json); give the directory python -m jaxlm.train "
                        f"wrote (<run.output_dir>/<run.name>)")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: {path} is not valid JSON ({e}); it is written by python -m jaxlm.train") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise UserError(f"{flag}: {path} has no 'model' section; give the directory python -m jaxlm.train wrote")
    return saved


def architecture(model: dict, defaults) -> dict[str, Any]:
    """The architecture keys of a saved `model` section and their values: every key of `defaults`
    (the schema's model section, `config.base_config().model`, whose value a key the saved config
    lacks takes) but COMPUTE_MODEL_KEYS, and max_seq_len where the positions are learned."""

    values = {key: model.get(key, defaults[key]) for key in defaults
              if key not in COMPUTE_MODEL_KEYS and not isinstance(defaults[key], ml_collections.ConfigDict)}
    variant = transformer.VARIANTS.get(values["variant"])
    if (values["position"] or (variant.position if variant else "")) == "learned":
        values["max_seq_len"] = model.get("max_seq_len", defaults["max_seq_len"])
    return values


def config_from_cli(argv: Sequence[str], default_recipe: str | None = None) -> ml_collections.ConfigDict:
    """The config of a command line (`config.parse_cli`: the recipe and its overrides), with run.init_from's
    architecture and tokenizer applied (`resolve_config`): what every command that trains or plans reads."""
    _, overrides = config_lib.split_cli(argv, default_recipe)
    cfg = config_lib.parse_cli(argv, default_recipe)
    if cfg.run.init_from:
        resolve_config(cfg, overrides)
    return cfg


def resolve_config(cfg: ml_collections.ConfigDict, overrides: Sequence[tuple[str, Any]]) -> None:
    """Give `cfg` (with run.init_from set) the source's architecture and tokenizer, in place; see the
    module's docstring. `overrides`: the (key, value) pairs given on the command line, which may repeat
    the source's values but never contradict them."""
    defaults, run_dir = transformer.ModelSection.defaults(), run_dir_path(cfg)
    flag = f"config.run.init_from={cfg.run.init_from}"
    source = pathlib.Path(cfg.run.init_from)
    if os.path.realpath(source) == os.path.realpath(run_dir):
        raise UserError(f"{flag} is this run's own directory; a fine-tuned run needs a directory of its own: set "
                        f"another config.run.name (or run.output_dir)")
    resumed = (not cfg.run.fresh and bool(checkpoint.complete_steps(run_dir / "checkpoints"))
               and (run_dir / "config.json").is_file())
    if resumed:  # its own checkpoints decide: the source is not read (it may have moved or changed since)
        origin, saved = f"{run_dir}'s own config.json (a resumed run)", _read_config(run_dir, str(run_dir))
    else:
        if not source.is_dir():
            raise UserError(f"{flag} is not a directory; give a run directory that python -m jaxlm.train wrote")
        saved = _read_config(source, flag)
        lora.check_source(saved, flag)  # its adapters would not be read: merge them first
        steps = checkpoint.complete_steps(source / "checkpoints")
        if not steps:
            raise UserError(f"{flag} has no complete checkpoint (nothing in {source / 'checkpoints'}); train it "
                            f"first (or wait for its first save), or give another run directory")
        if cfg.run.init_step >= 0 and cfg.run.init_step not in steps:
            raise UserError(f"config.run.init_step={cfg.run.init_step}: {source} has no complete checkpoint for that "
                            f"step; its checkpoints: {', '.join(map(str, steps))} (or -1 for the newest)")
        origin = flag
    given = [(key, text, _get(cfg, key)) for key, text in overrides]
    given_keys = {key for key, _, _ in given}
    explicit_tokenizer = cfg.data.tokenizer_path
    for key, value in compressed_structure(saved).items():  # a compressed source's quantized or pruned projections
        cfg.compress[key] = value
    for key, value in architecture(saved["model"], defaults).items():
        if (not resumed and key in POSITION_MODEL_KEYS
                and (f"model.{key}" in given_keys or cfg.model[key] != defaults[key])):
            continue  # the new run's own RoPE settings (POSITION_MODEL_KEYS)
        try:
            if key == "max_seq_len":  # a table of learned positions: the source's, as every position's length
                _keep_context(cfg, value)
            else:
                cfg.model[key] = value
        except TypeError:
            raise UserError(f"{origin}: its model.{key}={value!r} does not fit this jaxlm's model.{key} "
                            f"(a {type(cfg.model[key]).__name__}); give a run directory this jaxlm wrote") from None
    own_context = cfg.model.get_ref("max_seq_len") is not cfg.data.get_ref("seq_len")  # the recipe's, apart
    if "model.max_seq_len" not in given_keys and not (own_context and not resumed):
        _keep_context(cfg, saved["model"].get("max_seq_len", defaults["max_seq_len"]))
    for key, text, value in given:
        if _get(cfg, key) != value:
            raise UserError(
                f"--config.{key}={text} contradicts the architecture of {origin}, whose {key} is {_get(cfg, key)!r}: "
                f"a run started from another's parameters takes the source's architecture; drop --config.{key}, "
                f"or train from scratch without run.init_from"
            )
    if explicit_tokenizer:
        if not resumed:
            _check_vocab(cfg, explicit_tokenizer, flag)
        return

    found = tokenizer.find_in(run_dir if resumed else source)
    if resumed:  # the path its config recorded while it is there, else its own copy (the same tokenizer:
        recorded = saved.get("data", {}).get("tokenizer_path", "")  # its sha256 is checked on resume)
        found = pathlib.Path(recorded) if recorded and pathlib.Path(recorded).is_file() else found
    if found is None:
        where = run_dir if resumed else source
        raise UserError(f"{origin}: {where} has no tokenizer file ({' or '.join(tokenizer.FILE_NAMES)}); copy the run's "
                        f"tokenizer there, or give config.data.tokenizer_path")
    cfg.data.tokenizer_path = str(found)


def _keep_context(cfg: ml_collections.ConfigDict, max_seq_len: int) -> None:
    """The model's context is the source's (`model.max_seq_len`), whatever the training rows' length
    (`data.seq_len`, at most it): a fine-tune on short rows keeps the base's positions, so it generates
    and exports with them. The recipe links the two keys (one FieldReference); the model's gets a field
    of its own. A `--config.model.max_seq_len` given on the command line, or a recipe's model.max_seq_len
    set apart from data.seq_len (a RoPE context extension: configs/long_tiny.py), wins: the caller does
    not call this then."""
    if cfg.model.max_seq_len != max_seq_len or cfg.model.get_ref("max_seq_len") is cfg.data.get_ref("seq_len"):
        with cfg.unlocked():
            del cfg.model["max_seq_len"]
            cfg.model["max_seq_len"] = max_seq_len


# The keys of config.compress that are the model's structure (quantized kernels, pruning masks): a run
# started from a compressed run takes them from it, as it takes the architecture.
COMPRESS_STRUCTURE_KEYS = ("targets", "quantize", "group", "symmetric", "qat", "sparsity", "pattern")


def compressed_structure(saved: dict) -> dict[str, Any]:
    """The structure keys of a saved config's `compress` section when it quantized or pruned anything
    (`COMPRESS_STRUCTURE_KEYS`); {} for an uncompressed run."""
    section = saved.get("compress") or {}
    if not section.get("quantize") and not float(section.get("sparsity", 0) or 0) > 0:
        return {}
    return {key: section[key] for key in COMPRESS_STRUCTURE_KEYS if key in section}


def _check_vocab(cfg: ml_collections.ConfigDict, path: str, flag: str) -> None:

    size = Tokenizer.load(path).vocab_size
    if size != cfg.model.vocab_size:
        raise UserError(
            f"config.data.tokenizer_path={path} has {size} tokens but the model of {flag} has "
            f"vocab_size={cfg.model.vocab_size}; give a tokenizer of {cfg.model.vocab_size} tokens, or leave "
            f"data.tokenizer_path empty to use that run's own tokenizer"
        )


def load_state(setup) -> tuple[Any, dict[str, Any]]:
    """(the first train state of a new run started from run.init_from, the record of where it came
    from: {"run_dir", "step"}). `setup` is a `train_setup.TrainSetup` built with `abstract=True`."""


    cfg = setup.cfg
    source = pathlib.Path(cfg.run.init_from)
    flag = f"config.run.init_from={cfg.run.init_from}"
    differences = [f"model.{key}: {value!r} there, {cfg.model[key]!r} here"
                   for key, value in architecture(_read_config(source, flag)["model"], cfg.model).items()
                   if cfg.model[key] != value and key not in POSITION_MODEL_KEYS]
    if differences:  # a config put together without config.parse_cli / recipe / explore.make_config
        raise UserError(f"{flag}: the config's architecture is not that run's ({'; '.join(differences)}); resolve the "
                        f"config with jaxlm.init_from.resolve_config(cfg, overrides) first (the commands and "
                        f"explore.make_config do)")
    step = cfg.run.init_step if cfg.run.init_step >= 0 else None
    try:
        params, step = read_params(setup, source, step)
    except UserError as e:
        raise UserError(f"{flag}: {e}; restore its checkpoints from a copy, or give another run.init_from (or "
                        f"run.init_step)") from None
    scale = None if setup.state.loss_scale is None else cfg.optim.loss_scale_init
    state = train_state.from_params(params, setup.model_spec, setup.tx, setup.shardings, setup.mesh, cfg.run.seed,
                                    loss_scale=scale or 0.0)
    return state, {"run_dir": str(source.resolve()), "step": int(step)}


def read_params(setup, source: pathlib.Path, step: int | None) -> tuple[Any, int]:
    """(the parameters a new run of `setup` starts with from the run `source`, the step read): its checkpoint
    `step` (None: the newest that loads and matches its manifest) on the run's mesh by its rules, in its
    `model.param_dtype`, quantized or given pruning masks as the run's model has them, fresh LoRA adapters
    added (`run.seed`'s). `load_state` builds the first train state on them; a GRPO run with a KL penalty in
    full training reads them again on resume as its reference (`TrainSetup.read_start`). A checkpoint that
    does not load raises its `UserError`."""
    cfg = setup.cfg
    # LoRA: the base weights alone are read (the source has no adapters: lora.check_source); the adapters
    # are initialised as a new run's would be. QLoRA: the source's float kernels are read onto the same
    # model unquantized (same mesh and rules), then quantized once, shard by shard, into the 4-bit base.
    # A compressed source (python -m jaxlm.compress) holds its integer codes and masks: read as they are.
    # A pruning run from a dense source reads the kernels, its masks start all True.
    saved = compressed_structure(_read_config(source, f"config.run.init_from={source}"))
    target = lora.base_params(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                           setup.state.params))
    quantized = setup.model_cfg.stored_quant is not None and not saved.get("quantize")
    unmasked = setup.model_cfg.pruned is not None and not float(saved.get("sparsity", 0) or 0) > 0
    if quantized or unmasked:
        read_cfg = dataclasses.replace(setup.model_cfg, quantized=None if quantized else setup.model_cfg.quantized,
                                       pruned=None if unmasked else setup.model_cfg.pruned)
        abstract, *_ = train_state.abstract_state(read_cfg, optax.identity(), setup.mesh, setup.rules)
        target = lora.base_params(abstract.params)
    # onto the abstract params: the new run's shardings and param_dtype
    params, step = checkpoint.load_params_and_step(source / "checkpoints", target, step=step)
    if quantized:
        params = quantize_base(params, setup.model_cfg, lora.base_params(setup.shardings.params), setup.mesh)
    if unmasked:
        params = pruning_masks.add_masks(params, setup.model_cfg, lora.base_params(setup.shardings.params), setup.mesh)
    if setup.model_cfg.lora is not None:
        fresh = lora.init_adapters(setup.model_cfg, setup.shardings.params, setup.mesh, cfg.run.seed)
        params = lora.fill_missing(params, fresh)
    return params, int(step)


def quantize_base(params: dict, cfg, shardings: dict, mesh) -> dict:
    """Float base parameters (adapters aside) -> those of the quantized model `cfg` (QLoRA), in one
    compiled function whose outputs are born in `shardings`: each device quantizes its own shards."""
    with jax.set_mesh(mesh):
        return jax.jit(lambda p: quantized.quantize_params(p, cfg), out_shardings=shardings)(params)


def describe(record: dict[str, Any], params, bits: int = 4) -> str:
    """The start-up line of a run started from another's parameters (a quantized weight of `bits`
    counted as one)."""
    count = quant.count(params, bits)
    return f"initialized from {record['run_dir']} step {record['step']} ({count / 1e6:.2f}M parameters)"
