"""A Mixture-of-Experts MLP (`model.mlp=moe`): `E` SwiGLU experts, a router sending each token to `k`
of them, optional shared experts every token uses, and the router's balancing and stability losses
returned through the auxiliary-output channel (`jaxlm.models.aux`).

Routers (`model.moe_router`), on float32 logits x @ router:
  topk_softmax  the top k logits, softmaxed among themselves (Mixtral; Qwen3-MoE with norm_topk_prob)
  softmax_topk  a softmax over every expert, the top k probabilities as they are (Switch, OLMoE,
                Qwen-MoE without norm_topk_prob)
  sigmoid       sigmoid scores; the top k of the scores plus a per-expert bias are chosen (the bias
                moves the choice alone: DeepSeek-V3's auxiliary-loss-free balancing), weighted by
                their scores normalized to sum to 1
The bias is a parameter whose gradient is zero (it moves the choice, not the output) and which is
not decayed, so the optimizer leaves it as it is; after each finite step `RouterBiasHook` moves each
layer's bias of each expert by `model.moe_bias_rate` towards balance: up for an expert whose load in
that step was under its share, down for one over it (DeepSeek-V3's rule, its gamma).

Dispatch (`model.moe_impl`), each the same function of the routed tokens where none is dropped:
  ragged    dropless: the (token, expert) pairs sorted by expert, each expert's rows multiplied by its
            weights with `jax.lax.ragged_dot` (a grouped matmul), then unsorted. jax 0.10 lowers it on
            XLA:CPU and XLA:GPU alike to a dense dot over every expert, masked: E x the routed FLOPs
  tokamax   ragged's dispatch with tokamax's grouped matmul (`tokamax.ragged_dot`, an optional package:
            the `cuda12` extra): on a GPU a real grouped GEMM (Mosaic GPU on Hopper, else Triton) whose
            FLOPs are the routed ones; elsewhere tokamax falls back to `jax.lax.ragged_dot` (the same
            values as ragged)
  dense     dropless: every expert applied to every token, the outputs weighted by the gates (E / k
            times the routed FLOPs; exact, simple, for small E and for checking the others)
  capacity  each expert takes at most C = ceil(capacity_factor x T x k / E) pairs of each row of T
            tokens, earlier tokens' first choices first (GShard's order, a row per group); pairs past
            an expert's capacity are dropped (their share of the token's output is zero) and counted
            (`aux/moe_dropped`). Fixed shapes, rows gathered and scattered by index: no one-hot
            dispatch matmul.

Auxiliary outputs (each a mean over the MoE layers, per token of the batch): `moe_balance_loss` (the
load-balancing loss times `model.moe_aux_loss`), `moe_z_loss` (the router z-loss times
`model.moe_z_loss`), and as metrics `moe_balance` (the balancing loss itself: E x sum_e f_e P_e, with
f_e the share of the batch's (token, expert) pairs routed to e times k and P_e the mean router
probability of e, 1.0 x k when balanced, as Switch Transformer and Hugging Face's Mixtral compute it),
`moe_load_max` and `moe_load_min` (the busiest and idlest expert's share of the pairs times E: 1.0 when
balanced), `moe_load_entropy` (the shares' entropy over log E: 1.0 when balanced), `moe_dropped` (the
share of pairs dropped); and per layer (`aux.by_layer`, TensorBoard's `aux/moe_load_by_layer/layer_<i>/<e>`),
`moe_load_by_layer` (each expert's share of the layer's pairs times E) and `moe_dropped_by_layer`.
"The batch" is what the model runs on at once: with micro-batches (gradient accumulation's, a pipeline's)
each is computed over one micro-batch and the step reports their mean (Megatron's choice), so the
balancing loss, a product of two means, depends on the micro-batch size as well as on the routing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from flax.linen import spmd
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

from jaxlm.errors import UserError
from jaxlm.mesh import logical_to_spec, mesh_axes_of
from jaxlm.models import layers
from jaxlm.models.mlps.base import EMBED, HIDDEN, MLP, output
from jaxlm.models.mlps.swiglu import GatedMLP

ROUTERS = ("topk_softmax", "softmax_topk", "sigmoid")
IMPLS = ("ragged", "tokamax", "dense", "capacity")  # model.moe_impl; "auto" resolves to one (`resolve_impl`)
# model.moe_ep: how rows reach the experts of other devices under expert parallelism; "auto" resolves to one
# (`resolve_ep`): the capacity dispatch's buffers exchanged by all-to-all, or every row gathered (`dispatch`)
EP_PATHS = ("alltoall", "gather")
# tokamax's grouped matmuls, in the order tried (each refuses what it cannot run with NotImplementedError):
# Mosaic GPU (Hopper and Blackwell), Triton (GPUs), XLA (`jax.lax.ragged_dot_general`, anywhere)
TOKAMAX_KERNELS = ("mosaic_gpu", "triton", "xla")
# The expert weights' logical axis names: [experts, inputs, outputs]
EXPERT_AXES = {"expert_gate": ("experts", EMBED, HIDDEN), "expert_up": ("experts", EMBED, HIDDEN),
               "expert_down": ("experts", HIDDEN, EMBED)}
# Each expert projection's contraction: rows [E, N, inputs] by their expert's matrix, the experts a batch axis
# (`layers.Projection.batch_axes`); the dispatches take its whole weight [E, inputs, outputs] instead
_EXPERT_EQUATIONS = {(EMBED, HIDDEN): "end,edf->enf", (HIDDEN, EMBED): "enf,efd->end"}
SHARED = {"shared_gate": (EMBED, HIDDEN), "shared_up": (EMBED, HIDDEN), "shared_down": (HIDDEN, EMBED)}
_SHARED_EQUATIONS = {(EMBED, HIDDEN): "btd,df->btf", (HIDDEN, EMBED): "btf,fd->btd"}


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The MoE settings of a model (`model.moe_*`, resolved: `impl` is never auto)."""

    experts: int = 8
    top_k: int = 2
    shared_experts: int = 0  # one SwiGLU of shared_experts x mlp_dim hidden units, every token through it
    router: str = "topk_softmax"
    impl: str = "ragged"
    capacity_factor: float = 1.25
    aux_loss: float = 0.01
    z_loss: float = 0.0
    bias_rate: float = 0.001  # the sigmoid router's bias step (`RouterBiasHook`)
    dense_layers: int = 0  # the first layers dense: a SwiGLU of dense_dim units (`transformer.layer_stacks`)
    dense_dim: int = 0  # resolved: never 0 where dense_layers > 0
    ep: str = "alltoall"  # expert parallelism's path (`EP_PATHS`, `dispatch`): alltoall for capacity, else gather

    @classmethod
    def from_model(cls, m, platform: str) -> MoESpec:
        """From `config.model` (a ConfigDict or dict: its `moe_*` keys; the defaults where absent)."""
        d = cls()
        get = m.get if hasattr(m, "get") else (lambda k, v: v)
        impl = resolve_impl(str(get("moe_impl", "auto")), platform)
        return cls(experts=int(get("moe_experts", d.experts)), top_k=int(get("moe_top_k", d.top_k)),
                   shared_experts=int(get("moe_shared_experts", d.shared_experts)),
                   router=str(get("moe_router", d.router)),
                   impl=impl, ep=resolve_ep(str(get("moe_ep", "auto")), impl),
                   capacity_factor=float(get("moe_capacity_factor", d.capacity_factor)),
                   aux_loss=float(get("moe_aux_loss", d.aux_loss)), z_loss=float(get("moe_z_loss", d.z_loss)),
                   bias_rate=float(get("moe_bias_rate", d.bias_rate)),
                   dense_layers=int(get("moe_dense_layers", 0)),
                   dense_dim=int(get("moe_dense_dim", 0)) or GatedMLP.default_dim(int(get("d_model", 0))))


