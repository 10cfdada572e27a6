"""Calibration: the inputs each projection sees, layer by layer, as the second moments GPTQ and Wanda need.

`LayerRunner` runs a model's blocks one at a time over calibration sequences held on the devices: the
embedding once, then for each layer `statistics` (the Gram matrix H = sum over tokens of x x^T of
each distinct projection input, [inputs, inputs] in float32, the inputs flattened as the kernel's
contracted dimensions) and `advance` (the layer's output, from whatever weights the layer has by
then: compressing layer by layer, each layer is calibrated on the outputs of the already compressed
ones, as GPTQ does). Projections that read the same input (q, k and v; gate and up) share one H.
Computed in float32 on the run's mesh, the calibration batch split over its batch axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd

from jaxlm.mesh import logical_to_spec
from jaxlm.models import layers, transformer


def sequences(docs: Sequence[np.ndarray], samples: int, seq_len: int) -> np.ndarray:
    """Up to `samples` windows of `seq_len` tokens [N, seq_len] from tokenized documents, concatenated
    (as GPTQ takes windows of a corpus); fewer when the documents hold fewer tokens."""
    flat = np.concatenate([np.asarray(d, np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
    n = min(samples, flat.size // seq_len)
    return flat[: n * seq_len].reshape(n, seq_len)


@jax.jit
def _slice(blocks: dict, i: jax.Array) -> dict:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), blocks)


def stack_of(cfg: transformer.ModelConfig, i: int) -> transformer.LayerStack:
    """The stack of layer `i` (`transformer.layer_stacks`: an MoE's dense first layers, or the model's own)."""
    return next(s for s in transformer.layer_stacks(cfg) if s.first <= i < s.first + s.count)


def layer_of(params: dict, cfg: transformer.ModelConfig, i: int) -> dict:
    """Layer `i`'s block parameters (a slice of its stack's stacked blocks, one compiled program for every
    layer of the stack; or the i-th of the list)."""
    if cfg.scan_layers:
        stack = stack_of(cfg, i)
        return jax.block_until_ready(_slice(params[stack.name], jnp.int32(i - stack.first)))
    return params["blocks"][i]


def _flat_inputs(equation: str, x: jax.Array) -> jax.Array:
    """A projection's input as [tokens, inputs]: its contracted dimensions last, in the kernel's order."""
    lhs = equation.split("->")[0]
    x_sub, k_sub = lhs.split(",")
    contracted = [c for c in k_sub if c in x_sub]
    batch = [c for c in x_sub if c not in contracted]
    order = [x_sub.index(c) for c in batch + contracted]
    moved = jnp.transpose(x, order)
    n_in = int(np.prod([x.shape[x_sub.index(c)] for c in contracted]))
    return moved.reshape(-1, n_in)


@dataclasses.dataclass
class LayerRunner:
    """The blocks of a float model, run one at a time over calibration tokens (see the module's docstring)."""

    cfg: transformer.ModelConfig  # the float model (no quantized kernels, masks or adapters)
    params: dict  # its parameters (the run's sharding)
    mesh: jax.sharding.Mesh
    rules: tuple
    batch: int = 8  # sequences per compiled call

    def __post_init__(self):
        self.cfg = dataclasses.replace(self.cfg, dtype=jnp.float32, dropout=0.0, remat="none")
        model_graphdef, _ = nnx.split(transformer.abstract_model(self.cfg))
        self._model_graphdef = model_graphdef
        self._block_graphdefs = {}  # of each stack's blocks: one block of its settings, alone
        for stack in transformer.layer_stacks(self.cfg):
            alone = dataclasses.replace(stack.cfg, scan_layers=False, n_layers=1,
                                        moe=dataclasses.replace(stack.cfg.moe, dense_layers=0))
            self._block_graphdefs[stack.name] = nnx.split(transformer.abstract_model(alone).blocks[0])[0]
        self._names, self._stats, self._advance = {}, {}, {}  # each stack's

    def _rows(self):
        return jax.sharding.NamedSharding(self.mesh, logical_to_spec(("act_batch", None, None), self.rules))

    def embed(self, tokens: np.ndarray) -> list[jax.Array]:
        """Calibration tokens [N, T] -> the first block's inputs, in chunks of `batch` sequences."""
        graphdef = self._model_graphdef

        @jax.jit
        def run(params, tokens):
            with spmd.logical_axis_rules(self.rules):
                model = nnx.merge(graphdef, params)
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
                return model.embed_tokens(tokens, positions)

        out = []
        with jax.set_mesh(self.mesh):
            for i in range(0, len(tokens), self.batch):
                chunk = jnp.asarray(tokens[i: i + self.batch])
                out.append(run(self.params, chunk))
        return out

    def _call(self, block_params: dict, x: jax.Array, capture: bool, stack: str):
        graphdef = self._block_graphdefs[stack]
        with spmd.logical_axis_rules(self.rules):
            block = nnx.merge(graphdef, block_params)
            seen: dict[int, tuple[str, jax.Array]] = {}
            names: dict[str, str] = {}
            if capture:
                for path, projection in layers.projections(block):
                    name = path[-1]

                    def op(equation, inputs, kernel, name=name, contract=projection.einsum_op):
                        key = id(inputs)
                        if key not in seen:
                            seen[key] = (name, _flat_inputs(equation, inputs))
                        names[name] = seen[key][0]
                        return contract(equation, inputs, kernel)

                    projection.einsum_op = op
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
            segment_ids = jnp.ones(x.shape[:2], jnp.int32)
            y = block(x, positions, segment_ids, None)
            grams = {first: jnp.einsum("ti,tj->ij", flat, flat, precision=jax.lax.Precision.HIGHEST)
                     for first, flat in seen.values()}
            return y, grams, names

    def statistics(self, block_params: dict, xs: list[jax.Array], stack: str = "blocks") -> dict[str, jax.Array]:
        """{projection name: H [inputs, inputs]} of one layer (of the stack `stack`) over the calibration
        inputs `xs`."""
        if stack not in self._names:  # which projection reads which input: one abstract trace
            names: dict[str, str] = {}

            def probe(p, x):
                _, grams, found = self._call(p, x, True, stack)
                names.update(found)
                return grams

            jax.eval_shape(probe, block_params, xs[0])
            self._names[stack] = names
            self._stats[stack] = jax.jit(lambda p, x: self._call(p, x, True, stack)[1])
        total: dict[str, jax.Array] = {}
        with jax.set_mesh(self.mesh):
            for x in xs:
                grams = self._stats[stack](block_params, x)
                total = grams if not total else {k: total[k] + grams[k] for k in grams}
        return {name: total[first] for name, first in self._names[stack].items()}

    def advance(self, block_params: dict, xs: list[jax.Array], stack: str = "blocks") -> list[jax.Array]:
        """The layer's (of the stack `stack`) outputs for inputs `xs` (the next layer's inputs)."""
        if stack not in self._advance:
            self._advance[stack] = jax.jit(lambda p, x: self._call(p, x, False, stack)[0])
        with jax.set_mesh(self.mesh):
            return [self._advance[stack](block_params, x) for x in xs]

    def final_inputs(self, xs: list[jax.Array]) -> jax.Array:
        """H of the unembedding's input (the final norm's output) over the last layer's outputs."""
        graphdef = self._model_graphdef

        @jax.jit
        def gram(params, x):
            with spmd.logical_axis_rules(self.rules):
                h = nnx.merge(graphdef, params).final_norm(x).reshape(-1, x.shape[-1])
                return jnp.einsum("ti,tj->ij", h, h, precision=jax.lax.Precision.HIGHEST)

        with jax.set_mesh(self.mesh):
            return sum(gram(self.params, x) for x in xs)
