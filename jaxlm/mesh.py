"""The device mesh (its axes: `jaxlm.axes.MESH_AXES`) and the one table that maps logical axis names onto it.

Model code names axes logically ("embed", "act_batch"); which mesh axes they land on is decided
here, per recipe, from `config.mesh.rules`. Changing the parallelism never touches model code:

  ZeRO-1             rules.opt_state="data": Adam's moments also sharded over `data`
  sequence parallel  rules.act_seq="context,tensor" (or "tensor"): activations' sequence axis over
                     `tensor` wherever no other dimension uses it (between the tensor-parallel regions)
  hybrid sharding    mesh.hybrid="host" (or "process"): fsdp within each host, data across hosts;
                     "slice": on TPUs, fsdp within each slice (ICI), data across slices (DCN)
  expert parallelism mesh.expert: MoE layers' experts split over `expert` (rule experts);
                     everywhere else `expert` is one more batch axis (act_batch), as `data` is
  context parallel   mesh.context: every activation's sequence split over `context` (rule act_seq,
                     attention included: `jaxlm.models.attention.context_attention`); parameters
                     are not split over it, their gradients reduced across it as across `data`
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import socket
from collections.abc import Sequence

import jax
import numpy as np
from flax.core import spmd
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# MESH_AXES, the one list of the mesh's axes, lives in jaxlm.axes (no JAX import: the config reads it)
from jaxlm.axes import MESH_AXES, MeshShape, describe, sizes_of
from jaxlm.errors import UserError
from jaxlm.section import Section, check, check_choice, setting

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def axes_of(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """One entry of a PartitionSpec or a rules table (None, "fsdp" or ("data", "fsdp")) as a tuple."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


HYBRID = ("", "process", "host", "slice")


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None, hybrid: str = "") -> Mesh:
    """A mesh over MESH_AXES with Auto axes, so the compiler propagates shardings (GSPMD). On TPUs
    `jax.make_mesh` lays the axes along the chips' ICI torus (`mesh_utils.create_device_mesh`).

    `hybrid` ("process", "host" or "slice"): `data` indexes the groups of `device_groups` and each
    group's devices form the block of the other axes, so fsdp's collectives stay within a host (or a
    TPU slice, its devices laid along its torus as above)."""
    devices = list(devices) if devices is not None else jax.devices()
    n = int(np.prod(shape))
    if len(devices) < n:
        raise ValueError(f"mesh {tuple(shape)} needs {n} devices, {len(devices)} available")
    if hybrid:
        groups = device_groups(devices, hybrid)
        if len(groups) != sizes_of(shape)["data"] or any(len(g) * len(groups) != n for g in groups):
            raise ValueError(f"mesh {tuple(shape)} does not match {len(groups)} {hybrid} groups of devices")
        block = tuple(shape)[1:]  # data = the groups, first of MESH_AXES
        grid = np.stack([_laid_out(g, block) for g in groups]).reshape(tuple(shape))
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices[:n])


def trace_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices the program being traced is for: the current mesh's,
    else JAX's default backend. The planner traces for compile-only GPUs or TPUs on a CPU machine, where
    `jax.default_backend()` is the CPU's: a kernel chosen by it would be the CPU's in the planned program."""
    # local import: JAX's internal module, the only one to give the concrete mesh inside jit
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.get_concrete_mesh()
    platform = jax.default_backend() if mesh is None or mesh.empty else mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm") else platform


@functools.cache
def hostnames() -> tuple[str, ...]:
    """Every process's hostname, in process order (a collective the first time on several processes:
    all of them must call it)."""
    if jax.process_count() == 1:
        return (socket.gethostname(),)
    raw = np.zeros(256, np.uint8)
    name = socket.gethostname().encode()[:256]
    raw[: len(name)] = np.frombuffer(name, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(raw))
    return tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows)


def _laid_out(devices: Sequence[jax.Device], block: tuple[int, ...]) -> np.ndarray:
    """One hybrid group's devices as a [block] array: along a TPU slice's torus, elsewhere in id order."""
    if devices[0].platform == "tpu":
        return mesh_utils.create_device_mesh(block, devices=list(devices), allow_split_physical_axes=True)
    return np.array(sorted(devices, key=lambda d: d.id), dtype=object).reshape(block)


def slice_index(device) -> int:
    """The TPU slice a device is in (its `slice_index`; 0 for a single slice and for other platforms)."""
    return int(getattr(device, "slice_index", 0) or 0)


def device_groups(devices: Sequence[jax.Device], by: str) -> list[list[jax.Device]]:
    """Devices grouped by their process ("process"), by their process's host ("host"), or by their TPU slice
    ("slice"), in order of the groups' first process (slices: of their index)."""
    hosts = hostnames() if by == "host" and _PLANNED_DEVICES.get() is None else None
    groups: dict = {}
    for d in sorted(devices, key=lambda d: (slice_index(d) if by == "slice" else 0, d.process_index, d.id)):
        key = slice_index(d) if by == "slice" else hosts[d.process_index] if hosts else d.process_index
        groups.setdefault(key, []).append(d)
    return list(groups.values())


