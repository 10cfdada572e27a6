"""LoRA adapters on a projection (Hu et al., 2021): y = x W + (alpha / rank) (dropout(x) A) B.

The projection keeps its kernel (plain, quantized or masked); `Adapted` adds A and B beside it and
their term to its output. What to do with trained adapters (merge, export to PEFT) is `jaxlm.lora`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models import layers

# The logical name of an adapter's rank dimension: small, never sharded (mesh.default_rules maps it to none).
LORA_RANK_AXIS = "lora_rank"


def lora_equations(equation: str) -> tuple[str, str]:
    """The two contractions of a LoRA adapter beside `einsum(equation, x, kernel)`: (x, A) -> h and
    (h, B) -> y, where A holds the kernel's batch dimensions (those the input and output share: an MoE's
    experts), its input (contracted) dimensions, then a rank dimension, and B the batch dimensions, the
    rank dimension, then the kernel's output dimensions: one adapter per batch index. wq's
    "btd,dnh->btnh" gives ("btd,dr->btr", "btr,rnh->btnh"); wo's "btnh,nhd->btd" gives ("btnh,nhr->btr",
    "btr,rd->btd"); an expert's "end,edf->enf" gives ("end,edr->enr", "enr,erf->enf")."""
    lhs, out = equation.split("->")
    x, kernel = lhs.split(",")
    r = next(c for c in "rzyxwqponmlkjigfeca" if c not in equation)
    batch = "".join(c for c in kernel if c in x and c in out)
    a = batch + "".join(c for c in kernel if c in x and c not in out) + r
    b = batch + r + "".join(c for c in kernel if c not in x)
    h = "".join(c for c in x if c not in kernel or c in out) + r
    return f"{x},{a}->{h}", f"{h},{b}->{out}"


@dataclasses.dataclass(frozen=True)
class LoRA:
    """The model's adapters (`ModelConfig.lora`, from `config.lora`): the projections that get one, by
    attribute name, their rank (`ranks` overrides it per name), `alpha` (the update is scaled by
    alpha / rank) and the dropout on their input."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    ranks: tuple[tuple[str, int], ...] = ()
    dropout: float = 0.0

    def rank_of(self, name: str) -> int:
        """The rank of the adapter on the projections called `name` (wq, w_down, unembed, ...); 0 = none."""
        return dict(self.ranks).get(name, self.rank) if name in self.targets else 0

    def parts(self, name: str) -> tuple[set[type], dict[str, Any]]:
        """The projection transforms (`Adapted`) and their arguments for the projections called `name`."""
        return ({Adapted}, {}) if self.rank_of(name) else (set(), {})

    def param_count(self, layer_shapes: dict[str, tuple[int, ...]], n_layers: int,
                    unembed_shape: tuple[int, int] | None) -> int:
        """The adapters' parameters: rank x (inputs + outputs) of each adapted projection (of each expert's,
        for a projection with an experts axis), over the layers (`layer_shapes`: each block projection's
        (inputs, outputs), or (experts, inputs, outputs)) and the unembedding (None when tied)."""
        per_layer = sum(self.rank_of(name) * math.prod(shape[:-2]) * sum(shape[-2:])
                        for name, shape in layer_shapes.items())
        return n_layers * per_layer + (self.rank_of("unembed") * sum(unembed_shape) if unembed_shape else 0)

    def peft_settings(self) -> dict[str, Any]:
        """PEFT's LoraConfig fields for these adapters, with jaxlm's projection names in `target_modules`
        and `rank_pattern` (an exporter maps them to the checkpoint's, e.g. wq -> q_proj)."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.targets),
            "rank_pattern": {name: rank for name, rank in self.ranks if rank != self.rank},
            "lora_dropout": self.dropout,
            "bias": "none",
            "use_rslora": False,  # the scale is alpha / rank, not alpha / sqrt(rank)
        }


