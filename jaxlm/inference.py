"""A trained run loaded for inference: its config, tokenizer, a mesh for the devices here, and the
parameters of one checkpoint, sharded by the run's logical-axis rules. `jaxlm.evaluate` and
`jaxlm.generate` start from `load_run`.

Only the parameters are read (no optimizer state), onto whatever devices there are: the run's own
mesh when it fits them, else FSDP over all of them, else plain data parallelism.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jaxlm import axes, checkpoint, quant, train_state
from jaxlm import config as config_lib
from jaxlm import mesh as mesh_lib
from jaxlm.data import loader, sft
from jaxlm.data.tokenizer import FILE_NAMES, Tokenizer, find_in
from jaxlm.errors import UserError
from jaxlm.models import transformer
from jaxlm.run_dir import config_differences


@dataclasses.dataclass
class LoadedRun:
    run_dir: pathlib.Path
    cfg: ml_collections.ConfigDict  # the run's resolved config
    step: int  # the checkpoint the parameters come from
    model_cfg: transformer.ModelConfig
    tokenizer: Tokenizer
    mesh: Mesh
    rules: mesh_lib.Rules
    model_spec: train_state.ModelSpec
    params: Any  # nested dict of arrays, sharded by the rules
    param_shardings: Any

    @property
    def batch_shards(self) -> int:
        """Devices a batch is split over (the mesh axes of `act_batch`): batches are a multiple of this."""
        return batch_shards(self.mesh, self.rules)

    @property
    def sequence_multiple(self) -> int:
        """What a row's length must be a multiple of on this mesh (`sequence_multiple`)."""
        return sequence_multiple(self.mesh, self.rules, self.model_cfg.context_layout)

    def sharding(self, names: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, mesh_lib.logical_to_spec(names, self.rules))

    def put(self, array: np.ndarray, names: Sequence[str | None]) -> jax.Array:
        """A host array (the same on every process) onto the mesh, sharded by logical names."""
        return put_global(array, self.sharding(names))

    def chat_template(self) -> sft.Encoder:
        """The chat template this run's conversations are rendered with (`chat_template`)."""
        return chat_template(self.cfg, self.tokenizer, str(self.run_dir))


def chat_template(cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, where: str = "this model") -> sft.Encoder:
    """How a model's conversations are rendered for generation: the template it was fine-tuned with
    (data.chat_template of a run on chat rows: data.format=chat, or data.corpus=builtin_chat), else its
    tokenizer's own (an imported Hugging Face model's). A run with neither is refused in one line."""
    spec = loader.sft_spec(loader.DataConfig.from_config(cfg.data))
    if spec is not None and spec.format == "chat":
        return sft.Encoder.make(spec, tokenizer)
    if tokenizer.chat_template:
        return sft.Encoder("chat", tokenizer.chat_template, "the tokenizer's chat template")
    raise UserError(f"{where} has no chat template: it was not trained on chat rows (data.format="
                    f"{cfg.data.format}) and its tokenizer has none; chat with a run fine-tuned with "
                    f"--config.data.format=chat (and data.chat_template), or prompt it with plain text")


def put_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds whole onto `sharding`: each device takes its slice
    (also when the mesh spans processes, where `device_put` of a host array would not do)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def batch_shards(mesh: Mesh, rules: mesh_lib.Rules) -> int:
    return math.prod(mesh.shape[a] for a in mesh_lib.axes_of(mesh_lib.logical_to_spec(("act_batch",), rules)[0]))


def sequence_multiple(mesh: Mesh, rules: mesh_lib.Rules, context_layout: str) -> int:
    """The devices a row's sequence is split over (rule act_seq: mesh.context, x tensor under sequence
    parallelism), twice the context size under the balanced layout (`context_parallel`): rows padded to a
    multiple of it run on the mesh."""
    split = math.prod(mesh.shape[a] for a in mesh_lib.axes_of(dict(rules).get("act_seq")))
    context = mesh.shape.get("context", 1)
    return math.lcm(split, 2 * context) if context > 1 and context_layout == "balanced" else split