# The devices a planned program is compiled for (`planned_devices`), or None: this run's own.
_PLANNED_DEVICES: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("planned_devices", default=None)


@contextlib.contextmanager
def planned_devices(devices: Sequence):
    """While planning for compile-only `devices` (`jaxlm.plan --target`): the run's layout (`hybrid_groups`)
    is theirs, not this machine's CPU's; their hosts are their processes (they have no hostnames)."""
    token = _PLANNED_DEVICES.set(tuple(devices))
    try:
        yield
    finally:
        _PLANNED_DEVICES.reset(token)


def hybrid_groups(by: str) -> int:
    """How many hosts, processes or TPU slices this run spans (`planned_devices` while planning): the `data`
    axis of a hybrid mesh."""
    if not by:
        return 1
    planned = _PLANNED_DEVICES.get()
    return len(device_groups(jax.devices() if planned is None else planned, by))


def default_rules() -> dict[str, str]:
    """Logical axis name -> mesh axes ("" = replicated, "a,b" = sharded over both)."""
    return {
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
        "experts": "expert",  # the expert dimension of an MoE layer's expert weights: each device holds its experts
        # optimizer state: mesh axes Adam's moments are split over beyond their parameter's ("data" = ZeRO-1)
        "opt_state": "",
        # activations
        # the sequence: over `context` (context parallelism, everywhere); "context,tensor" adds sequence
        # parallelism between the tensor-parallel regions
        "act_seq": "context",
        # the sequence at a tensor-parallel region's entry (attention, MLP, unembedding: `layers.tensor_parallel_entry`),
        # whole over tensor (Megatron's all-gather under sequence parallelism) and still split over context
        "act_seq_region": "context",
        "act_embed": "",  # the residual stream's width
        "act_heads": "tensor",  # query heads (attention runs per head)
        "act_kv_heads": "tensor",  # key and value heads
        "act_mlp": "tensor",  # the MLP's hidden activation
        "act_vocab": "tensor",  # the logits' vocabulary axis
        "act_stage": "stage",  # the pipeline's per-stage activations
        # the rows of a batch: over every axis that splits the batch, in the mesh's order (each process then
        # holds one block of rows); outside the MoE layers `expert` is one more data-parallel axis
        "act_batch": "data,fsdp,expert",
    }


def parse_rule(axes: str) -> tuple[str, ...]:
    """One rule's "a,b" as its mesh axes."""
    return tuple(a.strip() for a in axes.split(",") if a.strip())


