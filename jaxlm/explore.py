"""The notebook API: build a model from a recipe, look inside it, run it on text, train it a few
steps in a loop you control, save, load and sample. Each function is a thin layer over what the
CLI uses (`train_setup.build`, `load_data`, the compiled train and eval steps, `Checkpointer`,
`inference.load_run`, `generate.Generator`), so a notebook runs exactly what `python -m
jaxlm.train` runs.

    from jaxlm import explore
    setup = explore.build("tiny", devices=1, model__vocab_size=512)   # a__b=v overrides
    explore.parameter_table(setup)           # names, shapes, logical axes, specs, shards, counts
    data = explore.load_data(setup)
    explore.forward(setup, "def main():", data.tokenizer).loss
    for metrics in explore.train_steps(setup, data, 50): ...
    explore.evaluate(setup, data)
    explore.sample(setup, ["def "], data.tokenizer, max_new_tokens=40)
    explore.chat(setup, [{"role": "user", "content": "hi"}], data.tokenizer)  # a chat run: its template
    run_dir = explore.save(setup, data, "runs/notebook")   # a run directory the CLI resumes
    loaded = explore.load(run_dir)             # parameters only, on the devices here
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import checkpoint, generate, inference, init_from, steps, train_setup, xla_flags
from jaxlm import config as config_lib
from jaxlm import mesh as mesh_lib
from jaxlm.axes import MESH_AXES
from jaxlm.axes import describe as describe_mesh
from jaxlm.data import loader, sft
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError
from jaxlm.models import transformer
from jaxlm.run_dir import check_run_dir, make_run_dir, run_dir_path
from jaxlm.table import Table

Model = train_setup.TrainSetup | inference.LoadedRun  # what inspection, forward and sampling accept


# ----------------------------------------------------------------------------- building


def make_config(recipe: str | ml_collections.ConfigDict = "tiny", *,
                mesh: Mapping[str, int] | Sequence[int] | None = None, **overrides: Any) -> ml_collections.ConfigDict:
    """A validated config: a recipe name or path (or a ConfigDict, copied) with `a__b=value`
    overrides; `mesh=dict(data=2, tensor=4)` (sizes by axis name, 1 for the axes not named) or a size per
    axis of MESH_AXES, in its order, sets the mesh sizes."""
    if isinstance(recipe, ml_collections.ConfigDict):
        cfg = copy.deepcopy(recipe)
    else:
        cfg = config_lib.load_recipe(recipe)
    if isinstance(mesh, Mapping):
        unknown = sorted(set(mesh) - set(MESH_AXES))
        if unknown:
            raise UserError(f"mesh={dict(mesh)}: no axis {', '.join(unknown)}; the axes are {', '.join(MESH_AXES)}")
        mesh = [mesh.get(a, 1) for a in MESH_AXES]
    if mesh is not None:
        if len(mesh) != len(MESH_AXES):
            raise UserError(f"mesh={tuple(mesh)}: give {len(MESH_AXES)} sizes ({', '.join(MESH_AXES)}); "
                            f"-1 takes the devices left over")
        overrides = {**{f"mesh__{a}": size for a, size in zip(MESH_AXES, mesh)}, **overrides}
    pairs = [(k.replace("__", "."), v) for k, v in overrides.items()]
    config_lib.apply_overrides(cfg, pairs)
    if cfg.run.init_from:  # that run's architecture and tokenizer
        init_from.resolve_config(cfg, pairs)
    config_lib.validate(cfg)
    return cfg


def pick_devices(devices: int | str | Sequence[jax.Device] | None) -> list[jax.Device]:
    """None: every device; an int n: the first n; a platform name ('cpu', 'gpu'): that platform's."""
    if devices is None:
        return jax.devices()
    if isinstance(devices, str):
        return jax.devices(devices)
    if isinstance(devices, int):
        available = jax.devices()
        if not 1 <= devices <= len(available):
            raise UserError(f"devices={devices}: there are {len(available)} devices ({available[0].platform})")
        return available[:devices]
    return list(devices)


