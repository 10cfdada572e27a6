"""The train state pytree and how it is created: born sharded, never gathered on one device.

The state is plain data (step, params as a nested dict of arrays, optax state, RNG key) so that jit
can donate it and Orbax can save it. The model's structure (an NNX graphdef) is kept beside it and
merged with the params inside the compiled step.

Parameters are trainable or frozen (`optim.trainable`, `ModelSpec.trainable`): gradients, the
optimizer's state and its update exist only for the trainable part; frozen parameters ride along in
`params` untouched. Full training is the case where everything is trainable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm.errors import UserError
from jaxlm.loss_scale import LossScale
from jaxlm.mesh import Rules, axes_of, extend_sharding, logical_to_spec
from jaxlm.models import layers
from jaxlm.models.layers import Frozen
from jaxlm.models.transformer import ModelConfig, Transformer
from jaxlm.optim import Matrix


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # nested dict of float arrays (param_dtype)
    opt_state: Any  # optax state
    rng: jax.Array  # uint32[2] raw key; dropout keys are folded from it and the step
    # float16 runs: the dynamic loss scale (jaxlm.loss_scale); None (no leaves) otherwise
    loss_scale: LossScale | None = None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the step needs to rebuild the model from params: structure and per-param metadata."""

    graphdef: Any
    logical_names: Any  # dict tree of tuples of logical axis names, like params
    trainable: Any  # dict tree of bools, like params: what the optimizer updates
    decay_mask: Any  # dict tree of bools, like the trainable part of params: what weight decay applies to
    # dict tree like the trainable part of params: how each projection's kernel (not the output head's) is a
    # matrix, or a stack of them (`optim.Matrix`: what Muon orthogonalizes), None for the other parameters
    matrices: Any = None
    # dict tree like params: the compute dtype a leaf's forward use casts it to and nothing else (the
    # projections' kernels, the embedding: `layers.cast_leaves`), None for the others
    cast_dtypes: Any = None
    # Paths of the trainable kernels of plain projections (`layers.Projection.takes_compute_kernel`) not stacked
    # for a layer scan (`build_model_spec` says why): a step with micro-batches hands each to the model as a
    # `layers.ComputeKernel`, whose weight gradient comes in float32 from the matmul itself (a float8 one's
    # weight quantized once per step: `layers.Contraction.prepare_kernel`); and `layers.Joint`s, groups of them
    # the model runs as one matmul, joined once per step (a group with a part that does not train is left out
    # of both)
    grad_kernels: frozenset = frozenset()
    joints: tuple = ()
    # the model's auxiliary outputs, (name, shape) pairs (`jaxlm.models.aux`, `Transformer.aux_shapes`)
    aux_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    cfg: ModelConfig | None = None  # the model's settings (its dropout, attention kernel, loss chunks)

    def cast_for_compute(self, trainable):
        """The trainable parameters with the `cast_dtypes` leaves cast to their compute dtype (the others
        as they are): what a step with micro-batches differentiates, cast once per step rather than in
        every micro-batch (the forward's own cast is then the identity; the gradients are the same)."""
        if self.cast_dtypes is None:
            return trainable
        dtypes = self.split(self.cast_dtypes)[0]
        return jax.tree.map(lambda x, dt: x if dt is None else x.astype(dt), trainable, dtypes)

    # ---- the compute layout: what a step with micro-batches differentiates in each micro-batch

    def compute_layout(self, trainable, cast: bool = True):
        """Once per step: the trainable parameters as the micro-batches use them. `cast_for_compute` (with
        `cast`), and each joint's kernels joined into its first part's place (`layers.Joint.join`), the
        other parts None. Gradients in this layout go back with `param_layout`."""
        return self._joined(self.cast_for_compute(trainable) if cast else trainable, lambda j, parts: j.join(parts))

    def param_layout(self, tree):
        """The inverse of `compute_layout`'s joins (`layers.Joint.split`)."""
        tree = _copy(tree)
        for joint in self.joints:
            for path, part in zip(joint.paths, joint.split(_get_path(tree, joint.paths[0])), strict=True):
                _set_path(tree, path, part)
        return tree

    def compute_names(self):
        """`trainable_names` in the compute layout (a joint's kernel named by `layers.Joint.names`)."""
        return self._joined(self.trainable_names, lambda j, parts: j.names(parts))

    def _joined(self, tree, combine):
        """`tree` (params-like) with each joint's parts replaced by `combine(joint, parts)` in its first
        part's place and None in the others'."""
        tree = _copy(tree)
        for joint in self.joints:
            _set_path(tree, joint.paths[0], combine(joint, [_get_path(tree, path) for path in joint.paths]))
            for path in joint.paths[1:]:
                _set_path(tree, path, None)
        return tree

    def kernel_mask(self, layout):
        """A tree like `layout` (compute layout): True where the model takes a `layers.ComputeKernel` (a
        joint's first part holds the joined kernel; its other parts are None in `layout`)."""
        flat = jax.tree_util.tree_flatten_with_path(layout)[0]
        keys = [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path) for path, _ in flat]
        return jax.tree.unflatten(jax.tree.structure(layout), [key in self.grad_kernels for key in keys])

    def model_params(self, diff, fixed):
        """Per micro-batch, the trainable tree the model runs, from the compute layout split in two: where
        `kernel_mask` holds, `layers.ComputeKernel(fixed's weight, diff's float32 array)` (joined for a
        joint's first part; its other parts an empty joined one); elsewhere `diff`'s values."""
        out = jax.tree.map(lambda d, w: d if w is None else layers.ComputeKernel(w, d), diff, fixed,
                           is_leaf=lambda x: x is None)
        for joint in self.joints:
            first = _get_path(out, joint.paths[0])
            _set_path(out, joint.paths[0], layers.ComputeKernel(first.w, first.grad, joined=True))
            for path in joint.paths[1:]:
                _set_path(out, path, layers.ComputeKernel(None, None, joined=True))
        return out

    def split(self, tree) -> tuple[Any, Any]:
        """A params-like tree -> (its trainable part, its frozen part), each a nested dict holding
        only its own leaves (the frozen part is `{}` when everything trains)."""
        return _select(tree, self.trainable, True), _select(tree, self.trainable, False)

    def merge(self, trainable, frozen):
        """The inverse of `split`."""
        return _union(trainable, frozen)

    @property
    def trainable_names(self):
        """`logical_names` of the trainable parameters only."""
        return self.split(self.logical_names)[0]


