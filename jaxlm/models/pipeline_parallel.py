"""Pipeline parallelism inside the one compiled step: the stacked layers split into stages, micro-batches
flowing through them.

GSPMD style, as MaxText's `layers/pipeline.py`: the layers' stacked axis [L] is seen as [repeats, stages,
layers per group]; one loop iteration runs every stage at once (a `vmap` over the stage dimension, which
the rules shard over the mesh's `stage` axis through the logical names `layers` and `act_stage`), then
hands each stage's output to the next by rotating the stage-sharded buffer, which XLA compiles to a
collective permute. JAX differentiates the loop, so the backward pass runs the same schedule in reverse.
Nothing here names a mesh axis. cuDNN attention runs in the stages through jaxlm's batching rules for it
(`jaxlm.models.cudnn_batching`; jax's own fail under the stage vmap), its packed-or-masked choice made
once for the whole batch (`attention.whole_batch_segments`).

Schedules (`Schedule`): with `repeats=1`, GPipe (all micro-batches through stage 0, then 1, ...; the
backward in reverse); with `repeats=R > 1`, circular (interleaved): stage s holds the layer groups
s, s + S, s + 2S, ... and each micro-batch goes round the ring R times, which divides the bubble by about
R. Either way pass k of stage s happens at iteration s + k, and the idle fraction of stage-iterations is
(S - 1) / (M R + S - 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.mesh import constrain, mesh_axes_of
from jaxlm.models import attention, aux
from jaxlm.section import Section, check, check_choice, setting

STAGE = "act_stage"  # the logical name of the stage dimension of activations (rules: -> the stage axis)
SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineConfig(Section):
    """Pipeline parallelism, when mesh.stage > 1: the stacked layers (model.scan_layers) split into
    mesh.stage stages, inside the one compiled step (`config.pipeline`)."""

    section: ClassVar[str] = "pipeline"
    schedule: str = setting(
        "gpipe", "gpipe (all forwards, then all backwards) | circular (interleaved: `repeats` groups per stage)")
    microbatches: int = setting(
        0, "pipeline micro-batches per gradient-accumulation micro-batch, at least mesh.stage; 0 = the most up to "
           "4 x stages that the micro-batch's rows per batch shard (data x fsdp x expert) divide into")
    repeats: int = setting(
        1, "circular: non-adjacent layer groups per stage (the bubble shrinks about this much); gpipe: 1")

    def validate(self) -> None:
        check_choice(self.key("schedule"), self.schedule, SCHEDULES)
        check(self.repeats >= 1 and (self.schedule == "circular" or self.repeats == 1), self.key("repeats"),
              self.repeats, "1 with pipeline.schedule='gpipe'; a positive number of layer groups per stage with "
                            "'circular'")
        check(self.microbatches >= 0, self.key("microbatches"), self.microbatches, "0 (auto) or at least mesh.stage")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """S stages, M pipeline micro-batches, R repeats (layer groups per stage; 1 = GPipe)."""

    stages: int
    microbatches: int
    repeats: int = 1

    def __post_init__(self):
        if self.microbatches < self.stages:
            raise ValueError(f"{self.microbatches} pipeline micro-batches for {self.stages} stages: need at least as "
                             f"many micro-batches as stages")

    @property
    def passes(self) -> int:
        """Micro-batch passes each stage runs: M R."""
        return self.microbatches * self.repeats

    @property
    def iterations(self) -> int:
        """Loop iterations of the forward: M R + S - 1."""
        return self.passes + self.stages - 1

    @property
    def bubble(self) -> float:
        """The idle fraction of stage-iterations: (S - 1) / (M R + S - 1)."""
        return (self.stages - 1) / self.iterations

    def work(self, i, xp=np):
        """At iteration `i`: each stage's (micro-batch, repeat, active). Stage s runs pass k = i - s, which is
        micro-batch k mod M in repeat k div M; outside 0 <= k < M R it idles (and computes on whatever it
        holds, which nothing reads)."""
        k = i - xp.arange(self.stages)
        active = (k >= 0) & (k < self.passes)
        k = xp.clip(k, 0, self.passes - 1)
        return k % self.microbatches, k // self.microbatches, active

    def table(self) -> np.ndarray:
        """[iterations, stages] of (micro-batch, repeat) per stage, -1 where it idles (to print or count)."""
        out = np.full((self.iterations, self.stages, 2), -1)
        for i in range(self.iterations):
            m, r, active = self.work(i)
            out[i, active] = np.stack([m, r], -1)[active]
        return out


def _names(variable: nnx.Variable, ndim: int) -> tuple:
    names = tuple(variable.get_metadata().get("out_sharding") or ())
    return names if len(names) == ndim else (None,) * ndim


def run(
    schedule: Schedule,
    blocks: nnx.Module,  # the stacked blocks: every parameter [L, ...]
    x: jax.Array,  # [B, T, D]
    positions: jax.Array,  # [B, T]
    segment_ids: jax.Array | None,  # [B, T]
    keys: jax.Array | None,  # [L] dropout keys, one per layer
    # (x, block, key, positions, segment_ids) -> (x, aux), the block as the unpipelined scan runs it
    block_fn: Callable,
    return_activity: bool = False,
    aux_shapes: aux.Shapes | None = None,  # the model's auxiliary outputs' shapes (`Transformer.aux_shapes`)
) -> tuple[jax.Array, aux.Aux] | tuple[jax.Array, aux.Aux, jax.Array]:
    """(the blocks applied to `x` under `schedule`: the same function as running them in order, their
    auxiliary outputs summed over the layers, or kept per layer in layer order (`aux.by_layer`), and
    averaged over the micro-batches). With
    `return_activity`, also the [iterations, stages] bool array of which stage worked in which iteration
    (the loop's own record, to check the bubble against)."""
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    graphdef, state = nnx.split(blocks)
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    n_layers = jax.tree.leaves(state)[0].shape[0]
    if n_layers % (S * R):
        raise ValueError(f"{n_layers} layers do not split into {S} stages x {R} repeats")
    G = n_layers // (S * R)

    def grouped(v: nnx.Variable) -> jax.Array:  # [L, ...] -> [R, S, G, ...], the stage dimension sharded
        a = v[...]
        names = _names(v, a.ndim)
        return constrain(a.reshape(R, S, G, *a.shape[1:]), (None, names[0], None, *names[1:]))

    params = jax.tree.map(grouped, state, is_leaf=is_var)
    layer_keys = None if keys is None else keys.reshape(R, S, G)
    B = x.shape[0]
    if B % M:
        raise ValueError(f"a batch of {B} rows does not split into {M} pipeline micro-batches")
    act = ("act_batch", "act_seq", "act_embed")

    def split(a):  # [B, ...] -> [M, B / M, ...], micro-batch m taking rows m, m + M, ...: each device keeps its rows
        return a.reshape(B // M, M, *a.shape[1:]).swapaxes(0, 1)

    stream = constrain(split(x), (None, *act))  # [M, b, T, D]
    positions = split(positions)
    segments = None if segment_ids is None else split(segment_ids)
    ring = constrain(jnp.zeros((S, *stream.shape[1:]), x.dtype), (STAGE, *act))  # what each stage works on

    def stage(p, h, key, pos, seg):  # one stage: its G layers in order; (output, their aux outputs summed)
        def layer(h, xs):
            layer_params, k = xs
            block = nnx.merge(graphdef, jax.tree.map(lambda v, a: v.replace(a), state, layer_params, is_leaf=is_var))
            return block_fn(h, block, k, pos, seg)

        h, per_layer = jax.lax.scan(layer, h, (p, key))
        return h, aux.over_layers(per_layer)  # a per-layer entry [G, ...]: this stage's layers

    spmd = mesh_axes_of(STAGE)
    stages = jax.vmap(stage, spmd_axis_name=spmd or None)
    def pick(a, r):  # [R, S, ...] and [S] -> each stage's repeat, [S, ...]
        # A select over the R static slices, not a gather: XLA's GPU compiler rejects the scatter that the
        # gather of a per-stage index (vmapped a[r]) becomes in the backward pass (compiled for H100s)
        r = r.reshape(r.shape + (1,) * (a.ndim - 2))
        return functools.reduce(lambda acc, j: jnp.where(r == j, a[j], acc), range(1, a.shape[0]), a[0])

    # GPipe: every pass of a stage runs the same layers, taken once, outside the loop; picked per iteration
    # (circular), its backward keeps a copy of each stage's weights per iteration
    fixed = jax.tree.map(lambda a: a[0], params) if R == 1 else None
    fixed_keys = None if layer_keys is None or R > 1 else layer_keys[0]

    def iteration(carry, i):
        stream, ring, totals = carry
        m, r, active = schedule.work(i, jnp)
        ring = ring.at[0].set(stream[m[0]])  # stage 0 takes its next pass from the stream
        p = fixed if R == 1 else jax.tree.map(lambda a: pick(a, r), params)
        # each layer's dropout key, folded with the micro-batch (the unpipelined step draws one mask per layer)
        ks = None if layer_keys is None else (fixed_keys if R == 1 else pick(layer_keys, r))
        k = None if ks is None else jax.vmap(lambda g, mb: jax.vmap(lambda key: jax.random.fold_in(key, mb))(g))(ks, m)
        out, stage_aux = stages(p, ring, k, positions[m], None if segments is None else segments[m])
        out = constrain(out, (STAGE, *act))
        # an idle stage's values are of nothing: only the active stages' count; a per-layer entry [S, G, ...]
        # goes to its stages' layers of the repeat each works on, totals [R, S, G, ...]
        def added(name, v):
            mask = active.reshape(active.shape + (1,) * (v.ndim - 1))
            if not aux.by_layer(name):
                return jnp.sum(jnp.where(mask, v, 0.0))
            on = (r[None, :] == jnp.arange(R)[:, None]) & active[None, :]  # [R, S]
            return on.reshape(on.shape + (1,) * (v.ndim - 1)) * v[None]

        totals = aux.add(totals, {name: added(name, v) for name, v in stage_aux.items()})
        # the last stage's pass goes back into the stream: the next repeat's input, or the result
        last = jnp.where(active[-1], out[-1], stream[m[-1]])
        stream = stream.at[m[-1]].set(last)
        return (stream, constrain(jnp.roll(out, 1, axis=0), (STAGE, *act)), totals), active

    with attention.whole_batch_segments(segment_ids) if segment_ids is not None else contextlib.nullcontext():
        shapes = {name: (R, S, G, *shape[1:]) if aux.by_layer(name) else shape
                  for name, shape in (aux_shapes or {}).items()}  # a per-layer entry by repeat, stage, layer
        (stream, _, totals), activity = jax.lax.scan(iteration, (stream, ring, aux.zeros(shapes)),
                                                     jnp.arange(schedule.iterations))
    out = constrain(stream.swapaxes(0, 1).reshape(x.shape), act)
    totals = {name: v.reshape(n_layers, *v.shape[3:]) if aux.by_layer(name) else v for name, v in totals.items()}
    totals = aux.scale(totals, 1.0 / M)  # each micro-batch's values are means over its tokens
    return (out, totals, activity) if return_activity else (out, totals)
