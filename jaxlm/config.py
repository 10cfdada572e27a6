"""The config schema: every default in one place, command-line overrides, validation, derived values.

A recipe (`configs/<name>.py`) defines `get_config()` that starts from `base_config()` and changes
what differs. Every key is overridable as `--config.a.b=value`. `validate` runs before any device
work and raises `UserError` with one line naming the key, the value and what is allowed.
`derive` computes every value that follows from the config and the device count, in one place.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from jaxlm import overrides as overrides_lib
from jaxlm import paths
from jaxlm import section as section_lib
from jaxlm.axes import MeshShape, sizes_of
from jaxlm.checkpoint import CheckpointConfig
from jaxlm.data.loader import DataConfig
from jaxlm.data.mixture import parse_sources, parse_stages
from jaxlm.energy import EnergyConfig
from jaxlm.errors import UserError, in_user_file, run_user_file
from jaxlm.lora import LoraConfig
from jaxlm.mesh import MeshConfig, parse_rule
from jaxlm.metrics import MetricsConfig, ProfileConfig
from jaxlm.models import transformer
from jaxlm.models.pipeline_parallel import PipelineConfig
from jaxlm.models.quantized import CompressConfig
from jaxlm.objectives import ObjectiveConfig
from jaxlm.objectives import validate as validate_objective
from jaxlm.objectives.dpo import DPOConfig
from jaxlm.optim import OptimConfig
from jaxlm.post_training.distill import DistillConfig
from jaxlm.post_training.grpo import GRPOConfig
from jaxlm.run_dir import RunConfig, run_dir_path  # noqa: F401 -- run_dir_path: for callers of config

# Every section of the config, owned by its component as a typed dataclass (`jaxlm.section`), in the
# order of the configuration reference
SECTIONS = {cls.section: cls for cls in (
    RunConfig, transformer.ModelSection, DataConfig, OptimConfig, LoraConfig, CompressConfig, ObjectiveConfig,
    DPOConfig, GRPOConfig, DistillConfig, CheckpointConfig, MetricsConfig, EnergyConfig, ProfileConfig, MeshConfig,
    PipelineConfig)}

RECIPES_DIR = overrides_lib.RECIPES_DIR  # (configs/ beside the package)
recipe_names = overrides_lib.recipe_names
split_cli = overrides_lib.split_cli

def base_config() -> ml_collections.ConfigDict:
    """The base recipe: every key jaxlm knows, with its default (its section's). Recipes derive from this.

    Two pairs of keys are one value each (`FieldReference`s): model.max_seq_len and data.seq_len,
    model.vocab_size and data.tokenizer_vocab_size; setting either sets both (`apply_overrides`: the
    lengths given both apart each keep their own; `run.init_from` keeps the source's context)."""
    c = ml_collections.ConfigDict()
    seq_len = config_dict.FieldReference(DataConfig.defaults()["seq_len"])
    vocab_size = config_dict.FieldReference(DataConfig.defaults()["tokenizer_vocab_size"])
    linked = {"model": dict(max_seq_len=seq_len, vocab_size=vocab_size),
              "data": dict(seq_len=seq_len, tokenizer_vocab_size=vocab_size)}
    for name, cls in SECTIONS.items():
        c[name] = {**cls.defaults(), **linked.get(name, {})}
    return c


# ----------------------------------------------------------------------------- loading


def load_recipe(name_or_path: str) -> ml_collections.ConfigDict:
    """Load `configs/<name>.py` (or any path), optionally `path:arg`, and return its locked config."""
    path, arg = overrides_lib.recipe_file(name_or_path)
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
    """Load a recipe and apply `a__b=value` overrides, validated. run.init_from is left as given (the
    notebooks' `explore.make_config` also applies the source run's architecture)."""
    cfg = load_recipe(name)
    pairs = [(k.replace("__", "."), v) for k, v in overrides.items()]
    apply_overrides(cfg, pairs)
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- overrides


# The linked keys that may be given apart: the model's context (its positions) and the training rows'
# length, at most that (a fine-tune on short rows of a long-context model; RoPE trained short)
SEPARABLE = {"model.max_seq_len", "data.seq_len"}


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[tuple[str, Any]]) -> None:
    """Apply (dotted key, value) pairs; values given as strings are parsed to the field's type.

    Keys linked to one value (`FieldReference`s: model.vocab_size and data.tokenizer_vocab_size,
    data.seq_len and model.max_seq_len) may be set through either; set to different values by the
    same overrides, they contradict each other, which is refused naming both, except the model's
    context and the rows' length (`SEPARABLE`), which then each take their own value.
    """
    applied = []
    for key, text in overrides:
        node, leaf = overrides_lib.find(cfg, key)
        node[leaf] = value = overrides_lib.parse_value(key, text, node[leaf])
        applied.append((key, text, value, node, leaf))
    for i, (key, text, value, node, leaf) in enumerate(applied):
        later = [a for a in applied[i + 1:] if a[0] == key]
        if not later and not _same(node[leaf], value):  # a later override of a linked key changed it
            other = next(a for a in reversed(applied[i + 1:]) if _same(a[2], node[leaf]))
            if {key, other[0]} == SEPARABLE:  # both given: each keeps its own value (the model's gets its own field)
                model_len, data_len = (value, other[2]) if key == "model.max_seq_len" else (other[2], value)
                with cfg.unlocked():
                    del cfg.model["max_seq_len"]
                    cfg.model["max_seq_len"] = model_len
                cfg.data.seq_len = data_len
                continue
            raise UserError(
                f"--config.{key}={text} and --config.{other[0]}={other[1]} contradict each other: the two keys are "
                f"linked to one value, which either sets; give only one of them (drop --config.{other[0]}={other[1]} "
                f"to set both to {value!r})"
            )


def _same(a: Any, b: Any) -> bool:
    """Equal, nan included (nan != nan: a key set to nan still holds what it was set to)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def parse_cli(argv: Sequence[str], default_recipe: str | None = None) -> ml_collections.ConfigDict:
    """The recipe of a command line with its overrides applied (not yet validated). run.init_from is
    left as given: `jaxlm.init_from.config_from_cli` also applies the source run's architecture."""
    recipe_arg, overrides = split_cli(argv, default_recipe)
    cfg = load_recipe(recipe_arg)
    apply_overrides(cfg, overrides)
    return cfg


# ----------------------------------------------------------------------------- validation


_check = section_lib.check  # the one line every config check raises


def sections(cfg: ml_collections.ConfigDict) -> dict[str, section_lib.Section]:
    """Every section of `cfg` as its typed dataclass, by name."""
    return {name: cls.from_config(cfg[name]) for name, cls in SECTIONS.items()}


def check_paths(cfg: ml_collections.ConfigDict) -> None:
    """The paths a starting run writes, checked before any work (`Section.check_paths`; the run's own
    directory, output_dir/name, too): one line naming the key."""
    for section in sections(cfg).values():
        section.check_paths()
    run = cfg.run.name or cfg.run.recipe
    if run:
        paths.check(str(pathlib.Path(cfg.run.output_dir) / run), kind="dir", io="out", name="config.run.name")


def check_keys(cfg: ml_collections.ConfigDict, known: ml_collections.ConfigDict | None = None, prefix: str = "") -> None:
    """Every key of `cfg` is one jaxlm knows (the base config's): a recipe that sets `c.model.d_modle`
    adds a key that nothing reads, refused here naming the key it was likely meant to be."""
    known = base_config() if known is None else known
    for name in cfg.keys():
        if name not in known:
            raise overrides_lib.unknown_key(prefix + name, name, list(known.keys()), prefix)
        if isinstance(cfg[name], ml_collections.ConfigDict) and isinstance(known[name], ml_collections.ConfigDict):
            check_keys(cfg[name], known[name], f"{prefix}{name}.")


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Check everything that needs no device. Raises UserError naming the key, value, and what is allowed.

    Each section checks its own keys (`Section.validate`); what follows are the checks across sections."""
    check_keys(cfg)
    typed = sections(cfg)
    for section in typed.values():
        section.check_values()  # every key by its type: finite numbers, integers, bools (`Section.check_values`)
        section.validate()
    m, d, o, pl = cfg.model, cfg.data, cfg.optim, cfg.pipeline
    if cfg.mesh.stage > 1 or cfg.mesh.stage == -1:
        _check(m.scan_layers, "model.scan_layers", m.scan_layers,
               f"true with mesh.stage={cfg.mesh.stage} (the stages split the stacked layers)")
        _check(cfg.mesh.stage == -1 or m.n_layers % (cfg.mesh.stage * pl.repeats) == 0, "model.n_layers", m.n_layers,
               f"a multiple of mesh.stage x pipeline.repeats = {cfg.mesh.stage} x {pl.repeats}")
        _check(pl.microbatches == 0 or pl.microbatches >= cfg.mesh.stage, "pipeline.microbatches", pl.microbatches,
               f"0 (auto) or at least mesh.stage={cfg.mesh.stage}: every stage needs a micro-batch to work on")
        _check(m.mlp != "moe" or m.moe_dense_layers == 0, "model.moe_dense_layers", m.moe_dense_layers,
               f"0 with mesh.stage={cfg.mesh.stage}: pipeline stages split one stack of like layers, and dense "
               "first layers are a second stack (not built for pipelines)")
    _check(m.loss_chunk_len >= 0 and (m.loss_chunk_len == 0 or d.seq_len % m.loss_chunk_len == 0),
           "model.loss_chunk_len", m.loss_chunk_len, f"0 (off) or a divisor of data.seq_len={d.seq_len}")
    _check(d.seq_len <= m.max_seq_len, "data.seq_len", d.seq_len, f"at most model.max_seq_len={m.max_seq_len}")
    _check(d.tokenizer_vocab_size == m.vocab_size, "data.tokenizer_vocab_size", d.tokenizer_vocab_size,
           f"equal to model.vocab_size={m.vocab_size}")
    _check(o.micro_batches == 0 or d.global_batch_size % o.micro_batches == 0, "optim.micro_batches",
           o.micro_batches, f"a divisor of data.global_batch_size={d.global_batch_size}")
    if typed["lora"].active or typed["compress"].active:
        # targets and groups against the projections (an abstract build)
        transformer.ModelConfig.from_config(m, "cpu", attention="xla", log_choice=False, lora=cfg.lora,
                                            compress=cfg.compress)
    # A pruned model's updates are masked after the optimizer's (`pruning_masks.keep_pruned`): y stays zero at pruned
    # weights but schedule-free's z does not, so its evaluation point x = (y - (1 - b1) z) / b1 would not be.
    _check(o.name != "schedule_free_adamw" or not cfg.compress.sparsity > 0, "optim.name", o.name,
           f"another optimizer with config.compress.sparsity={cfg.compress.sparsity:g} (pruning masks): schedule-free "
           f"AdamW's averaged parameters would not stay zero at pruned weights")
    _check(not cfg.checkpoint.keep_best or d.val_tokens > 0, "checkpoint.keep_best", cfg.checkpoint.keep_best,
           "0 when data.val_tokens=0 (no validation loss to rank checkpoints by)")
    if d.sources:
        objective = cfg.objective.name if "objective" in cfg else "lm"
        _check(objective in ("lm", "distill"), "data.sources", d.sources,
               f"a corpus (data.corpus) with objective.name={objective}: mixtures feed the lm and distill objectives")
        last = max((step for step, _ in parse_stages(d.stages, [s.name for s in parse_sources(d.sources)])), default=0)
        _check(last <= cfg.run.steps, "data.stages", d.stages,
               f"stages that start within the run: step {last} is beyond run.steps={cfg.run.steps}")
    validate_objective(cfg)  # the chosen objective's checks across sections (`jaxlm.objectives`)
    if o.loss_scale == "dynamic" and m.dtype == "float32":
        raise UserError("config.optim.loss_scale='dynamic' with config.model.dtype='float32' is not allowed: float32 "
                        "gradients do not underflow; use loss_scale='auto' or a float16 model.dtype")


# ----------------------------------------------------------------------------- derived values


@dataclasses.dataclass(frozen=True)
class Derived:
    """Everything that follows from the config and the number of devices, computed once."""

    mesh_shape: MeshShape  # one size per axis of MESH_AXES
    num_devices: int
    batch_shards: int  # devices a batch's rows are split over: the act_batch axes (data * fsdp * expert)
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
    lines = []
    default = base_config().pipeline
    changed = [f"pipeline.{key}={cfg.pipeline[key]}" for key in default if cfg.pipeline[key] != default[key]]
    if changed and sizes_of(derived.mesh_shape)["stage"] == 1:
        lines.append(f"{', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect with one pipeline "
                     f"stage (mesh.stage={cfg.mesh.stage}): set mesh.stage to the number of stages to pipeline")
    if cfg.data.sources and cfg.data.corpus != DataConfig.defaults()["corpus"]:
        lines.append(f"data.corpus={cfg.data.corpus!r} is not read: data.sources names the corpora this run "
                     f"trains on (give the corpus as one of its sources)")
    return lines


def mesh_shape(cfg: ml_collections.ConfigDict, num_devices: int, groups: int | None = None) -> MeshShape:
    """The size of each mesh axis for `num_devices` (`MeshConfig.shape`)."""
    return MeshConfig.from_config(cfg.mesh).shape(num_devices, groups)


def pipeline_microbatch_choices(rows: int, stages: int) -> list[int]:
    """The pipeline micro-batch counts `pipeline.microbatches=0` chooses among, for a micro-batch of `rows`
    sequences per batch shard (`Derived.batch_shards`): from `stages` up to 4 x stages, dividing the rows (auto
    takes the last)."""
    return [n for n in range(stages, 4 * stages + 1) if rows % n == 0]


def check_context(cfg: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """Context parallelism (mesh.context > 1): what it needs and what it is not built for, one line each."""
    context = sizes.get("context", 1)
    if context == 1:
        return
    seq_axes = parse_rule(cfg.mesh.rules.get("act_seq", ""))
    if "context" not in seq_axes:
        raise UserError(f"config.mesh.context={context} needs the activations' sequence split over it: "
                        f"mesh.rules.act_seq={cfg.mesh.rules.get('act_seq', '')!r} should list context "
                        f"(\"context\", or \"context,tensor\" with sequence parallelism)")
    if "context" in parse_rule(cfg.mesh.rules.get("act_batch", "")):
        raise UserError("config.mesh.rules.act_batch lists context: the context axis splits the sequence, "
                        "not the rows; remove it from act_batch")
    split = context * (sizes["tensor"] if "tensor" in seq_axes else 1)
    if cfg.data.seq_len % split:
        raise UserError(f"config.data.seq_len={cfg.data.seq_len} does not split into mesh.context={context}"
                        + (f" x mesh.tensor={sizes['tensor']}" if split != context else "")
                        + f" chunks; use a sequence length that is a multiple of {split}")
    if cfg.model.get("context_layout", "balanced") == "balanced" and cfg.data.seq_len % (2 * context):
        raise UserError(f"config.data.seq_len={cfg.data.seq_len} does not split into the 2 x mesh.context={context} "
                        f"chunks of model.context_layout='balanced'; use a multiple of {2 * context}, or "
                        "model.context_layout='contiguous'")



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
    check_context(cfg, sizes)
    experts = sizes.get("expert", 1)
    if experts > 1 and m.mlp == "moe" and m.moe_experts % experts:
        raise UserError(f"config.mesh.expert={experts} does not divide config.model.moe_experts={m.moe_experts}: "
                        f"each device along the expert axis holds the same number of experts; choose an expert axis "
                        f"that divides {m.moe_experts}")
    batch_shards, batch_axes = MeshConfig.from_config(cfg.mesh).batch_split(shape)
    if not cfg.optim.micro_batches:
        raise ValueError("optim.micro_batches=0 must be resolved first (jaxlm.train_setup.resolve_config)")
    micro = cfg.data.global_batch_size // cfg.optim.micro_batches
    if micro % batch_shards:
        raise UserError(
            f"config.data.global_batch_size={cfg.data.global_batch_size} with optim.micro_batches="
            f"{cfg.optim.micro_batches} gives {micro} sequences per micro-batch, which does not divide over the "
            f"{batch_shards} devices of the batch axes {batch_axes}; use a global batch that is a multiple of "
            f"{batch_shards * cfg.optim.micro_batches}"
        )
    stages = sizes["stage"]
    pipeline_microbatches = 1
    if stages > 1:
        pl = cfg.pipeline
        if m.n_layers % (stages * pl.repeats):
            raise UserError(f"config.model.n_layers={m.n_layers} does not split into mesh.stage={stages} stages x "
                            f"pipeline.repeats={pl.repeats}; choose a stage count and repeats whose product divides it")
        rows = micro // batch_shards  # each pipeline micro-batch splits over the batch axes too
        fits = pipeline_microbatch_choices(rows, stages)
        pipeline_microbatches = pl.microbatches or (fits[-1] if fits else 0)
        if pipeline_microbatches < stages or rows % pipeline_microbatches:
            raise UserError(
                f"config.pipeline.microbatches={pl.microbatches or 'auto'}: a micro-batch of {micro} sequences has "
                f"{rows} per batch shard ({batch_axes}), which does not split into "
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