def _select(tree, mask, keep: bool):
    out = {}
    for key, sub in mask.items():
        if isinstance(sub, dict):
            part = _select(tree[key], sub, keep)
            if part:
                out[key] = part
        elif sub == keep:
            out[key] = tree[key]
    return out


def _union(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _union(out[key], value) if key in out else value
    return out


# What trains in a model with LoRA adapters when optim.trainable is empty: the adapters (nnx.LoRAParam).
LORA_TRAINABLE = "type:LoRAParam"


def trainable_filter(selection: str):
    """`optim.trainable` -> a predicate (path, variable type) -> bool. "" = everything trains.

    Comma-separated entries, a parameter trains when any entry matches it: a regular expression
    searched in its path (`blocks/attn/wq/kernel`), or `type:Name`, an NNX variable type (the
    parameter's class or a base class), as `nnx.LoRAParam` marks adapters."""
    entries = [e.strip() for e in selection.split(",") if e.strip()]
    if not entries:
        return lambda path, types: True
    patterns, types = [], []
    for entry in entries:
        if entry.startswith("type:"):
            types.append(entry[len("type:"):])
            continue
        try:
            patterns.append(re.compile(entry))
        except re.error as e:
            raise UserError(f"config.optim.trainable: {entry!r} is not a regular expression ({e})") from None
    return lambda path, var_types: any(p.search(path) for p in patterns) or any(t in var_types for t in types)


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A concrete model on the default device (for notebooks and tests); training uses `create`.

    Eager sharding is off even under an active mesh: shardings are applied in one place, `create`.
    """
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def build_model_spec(cfg: ModelConfig, trainable: str = "") -> ModelSpec:
    """Structure and metadata of the model, from an abstract build (no arrays allocated);
    `trainable` is `optim.trainable` (`trainable_filter`): empty, every parameter trains, or with LoRA
    adapters (`cfg.lora`) the adapters alone (`LORA_TRAINABLE`). Quantized weights and pruning
    masks (`layers.Frozen`: QLoRA's 4-bit base, a compressed model's codes) never train, whatever it selects."""
    trainable = trainable or (LORA_TRAINABLE if cfg.lora is not None else "")
    # With no mesh in scope: under one, nnx.eval_shape would map the logical names without the rules.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
    names, decay, trains, casts = {}, {}, {}, {}
    model = nnx.merge(graphdef, state)
    cast = layers.cast_leaves(model)
    selected = trainable_filter(trainable)
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        _set_path(names, path, tuple(meta["out_sharding"]))
        _set_path(decay, path, bool(meta["decay"]))
        _set_path(casts, path, cast.get(tuple(path)))
        frozen = isinstance(var, Frozen)  # quantized codes and scales, pruning masks: never trained
        _set_path(trains, path, not frozen and bool(selected("/".join(map(str, path)),
                                                             {c.__name__ for c in type(var).__mro__})))
    if not any(jax.tree.leaves(trains)):
        example = "/".join(map(str, next(iter(nnx.to_flat_state(state)))[0]))
        raise UserError(f"config.optim.trainable={trainable!r} matches no parameter (paths look like {example!r})")
    # Trained kernels of plain projections, not stacked for a layer scan: a scan's weight gradients come out
    # stacked, and XLA adds a float32 stack to the accumulator in a kernel of its own, where unstacked ones
    # add up in the GEMMs (the rooflines of both: benchmarks/BENCHMARKS.md)
    kernels = {(*path, "kernel") for path, p in layers.projections(model) if p.takes_compute_kernel}
    kernels = {path for path in kernels if _get_path(trains, path) and "layers" not in _get_path(names, path)}
    joints = tuple(j for j in layers.joints(model) if all(path in kernels for path in j.paths))
    kernels -= {path for j in layers.joints(model) if j not in joints for path in j.paths}
    model_spec = ModelSpec(graphdef=graphdef, logical_names=names, trainable=trains, decay_mask=decay, cast_dtypes=casts,
                           grad_kernels=frozenset(kernels), joints=joints,
                           aux_shapes=tuple(model.aux_shapes.items()), cfg=cfg)
    return dataclasses.replace(model_spec, decay_mask=model_spec.split(decay)[0],
                               matrices=model_spec.split(_matrices(model, names))[0])


def _matrices(model: Transformer, names: dict) -> dict:
    """A tree like `names` (every parameter's logical names): each projection's stored kernel as the matrix
    its contraction uses (`optim.Matrix`: its input dimensions the rows, its outputs the columns; a scanned
    stack's layers and an MoE's experts index matrices), None for every other parameter: the output head
    (a projection to the vocabulary), the embedding, norms, biases, routers, adapters."""
    out = jax.tree.map(lambda _: None, names, is_leaf=lambda x: isinstance(x, tuple))
    for path, projection in layers.projections(model):
        kernel_path = (*path, "kernel")
        try:
            stored = _get_path(names, kernel_path)  # a quantized base (kernel_q) has none: it never trains
        except (KeyError, TypeError):
            continue
        if not isinstance(stored, tuple) or "vocab" in projection.kernel_names:
            continue
        lead = len(stored) - len(projection.kernel_shape)  # a scanned stack's layers axis
        batch = (*range(lead), *(lead + i for i in projection.batch_axes))
        rows = tuple(lead + i for i in projection.in_axes)
        cols = tuple(lead + i for i in range(len(projection.kernel_shape))
                     if i not in projection.in_axes and i not in projection.batch_axes)
        _set_path(out, kernel_path, Matrix(batch, rows, cols, tuple(stored[i] for i in batch)))
    return out


def _get_path(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _copy(tree):
    """The nested dicts of `tree` copied (the leaves shared), for `_set_path` to change."""
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _set_path(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def param_shardings(model_spec: ModelSpec, mesh: Mesh, rules: Rules):
    return jax.tree.map(
        lambda names: NamedSharding(mesh, logical_to_spec(names, rules)),
        model_spec.logical_names,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _fresh_state(params, model_spec: ModelSpec, tx: optax.GradientTransformation, seed: int,
                 loss_scale: float = 0.0) -> TrainState:
    """Step 0 and a new optimizer state around `params`; with `loss_scale` > 0 a dynamic loss scale
    starting there (float16 compute)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(model_spec.split(params)[0]),
        rng=jax.random.PRNGKey(seed + 1),
        loss_scale=LossScale.create(loss_scale) if loss_scale else None,
    )


def init_fn(cfg: ModelConfig, model_spec: ModelSpec, tx: optax.GradientTransformation, seed: int,
            loss_scale: float = 0.0):
    """A function () -> TrainState: what `create` compiles with sharded outputs."""

    def init() -> TrainState:
        model = build_model(cfg, seed)
        return _fresh_state(nnx.to_pure_dict(nnx.state(model)), model_spec, tx, seed, loss_scale)

    return init


def from_params(params, model_spec: ModelSpec, tx: optax.GradientTransformation, shardings: TrainState, mesh: Mesh,
                seed: int = 0, loss_scale: float = 0.0) -> TrainState:
    """A new run's state around given parameters (sharded as `shardings.params`, e.g. read from
    another run's checkpoint): step 0, a fresh optimizer state, the RNG `create` would give. The
    parameters are donated: they become the state's, not copied."""
    with jax.set_mesh(mesh):
        make = jax.jit(lambda p: _fresh_state(p, model_spec, tx, seed, loss_scale), in_shardings=(shardings.params,),
                       out_shardings=shardings, donate_argnums=0)
        return make(params)


def state_shardings(abstract: TrainState, model_spec: ModelSpec, tx, mesh: Mesh, rules: Rules) -> TrainState:
    """The sharding of every leaf of the (abstract) train state: params by the rules, optimizer state like
    its (trainable) params (`opt_state_shardings`) and further over the `opt_state` rule's axes (ZeRO-1:
    "data"), scalars replicated."""
    del tx  # the state's own paths say which parameter each leaf belongs to
    params = param_shardings(model_spec, mesh, rules)
    replicated = NamedSharding(mesh, P())
    opt = opt_state_shardings(abstract.opt_state, model_spec.split(abstract.params)[0], model_spec.split(params)[0],
                              replicated, dict(rules).get("opt_state"))
    scale = None if abstract.loss_scale is None else jax.tree.map(lambda _: replicated, abstract.loss_scale)
    return TrainState(step=replicated, params=params, opt_state=opt, rng=replicated, loss_scale=scale)


def opt_state_shardings(opt_state, params, shardings, replicated: NamedSharding, extra) -> Any:
    """Each leaf of an (abstract) optimizer state sharded like the parameter it belongs to, further over the
    mesh axes `extra` (`extend_sharding`); the others (step counts, coefficients) `replicated`. A leaf belongs to
    the parameter whose path ends its own (optax keeps each per-parameter tree under its state's fields: mu,
    nu, z, an Adafactor's v_row...). A leaf of its parameter's shape takes its sharding; one with one dimension
    fewer (an Adafactor's row or column means) takes it without that dimension's; any other shape (a
    placeholder) is replicated."""
    by_path = {_keys(path): (leaf.shape, sharding) for (path, leaf), sharding in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings), strict=True)}

    def one(path, leaf):
        keys = _keys(path)
        found = next((by_path[keys[i:]] for i in range(len(keys)) if keys[i:] in by_path), None)
        if found is None:
            return replicated
        shape, sharding = found
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        if tuple(leaf.shape) != tuple(shape):
            drop = next((i for i in range(len(shape)) if shape[:i] + shape[i + 1:] == tuple(leaf.shape)), None)
            if drop is None:
                return replicated
            sharding = NamedSharding(sharding.mesh, P(*(spec[:drop] + spec[drop + 1:])))
        return extend_sharding(sharding, leaf.shape, extra)

    return jax.tree_util.tree_map_with_path(one, opt_state)