def read_config(run_dir: pathlib.Path) -> ml_collections.ConfigDict:
    """The run's config.json over the current defaults (so a run from before a key existed still loads)."""
    path = run_dir / "config.json"
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist; "
                        "give --run_dir=<run.output_dir>/<run.name> of a training run")
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.json); give the directory python -m jaxlm.train wrote")
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); it is written by python -m jaxlm.train") from None
    if isinstance(saved, dict) and not isinstance(saved.get("run"), dict) and (
            "model_type" in saved or "architectures" in saved):  # a Hugging Face model's config.json
        raise UserError(f"{run_dir} is a Hugging Face model directory, not a jaxlm run; import it first: python -m "
                        f"jaxlm.hf import --hf_dir={run_dir} --output=<a new run directory>, and give that")

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        return out

    cfg = ml_collections.ConfigDict(merge(config_lib.base_config().to_dict(), saved))
    config_lib.validate(cfg)
    return cfg


def model_config(cfg: ml_collections.ConfigDict, platform: str, dtype: str | None = None) -> transformer.ModelConfig:
    """The run's model for inference: no dropout or remat; its LoRA adapters (config.lora), if any; the
    attention kernel chosen for `platform` (a run trained with cuDNN attention is evaluated on a CPU with
    XLA's); `dtype` overrides the compute dtype."""
    overrides: dict[str, Any] = dict(dropout=0.0, remat="none")
    if dtype:
        if dtype not in transformer.DTYPES:
            raise UserError(f"--dtype={dtype}: use one of {', '.join(transformer.DTYPES)}")
        overrides["dtype"] = transformer.DTYPES[dtype]
    model_cfg = transformer.ModelConfig.from_config(cfg.model, platform, attention="auto", lora=cfg.lora,
                                                    compress=cfg.compress, **overrides)
    if model_cfg.lora is not None:  # the adapters' dropout off too
        model_cfg = dataclasses.replace(model_cfg, lora=dataclasses.replace(model_cfg.lora, dropout=0.0))
    return model_cfg


def make_inference_mesh(cfg: ml_collections.ConfigDict, model_cfg: transformer.ModelConfig, model_spec, devices,
                        rules: mesh_lib.Rules) -> tuple[Mesh, Any]:
    """(mesh, abstract params with their shardings): the run's mesh shape if it fits these devices and
    the model, else FSDP over all devices, else data parallelism (parameters replicated)."""
    n = len(devices)
    shapes = []
    try:
        shapes.append(config_lib.mesh_shape(cfg, n))
    except UserError:
        pass
    shapes += [axes.shape_of(fsdp=n), axes.shape_of(data=n)]
    abstract_params, problem = None, None
    for shape in dict.fromkeys(shapes):
        tensor = axes.sizes_of(shape)["tensor"]
        if model_cfg.n_heads % tensor or model_cfg.n_kv_heads % tensor:
            continue
        mesh = mesh_lib.make_mesh(shape, devices)
        try:
            abstract, *_ = train_state.abstract_state(model_cfg, optax.identity(), mesh, rules, 0, model_spec)
        except UserError as e:  # a parameter dimension that does not split over this mesh
            problem = problem or e
            continue
        abstract_params = abstract.params
        return mesh, abstract_params
    raise problem or UserError(f"no mesh of {n} devices fits this model")


def _check_config_matches(run_dir: pathlib.Path, cfg, ckpt_dir: pathlib.Path, steps: list[int]) -> None:
    """The model keys of `config.json` (edited by hand?) against the config the newest readable
    checkpoint saved: a difference is named, rather than found as arrays of the wrong shape."""
    for s in reversed(steps):
        try:
            with checkpoint.Checkpointer(ckpt_dir) as ckpt:
                saved = ckpt.read_meta(s).get("config")
        except Exception:  # noqa: BLE001 -- damaged metadata: restoring reports it, and falls back
            continue
        if not saved:
            return
        differences = [d for d in config_differences({"model": saved.get("model", {})}, cfg, config_lib.base_config())
                       if d.startswith("model.")]
        if differences:
            raise UserError(
                f"{run_dir / 'config.json'} disagrees with checkpoint {s} ({'; '.join(differences)}, as "
                f"checkpoint -> config.json); put the checkpoint's values back (its own copy of the config is in "
                f"{ckpt_dir / str(s) / 'meta' / 'metadata'})"
            )
        return


def cast_abstract(abstract_params, param_dtype: str | None):
    """Abstract parameters as `load_run` reads them with `param_dtype` (floating leaves cast; a QLoRA base's
    quantized codes and scales, and masks, as saved)."""
    if not param_dtype:
        return abstract_params
    if param_dtype not in transformer.DTYPES:
        raise UserError(f"--param_dtype={param_dtype}: use one of {', '.join(transformer.DTYPES)}")
    cast = transformer.DTYPES[param_dtype]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if quant.is_quantized_leaf(getattr(path[-1], "key", None))
        or not jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
        else jax.ShapeDtypeStruct(x.shape, cast, sharding=x.sharding), abstract_params)