class Adapted(layers.Projection):
    """A projection with a LoRA adapter, once `add_adapter` ran (after every base weight of the model is
    drawn, so that those are the same with or without adapters: one seed, one base model)."""

    def store_kernel(self, kernel) -> None:
        super().store_kernel(kernel)
        self.lora_a, self.lora_b = nnx.data(None), nnx.data(None)
        self.lora_scale, self.lora_dropout = 0.0, 0.0

    def add_adapter(self, rank: int, alpha: float, *, rngs: nnx.Rngs, dropout: float = 0.0) -> None:
        """A [the kernel's input dims..., rank] starts as PEFT's (kaiming-uniform, U(-1, 1) / sqrt(fan_in)),
        B [rank, the kernel's output dims...] at zero, so a new adapter changes nothing. Both are
        `nnx.LoRAParam`s (an `nnx.Param` subclass: `optim.trainable=type:LoRAParam` selects them), in
        float32 and cast to the compute dtype like the kernel, decayed like any matrix (PEFT's
        convention under Hugging Face's Trainer). Their logical names are the kernel's input names +
        `lora_rank` and `lora_rank` + its output names, so they shard like the kernel under any rules.
        """
        shape, names, batch, ins = self.kernel_shape, self.kernel_names, self.batch_axes, self.in_axes
        outs = tuple(i for i in range(len(shape)) if i not in ins + batch)
        bound = 1.0 / math.sqrt(math.prod(shape[i] for i in ins))
        a_shape = (*(shape[i] for i in batch + ins), rank)
        b_shape = (*(shape[i] for i in batch), rank, *(shape[i] for i in outs))
        self.lora_a = nnx.LoRAParam(jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound),
                                    out_sharding=(*(names[i] for i in batch + ins), LORA_RANK_AXIS), decay=True,
                                    eager_sharding=False)
        self.lora_b = nnx.LoRAParam(jnp.zeros(b_shape, jnp.float32),
                                    out_sharding=(*(names[i] for i in batch), LORA_RANK_AXIS,
                                                  *(names[i] for i in outs)), decay=True, eager_sharding=False)
        self.lora_scale, self.lora_dropout = alpha / rank, dropout

    def adapter(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """The adapter's term, (alpha / rank) (dropout(x) A) B, in the compute dtype, shaped like the output."""
        to_h, to_y = lora_equations(self.equation)
        h = jnp.einsum(to_h, layers.dropout(x, self.lora_dropout, dropout_key), self.lora_a[...].astype(self.dtype))
        return jnp.einsum(to_y, h * jnp.asarray(self.lora_scale, self.dtype), self.lora_b[...].astype(self.dtype))

    def delta(self) -> jax.Array:
        """The adapter's update of the kernel, (alpha / rank) A B, shaped like it, summed in float32 from A
        and B in the compute dtype (their forward use a plain cast, as `cast_leaves` says)."""
        to_h, to_y = lora_equations(self.equation)
        a_sub, b_sub = to_h.split("->")[0].split(",")[1], to_y.split("->")[0].split(",")[1]
        kernel_sub = self.equation.split("->")[0].split(",")[1]
        ab = jnp.einsum(f"{a_sub},{b_sub}->{kernel_sub}", self.lora_a[...].astype(self.dtype),
                        self.lora_b[...].astype(self.dtype), preferred_element_type=jnp.float32)
        return self.lora_scale * ab

    def effective_weight(self) -> jax.Array:
        """The kernel with the adapter merged, W + (alpha / rank) A B, summed in float32 and cast to the
        compute dtype once: exact in float32; in bfloat16 the update is seen at the merged weight's precision
        (as the float32 master weights of full fine-tuning are seen cast), and without dropout."""
        w = super().effective_weight()
        return w if self.lora_a is None else (w.astype(jnp.float32) + self.delta()).astype(self.dtype)

    @property
    def plain(self) -> bool:
        return False

    def cast_leaves(self) -> dict[str, object]:
        out = super().cast_leaves()
        if self.lora_a is not None:
            out.update(lora_a=self.dtype, lora_b=self.dtype)
        return out

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """`dropout_key`: the adapter's dropout (training only); the kernel's contraction has none."""
        y = super().__call__(x, dropout_key)
        return y if self.lora_a is None else y + self.adapter(x, dropout_key)
