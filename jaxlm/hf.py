"""Hugging Face checkpoints in and out.

    python -m jaxlm.hf import --hf_dir=DIR --output=RUN_DIR [--param_dtype=float32]
    python -m jaxlm.hf export --run_dir=RUN_DIR --output=DIR [--step=N] [--dtype=bfloat16]
    python -m jaxlm.hf export --run_dir=LORA_RUN --output=ADAPTER_DIR --adapters=peft [--base_model=ID] [--with_base]

Several processes (a model larger than one host): the same command on each, with `--coordinator`,
`--num_processes`, `--process_id` or a launcher's environment, as for `jaxlm.train`.

`import` turns a Hugging Face model directory (config.json, model.safetensors or shards with
model.safetensors.index.json, in float32, bfloat16 or float16, and its tokenizer) into a jaxlm run
directory: config.json, the tokenizer, and checkpoint 0 holding the parameters alone. evaluate,
generate and explore read it like any run; training starts from it with `--config.run.init_from`.
Each parameter is created in its shards on the devices here, each device reading only its slice of
the safetensors files, so no host ever holds the whole model.

`export` writes any jaxlm run with a Hugging Face counterpart (Llama, Qwen2, Qwen3, GPT-2; an MoE as
Mixtral or Qwen3-MoE) as a directory `transformers.AutoModelForCausalLM.from_pretrained` loads:
config.json, generation_config.json, safetensors (sharded past `--max_shard_gb`) and the tokenizer; a
LoRA run merged, or (`--adapters=peft`) its adapter alone, for the model its base was imported from
(`peft_base`).

Name maps and config translation: `jaxlm.models.hf`.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxlm import checkpoint, commands, distributed, inference, lora, train_state
from jaxlm import config as config_lib
from jaxlm import mesh as mesh_lib
from jaxlm import run_dir as run_dir_lib
from jaxlm.console import command_logging
from jaxlm.data.tokenizer import Tokenizer, write_bytes_atomically
from jaxlm.errors import UserError, run_command
from jaxlm.models import hf as hf_map
from jaxlm.models import quantized, transformer
from jaxlm.models.mlps import MLPS

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
EVAL_SEQ_LEN = 2048  # the imported run's data.seq_len, where the model takes that many positions


class SafetensorsFiles:
    """The tensors of a Hugging Face model directory, opened lazily: `slice(name)` reads nothing
    until indexed, and then only the bytes of the block asked for."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        if (directory / INDEX).is_file():
            index = hf_map.read_json(directory / INDEX, "import")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{directory / INDEX} has no weight_map; it is not a safetensors index")
            files = sorted(set(weight_map.values()))
        elif (directory / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            pickles = sorted(p.name for pattern in _PICKLES for p in directory.glob(pattern))
            if pickles:
                raise UserError(
                    f"{directory} holds only PyTorch pickle files ({', '.join(pickles[:3])}), which can run code when "
                    "loaded; jaxlm reads safetensors only: convert them where you trust the files, with transformers: "
                    "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) (writes safetensors)")
            raise UserError(f"{directory} has no {SINGLE} or {INDEX}; give a Hugging Face model directory")
        self._files: dict[str, Any] = {}
        for name in files:
            path = directory / name
            if pathlib.PurePath(name).name != name:
                raise UserError(f"{directory / INDEX} names {name!r}, which is not a file in {directory}")
            if not path.is_file():
                raise UserError(f"{path} is missing (named in {INDEX}); the checkpoint is incomplete: download it again")
            try:
                self._files[name] = safe_open(str(path), framework="numpy")
            except Exception as e:  # noqa: BLE001 -- safetensors' own words for a bad header or size
                raise UserError(f"{path} is not a complete safetensors file ({str(e).strip().splitlines()[0]}); "
                                "download or save it again") from None
        located = {key: name for name, f in self._files.items() for key in f.keys()}
        if weight_map is not None:
            for key, name in weight_map.items():
                if located.get(key) != name:
                    raise UserError(f"{directory / INDEX} says tensor {key!r} is in {name}, which does not hold it; "
                                    "the checkpoint is incomplete or mixed: download it again")
        self.location = located

    def names(self) -> list[str]:
        return sorted(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self.location[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._files[self.location[name]].get_slice(name).get_dtype()

    def slice(self, name: str):
        return self._files[self.location[name]].get_slice(name)


def _resolve_names(files: SafetensorsFiles, wanted: list[str]) -> dict[str, str]:
    """Our name -> the checkpoint's: GPT-2 checkpoints saved from `GPT2Model` lack the `transformer.` prefix."""
    out = {}
    for name in wanted:
        if name in files.location:
            out[name] = name
        elif name.startswith("transformer.") and name[len("transformer."):] in files.location:
            out[name] = name[len("transformer."):]
        else:
            raise UserError(f"{files.directory} has no tensor {name!r}, which its config.json implies; the checkpoint "
                            "does not match its config (or is incomplete)")
    return out


# ----------------------------------------------------------------------------- import


def import_checkpoint(hf_dir: str | os.PathLike, output: str | os.PathLike, *, param_dtype: str = "float32",
                      tokenizer: str | os.PathLike | None = None, devices: Sequence[jax.Device] | None = None,
                      ) -> pathlib.Path:
    """Write the Hugging Face model in `hf_dir` as a jaxlm run directory `output`; returns it."""
    hf_dir, output = pathlib.Path(hf_dir), pathlib.Path(output)
    if not hf_dir.is_dir():
        raise UserError(f"--hf_dir={hf_dir} is not a directory; give a Hugging Face model directory")
    run_dir_lib.check_new_output(output, is_a_run=True)
    if param_dtype not in transformer.DTYPES:
        raise UserError(f"--param_dtype={param_dtype}: use one of {', '.join(transformer.DTYPES)}")
    hf = hf_map.read_json(hf_dir / "config.json", "import")
    arch, keys = hf_map.model_keys(hf)
    cfg = _run_config(keys, arch, param_dtype, output, hf)  # the file's values checked before its tensors are read
    files = SafetensorsFiles(hf_dir)
    tok = _load_tokenizer(pathlib.Path(tokenizer) if tokenizer else hf_dir)
    if tok.vocab_size > keys["vocab_size"]:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but config.json's vocab_size is "
                        f"{keys['vocab_size']}; give the model's own tokenizer")
    devices = list(devices) if devices is not None else jax.devices()
    model_cfg = inference.model_config(cfg, devices[0].platform)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    _, abstract = inference.make_inference_mesh(cfg, model_cfg, train_state.build_model_spec(model_cfg), devices,
                                                rules)
    started = time.time()
    params = _read_params(files, abstract, model_cfg, arch)
    meta = {"config": cfg.to_dict(), "tokenizer_sha256": tok.sha256, "params_only": True,
            "imported_from": {"hf_dir": str(hf_dir.resolve()), "model_type": arch,
                              "dtypes": sorted({files.dtype(n) for n in files.names()})}}
    with run_dir_lib.new_output(output, is_a_run=True) as partial:  # whole or not at all
        if jax.process_index() == 0:
            write_bytes_atomically(partial / "config.json", json.dumps(cfg.to_dict(), indent=2).encode())
            tok.save(partial / tok.file_name)
        with checkpoint.Checkpointer(partial / "checkpoints", async_save=False) as ckpt:
            ckpt.save(0, {"params": params}, meta=meta, force=True)
            ckpt.wait()
            ckpt.record_manifest(0)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    log.info("imported %s (%s, %.1fM parameters) in %.1f s", hf_dir, arch, count / 1e6, time.time() - started)
    return output


def _load_tokenizer(path: pathlib.Path) -> Tokenizer:
    try:
        return Tokenizer.load(path)
    except UserError as e:
        raise UserError(f"no usable tokenizer in {path} ({e}); give --tokenizer=PATH (a tokenizer.json or "
                        "SentencePiece .model)") from None


def _run_config(keys: dict, arch: str, param_dtype: str, output: pathlib.Path,
                hf: dict | None = None) -> ml_collections.ConfigDict:
    """The imported run's config: the defaults, with the model from config.json (`hf`, naming its
    fields in a refusal)."""
    values = config_lib.base_config().to_dict()  # plain values: max_seq_len and seq_len unlinked
    values["model"].update(keys, param_dtype=param_dtype)
    values["data"].update(seq_len=min(keys["max_seq_len"], EVAL_SEQ_LEN), tokenizer_vocab_size=keys["vocab_size"])
    values["run"].update(name=output.name, output_dir=str(output.parent))
    cfg = ml_collections.ConfigDict(values)
    try:
        config_lib.validate(cfg)
    except UserError as e:  # a value of the file: named by its field, not by the jaxlm key it became
        raise UserError(hf_map.in_file_terms(str(e), arch, hf)) from None
    return cfg


def _read_params(files: SafetensorsFiles, abstract: dict, model_cfg, arch: str) -> dict:
    """Every parameter, created in its shards: each device's block read from the files alone."""
    parts = list(hf_map.param_parts(abstract, model_cfg, arch))
    wanted = sorted({n for _, part, layers, _ in parts for n in hf_map.hf_names(part, layers)})
    names = _resolve_names(files, wanted)
    for _, part, layers, _ in parts:  # every shape checked before anything is read
        for name in hf_map.hf_names(part, layers):
            shape, dtype = files.shape(names[name]), files.dtype(names[name])
            if shape != part.hf_shape:
                raise UserError(f"tensor {names[name]} has shape {list(shape)} but config.json implies "
                                f"{list(part.hf_shape)}; the weights do not match the config")
            if dtype not in hf_map.DTYPES:
                raise UserError(f"tensor {names[name]} is {dtype}; jaxlm imports F32, BF16 and F16 weights")
    used = set(names.values())
    tied = {"lm_head.weight"} if model_cfg.tie_embeddings else set()
    if tied & set(files.names()):
        _check_tied_head(files, parts, names, model_cfg)
    extra = [n for n in files.names() if n not in used and n not in tied and not n.endswith(hf_map.BUFFERS)]
    if extra:
        raise UserError(f"{files.directory} holds tensors this {arch} config does not use ({', '.join(extra[:3])}"
                        f"{', ...' if len(extra) > 3 else ''}); the config does not describe these weights")
    flat = {}
    leaves = dict(hf_map.leaves(abstract))
    for path, part, layers, stacked in parts:
        target = leaves[path]
        sources = [files.slice(names[n]) for n in hf_map.hf_names(part, layers)]

        def block(index, part=part, sources=sources, stacked=stacked, target=target):
            return hf_map.read_block(sources, part, stacked, target.shape, index).astype(target.dtype)

        flat[path] = jax.make_array_from_callback(target.shape, target.sharding, block)
    for path, part, layers, _ in parts:  # a weight that is not finite would train and sample nan
        if not bool(jax.device_get(jnp.isfinite(flat[path]).all())):
            tensors = ", ".join(names[n] for n in hf_map.hf_names(part, layers)[:2])
            raise UserError(f"{files.directory}: tensor {tensors} holds nan or inf values as read in "
                            f"{np.dtype(model_cfg.param_dtype).name} (a damaged checkpoint, or weights beyond that "
                            f"dtype's range: --param_dtype=float32 reads them whole); download or save it again")
    return _unflatten(flat)


def _check_tied_head(files: SafetensorsFiles, parts, names: dict[str, str], model_cfg) -> None:
    """config.json ties the output layer to the embedding, but the files also hold an lm_head.weight: one
    that equals the embedding is the tie written out (imported tied); one that differs is a model that
    transformers loads untied, which jaxlm would import as something else: refused in one line."""
    path, part, layers, stacked = next(p for p in parts if p[0][0] == "embed")
    embedding = names[hf_map.hf_names(part, layers)[0]]
    whole = tuple(slice(None) for _ in part.hf_shape)
    if files.shape("lm_head.weight") != files.shape(embedding) or not np.array_equal(
            hf_map.read_slice(files.slice("lm_head.weight"), part, whole),
            hf_map.read_slice(files.slice(embedding), part, whole)):
        raise UserError(f"{files.directory}/config.json ties the output layer to the embedding (tie_word_embeddings), "
                        f"but its weights hold an lm_head.weight that differs from {embedding}, which transformers "
                        f"loads untied: set \"tie_word_embeddings\": false in config.json to import the model it "
                        f"computes")


def _unflatten(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


# ----------------------------------------------------------------------------- export


ADAPTER_CHOICES = commands.ADAPTER_CHOICES
BASE_DIR = "base"  # --adapters=peft --with_base: the base model's directory inside the adapter's


def export_run(run_dir: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None,
               dtype: str | None = None, max_shard_bytes: int = 5 * 10**9, adapters: str = "merge",
               base_model: str | None = None, with_base: bool = False) -> pathlib.Path:
    """Write checkpoint `step` (default: the newest that loads) of a jaxlm run as a Hugging Face
    model directory `output`, its weights in `dtype` (default: the run's `model.param_dtype`).

    A LoRA run's adapters are merged into the weights (`adapters="merge"`), or (`"peft"`) `output` is
    the adapter alone in PEFT's format (adapter_config.json, adapter_model.safetensors), whose
    `base_model_name_or_path` is `base_model` if given, else the Hugging Face model the run's base was
    imported from (`peft_base`); `peft.PeftModel.from_pretrained(base, output)` loads it. `with_base`
    also writes the run's frozen base as a Hugging Face model in `<output>/base` and points the adapter
    at it (unless `base_model` is given). A QLoRA run's 4-bit base is exported dequantized (the weights
    the run trained over): merged, or as the base `with_base` writes; its adapter alone belongs to that
    dequantized base, which one warning line says."""
    output = pathlib.Path(output)
    run_dir_lib.check_new_output(output)
    if adapters not in ADAPTER_CHOICES:
        raise UserError(f"--adapters={adapters}: use one of {', '.join(ADAPTER_CHOICES)}")
    if adapters != "peft" and (base_model or with_base):
        raise UserError(f"--{'base_model' if base_model else 'with_base'} is for an adapter export: add "
                        f"--adapters=peft, or drop it to export the merged model")
    run = inference.load_run(run_dir, step=step)
    dtype = dtype or run.cfg.model.param_dtype
    if dtype not in transformer.DTYPES:
        raise UserError(f"--dtype={dtype}: use one of {', '.join(transformer.DTYPES)}")
    np_dtype = np.dtype(transformer.DTYPES[dtype])
    # A compressed run (jaxlm.compress, QAT, QLoRA's base): the float weights it computes with.
    params, model_cfg = quantized.to_float(run.params, run.model_cfg)
    adapted = None
    if lora.sites(model_cfg):  # a QLoRA run's base is dequantized (`lora.base_weights`, `lora.merge`)
        if adapters == "peft":
            adapted, params = (params, model_cfg), lora.base_weights(params, model_cfg)
        else:
            params = lora.merge(params, model_cfg)
        model_cfg = lora.without_lora(model_cfg)
    elif adapters == "peft":
        raise UserError(f"{run_dir} has no LoRA adapters (lora.rank=0); --adapters=peft exports a run trained with them")
    arch = hf_map.architecture_of(model_cfg)
    if adapted is None:
        with run_dir_lib.new_output(output) as partial:  # whole or not at all
            _write_model(partial, run, params, model_cfg, arch, dtype, max_shard_bytes)
        return output
    peft_tensors = _peft_tensors(*adapted, model_cfg, arch, np_dtype)  # checked before writing
    source, unknown = peft_base(run)
    if base_model:
        base, revision = base_model, None
    elif with_base:
        base, revision = str(output.resolve() / BASE_DIR), None
    elif source:
        base, revision = _hub_id(source) or (source, None)
    else:
        raise UserError(f"{unknown}; give the base model the adapter belongs to with --base_model=DIR_OR_HUB_ID, "
                        f"or --with_base to write the run's base beside the adapter")
    with run_dir_lib.new_output(output) as partial:  # whole or not at all
        if with_base:
            _write_model(partial / BASE_DIR, run, params, model_cfg, arch, dtype, max_shard_bytes)
        if jax.process_index() == 0:
            _write_peft(partial, base, revision, *peft_tensors, adapted[1])
    quantized_as = run.cfg.lora.quantize_base
    if quantized_as:
        original = source or "the run's source"
        if with_base:
            log.warning("this QLoRA adapter belongs to the %s-dequantized base in %s (the weights the run trained "
                        "over), not to %s itself", quantized_as, output / BASE_DIR, original)
        else:
            log.warning("this QLoRA adapter was trained over the %s-dequantized weights of %s, and on the original "
                        "weights computes another model: --with_base writes that dequantized base into %s and points "
                        "the adapter at it", quantized_as, original, output / BASE_DIR)
    return output


def peft_base(run: inference.LoadedRun) -> tuple[str | None, str]:
    """(the Hugging Face model directory a LoRA run's frozen base was imported from, ""): the run started
    (`run.init_from`, recorded in its checkpoint's metadata) from a run `jaxlm.hf import` wrote, whose
    parameters are that model's. Otherwise (None, why not, in words): a run from scratch, a source
    that has gone, one whose weights are its own (trained, compressed)."""
    with checkpoint.Checkpointer(run.run_dir / "checkpoints") as ckpt:
        record = ckpt.read_meta(run.step).get("init_from")
    if not record and run.cfg.run.init_from:  # saved without the record: the config's
        record = {"run_dir": run.cfg.run.init_from, "step": run.cfg.run.init_step if run.cfg.run.init_step >= 0
                  else None}
    if not record:
        return None, f"{run.run_dir} was not started from an imported Hugging Face model (no run.init_from)"
    source = pathlib.Path(record["run_dir"])
    steps = checkpoint.complete_steps(source / "checkpoints") if source.is_dir() else []
    step = record.get("step")
    if not steps or (step is not None and step not in steps):
        at = "" if step is None else f" step {step}"
        return None, (f"{run.run_dir} was started from {source}{at}, which is no longer there to say which model "
                      f"it was imported from")
    with checkpoint.Checkpointer(source / "checkpoints") as ckpt:
        imported = ckpt.read_meta(step if step is not None else steps[-1]).get("imported_from")
    if not imported:
        return None, (f"{run.run_dir} was started from {source}, which holds weights of its own, not a Hugging Face "
                      f"model as imported (python -m jaxlm.hf export --run_dir={source} makes one of them)")
    return imported["hf_dir"], ""


def _hub_id(path: str) -> tuple[str, str] | None:
    """A directory of the Hugging Face hub's cache, `<cache>/models--<org>--<name>/snapshots/<commit>` as
    `snapshot_download` leaves it -> (the repo id, the commit): what an adapter names its base by, and
    what `AutoPeftModelForCausalLM` downloads anywhere. None for any other directory (named by its path)."""
    snapshot = pathlib.PurePath(path)
    repo = snapshot.parent.parent.name
    if snapshot.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    parts = repo[len("models--"):].split("--")  # the cache's "/" -> "--"; a name holding "--" stays a path
    return ("/".join(parts), snapshot.name) if 1 <= len(parts) <= 2 and all(parts) else None


def _write_model(directory: pathlib.Path, run: inference.LoadedRun, params: dict, model_cfg, arch: str, dtype: str,
                 max_shard_bytes: int) -> None:
    """The Hugging Face model directory of `params` (every process gathers; process 0 writes):
    safetensors, config.json, generation_config.json and the run's tokenizer."""
    np_dtype = np.dtype(transformer.DTYPES[dtype])
    writer = _ShardWriter(directory, max_shard_bytes) if jax.process_index() == 0 else None
    for name, tensor in hf_map.hf_tensors(params, model_cfg, arch, np_dtype, to_host=_to_host,
                                          build=writer is not None):
        if writer:
            writer.add(name, tensor)
    if not writer:
        return
    tok = run.tokenizer
    writer.close()
    # A pad id that is only the eos stand-in (`Tokenizer.pad_id`) is no pad token of the model's.
    pad_id = None if tok.pad_id == tok.eos_id else tok.pad_id
    hf = hf_map.hf_config(model_cfg, arch, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=pad_id, dtype=dtype)
    _write_json(directory / "config.json", hf)
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"], "do_sample": False}
    if hf["pad_token_id"] is not None:
        generation["pad_token_id"] = hf["pad_token_id"]
    _write_json(directory / "generation_config.json", generation)
    tok.save(directory / tok.file_name)
    if tok.file_name == "tokenizer.model":  # SentencePiece: say which pieces are special, and that BOS starts a text
        _write_json(directory / "tokenizer_config.json", {
            **{f"{kind}_token": tok.token_text(getattr(tok, f"{kind}_id")) or None
               for kind in ("bos", "eos", "unk")},
            "pad_token": None if pad_id is None else tok.token_text(pad_id), "add_bos_token": tok.adds_bos,
            "add_eos_token": False, "model_max_length": model_cfg.max_seq_len})


def _peft_tensors(params: dict, cfg, base_cfg, arch: str,
                  dtype) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, dict]]:
    """The adapters as PEFT's tensors (`base_model.model.<module>.lora_A.weight` [r, in] and
    `lora_B.weight` [out, r]), jaxlm's projection name -> the checkpoint's module name, and an MoE's
    expert adapters as adapters of transformers' fused expert parameters (`hf_map.peft_expert_matrices`:
    their `target_parameters`, `rank_pattern` and `alpha_pattern` entries)."""
    outside = hf_map.name_map(base_cfg, arch)[1]
    tensors, modules = {}, {}
    expert_sizes = {name: shape[-1] for name, shape in MLPS[cfg.mlp].expert_shapes(cfg).items()}
    experts: dict[int, dict] = {}  # layer -> expert name -> (A, B, scale): PEFT's fused parameters, below
    for site in lora.sites(cfg):
        if site.name in expert_sizes:
            node = params
            for k in site.path:
                node = node[k]
            a, b = _to_host(node["lora_a"]), _to_host(node["lora_b"])
            per_layer = ([(site.first + i, a[i], b[i]) for i in range(a.shape[0])] if site.stacked
                         else [(site.layer, a, b)])
            for layer, la, lb in per_layer:
                experts.setdefault(layer, {})[site.name] = (la, lb, site.scale)
            continue
        in_block = site.path[0] in transformer.STACKS
        key = (*(p for p in site.path[1:] if not isinstance(p, int)), "kernel") if in_block else (*site.path, "kernel")
        part = (hf_map.layer_parts(base_cfg, arch, site.path) if in_block else outside)[key]
        x, kernel = site.equation.split("->")[0].split(",")
        in_axes = tuple(i for i, c in enumerate(kernel) if c in x)
        node = params
        for k in site.path:
            node = node[k]
        a, b = _to_host(node["lora_a"]), _to_host(node["lora_b"])
        per_layer = [(site.first + i, a[i], b[i]) for i in range(a.shape[0])] if site.stacked else [(site.layer, a, b)]
        for layer, la, lb in per_layer:
            lora_a, lora_b = hf_map.peft_matrices(part, in_axes, la, lb)
            module = (part.hf.format(layer=layer) if layer is not None else part.hf).removesuffix(".weight")
            # C order: safetensors writes an array's buffer as it lies, and a transpose is a strided view
            tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(lora_a, dtype)
            tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(lora_b, dtype)
            modules[site.name] = module.rsplit(".", 1)[-1]
    fused: dict[str, dict] = {"target_parameters": {}, "rank_pattern": {}, "alpha_pattern": {}}
    for layer, adapted in sorted(experts.items()):
        matrices = hf_map.peft_expert_matrices(adapted, expert_sizes)
        for i, (param, (lora_a, lora_b, rank, alpha)) in enumerate(matrices.items()):
            # PEFT wraps a module's parameters one inside the other, the first it registers innermost
            module = f"model.layers.{layer}.{hf_map.EXPERTS_MODULE}" + ".base_layer" * (len(matrices) - 1 - i)
            tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(lora_a, dtype)
            tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(lora_b, dtype)
            fused["target_parameters"][f"{hf_map.EXPERTS_MODULE}.{param}"] = None
            # (peft 0.21 warns that these patterns match no targeted module, its check looking at modules
            # alone, and applies them to the parameters: tests/test_hf_moe.py loads ranks 4 + 2)
            fused["rank_pattern"][param], fused["alpha_pattern"][param] = rank, alpha
    return tensors, modules, fused


def _write_peft(directory: pathlib.Path, base: str, revision: str | None, tensors: dict[str, np.ndarray],
                modules: dict[str, str], fused: dict[str, dict], cfg) -> None:
    """adapter_model.safetensors and adapter_config.json, as `peft` saves a LoRA adapter of `base`
    (a directory or a hub id, at `revision`). An MoE's expert adapters adapt transformers' fused expert
    parameters (`fused`: `target_parameters`, their ranks and alphas); PEFT refuses dropout on those, so
    with them the config says none (it acts in training alone; jaxlm's expert adapters have none)."""
    settings = cfg.lora.peft_settings()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    extra = {"target_parameters": list(fused["target_parameters"]), "lora_dropout": 0.0} if fused[
        "target_parameters"] else {}
    _write_json(directory / "adapter_config.json", {
        **settings, "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "revision": revision, "target_modules": sorted({modules[n] for n in settings["target_modules"] if n in modules}),
        "rank_pattern": {**{modules[n]: r for n, r in settings["rank_pattern"].items() if n in modules},
                         **fused["rank_pattern"]},
        "alpha_pattern": fused["alpha_pattern"], **extra,
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None})


def _to_host(x: jax.Array) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _write_json(path: pathlib.Path, value: Any) -> None:
    write_bytes_atomically(path, (json.dumps(value, indent=2) + "\n").encode())


class _ShardWriter:
    """Safetensors files of at most `max_bytes` each (one tensor may exceed it), named as
    `save_pretrained` names them, with the index when there is more than one."""

    def __init__(self, output: pathlib.Path, max_bytes: int):
        self.output, self.max_bytes = output, max_bytes
        output.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes, self.written, self.total_bytes = 0, [], 0

    def add(self, name: str, tensor: np.ndarray) -> None:
        if self.pending and self.pending_bytes + tensor.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(tensor)
        self.pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def _flush(self) -> None:
        path = self.output / f".shard-{len(self.written)}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:
            os.replace(self.written[0][0], self.output / SINGLE)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{len(self.written):05d}.safetensors"
            os.replace(path, self.output / final)
            weight_map.update(dict.fromkeys(names, final))
        _write_json(self.output / INDEX, {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})


# ----------------------------------------------------------------------------- the command


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda: _main(argv), resume="run the same command again with a new --output")


make_parser = commands.hf_parser  # the command line, declared in jaxlm.commands (light to import)


def _main(argv: Sequence[str] | None) -> int:
    parser = make_parser()
    argv, layout_flags = distributed.pop_flags(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    command_logging()
    joined = distributed.join(**layout_flags)  # several processes: each reads (or gathers) its devices' shards
    if joined:
        print(f"jaxlm: {joined}")
    if args.command == "import":
        out = import_checkpoint(args.hf_dir, args.output, param_dtype=args.param_dtype,
                                tokenizer=args.tokenizer or None)
        print(f"jaxlm: wrote run directory {out}: evaluate, generate or explore it, or train from it with "
              f"--config.run.init_from={out}")
    else:
        out = export_run(args.run_dir, args.output, step=args.step, dtype=args.dtype or None,
                         max_shard_bytes=int(args.max_shard_gb * 1e9), adapters=args.adapters,
                         base_model=args.base_model or None, with_base=args.with_base)
        if args.adapters == "peft":
            base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
            print(f"jaxlm: wrote PEFT adapter {out} (adapter_config.json, adapter_model.safetensors) for the base "
                  f"model {base}: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {out})")
        else:
            print(f"jaxlm: wrote Hugging Face model directory {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