def build(recipe: str | ml_collections.ConfigDict = "tiny", devices: int | str | Sequence[jax.Device] | None = None,
          *, mesh: Mapping[str, int] | Sequence[int] | None = None, abstract: bool = False,
          **overrides: Any) -> train_setup.TrainSetup:
    """A `TrainSetup` (mesh, sharded train state, compiled steps) for a recipe on `devices`.

    `build("tiny", devices=1)` is one device; `build("1b", devices="cpu", mesh=dict(fsdp=4, tensor=2),
    abstract=True)` lays a large model out on 8 CPU devices without allocating it (shapes and
    shardings only: for `parameter_table`, `show_sharding` and `TrainSetup.compile_train_step`).
    `run__xla_flags` takes effect only in the first `build` of a kernel that has not started JAX yet.
    """
    cfg = make_config(recipe, mesh=mesh, **overrides)
    xla_flags.apply(cfg.run.xla_flags)  # before pick_devices starts JAX; once it has, refused, not ignored
    # the default only where it still can be (a notebook's TPU may be running already); a changed one, or refused
    xla_flags.apply_libtpu(cfg.run.libtpu_flags, required=cfg.run.libtpu_flags != xla_flags.LIBTPU_DEFAULT)
    return train_setup.build(cfg, pick_devices(devices), abstract=abstract)


def load_data(setup_or_cfg: train_setup.TrainSetup | ml_collections.ConfigDict) -> loader.Data:
    """The config's data: training stream (`.train`), held-out batches and tokenizer (cached in
    `data.cache_dir`, the same cache the CLI uses). In a run of several processes, give the setup: each
    process reads the rows of each batch its devices hold."""
    if not isinstance(setup_or_cfg, train_setup.TrainSetup):
        return loader.load_data(loader.DataConfig.from_config(setup_or_cfg.data))
    cfg = setup_or_cfg.cfg
    rows = None if jax.process_count() == 1 else loader.rows_held(
        setup_or_cfg.batch_sharding, (cfg.data.global_batch_size, cfg.data.seq_len))
    return loader.load_data(loader.DataConfig.from_config(cfg.data), rows=rows)


# ----------------------------------------------------------------------------- inspection


@dataclasses.dataclass(frozen=True)
class Parameter:
    name: str  # dotted path, e.g. blocks.attn.wq
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...]  # the names the model gives its dimensions
    spec: P  # the mesh axes each dimension is split over, from config.mesh.rules
    shard_shape: tuple[int, ...]  # what one device holds
    count: int  # elements in the whole parameter
    bytes_per_device: int


def _params_and_names(model: Model):
    if isinstance(model, train_setup.TrainSetup):
        return model.state.params, model.model_spec.logical_names, model.mesh, model.rules
    return model.params, model.model_spec.logical_names, model.mesh, model.rules


def parameters(model: Model) -> list[Parameter]:
    """Every parameter of a TrainSetup (concrete or abstract) or a loaded run, in tree order."""
    params, names, mesh, rules = _params_and_names(model)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_names = jax.tree_util.tree_leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    out = []
    for (path, leaf), axes in zip(flat, flat_names, strict=True):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            sharding = NamedSharding(mesh, mesh_lib.logical_to_spec(axes, rules))
        shard = tuple(sharding.shard_shape(leaf.shape))
        dtype = np.dtype(leaf.dtype)
        out.append(Parameter(
            name=".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), shape=tuple(leaf.shape),
            dtype=dtype.name, logical_axes=tuple(axes), spec=sharding.spec, shard_shape=shard,
            count=math.prod(leaf.shape), bytes_per_device=math.prod(shard) * dtype.itemsize,
        ))
    return out


def parameter_table(model: Model) -> Table:
    """Name, shape, dtype, logical axes, PartitionSpec, per-device shard, count; totals below."""
    rows = parameters(model)
    mesh = _params_and_names(model)[2]
    total = sum(p.count for p in rows)
    per_device = sum(p.bytes_per_device for p in rows)
    mesh_text = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    footer = (f"{total:,} parameters ({total / 1e6:.2f}M) on mesh {mesh_text}; "
              f"{_bytes(per_device)} of parameters per device")
    return Table(
        ["name", "shape", "dtype", "logical axes", "spec", "per device", "count"],
        [(p.name, p.shape, p.dtype, p.logical_axes, spec_text(p.spec), p.shard_shape, p.count) for p in rows],
        footer,
    )