@dataclasses.dataclass(frozen=True)
class RouterBiasHook:
    """The sigmoid router's auxiliary-loss-free balancing (a `steps.StepHook`): after a finite step, each
    layer's `router_bias` of expert e moves by `rate` x sign(1 - load_e), load_e being the step's
    `moe_load_by_layer` (the expert's share of the layer's pairs times E: 1 when balanced), wherever
    the bias is (trained or frozen, stacked or one per layer)."""

    rate: float
    first: int = 0  # the first MoE layer (model.moe_dense_layers): an unrolled block's index less this

    def optimizer_transforms(self) -> list:
        return []

    def update_args(self, trainable: dict, frozen: dict) -> dict:
        return {}

    def after_update(self, trainable: dict, frozen: dict, step, aux: dict, finite) -> tuple[dict, dict]:
        step_by_layer = self.rate * jnp.sign(1.0 - aux["moe_load_by_layer"])  # [L, E]
        step_by_layer = jnp.where(finite & jnp.all(jnp.isfinite(step_by_layer)), step_by_layer, 0.0)

        def moved(path, leaf):
            names = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
            if not names or names[-1] != "router_bias":
                return leaf
            layer = next((n for n in names if isinstance(n, int)), None)  # unrolled layers: one bias each
            delta = step_by_layer if layer is None else step_by_layer[layer - self.first]
            return (leaf + delta.reshape(leaf.shape)).astype(leaf.dtype)

        return (jax.tree_util.tree_map_with_path(moved, trainable),
                jax.tree_util.tree_map_with_path(moved, frozen))

    def metrics(self, trainable: dict, frozen: dict) -> dict:
        return {}


def step_hooks(cfg) -> list[RouterBiasHook]:
    """The train step's hooks of a model (`ModelConfig`): the bias rule of an MoE with the sigmoid router."""
    if cfg.mlp == "moe" and cfg.moe.router == "sigmoid" and cfg.moe.bias_rate > 0:
        return [RouterBiasHook(cfg.moe.bias_rate, cfg.moe.dense_layers)]
    return []


def resolve_impl(impl: str, platform: str) -> str:
    """model.moe_impl=auto, chosen by measurement (benchmarks/moe.py; benchmarks/BENCHMARKS.md): dropless
    where a dropless dispatch costs about what capacity's does, capacity elsewhere.

    - gpu: `tokamax` where it is installed: its grouped GEMM computes the routed FLOPs and no more, less
      than capacity's 1.25x and nothing dropped (in the H100 program compiled here); without it,
      `capacity`: jax's ragged_dot computes E x the routed FLOPs on a GPU (a masked dense dot over
      every expert), `dense` E / k x.
    - every other platform: `capacity`. A CPU has no grouped matmul: ragged_dot (and tokamax, which
      falls back to it) is the same masked dense dot, many times slower than capacity's batched
      einsum on the tiny recipe's shapes, and `dense` costs E / k x."""
    if impl == "tokamax":
        _tokamax()  # installed, or one line saying so
    if impl != "auto":
        return impl
    return "tokamax" if platform == "gpu" and tokamax_available() else "capacity"


def resolve_ep(ep: str, impl: str) -> str:
    """model.moe_ep=auto: `alltoall` for the capacity dispatch, `gather` for the dropless ones (XLA:CPU has
    no ragged all-to-all, and the dropless buffers have no fixed size). An explicit `alltoall` with a
    dropless dispatch is one line. Measured on moe_1b for 8 H100s (benchmarks/BENCHMARKS.md)."""
    if ep == "alltoall" and impl != "capacity":
        raise UserError(f"config.model.moe_ep=alltoall needs config.model.moe_impl=capacity (the all-to-all "
                        f"exchanges fixed-size buffers; {impl} is dropless): set model.moe_ep=auto or gather")
    if ep != "auto":
        return ep
    return "alltoall" if impl == "capacity" else "gather"