def abstract_run(run_dir: str | pathlib.Path, mesh: Mesh, rules: mesh_lib.Rules, *, dtype: str | None = None,
                 param_dtype: str | None = None):
    """(the run's inference ModelSpec, its parameters as abstract arrays with their shardings on `mesh` by
    `rules`): what `load_run` with `mesh` and `rules` reads, from the run's config alone (no parameter read),
    for a step to be jitted, or planned, before the parameters are loaded."""
    cfg = read_config(pathlib.Path(run_dir))
    model_cfg = model_config(cfg, mesh.devices.flat[0].platform, dtype)
    spec = train_state.build_model_spec(model_cfg)
    abstract = train_state.abstract_state(model_cfg, optax.identity(), mesh, rules, 0, spec)[0].params
    return spec, cast_abstract(abstract, param_dtype)


def load_run(
    run_dir: str | pathlib.Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    param_dtype: str | None = None,
    devices: Sequence[jax.Device] | None = None,
    mesh: Mesh | None = None,
    rules: mesh_lib.Rules | None = None,
) -> LoadedRun:
    """Load checkpoint `step` (default: the newest that loads) of a run for inference.

    `dtype` overrides the compute dtype (e.g. float32 for exact comparisons); `param_dtype` casts the
    parameters as they are read (bfloat16 halves their memory; the model computes in `dtype` anyway),
    all but a QLoRA run's 4-bit base, which loads as it was saved (uint8 codes, scales).

    `mesh` and `rules` (both or neither) place the parameters on another model's mesh by that model's
    rules, as a distillation teacher runs inside its student's step (`jaxlm.post_training.distill`);
    by default the run's own rules, on the mesh `make_inference_mesh` picks for `devices`.
    """
    run_dir = pathlib.Path(run_dir)
    cfg = read_config(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    steps = checkpoint.complete_steps(ckpt_dir)
    if not steps:
        raise UserError(f"{run_dir} has no checkpoints (nothing complete in {ckpt_dir}); train it first, or wait "
                        f"for its first save")
    if step is not None and step not in steps:
        raise UserError(f"--step={step}: {run_dir} has no complete checkpoint for that step; "
                        f"its checkpoints: {', '.join(map(str, steps))}")
    _check_config_matches(run_dir, cfg, ckpt_dir, [step] if step is not None else steps)
    tok_path = find_in(run_dir)
    if tok_path is None:
        raise UserError(f"{run_dir} has no tokenizer ({' or '.join(FILE_NAMES)}); it is written by python -m "
                        f"jaxlm.train at the start of a run")
    tokenizer = Tokenizer.load(tok_path)
    if tokenizer.vocab_size > cfg.model.vocab_size:  # more model rows than tokens is fine (a padded vocabulary)
        raise UserError(f"{tok_path} has {tokenizer.vocab_size} tokens but the run's model.vocab_size is "
                        f"{cfg.model.vocab_size}; the run directory is inconsistent")
    if (mesh is None) != (rules is None):
        raise ValueError("load_run: give both mesh and rules, or neither")
    devices = list(mesh.devices.flat) if mesh is not None else list(devices) if devices is not None else jax.devices()
    model_cfg = model_config(cfg, devices[0].platform, dtype)
    model_spec = train_state.build_model_spec(model_cfg)
    if mesh is None:
        rules = mesh_lib.rules_from_config(cfg.mesh.rules)
        mesh, abstract_params = make_inference_mesh(cfg, model_cfg, model_spec, devices, rules)
    else:
        abstract_params = train_state.abstract_state(model_cfg, optax.identity(), mesh, rules, 0, model_spec)[0].params
    abstract_params = cast_abstract(abstract_params, param_dtype)
    params, step = checkpoint.load_params_and_step(ckpt_dir, abstract_params, step=step)
    shardings = jax.tree.map(lambda x: x.sharding, abstract_params)
    return LoadedRun(run_dir=run_dir, cfg=cfg, step=step, model_cfg=model_cfg, tokenizer=tokenizer,
                     mesh=mesh, rules=rules, model_spec=model_spec, params=params, param_shardings=shardings)