def spec_text(spec: P) -> str:
    parts = [("(" + ", ".join(a) + ")" if isinstance(a, tuple) else str(a)) for a in spec]
    return "P(" + ", ".join(parts) + ")"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def describe(setup: train_setup.TrainSetup) -> str:
    """One paragraph: model, devices, mesh, batch split, FLOPs."""
    cfg, d, m = setup.cfg, setup.derived, setup.model_cfg
    counts = transformer.param_count(m)
    devices = list(setup.mesh.devices.flat)
    return (
        f"{cfg.run.get('recipe', '?')} ({cfg.model.variant}: {m.norm}, {m.mlp}, {m.position} positions), "
        f"{counts['total'] / 1e6:.2f}M parameters, {m.n_layers} layers x d_model {m.d_model}, "
        f"{m.n_heads} heads ({m.n_kv_heads} kv) of {m.head_dim}, mlp {m.mlp_dim}, vocab {m.vocab_size}; "
        f"{len(devices)} {devices[0].platform} device(s), mesh {describe_mesh(d.mesh_shape)}; "
        f"batch {cfg.data.global_batch_size} x {cfg.data.seq_len} "
        f"({d.per_device_batch} sequences per device), {d.tokens_per_step:,} tokens/step, "
        f"{transformer.flops_per_token(m, cfg.data.seq_len) / 1e6:.1f} MFLOPs/token; attention={m.attention}"
    )


def find_parameter(model: Model, name: str) -> Parameter:
    found = {p.name: p for p in parameters(model)}
    if name not in found:
        raise UserError(f"no parameter {name!r}; parameters: {', '.join(found)}")
    return found[name]


def sharding_view(shape: Sequence[int], spec: P, mesh_sizes: Mapping[str, int] | None = None
                  ) -> tuple[tuple[int, ...], P, str]:
    """A 1-D or 2-D view of a parameter's layout for `jax.debug.visualize_sharding`: leading
    unsplit dimensions (the stacked `layers`) are dropped, as every layer is laid out alike, and an
    unsplit dimension is merged into the one before it, which keeps each shard contiguous. With
    `mesh_sizes`, a dimension over mesh axes of size 1 counts as unsplit; the stacked layers split into
    pipeline stages are drawn for one stage."""
    def split(entry) -> bool:
        return bool(entry) and (mesh_sizes is None or any(mesh_sizes.get(a, 1) > 1 for a in mesh_lib.axes_of(entry)))

    dims = [(size, entry if split(entry) else None) for size, entry in zip(shape, list(spec) + [None] * len(shape))]
    note = []
    while len(dims) > 2 and dims[0][1] is None:
        note.append(f"one slice of the leading dimension of {dims[0][0]}")
        dims.pop(0)
    for i in range(len(dims) - 1, 0, -1):
        if len(dims) > 2 and dims[i][1] is None:
            size, _ = dims.pop(i)
            dims[i - 1] = (dims[i - 1][0] * size, dims[i - 1][1])
    if len(dims) > 2:  # the stacked layers, split into stages: one stage's layers
        size, entry = dims.pop(0)
        note.append(f"the layers of one of the shards of the leading dimension of {size} (split over {entry})")
    if len(dims) > 2:
        raise UserError(f"a parameter of shape {tuple(shape)} split as {spec} has no 2-D view; "
                        f"use treescope.render_array_sharding on it")
    return tuple(s for s, _ in dims), P(*(a for _, a in dims)), "; ".join(note)


def show_sharding(model: Model, name: str) -> None:
    """Draw which device holds which block of a parameter (`jax.debug.visualize_sharding`, rich)."""
    p = find_parameter(model, name)
    mesh = _params_and_names(model)[2]
    shape, spec, note = sharding_view(p.shape, p.spec, dict(mesh.shape))
    print(f"{name} {p.shape} {spec_text(p.spec)} -> shards of {p.shard_shape}" + (f" (drawn: {note})" if note else ""))
    jax.debug.visualize_sharding(shape, NamedSharding(mesh, spec))


