"""The device mesh (data, fsdp, tensor) and the one table that maps logical axis names onto it.

Model code names axes logically ("embed", "act_batch"); which mesh axes they land on is decided
here, per recipe, from `config.mesh.rules`. Changing the parallelism never touches model code.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax.core import spmd
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes, so the compiler propagates shardings (GSPMD)."""
    devices = list(devices) if devices is not None else jax.devices()
    n = int(np.prod(shape))
    if len(devices) < n:
        raise ValueError(f"mesh {tuple(shape)} needs {n} devices, {len(devices)} available")
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:n])


def rules_from_config(rules_cfg) -> Rules:
    """config.mesh.rules ({'embed': 'fsdp', 'act_batch': 'data,fsdp', 'head_dim': ''}) -> flax rules."""
    out = []
    for name, axes in sorted(rules_cfg.items()):
        parsed = tuple(a.strip() for a in axes.split(",") if a.strip())
        out.append((name, None if not parsed else parsed[0] if len(parsed) == 1 else parsed))
    return tuple(out)


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> P:
    """Map logical names to a PartitionSpec. A mesh axis already used by an earlier dimension is
    skipped, so one table can serve weights and activations without duplicate-axis errors."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in names:
        axes = table.get(name) if name is not None else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside a mesh or rules."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of a [batch, seq] input: batch over the act_batch axes (data x fsdp)."""
    return NamedSharding(mesh, logical_to_spec(("act_batch", "act_seq"), rules))