def capacity(spec: MoESpec, tokens: int) -> int:
    """Pairs each expert takes from a group (a row) of `tokens` in `capacity` dispatch: ceil(capacity_factor
    x tokens x k / E), at most `tokens` (an expert never gets one token twice)."""
    return max(1, min(tokens, math.ceil(spec.capacity_factor * tokens * spec.top_k / spec.experts)))


def route(logits: jax.Array, spec: MoESpec, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits [N, E] (float32) -> (gates [N, k] float32, experts [N, k] int32, probabilities [N, E]
    float32: what the balancing loss's P_e averages)."""
    k = spec.top_k
    if spec.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts, jax.nn.softmax(logits, axis=-1)
    if spec.router == "softmax_topk":
        probs = jax.nn.softmax(logits, axis=-1)
        gates, experts = jax.lax.top_k(probs, k)
        return gates, experts, probs
    scores = jax.nn.sigmoid(logits)
    _, experts = jax.lax.top_k(scores if bias is None else scores + jax.lax.stop_gradient(bias), k)
    chosen = jnp.take_along_axis(scores, experts, axis=-1)
    return chosen / jnp.sum(chosen, axis=-1, keepdims=True), experts, scores / jnp.sum(scores, axis=-1, keepdims=True)


def load_stats(experts: jax.Array, probs: jax.Array, spec: MoESpec) -> dict[str, jax.Array]:
    """The balancing loss and the load metrics of one layer's routing (module docstring)."""
    e, k = spec.experts, spec.top_k
    counts = jnp.sum(jax.nn.one_hot(experts.reshape(-1), e, dtype=jnp.float32), axis=0)  # pairs per expert
    share = counts / experts.size  # sums to 1
    balance = e * jnp.sum(share * k * jnp.mean(probs, axis=0))
    entropy = -jnp.sum(jnp.where(share > 0, share * jnp.log(jnp.where(share > 0, share, 1.0)), 0.0)) / math.log(e)
    return {"balance": balance, "load_max": jnp.max(share) * e, "load_min": jnp.min(share) * e,
            "load_entropy": entropy, "load_by_layer": share * e}


class MoEMLP(MLP):
    """`E` SwiGLU experts of `model.mlp_dim` hidden units, a router choosing `k` per token, and optional
    shared experts (module docstring). Its weights: `router` [D, E] and `router_bias` [E] (sigmoid
    routing only); the experts, projections with a leading experts axis (`layers.Projection.batch_axes`):
    `expert_gate`, `expert_up` [E, D, F], `expert_down` [E, F, D] (each one's `kernel`); and the shared
    experts' projections `shared_gate`, `shared_up`, `shared_down`. Adapters (LoRA: A [E, inputs, r] and
    B [E, r, outputs], one per expert) and quantized or fake-quantized kernels apply to every projection
    by name, the experts' as a dense MLP's; the dispatches take each expert projection's
    `effective_weight`."""

    name = "moe"
    projections: ClassVar[dict[str, tuple[str, str]]] = {}  # the shared experts', when there are any
    saved_hidden = GatedMLP.saved_hidden
    autodiff_hidden = GatedMLP.autodiff_hidden
    merged_hidden = GatedMLP.merged_hidden
    aux_names = ("moe_balance_loss", "moe_z_loss", "moe_balance", "moe_load_max", "moe_load_min",
                 "moe_load_entropy", "moe_dropped", "moe_load_by_layer", "moe_dropped_by_layer")
    # Mixtral (MixtralForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM), as their checkpoints store them: the
    # router a Linear [E, D] named gate, each expert three Linears (what `save_pretrained` writes, and what
    # transformers fuses into experts.gate_up_proj [E, 2F, D] and experts.down_proj [E, D, F] when it loads)
    hf_architectures = ("mixtral", "qwen3_moe")
    hf_layouts: ClassVar[dict[str, dict[str, str]]] = {
        "mixtral": {"router": "block_sparse_moe.gate", "expert_gate": "block_sparse_moe.experts.{expert}.w1",
                    "expert_up": "block_sparse_moe.experts.{expert}.w3",
                    "expert_down": "block_sparse_moe.experts.{expert}.w2"},
        "qwen3_moe": {"router": "mlp.gate", "expert_gate": "mlp.experts.{expert}.gate_proj",
                      "expert_up": "mlp.experts.{expert}.up_proj", "expert_down": "mlp.experts.{expert}.down_proj"},
    }

    @classmethod
    def aux_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """Each expert's load in each layer (its share of the pairs times E: 1.0 when balanced)."""
        return {**super().aux_shapes(cfg), "moe_load_by_layer": (cfg.moe.experts,)}

    @staticmethod
    def default_dim(d_model: int) -> int:
        """Each expert as wide as the dense SwiGLU's default (Mixtral's experts are Mistral's MLP)."""
        return GatedMLP.default_dim(d_model)

    @classmethod
    def shared_dim(cls, cfg) -> int:
        return cfg.moe.shared_experts * cfg.mlp_dim

    @classmethod
    def projection_shapes(cls, cfg) -> dict[str, tuple[int, int]]:
        f = cls.shared_dim(cfg)
        size = {EMBED: cfg.d_model, HIDDEN: f}
        return {name: (size[i], size[o]) for name, (i, o) in SHARED.items()} if f else {}

    @classmethod
    def weight_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """The router [D, E] and its bias [E] (sigmoid routing)."""
        d, e = cfg.d_model, cfg.moe.experts
        return {"router": (d, e), **({"router_bias": (e,)} if cfg.moe.router == "sigmoid" else {})}

    @classmethod
    def expert_shapes(cls, cfg) -> dict[str, tuple[int, int, int]]:
        """The expert projections' kernels: [E, D, F] (gate, up) and [E, F, D] (down)."""
        d, f, e = cfg.d_model, cfg.mlp_dim, cfg.moe.experts
        return {name: (e, d, f) if i == EMBED else (e, f, d) for name, (_, i, _) in EXPERT_AXES.items()}

    @classmethod
    def hf_unsupported(cls, cfg) -> str:
        """Mixtral and Qwen3-MoE route by a softmax, and have no shared experts."""
        if cfg.moe.router not in ("topk_softmax", "softmax_topk"):
            return f"model.moe_router={cfg.moe.router} (Mixtral and Qwen3-MoE route with topk_softmax or softmax_topk)"
        if cfg.moe.shared_experts:
            return f"model.moe_shared_experts={cfg.moe.shared_experts} (Mixtral and Qwen3-MoE have no shared experts)"
        return ""

    @classmethod
    def expert_params(cls, cfg) -> int:
        """One expert's weights."""
        return 3 * cfg.d_model * cfg.mlp_dim

    @classmethod
    def other_params(cls, cfg) -> int:
        """The experts, the router (and its bias, with sigmoid routing)."""
        return cfg.moe.experts * (cls.expert_params(cfg) + cfg.d_model + (cfg.moe.router == "sigmoid"))

    @classmethod
    def unrouted_params(cls, cfg) -> int:
        return (cfg.moe.experts - cfg.moe.top_k) * cls.expert_params(cfg)

    @classmethod
    def matmul_params(cls, cfg) -> int:
        """Per token: the router, its k experts and the shared experts (the active weights)."""
        return cfg.d_model * cfg.moe.experts + cfg.moe.top_k * cls.expert_params(cfg) + super().matmul_params(cfg)

    @classmethod
    def rows_per_token(cls, cfg) -> float:
        """The rows the experts compute per token: k dropless (ragged, tokamax), E (dense: every expert, every
        token), up to k x capacity_factor (capacity)."""
        spec = cfg.moe
        return {"ragged": spec.top_k, "tokamax": spec.top_k, "dense": spec.experts,
                "capacity": min(spec.top_k * spec.capacity_factor, spec.experts)}[spec.impl]

    @classmethod
    def gathers_rows(cls, cfg, gather: int) -> bool:
        """Whether the dispatch gathers the rows of the `gather` devices of the expert axis (`dispatch`: the
        gather path), rather than exchanging capacity buffers by all-to-all or running without the axis."""
        return gather > 1 and not (cfg.moe.impl == "capacity" and cfg.moe.ep == "alltoall")

    @classmethod
    def hidden_copies(cls, cfg, gather: int = 1) -> float:
        """Per token of its own: the rows of its experts (a dropless dispatch under expert parallelism sorts
        every gathered pair, `gather` x its own; capacity computes its experts' share alone, of the
        gathered rows or of the buffers the all-to-all brings: as many) and the shared experts'."""
        rows = cls.rows_per_token(cfg) * (gather if cfg.moe.impl in ("ragged", "tokamax") else 1)
        return rows + cfg.moe.shared_experts

    @classmethod
    def hidden_dots(cls) -> int:
        """Gate and up, the experts' and the shared experts' alike (saved under remat's dots policies)."""
        return 2

    @classmethod
    def gathered_params(cls, cfg) -> int:
        """The experts: whole on every device in the per-shard dispatch (`dispatch`)."""
        return cfg.moe.experts * cls.expert_params(cfg)

    @classmethod
    def extra_saved(cls, cfg, act_bytes: int, gather: int = 1) -> tuple[float, float]:
        """(bytes per [tokens, d_model] element, bytes per token) the layer keeps for its backward pass
        beside its hidden activations: the rows gathered for the experts (with the all-to-all, the buffers
        it brought: as many) and each pair's output, and with the gather path of expert parallelism
        (`gather` devices' rows) the gathered tokens; the router's float32 probabilities (its softmax's
        two, the chosen gates)."""
        spec = cfg.moe
        rows = cls.hidden_copies(cfg, gather) - spec.shared_experts if spec.impl != "dense" else 0  # dense: tokens
        gathered = gather if cls.gathers_rows(cfg, gather) else 0
        return act_bytes * (rows + spec.top_k + gathered), 4 * (2 * spec.experts + 3 * spec.top_k)

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        spec = self.spec = cfg.moe
        self.dtype, self.n_layers = cfg.dtype, cfg.n_layers - spec.dense_layers  # its layers with experts
        d, f, e = cfg.d_model, cfg.mlp_dim, spec.experts
        self.router = layers.make_param(rngs, layers.normal(cfg.init_std), (d, e), (EMBED, None), cfg.param_dtype)
        if spec.router == "sigmoid":
            self.router_bias = layers.make_param(rngs, layers.zeros, (e,), (None,), jnp.float32, decay=False)
        for name, (_, i, o) in EXPERT_AXES.items():  # projections: LoRA, QLoRA's codes apply to them by name
            std = cfg.residual_init_std if o == EMBED else cfg.init_std
            shape = (e, d, f) if i == EMBED else (e, f, d)
            setattr(self, name, cfg.projection(name, _EXPERT_EQUATIONS[i, o], shape, EXPERT_AXES[name],
                                               init=layers.normal(std), dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                               rngs=rngs))
        for name, (i, o) in SHARED.items() if spec.shared_experts else ():
            std = cfg.residual_init_std if o == EMBED else cfg.init_std
            shape = (d, self.shared_dim(cfg)) if i == EMBED else (self.shared_dim(cfg), d)
            setattr(self, name, cfg.projection(name, _SHARED_EQUATIONS[i, o], shape, (i, o), init=layers.normal(std),
                                               dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs))

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        spec, dtype = self.spec, self.dtype
        batch, seq, d = x.shape
        flat = x.reshape(batch * seq, d)
        logits = jnp.einsum("nd,de->ne", flat.astype(dtype), self.router[...].astype(dtype),
                            preferred_element_type=jnp.float32)
        gates, experts, probs = route(logits, spec, self.router_bias[...] if spec.router == "sigmoid" else None)
        # Each expert projection's weight [E, inputs, outputs] as its matmul takes it: cast, dequantized (QLoRA),
        # with its LoRA adapters merged (W_e + scale A_e B_e): exact for every dispatch, none of them changed
        weights = {name: getattr(self, name).effective_weight() for name in EXPERT_AXES}
        y, kept = dispatch(x.astype(dtype), gates.reshape(batch, seq, -1), experts.reshape(batch, seq, -1), weights,
                           spec)
        y, dropped = y.astype(dtype), 1.0 - jnp.mean(kept)
        if spec.shared_experts:
            key_gate, key_up, key_down = layers.split_keys(dropout_key, 3)  # the adapters' dropout (LoRA)
            xs = layers.tensor_parallel_entry(x)
            h = jax.nn.silu(self.shared_gate(xs, key_gate)) * self.shared_up(xs, key_up)
            y = y + self.shared_down(h, key_down)
        stats = load_stats(experts, probs, spec)
        z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        out = {"moe_balance_loss": spec.aux_loss * stats["balance"], "moe_z_loss": spec.z_loss * z,
               "moe_dropped": dropped, **{f"moe_{k}": v for k, v in stats.items() if k != "load_by_layer"}}
        out = {name: value / self.n_layers for name, value in out.items()}  # summed over the layers: means
        return output(y), {**out, "moe_load_by_layer": stats["load_by_layer"], "moe_dropped_by_layer": dropped}


# ----------------------------------------------------------------------------- dispatch


def _broadcast_rule(fn):
    """A `custom_vmap` rule: every operand broadcast to the vmapped size, then jax's own batching rule,
    which takes a grouped matmul vmapped only when every operand is (the step vmaps its gradient over
    `data` replicas with the expert weights unbatched: `steps._replica_local_grads`)."""
    def rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
        return jax.vmap(fn)(*args), True
    return rule


def _vmappable(fn):
    """`fn` under `custom_vmap` with `_broadcast_rule`."""
    wrapped = custom_vmap(fn)
    wrapped.def_vmap(_broadcast_rule(fn))
    return wrapped


def _grouped(forward, input_grad, weight_grad):
    """A grouped matmul (x [M, K], w [E, K, N], sizes [E]) -> [M, N] from its three products:
    `forward(x, w, sizes)`, `input_grad(ct, w, sizes)` -> [M, K] and `weight_grad(x, ct, sizes, w)` ->
    [E, K, N]; its gradient written out so that it also runs under vmap with the weights unbatched."""
    forward_v, input_grad_v, weight_grad_v = map(_vmappable, (forward, input_grad, weight_grad))

    @jax.custom_vjp
    def matmul(x, w, sizes):
        return forward_v(x, w, sizes)

    def fwd(x, w, sizes):
        return forward_v(x, w, sizes), (x, w, sizes)

    def bwd(saved, ct):
        x, w, sizes = saved
        dx = input_grad_v(ct, w, sizes).astype(x.dtype)
        dw = weight_grad_v(x, ct, sizes, w).astype(w.dtype)
        return dx, dw, np.zeros(sizes.shape, jax.dtypes.float0)

    matmul.defvjp(fwd, bwd)
    return matmul


def _ragged_forward(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def _ragged_input_grad(ct, w, sizes):
    return _ragged_forward(ct.astype(w.dtype), jnp.swapaxes(w, 1, 2), sizes)


def _ragged_weight_grad(x, ct, sizes, w):
    return jax.vjp(lambda w: _ragged_forward(x, w, sizes), w)[1](ct)[0]


grouped_matmul = _grouped(_ragged_forward, _ragged_input_grad, _ragged_weight_grad)
grouped_matmul.__doc__ = """Rows [M, K] grouped by expert (the first sizes[0] rows expert 0's, ...) times their
expert's weight [E, K, N] -> [M, N] float32: `jax.lax.ragged_dot`."""


TOKAMAX_MISSING = ("config.model.moe_impl=tokamax needs the tokamax package, which is not installed: "
                   "pip install 'jaxlm[cuda12]' (or tokamax), or set model.moe_impl=auto")


def tokamax_available() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def _tokamax():
    """The tokamax package (optional: `pip install 'jaxlm[cuda12]'`), its options readable: tokamax reads
    them from absl flags, which parse sys.argv on first use when nobody has, and refuse the arguments of
    jaxlm's own command lines."""
    if not tokamax_available():
        raise UserError(TOKAMAX_MISSING)
    import tokamax  # local import: an optional package (the cuda12 extra)

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def _dims(contracting, groups):
    """Dimension numbers of `ragged_dot_general`, in the form tokamax's kernels compare against."""
    return jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(contracting, ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=groups)


_ROWS_BY_WEIGHT = _dims(([1], [1]), [0])  # x [M, K] . w [E, K, N] -> [M, N]
_ROWS_BY_WEIGHT_T = _dims(([1], [2]), [0])  # ct [M, N] . w [E, K, N] -> [M, K]
_ROWS_BY_ROWS = _dims(([0], [0]), [])  # x [M, K] . ct [M, N], summed within each group -> [E, K, N]


def _tokamax_dot(lhs, rhs, sizes, dims, out):
    # one operand dtype: Mosaic GPU's kernels take no mixed pair; summed in float32 inside the kernel
    return _tokamax().ragged_dot_general(lhs, rhs.astype(lhs.dtype), sizes, dims, preferred_element_type=out,
                                         implementation=TOKAMAX_KERNELS)


def _tokamax_weight_grad(x, ct, sizes, w):
    """x [M, K] . ct [M, N] summed within each group -> [E, K, N]. tokamax's kernel reads its left operand
    transposed, [K, M], which XLA writes out first (a fusion writing M x K elements): the narrower of the
    two is put on the left, and the product transposed back when that is ct (the down projection's,
    whose x is [M, F] and ct [M, D]; the transposed product is a weight's size)."""
    ct = ct.astype(w.dtype)
    if ct.shape[1] < x.shape[1]:
        return jnp.swapaxes(_tokamax_dot(ct, x, sizes, _ROWS_BY_ROWS, w.dtype), 1, 2)
    return _tokamax_dot(x, ct, sizes, _ROWS_BY_ROWS, w.dtype)


tokamax_grouped_matmul = _grouped(
    lambda x, w, sizes: _tokamax_dot(x, w, sizes, _ROWS_BY_WEIGHT, x.dtype),
    lambda ct, w, sizes: _tokamax_dot(ct.astype(w.dtype), w, sizes, _ROWS_BY_WEIGHT_T, w.dtype),
    _tokamax_weight_grad)
tokamax_grouped_matmul.__doc__ = """`grouped_matmul` with tokamax's kernels (`TOKAMAX_KERNELS`), each product written in its
operands' dtype (the compute dtype), summed in float32 inside the kernel: a float32 output would be cast
by a separate kernel that XLA cannot fuse into a custom call, and the compiled step kept the float32
buffers alive for the backward pass instead of their casts (benchmarks/BENCHMARKS.md). The cotangent in
the weights' dtype (it holds values of the compute dtype: the experts' outputs are cast to it)."""


def _expert_ffn(rows: jax.Array, weights: dict[str, jax.Array], matmul, joint: bool = False) -> jax.Array:
    """SwiGLU on rows already grouped by expert, `matmul(rows, weight)` doing the grouping; every
    activation in the rows' dtype, SwiGLU's product recomputed in the backward pass as a dense MLP's.
    `joint`: gate and up as one matmul against their weights side by side, [E, D, 2F] (joined here, at
    compute time: the parameters stay apart), its output split."""
    dtype = rows.dtype
    if joint:
        f = weights["expert_gate"].shape[-1]
        both = matmul(rows, jnp.concatenate([weights["expert_gate"], weights["expert_up"]], axis=-1)).astype(dtype)
        gate, up = both[..., :f], both[..., f:]
    else:
        gate = matmul(rows, weights["expert_gate"]).astype(dtype)
        up = matmul(rows, weights["expert_up"]).astype(dtype)
    h = layers.recomputed(lambda g, u: jax.nn.silu(g) * u)(gate, up)
    return matmul(h, weights["expert_down"]).astype(dtype)


def _combine(slots: jax.Array, gates: jax.Array) -> jax.Array:
    """Each token's k expert outputs [N * k, D] (token-major) weighted by its gates [N, k] and summed."""
    n, k = gates.shape  # (a product and a sum, not a matmul: no FLOPs beside the experts' and the router's)
    return jnp.sum(slots.reshape(n, k, -1) * gates[:, :, None], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _take_rows(src: jax.Array, index: jax.Array, back: jax.Array, group: int) -> jax.Array:
    """src[index] along the rows, where `index` takes each row of `src` exactly `group` times and `back`
    says where: row n's copies are at back[n * group] .. back[n * group + group - 1]. Its gradient is a
    gather too (each row's copies read back and summed), not the scatter-add autodiff writes for
    `jnp.take`: XLA fuses a gather with the elementwise work around it, a scatter it runs as a kernel of
    its own, after one that zeroes its output."""
    return jnp.take(src, index, axis=0)


def _take_rows_fwd(src, index, back, group):
    return jnp.take(src, index, axis=0), (index, back)


def _take_rows_bwd(group, saved, ct):
    index, back = saved
    copies = jnp.take(ct, back, axis=0)
    d_src = copies if group == 1 else jnp.sum(copies.reshape(-1, group, ct.shape[-1]).astype(jnp.float32), axis=1)
    zero = np.zeros(index.shape, jax.dtypes.float0)
    return d_src.astype(ct.dtype), zero, zero  # (ct has src's dtype)


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _ragged(x, gates, experts, weights, spec, einsum_op, first, grouped=grouped_matmul, joint=False):
    """Dropless: the (token, expert) pairs sorted by expert, one grouped matmul per weight (`grouped`:
    jax's or tokamax's; `joint`: gate and up as one, `_expert_ffn`). Only the experts `first` .. `first` +
    (the weights' count) are computed (expert parallelism: a device's own); the other pairs sort last,
    outside every group (zero rows), and their gates count nothing."""
    n, k = gates.shape
    count = weights["expert_gate"].shape[0]
    local = experts.reshape(-1) - first  # token-major: pair p is token p // k
    mine = (local >= 0) & (local < count)
    local = jnp.where(mine, local, count)
    order = jnp.argsort(local, stable=True)
    sizes = jnp.bincount(local, length=count + 1)[:count].astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype), unique_indices=True)
    rows = _take_rows(x, order // k, inverse, k)  # pair i of the sorted order is token order[i] // k
    out = _expert_ffn(rows, weights, lambda r, w: grouped(r, w, sizes), joint=joint)
    slots = _take_rows(out, inverse, order, 1)  # back in token-major order: pair p's output is out[inverse[p]]
    return _combine(slots, jnp.where(mine.reshape(n, k), gates, 0.0)), jnp.ones(gates.shape, jnp.float32)


def _dense(x, gates, experts, weights, spec, einsum_op, first):
    """Dropless: every expert on every token, weighted by the gates (zero for the experts not chosen);
    only the experts `first` .. `first` + (the weights' count)."""
    n, _ = gates.shape
    count = weights["expert_gate"].shape[0]
    combine = jnp.zeros((n, spec.experts), jnp.float32).at[jnp.arange(n)[:, None], experts].add(gates)
    combine = jax.lax.dynamic_slice_in_dim(combine, first, count, axis=1)

    def matmul(r, w):
        return einsum_op("nd,edf->enf" if r.ndim == 2 else "enf,efd->end", r, w)

    out = _expert_ffn(x, weights, matmul)  # [E, N, D]
    return jnp.sum(out * combine.T[:, :, None], axis=0), jnp.ones(gates.shape, jnp.float32)


def _capacity_slots(experts: jax.Array, spec: MoESpec, c: int) -> tuple[jax.Array, jax.Array]:
    """A group's (a row's) pairs, experts [n, k], in its [E, C] buffers: (slot [n * k] choice-major, pair q
    being choice q // n of token q % n, at expert x C + its place in the expert's queue, E x C where
    dropped; kept [n * k] bool). First choices of every token before second choices (GShard's order)."""
    choice_major = experts.T.reshape(-1)
    onehot = jax.nn.one_hot(choice_major, spec.experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # its place in its expert's queue
    kept = position < c
    return jnp.where(kept, choice_major * c + position, spec.experts * c), kept


def _capacity(x, gates, experts, weights, spec, einsum_op, first):
    """At most `capacity` pairs per expert, first choices of every token before second choices; which
    pairs are kept is decided over all the experts, only `first` .. `first` + (the weights' count) are
    computed."""
    n, k = gates.shape
    c, count = capacity(spec, n), weights["expert_gate"].shape[0]
    slot, kept = _capacity_slots(experts, spec, c)
    local = slot // c - first
    computed = kept & (local >= 0) & (local < count)
    slot = jnp.where(computed, slot - first * c, count * c)  # count * c: the discard slot
    token = jnp.arange(n * k) % n
    source = jnp.full((count * c + 1,), n, jnp.int32).at[slot].set(token)[: count * c]  # n: empty (a zero row)
    rows = jnp.take(jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)]), source, axis=0)
    rows = rows.reshape(count, c, -1)

    def matmul(r, w):
        return einsum_op("ecd,edf->ecf", r, w)

    out = _expert_ffn(rows, weights, matmul).reshape(count * c, -1)
    out = jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])
    slots = jnp.take(out, slot, axis=0).reshape(k, n, -1).transpose(1, 0, 2).reshape(n * k, -1)  # token-major
    return _combine(slots, gates), kept.reshape(k, n).T.astype(jnp.float32)