def device_memory_table(model: Model) -> Table:
    """Parameter bytes on each device (every device holds its shard of every parameter)."""
    params, _, mesh, _ = _params_and_names(model)
    per_device: dict[Any, int] = {d: 0 for d in mesh.devices.flat}
    for leaf in jax.tree.leaves(params):
        sharding = leaf.sharding
        itemsize = np.dtype(leaf.dtype).itemsize
        for device, index in sharding.devices_indices_map(leaf.shape).items():
            sizes = [len(range(*s.indices(n))) for s, n in zip(index, leaf.shape)]
            per_device[device] += math.prod(sizes) * itemsize
    coords = {d: c for c, d in np.ndenumerate(mesh.devices)}
    return Table(["device", f"mesh position ({', '.join(mesh.axis_names)})", "parameter bytes"],
                 [(str(d), coords[d], _bytes(n)) for d, n in per_device.items()])


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class Forward:
    """A forward pass on one text: tokens, next-token logits and losses (position i predicts i + 1)."""

    text: str
    ids: list[int]  # BOS then the text's tokens
    logits: np.ndarray  # float32 [len(ids) - 1, vocab]: the prediction after each token but the last
    losses: np.ndarray  # float32 [len(ids) - 1]: cross-entropy of each next token, nats
    tokenizer: Tokenizer

    @property
    def loss(self) -> float:
        return float(self.losses.mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def top(self, k: int = 3) -> Table:
        """For each position: the actual next token, its loss, and the model's k likeliest."""
        decode = self.tokenizer.decode
        order = np.argsort(-self.logits, axis=-1)[:, :k]
        rows = [(i, repr(decode([self.ids[i + 1]])), float(self.losses[i]),
                 "  ".join(repr(decode([int(t)])) for t in order[i]))
                for i in range(len(self.losses))]
        return Table(["position", "next token", "loss", f"top {k} predicted"], rows)


def _forward_fn(params, batch, *, graphdef, rules):
    with spmd.logical_axis_rules(rules):
        model = nnx.merge(graphdef, params)
        logits = model(batch["inputs"], batch["positions"], batch["segment_ids"]).astype(jnp.float32)
        return logits, steps.token_losses(logits, batch["targets"], 0.0)


_forward_jit = jax.jit(_forward_fn, static_argnames=("graphdef", "rules"))


def forward(model: Model, texts: str | Sequence[str], tokenizer: Tokenizer | None = None) -> Forward | list[Forward]:
    """Run the model on text (each with BOS in front): logits and per-token losses, on the model's
    mesh. A TrainSetup needs the `tokenizer` (`load_data(...).tokenizer`); a loaded run has its own."""
    tokenizer = tokenizer or getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise UserError("forward(setup, text, tokenizer): pass the tokenizer, e.g. load_data(setup).tokenizer")
    single = isinstance(texts, str)
    texts = [texts] if single else list(texts)
    params, _, mesh, rules = _params_and_names(model)
    context = model.model_cfg.max_seq_len
    ids = tokenizer.encode(texts, add_bos=True, add_eos=False)
    longest = max(len(row) for row in ids)
    if longest > context + 1:
        raise UserError(f"a text is {longest - 1} tokens but the model's context is {context} "
                        f"(model.max_seq_len); shorten it")
    if longest < 2:
        raise UserError("a text gives no tokens to predict; give non-empty text")
    shards = inference.batch_shards(mesh, rules)
    rows, length = -(-len(texts) // shards) * shards, longest - 1
    batch = {k: np.zeros((rows, length), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    for r, row in enumerate(ids):
        n = len(row) - 1
        batch["inputs"][r, :n], batch["targets"][r, :n] = row[:-1], row[1:]
        batch["segment_ids"][r, :n], batch["positions"][r, :n] = 1, np.arange(n)
    batch["weights"] = (batch["segment_ids"] > 0).astype(np.float32)
    sharding = NamedSharding(mesh, mesh_lib.logical_to_spec(("act_batch", "act_seq"), rules))
    with jax.set_mesh(mesh):
        device_batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
        logits, losses = jax.device_get(
            _forward_jit(params, device_batch, graphdef=model.model_spec.graphdef, rules=rules))
    out = [Forward(text=t, ids=row, logits=logits[r, :len(row) - 1], losses=losses[r, :len(row) - 1], tokenizer=tokenizer)
           for r, (t, row) in enumerate(zip(texts, ids))]
    return out[0] if single else out


def train_steps(setup: train_setup.TrainSetup, data: loader.Data, steps: int) -> Iterator[dict[str, float]]:
    """Run `steps` steps of the compiled train step on the next batches of `data.train`, yielding
    each step's metrics (step, loss, grad_norm, lr, ...) as floats; `setup.state` advances.

    The same step and batches as `python -m jaxlm.train`; the learning-rate schedule follows
    `run.steps` of the config. The state is donated: keep `setup.state`, not an old reference.
    """
    with jax.set_mesh(setup.mesh):
        for _ in range(steps):
            batch = next(data.train)
            packed = setup.attention_choice(batch)  # cuDNN's kernel for the batch, as the trainer chooses it
            setup.state, metrics = setup.train_step(setup.state, setup.put_batch(batch), packed)
            values = setup.objective.scalars(metrics)  # (a data mixture's loss and tokens by source by name)
            values["step"] = int(jax.device_get(setup.state.step))
            values["epoch"] = data.train.epoch
            yield values


def evaluate(setup: train_setup.TrainSetup, data: loader.Data) -> dict[str, float]:
    """Held-out val_loss, val_perplexity and val_bits_per_byte, as the CLI logs them."""
    return train_setup.evaluate(setup, setup.state.params, data.eval_batches, data.eval_target_bytes)


# ----------------------------------------------------------------------------- checkpoints


def save(setup: train_setup.TrainSetup, data: loader.Data, run_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write a run directory like the CLI's (config.json, the tokenizer, checkpoints/<step>/ with
    the train state and the data position): `load` reads it, and `python -m jaxlm.train` with the
    same config and `run.name` continues training it. Default: `run.output_dir/run.name`."""
    cfg = setup.cfg
    run_dir = pathlib.Path(run_dir) if run_dir is not None else run_dir_path(cfg)
    if run_dir_path(cfg) != run_dir:
        cfg = copy.deepcopy(cfg)
        cfg.run.output_dir, cfg.run.name = str(run_dir.parent), run_dir.name
    step = int(jax.device_get(setup.state.step))
    check_run_dir(run_dir)  # a directory jaxlm did not write is refused, as the CLI refuses it
    make_run_dir(run_dir, cfg, step)
    data.tokenizer.save(run_dir / data.tokenizer.file_name)
    meta = {"config": json.loads(cfg.to_json()), "tokenizer_sha256": data.tokenizer.sha256,
            "tokens_seen": step * setup.derived.tokens_per_step, "wall_s": 0.0}
    if setup.init_from:  # where its step-0 parameters came from, as the CLI records it (hf export reads it)
        meta["init_from"] = setup.init_from
    with checkpoint.Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        ckpt.save(step, setup.state, meta=meta, data_iter=data.train, force=True)
    return run_dir


def restore(setup: train_setup.TrainSetup, run_dir: str | pathlib.Path, *, step: int | None = None,
            data: loader.Data | None = None) -> int:
    """Replace `setup.state` with checkpoint `step` (default: the newest) of a run, onto the
    setup's mesh, and set `data.train` to the saved position; returns the step."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), setup.state)
    with checkpoint.Checkpointer(pathlib.Path(run_dir) / "checkpoints") as ckpt:
        setup.state, _, step = ckpt.restore(target, step=step, data_iter=None if data is None else data.train)
    return step


def load(run_dir: str | pathlib.Path, *, step: int | None = None, devices=None, dtype: str | None = None
         ) -> inference.LoadedRun:
    """A run's parameters (checkpoint `step`, default the newest), config and tokenizer, on these
    devices: for `forward`, `sample` and `parameter_table` (see `jaxlm.inference.load_run`)."""
    return inference.load_run(run_dir, step=step, dtype=dtype, devices=None if devices is None else pick_devices(devices))


# ----------------------------------------------------------------------------- sampling


def generator(model: Model, tokenizer: Tokenizer | None = None):
    """A `jaxlm.generate.Generator` over the model's current parameters (kept per model, so the
    prefill and decode steps compile once)."""
    cache = vars(model).setdefault("_explore_generator", {})
    gen = cache.get("gen")
    if gen is None:
        if isinstance(model, train_setup.TrainSetup):
            gen = generate.Generator(model.model_cfg, model.state.params, model.mesh, model.rules,
                                     model.shardings.params, tokenizer, model.model_spec.graphdef)
        else:
            gen = generate.Generator.from_run(model)
        cache["gen"] = gen
    if isinstance(model, train_setup.TrainSetup):
        gen.params = model.state.params  # the train step donates the state: always the newest
    if tokenizer is not None:
        gen.tokenizer = tokenizer
    if gen.tokenizer is None:
        raise UserError("sample(setup, prompts, tokenizer): pass the tokenizer, e.g. load_data(setup).tokenizer")
    return gen


Prompt = str | Sequence[int]  # text (encoded with BOS in front) or token ids, given to the model as they are


def _is_ids(prompt: Any) -> bool:
    return (isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0
            and all(isinstance(i, (int, np.integer)) for i in prompt))


def sample(model: Model, prompts: Prompt | Sequence[Prompt], tokenizer: Tokenizer | None = None, *,
           max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
           seed: int = 0) -> str | list[str]:
    """Continue each prompt (KV-cache sampling, `jaxlm.generate`); temperature 0 is greedy. A prompt is
    text (encoded with BOS in front) or token ids, which the model gets as they are: a chat prompt's ids
    (`chat_prompt_ids`) keep their special tokens, which decoding them to text would drop. Returns the
    new text (prompt not included), one string per prompt."""
    single = isinstance(prompts, str) or _is_ids(prompts)
    batch = [prompts] if single else list(prompts)
    gen = generator(model, tokenizer)
    options = dict(max_new_tokens=max_new_tokens, sampling=generate.Sampling(temperature, top_k, top_p), seed=seed)
    if all(isinstance(p, str) for p in batch):
        texts = [c.text for c in gen.generate(batch, **options)]
    elif all(_is_ids(p) for p in batch):
        texts = [gen.tokenizer.decode(c.ids) for c in gen.generate_ids([[int(i) for i in p] for p in batch], **options)]
    else:
        raise UserError("sample(model, prompts): give texts or token-id lists (one list per prompt), not a mix")
    return texts[0] if single else texts


def chat_template(model: Model, tokenizer: Tokenizer | None = None) -> sft.Encoder:
    """The model's chat template: the one its config fine-tunes with (data.chat_template of chat data),
    else its tokenizer's own (`inference.chat_template`)."""
    tokenizer = tokenizer or getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise UserError("pass the tokenizer, e.g. load_data(setup).tokenizer")
    return inference.chat_template(model.cfg, tokenizer)


def chat_prompt_ids(model: Model, messages: Sequence[Mapping[str, str]], tokenizer: Tokenizer | None = None) -> list[int]:
    """The ids a chat model is prompted with: `messages` ([{"role": ..., "content": ...}, ...], ending
    with a user message) rendered by its chat template with the generation prompt, special tokens kept.
    Give these ids to `sample`, never their decoded text."""
    tokenizer = tokenizer or getattr(model, "tokenizer", None)
    messages = sft.check_prompt([dict(m) for m in messages], "chat_prompt_ids(messages)")
    return chat_template(model, tokenizer).prompt_ids(tokenizer, messages)


def chat(model: Model, conversations: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
         tokenizer: Tokenizer | None = None, **sampling: Any) -> str | list[str]:
    """The assistant's answer to a conversation (a list of {role, content} messages) or to each of a
    list of them: `sample` on their `chat_prompt_ids`, with `sample`'s options."""
    single = bool(conversations) and isinstance(conversations[0], Mapping)
    batch = [conversations] if single else list(conversations)
    ids = [chat_prompt_ids(model, c, tokenizer) for c in batch]  # type: ignore[arg-type]
    answers = sample(model, ids, tokenizer, **sampling)
    return answers[0] if single else answers