class _MeshSection(Section):
    """The device mesh: devices along each axis of `jaxlm.axes.MESH_AXES`, -1 = the devices left over
    (`MeshConfig.shape`), and the rules that map logical axis names onto it (`rules_from_config`)."""

    section = "mesh"

    def validate(self) -> None:
        check_choice(self.key("hybrid"), self.hybrid, HYBRID[1:], allow_empty=True)
        sizes = [getattr(self, a) for a in MESH_AXES]
        for axis, size in zip(MESH_AXES, sizes):
            check(size == -1 or size >= 1, self.key(axis), size, "a positive integer or -1 (the devices left over)")
        check(sizes.count(-1) <= 1, "mesh", tuple(sizes), "at most one axis set to -1")
        for name, axes in self.rules.items():
            for axis in parse_rule(axes):
                check(axis in MESH_AXES, f"mesh.rules.{name}", axes,
                      f"'' or comma-separated mesh axes from {', '.join(MESH_AXES)}")

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch's rows are split over: rules.act_batch's (data, fsdp and expert)."""
        return parse_rule(self.rules.get("act_batch", ""))

    def batch_split(self, shape: Sequence[int]) -> tuple[int, str]:
        """(the devices a batch's rows are split over on a mesh of `shape`, those axes named with their
        sizes for an error line: 'mesh.data=2 x mesh.fsdp=2 x mesh.expert=2')."""
        sizes, batch = sizes_of(shape), self.batch_axes()
        named = " x ".join(f"mesh.{a}={sizes[a]}" for a in batch) or "no mesh axis (mesh.rules.act_batch='')"
        return math.prod(sizes[a] for a in batch), named

    def shape(self, num_devices: int, groups: int | None = None) -> MeshShape:
        """The size of each mesh axis for `num_devices`; with `hybrid`, data = `groups` (the hosts or
        processes of the run, from the live layout when not given) and fsdp the devices left in each."""
        if self.hybrid:
            groups = groups or hybrid_groups(self.hybrid)
            inner = {a: max(getattr(self, a), 1) for a in MESH_AXES if a not in ("data", "fsdp")}  # -1 counts as 1
            if num_devices % (groups * math.prod(inner.values())):
                raise UserError(
                    f"config.mesh.hybrid={self.hybrid!r}: {num_devices} devices do not split into {groups} "
                    f"{self.hybrid}(s) x {' x '.join(f'mesh.{a}={s}' for a, s in inner.items())}; every "
                    f"{self.hybrid} needs the same device count"
                )
            fsdp = num_devices // groups // math.prod(inner.values())
            return tuple({"data": groups, "fsdp": fsdp, **inner}[a] for a in MESH_AXES)
        sizes = [getattr(self, a) for a in MESH_AXES]
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


# `config.mesh`: one field per axis of MESH_AXES (so naming an axis there is all a new axis takes), then
# `hybrid` and `rules`.
MeshConfig = dataclasses.make_dataclass(
    "MeshConfig",
    [(axis, int, setting(-1 if axis == "fsdp" else 1, f"devices along the {axis} axis; -1 = the devices left over"))
     for axis in MESH_AXES]
    + [("hybrid", str, setting(
        "", '"host": data across hosts, fsdp (and expert, tensor) within each host; "process": the same per '
            'process; "slice": the same per TPU slice (data over DCN, the rest over each slice\'s ICI). Sets data '
            "and fsdp from the run's layout (mesh.data and mesh.fsdp are then ignored; the other axes keep their "
            "sizes); \"\" = off")),
       ("rules", dict, dataclasses.field(default_factory=default_rules, metadata={
           "doc": "logical axis name -> the mesh axes it is split over (mesh.rules below)"}))],
    bases=(_MeshSection,), frozen=True, namespace={"__module__": __name__})


def rules_from_config(rules_cfg) -> Rules:
    """config.mesh.rules ({'embed': 'fsdp', 'act_batch': 'data,fsdp,expert', 'head_dim': ''}) -> flax rules."""
    out = []
    for name, axes in sorted(rules_cfg.items()):
        parsed = parse_rule(axes)
        out.append((name, None if not parsed else parsed[0] if len(parsed) == 1 else parsed))
    return tuple(out)


# Names that take their mesh axes only where no other dimension of the same array uses them:
# with act_seq -> context,tensor (sequence parallelism) the sequence is split over tensor between the
# tensor-parallel regions, and over context alone inside them, where heads or the MLP width hold tensor.
YIELDING = ("act_seq",)


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> P:
    """Map logical names to a PartitionSpec. A mesh axis already used by an earlier dimension is
    skipped, so one table can serve weights and activations without duplicate-axis errors; the
    `YIELDING` names are resolved last, from the axes the others left."""
    table = dict(rules)
    used: set[str] = set()
    spec: list = [None] * len(names)
    order = [i for i, n in enumerate(names) if n not in YIELDING] + [i for i, n in enumerate(names) if n in YIELDING]
    for i in order:
        name = names[i]
        axes = tuple(a for a in axes_of(table.get(name) if name is not None else None) if a not in used)
        used.update(axes)
        spec[i] = None if not axes else axes[0] if len(axes) == 1 else axes
    return P(*spec)


def extend_sharding(sharding: NamedSharding, shape: Sequence[int], extra: str | tuple[str, ...] | None) -> NamedSharding:
    """`sharding` further split over the mesh axes `extra` (those it does not use yet), on the
    largest dimension that divides evenly; unchanged where none does. ZeRO-1 for optimizer state."""
    extra = tuple(a for a in axes_of(extra) if a)
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {a for s in spec for a in axes_of(s)}
    extra = tuple(a for a in extra if a not in used and sharding.mesh.shape[a] > 1)
    if not extra:
        return sharding
    factor = math.prod(sharding.mesh.shape[a] for a in extra)
    for dim in sorted(range(len(shape)), key=lambda i: -shape[i]):
        axes = axes_of(spec[dim])
        if shape[dim] % (math.prod(sharding.mesh.shape[a] for a in axes) * factor) == 0:
            new = axes + extra
            spec[dim] = new[0] if len(new) == 1 else new
            return NamedSharding(sharding.mesh, P(*spec))
    return sharding


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside a mesh or rules."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def mesh_axes_of(name: str) -> tuple[str, ...]:
    """The mesh axes the rules in force map the logical name `name` to; () outside a mesh or rules."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return ()
    return axes_of(dict(rules).get(name))


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of a [batch, seq] input: batch over the act_batch axes (data x fsdp x expert), whole rows, so
    each process supplies whole rows (the model splits the sequence itself under sequence parallelism)."""
    return NamedSharding(mesh, logical_to_spec(("act_batch", None), rules))
