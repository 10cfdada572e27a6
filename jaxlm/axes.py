"""The device mesh's axes, named once.

Every mesh, mesh shape, `config.mesh` key and description of a mesh follows `MESH_AXES`: a new
axis is added by naming it here, and its size defaults to 1 (as `stage`, pipeline parallelism's,
`expert`, expert parallelism's, and `context`, context parallelism's, were).
No JAX import, so that the config can read it before JAX starts; `jaxlm.mesh` re-exports it.
"""

from __future__ import annotations

from collections.abc import Sequence

# From the slowest links to the fastest: a mesh's last axes are its nearest devices. data and stage
# (pipeline parallelism) usually span nodes: one gradient reduction per step, one activation hand-over
# per micro-batch. fsdp, expert and tensor stay within one node. expert (expert parallelism) sits
# between fsdp and tensor: its collectives (tokens to their experts' devices and the outputs back, in
# every MoE layer, both passes) wait on the router and cannot be prefetched as fsdp's weight gathers
# can, while tensor's all-reduces, in every attention and MLP, need the nearest links. Its place also orders the batch's
# rows (`act_batch`: data, fsdp, expert, as the mesh), so that each process holds one block of rows. context
# (context parallelism: every activation's sequence split over it, `act_seq`) sits between fsdp and expert:
# its all-gathers of keys and values in every attention, both passes, wait on the projections before them,
# as expert's exchanges wait on the router. It holds no rows of its own (a batch's rows are whole across it).
MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "context", "expert", "tensor")

MeshShape = tuple[int, ...]  # one size per axis of MESH_AXES, in its order


def shape_of(**sizes: int) -> MeshShape:
    """A mesh shape from sizes by axis name, 1 for the axes not named: `shape_of(fsdp=8)`."""
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {', '.join(MESH_AXES)}")
    return tuple(sizes.get(axis, 1) for axis in MESH_AXES)


def sizes_of(shape: Sequence[int]) -> dict[str, int]:
    """{axis: size} of a mesh shape."""
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"mesh shape {tuple(shape)} has {len(shape)} sizes; the axes are {', '.join(MESH_AXES)}")
    return dict(zip(MESH_AXES, shape))


def describe(shape: Sequence[int], sep: str = " ") -> str:
    """'data=2 stage=1 fsdp=4 context=1 expert=1 tensor=1'."""
    return sep.join(f"{axis}={size}" for axis, size in sizes_of(shape).items())