def _keys(path) -> tuple:
    """A tree path's trailing run of dict keys (the part that is a params path)."""
    keys = []
    for entry in reversed(path):
        if not isinstance(entry, jax.tree_util.DictKey):
            break
        keys.append(entry.key)
    return tuple(reversed(keys))


def check_divisible(model_spec: ModelSpec, shapes, mesh: Mesh, rules: Rules) -> None:
    """Every sharded parameter dimension must split evenly over its mesh axes; say which does not."""
    flat_names = jax.tree_util.tree_flatten_with_path(model_spec.logical_names,
                                                      is_leaf=lambda x: isinstance(x, tuple))[0]
    flat_shapes = jax.tree.leaves(shapes)
    for (path, names), shape in zip(flat_names, flat_shapes):
        for name, size, axes in zip(names, shape.shape, logical_to_spec(names, rules)):
            axes = axes_of(axes)
            devices = math.prod(mesh.shape[a] for a in axes)
            if size % devices:
                where = ".".join(str(getattr(k, "key", k)) for k in path)
                packed = ": packed integer codes" if where.endswith(("kernel_q", "embedding_q")) else ""
                raise UserError(
                    f"parameter {where}: its {name!r} dimension ({size}{packed}) does not split over mesh "
                    f"{'x'.join(axes)}={devices}; change config.mesh, config.mesh.rules.{name}, or the model size"
                )