def _capacity_all_to_all(x, gates, experts, weights, spec, einsum_op, axis: str):
    """The capacity dispatch with the experts split over mesh axis `axis` (GShard's): inside `shard_map`,
    x [B, T, D], gates and experts [B, T, k] a device's own rows, `weights` its E / P experts (P the
    axis's size). Each row is a group of capacity C (`capacity`, `_capacity_slots`: the pairs one device
    keeps), its pairs copied into the row's [E, C, D] buffers; one all-to-all sends each device along
    the axis its experts' buffers of every row, [E/P, P x B x C, D] received; its experts run on them,
    and a second all-to-all returns the outputs to the rows' devices, where each token's k outputs are
    weighted by its gates and summed. Both all-to-alls move B x E x C x D values per device (each
    sends (P - 1) / P of them), in the compute dtype. -> (y [B, T, D] float32, kept [B, T, k])."""
    b, t, d = x.shape
    k, e = gates.shape[-1], spec.experts
    c, count = capacity(spec, t), weights["expert_gate"].shape[0]
    parts = e // count
    slot, kept = jax.vmap(lambda ex: _capacity_slots(ex, spec, c))(experts)  # [B, T * k] each
    row = jnp.arange(b)[:, None]
    token = jnp.arange(t * k) % t
    # for each row's buffer place (expert, position): the token it holds, t where empty
    source = jax.vmap(lambda s: jnp.full((e * c + 1,), t, jnp.int32).at[s].set(token)[: e * c])(slot)
    source = jnp.where(source < t, row * t + source, b * t)  # into the flat rows, b * t a zero row
    # expert-major [E, B, C]: the all-to-all splits and joins leading blocks, no transposes around it
    source = source.reshape(b, e, c).transpose(1, 0, 2)
    flat = jnp.concatenate([x.reshape(b * t, d), jnp.zeros((1, d), x.dtype)])
    buffers = jnp.take(flat, source, axis=0)  # [E, B, C, D]
    received = jax.lax.all_to_all(buffers, axis, split_axis=0, concat_axis=1, tiled=True)  # [E/P, P x B, C, D]

    def matmul(r, w):
        return einsum_op("ecd,edf->ecf", r, w)

    out = _expert_ffn(received.reshape(count, parts * b * c, d), weights, matmul)
    out = jax.lax.all_to_all(out.reshape(count, parts * b, c, d), axis, split_axis=1, concat_axis=0,
                             tiled=True)  # [E, B, C, D]: every expert's outputs for this device's rows
    out = jnp.concatenate([out.reshape(e * b * c, d), jnp.zeros((1, d), out.dtype)])
    where = jnp.where(kept, (slot // c) * (b * c) + row * c + slot % c, e * b * c)  # each pair's output
    slots = jnp.take(out, where, axis=0).reshape(b, k, t, d).transpose(0, 2, 1, 3)  # [B, T, k, D]
    y = jnp.sum(slots * gates[..., None], axis=2)
    return y, kept.reshape(b, k, t).transpose(0, 2, 1).astype(jnp.float32)


# tokamax: gate and up as one grouped GEMM (the rows read once, one kernel: a shorter H100 step); not jax's
# ragged_dot, a masked dense dot on a CPU that runs slower joined (measured: benchmarks/BENCHMARKS.md)
DISPATCH = {"ragged": _ragged, "tokamax": functools.partial(_ragged, grouped=tokamax_grouped_matmul, joint=True),
            "dense": _dense, "capacity": _capacity}
EXPERT_AXIS = "expert"  # the mesh axis the rules split the experts over (rules.experts)


def dispatch(x: jax.Array, gates: jax.Array, experts: jax.Array, weights: dict[str, jax.Array],
             spec: MoESpec, einsum_op=jnp.einsum) -> tuple[jax.Array, jax.Array]:
    """The experts' weighted outputs for tokens x [B, T, D] routed to `experts` [B, T, k] with `gates`
    [B, T, k]: (y [B, T, D] float32, kept [B, T, k]: 1.0 for each pair its expert took, 0.0 dropped).
    `einsum_op`: the dense and capacity dispatches' per-expert matmul (XLA's einsum: the CPU's accumulating
    form fails at run time on the batched dots of its gradient, and float8 experts are not built yet).

    Under a mesh each device dispatches its own rows (shard_map over the batch's mesh axes): a sort or a
    capacity count across the whole batch would gather every token to every device. Without a mesh, all
    rows at once. The capacity dispatch takes each row as its own group (GShard's groups), so which
    pairs it drops does not depend on how the rows are split over devices.

    Expert parallelism (the rules split the experts over the `expert` mesh axis, mesh.expert > 1): each
    device holds E / mesh.expert experts and the batch's rows are split over that axis too; `spec.ep` says
    how rows reach the experts on other devices (`model.moe_ep`, `resolve_ep`):

    - alltoall (the capacity dispatch; GShard's): each device copies its rows' pairs into the rows' [E, C]
      capacity buffers, an all-to-all over the axis hands every device its experts' buffers from all the
      devices along it, it runs its experts, and a second all-to-all returns the outputs, which each
      device combines for its own rows (`_capacity_all_to_all`). Each moves B x E x C x D values of the
      compute dtype per device, k x capacity_factor x a device's tokens; nothing is gathered or summed.
    - gather (the dropless dispatches, or asked for): the rows of the devices along the axis are gathered
      (all-gather), each device runs its own experts on all of them, and each row's partial outputs are
      summed back to the device that holds it (a float32 reduce-scatter). The dropless ones sort and hold
      every gathered pair's row, `expert` times a device's own (a ragged all-to-all, which moves only the
      routed pairs, is not built: XLA:CPU has none).

    Both compute the same function as one device, dropless or with the same drops (a row is a group on
    any mesh), with collectives every XLA backend runs. Where the rules keep the batch whole along the
    axis, every device there has the same rows: each runs its experts and the outputs are summed (psum).
    (Without the axis the experts are whole on every device, gathered as fsdp gathers a weight.)"""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    meshed = bool(rules) and not mesh.empty
    split = meshed and EXPERT_AXIS in mesh_axes_of("experts") and mesh.shape.get(EXPERT_AXIS, 1) > 1
    rows_split = split and EXPERT_AXIS in mesh_axes_of("act_batch")  # (else every device there has the same rows)

    def local(x, gates, experts, *ws):
        if rows_split and spec.impl == "capacity" and spec.ep == "alltoall":
            return _capacity_all_to_all(x, gates, experts, dict(zip(weights, ws)), spec, einsum_op, EXPERT_AXIS)
        if rows_split:  # the rows of every device along the expert axis
            x, gates, experts = (jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True) for a in (x, gates, experts))
        first = jax.lax.axis_index(EXPERT_AXIS) * ws[0].shape[0] if split else 0  # this device's experts
        b, t, d = x.shape
        k = gates.shape[-1]
        fn = functools.partial(DISPATCH[spec.impl], weights=dict(zip(weights, ws)), spec=spec, einsum_op=einsum_op,
                               first=first)
        if spec.impl == "capacity":  # each row its own group: its capacity the same on any mesh
            y, kept = jax.vmap(fn)(x, gates, experts)
        else:
            y, kept = fn(x.reshape(b * t, d), gates.reshape(b * t, k), experts.reshape(b * t, k))
            y, kept = y.reshape(b, t, d), kept.reshape(b, t, k)
        if rows_split:  # each row's outputs summed over the experts' devices, back on its own device
            y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
            rows_here = b // mesh.shape[EXPERT_AXIS]
            kept = jax.lax.dynamic_slice_in_dim(kept, jax.lax.axis_index(EXPERT_AXIS) * rows_here, rows_here)
        elif split:  # the same rows on every device along the axis: the outputs summed over its experts
            y = jax.lax.psum(y, EXPERT_AXIS)
        return y, kept

    if not meshed:
        return local(x, gates, experts, *weights.values())
    rows = logical_to_spec(("act_batch", None, None), rules)
    expert_spec = P(EXPERT_AXIS) if split else P()
    return jax.shard_map(local, in_specs=(rows, rows, rows, *(expert_spec for _ in weights)), out_specs=(rows, rows),
                         check_vma=False)(x, gates, experts, *weights.values())