def abstract_state(cfg: ModelConfig, tx, mesh: Mesh, rules: Rules, seed: int = 0, model_spec: ModelSpec | None = None,
                   loss_scale: float = 0.0):
    """(abstract state whose leaves carry their shardings, the shardings, ModelSpec, init function).

    Nothing is allocated: this is what ahead-of-time compilation and memory planning need.
    """
    model_spec = model_spec or build_model_spec(cfg)
    init = init_fn(cfg, model_spec, tx, seed, loss_scale)
    shapes = jax.eval_shape(init)
    check_divisible(model_spec, shapes.params, mesh, rules)
    shardings = state_shardings(shapes, model_spec, tx, mesh, rules)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return abstract, shardings, model_spec, init


# XLA options for the one-off init program. XLA fuses the random generators of every parameter of one shape into
# a single multi-output kernel (they share the iota the counter-based generator starts from): with unscanned layers
# (the 1b and 7b recipes) that is one kernel of 44 generators and ~8,000 instructions, which the GPU backend
# compiles for minutes. Without the pass each generator is its own small kernel, compiled in a fraction of that
# time (benchmarks/BENCHMARKS.md). The values are the same bits: fusion does not change what is computed.
INIT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "multi_output_fusion"}
# On a CPU, also LLVM's optimization level 1 for that program, not XLA's default 2: the generators' unrolled
# integer code is where a small model's init spends most of its compile time at level 2, and the program runs
# once. The same bits came out on the CPUs measured (benchmarks/BENCHMARKS.md, "Start-up"; checked within 2 ulps by
# tests/test_init_program.py); a level the user sets in XLA_FLAGS is kept.
CPU_INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def init_compiler_options(platform: str) -> dict:
    """The XLA options `create` compiles the init program with on `platform`'s devices."""
    if platform == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        return {**INIT_COMPILER_OPTIONS, **CPU_INIT_COMPILER_OPTIONS}
    return INIT_COMPILER_OPTIONS


def create(
    cfg: ModelConfig, tx, mesh: Mesh, rules: Rules, seed: int = 0, model_spec: ModelSpec | None = None,
    loss_scale: float = 0.0,
) -> tuple[TrainState, TrainState, ModelSpec]:
    """Initialise the state directly into its shards: (state, its shardings, ModelSpec)."""
    _, shardings, model_spec, init = abstract_state(cfg, tx, mesh, rules, seed, model_spec, loss_scale)
    with jax.set_mesh(mesh):
        options = init_compiler_options(mesh.devices.flat[0].platform)
        state = jax.jit(init, out_shardings=shardings).lower().compile(compiler_options=options)()
    return state, shardings, model_spec
