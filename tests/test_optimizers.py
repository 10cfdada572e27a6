"""The optimizers of the registry (`optim.name`): each one's update against a reference (NumPy for Muon,
optax's own transforms for the others), its state unchanged by a non-finite step, the planner's count of
its state against the real one; which parameters Muon takes as matrices; Muon on sharded matrices."""

from __future__ import annotations

import functools
import math

import floats
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax.core import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import random_batch, small_config, step_losses
from jaxlm import axes, config, memory, optim, train_setup, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.optim import Matrix
from jaxlm.optim.muon import RMS

NAMES = sorted(optim.OPTIMIZERS)


def _settings(name: str, **overrides) -> ml_collections.ConfigDict:
    extra = dict(optim__schedule="constant") if name == "schedule_free_adamw" else {}
    return config.recipe("tiny", optim__name=name, **extra, **{f"optim__{k}": v for k, v in overrides.items()}).optim


def _params():
    """A matrix, a tall one, q's [d, heads, head_dim] kernel, a stack of two layers' matrices, and a bias."""
    shapes = {"w": (8, 12), "tall": (12, 8), "wq": (8, 2, 3), "stack": (2, 6, 4), "b": (12,)}
    return {k: jnp.sin(jnp.arange(math.prod(s), dtype=jnp.float32) + i).reshape(s)
            for i, (k, s) in enumerate(shapes.items())}


MATRICES = {"w": Matrix((), (0,), (1,)), "tall": Matrix((), (0,), (1,)), "wq": Matrix((), (0,), (1, 2)),
            "stack": Matrix((0,), (1,), (2,), ("layers",)), "b": None}
DECAY = {"w": True, "tall": True, "wq": True, "stack": True, "b": False}


def _grads(params, i):
    return jax.tree.map(lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(7), i), p.shape), params)


# ----------------------------------------------------------------------------- the registry and AdamW


def test_adamw_is_the_default_and_builds_the_chain_and_state_it_always_did():
    """optim.name=adamw: clip, then optax.adamw's transforms (scale_by_adam, add_decayed_weights,
    scale_by_learning_rate), in the state structure checkpoints have always had."""
    o = config.recipe("tiny").optim
    assert o.name == "adamw"
    params = _params()
    ours, schedule = optim.make_optimizer(o, 50, DECAY)
    ref = optax.chain(optax.clip_by_global_norm(o.clip_norm), optax.chain(
        optax.scale_by_adam(o.b1, o.b2, o.eps), optax.add_decayed_weights(o.weight_decay, DECAY),
        optax.scale_by_learning_rate(schedule)))
    assert jax.tree.structure(ours.init(params)) == jax.tree.structure(ref.init(params))
    assert jax.tree.structure(ours.init(params)) == jax.tree.structure(
        optax.chain(optax.clip_by_global_norm(o.clip_norm), optax.adamw(schedule, weight_decay=0.1, mask=DECAY)
                    ).init(params))


def test_an_unknown_optimizer_or_a_bad_muon_setting_stops_in_one_line():
    with pytest.raises(UserError, match=r"^config.optim.name='sgd' is not allowed: one of 'adamw', 'muon'"):
        config.recipe("tiny", optim__name="sgd")
    with pytest.raises(UserError, match=r"config.optim.muon_ns_coeffs='3.4,-4.7' is not allowed: three"):
        config.recipe("tiny", optim__name="muon", optim__muon_ns_coeffs="3.4,-4.7")
    with pytest.raises(UserError, match=r"config.optim.schedule='cosine' is not allowed: 'constant' with "
                                        r"optim.name='schedule_free_adamw'"):
        config.recipe("tiny", optim__name="schedule_free_adamw")


# ----------------------------------------------------------------------------- Muon against NumPy


def _newton_schulz(x: np.ndarray, coeffs, steps: int, eps: float) -> np.ndarray:
    a, b, c = coeffs
    if x.shape[0] > x.shape[1]:
        return _newton_schulz(x.T, coeffs, steps, eps).T
    x = x / (np.sqrt(np.sum(x * x)) + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _as_matrices(x: np.ndarray, name: str) -> np.ndarray:
    """[batch, rows, cols] of each parameter of `_params` (written out, not from `Matrix`)."""
    if name == "wq":  # [d, heads, head_dim] -> [d, heads x head_dim]
        return x.reshape(1, 8, 6)
    return x if name == "stack" else x[None]


def _numpy_muon(params, grads_list, o, schedule):
    """Muon (Keller Jordan's, with optax's bias-corrected Nesterov momentum) for the matrices, AdamW for the
    bias, in float64: the updates of each step."""
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    beta, (b1, b2), coeffs = o.muon_momentum, (o.b1, o.b2), tuple(float(c) for c in o.muon_ns_coeffs.split(","))
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    out = []
    for t, grads in enumerate(grads_list, 1):
        lr, updates = float(schedule(t - 1)), {}
        for k, g in ((k, np.asarray(v, np.float64)) for k, v in grads.items()):
            if k == "b":  # AdamW, no decay on a bias
                mu[k] = b1 * mu[k] + (1 - b1) * g
                nu[k] = b2 * nu[k] + (1 - b2) * g * g
                adam = (mu[k] / (1 - b1**t)) / (np.sqrt(nu[k] / (1 - b2**t)) + o.eps)
                updates[k] = -lr * o.muon_adam_lr_ratio * adam
                continue
            mu[k] = beta * mu[k] + (1 - beta) * g
            u = beta * mu[k] / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
            stack = _as_matrices(u, k)
            ortho = np.stack([_newton_schulz(m, coeffs, o.muon_ns_steps, o.eps) for m in stack])
            scale = RMS * math.sqrt(max(stack.shape[1:]))
            updates[k] = -lr * (scale * ortho.reshape(u.shape) + o.weight_decay * params[k])
        params = {k: params[k] + updates[k] for k in params}
        out.append(updates)
    return out


def test_muon_updates_equal_a_numpy_reference_and_orthogonalize_each_matrix():
    o = _settings("muon", clip_norm=0.0, warmup_steps=2, muon_adam_lr_ratio=0.5)
    tx, schedule = optim.make_optimizer(o, 10, DECAY, matrices=MATRICES)
    params = _params()
    grads_list = [_grads(params, i) for i in range(3)]
    want = _numpy_muon(params, grads_list, o, schedule)
    state, update = tx.init(params), jax.jit(tx.update)
    for grads, expected in zip(grads_list, want):
        updates, state = update(grads, state, params, finite=jnp.bool_(True))
        # float32 against float64, through five quintic iterations that amplify rounding
        floats.close(updates, {k: v.astype(np.float32) for k, v in expected.items()}, ulps=256)
        params = optax.apply_updates(params, updates)
    # the orthogonalized momentum's singular values lie near 1 (Keller Jordan's iteration: 0.5-1.5, not exactly 1)
    ortho = _newton_schulz(np.asarray(grads_list[0]["w"], np.float64), (3.4445, -4.775, 2.0315), 5, 1e-8)
    singular = np.linalg.svd(ortho, compute_uv=False)
    assert 0.5 < singular.min() and singular.max() < 1.5, singular


def test_muon_lr_scales_are_moonshots_and_keller_jordans():
    shapes = {"w": (8, 12), "tall": (12, 8)}
    rms = {k: optim.muon_lib.shape_scale(MATRICES[k], s, "rms") for k, s in shapes.items()}
    shape = {k: optim.muon_lib.shape_scale(MATRICES[k], s, "shape") for k, s in shapes.items()}
    assert rms == pytest.approx({"w": 0.2 * math.sqrt(12), "tall": 0.2 * math.sqrt(12)})
    assert shape == pytest.approx({"w": math.sqrt(12 / 8), "tall": 1.0})  # sqrt(max(1, cols / rows))


# ----------------------------------------------------------------------------- the others against optax


def _reference(name: str, o, schedule):
    """optax's own transforms for what each registry entry builds."""
    decayed = optax.add_decayed_weights(o.weight_decay, DECAY)
    lr = optax.scale_by_learning_rate(schedule)
    if name == "lion":
        return optax.lion(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=DECAY)
    if name == "adafactor":
        return optax.chain(optax.scale_by_factored_rms(decay_rate=o.adafactor_decay_rate, min_dim_size_to_factor=8),
                           optax.clip_by_block_rms(1.0), decayed, lr)
    if name == "schedule_free_adamw":
        base = optax.chain(optax.scale_by_rms(o.b2, o.eps, eps_in_sqrt=False, bias_correction=True), decayed, lr)
        return optax.chain(optax.contrib.schedule_free(base, schedule, o.b1))
    raise ValueError(name)


@pytest.mark.parametrize("name", ["lion", "adafactor", "schedule_free_adamw"])
def test_each_update_is_optaxs_in_the_same_state(name, monkeypatch):
    monkeypatch.setattr(optim.adafactor, "MIN_DIM_TO_FACTOR", 8)  # so that these small matrices are factored
    o = _settings(name, clip_norm=0.0, warmup_steps=2)
    ours, schedule = optim.make_optimizer(o, 10, DECAY)
    ref = _reference(name, o, schedule)
    params = _params()
    state, ref_state = ours.init(params), ref.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    for i in range(3):
        grads = _grads(params, i)
        updates, state = jax.jit(ours.update)(grads, state, params, finite=jnp.bool_(True))
        ref_updates, ref_state = jax.jit(ref.update)(grads, ref_state, params)
        floats.close((updates, state), (ref_updates, ref_state))
        params = optax.apply_updates(params, updates)
    if name == "adafactor":
        factored = state[0]  # w's row and column means; the stack's 4 x 6 is under 8: a whole second moment
        assert (factored.v_row["w"].shape, factored.v_col["w"].shape, factored.v["stack"].shape) == ((8,), (12,),
                                                                                                        (2, 6, 4))
    if name == "schedule_free_adamw":  # the parameters to evaluate: x, from y and z
        floats.close(optim.eval_params(o, state, params), optax.contrib.schedule_free_eval_params(ref_state[0], params))


@pytest.mark.parametrize("name", NAMES)
def test_a_non_finite_step_leaves_the_state_unchanged(name):
    """With finite=False (the train step's guard) and an infinite gradient, every optimizer's state comes back
    as it was, bit for bit; a finite step changes it."""
    o = _settings(name)
    tx, _ = optim.make_optimizer(o, 10, DECAY, matrices=MATRICES)
    params = _params()
    update = jax.jit(tx.update)
    state = update(_grads(params, 0), tx.init(params), params, finite=jnp.bool_(True))[1]
    inf = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), _grads(params, 1))
    _, kept = update(inf, state, params, finite=jnp.bool_(False))
    floats.identical(kept, state, why=floats.MOVED)
    _, moved = update(_grads(params, 1), state, params, finite=jnp.bool_(True))
    assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(state)))


# ----------------------------------------------------------------------------- Muon and the model


def test_muon_takes_the_projections_kernels_as_matrices_and_leaves_the_rest_to_adamw():
    spec = train_state.build_model_spec(small_config(n_layers=2, use_bias=True, qkv_bias=True))
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): m for path, m in
            jax.tree_util.tree_flatten_with_path(spec.matrices, is_leaf=optim.base.is_matrix_leaf)[0]}
    matrices = {k for k, m in flat.items() if m is not None}
    assert matrices == {f"blocks/{p}/kernel" for p in ("attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/w_gate",
                                                       "mlp/w_up", "mlp/w_down")}, sorted(matrices)
    stacked = (0,), ("layers",)  # scanned: one matrix per layer
    assert flat["blocks/attn/wq/kernel"] == Matrix(*stacked[:1], (1,), (2, 3), stacked[1])  # [d, heads x head_dim]
    assert flat["blocks/attn/wo/kernel"] == Matrix(*stacked[:1], (1, 2), (3,), stacked[1])  # [heads x head_dim, d]
    assert flat["unembed/kernel"] is None and flat["embed/embedding"] is None
    moe = train_state.build_model_spec(small_config(n_layers=2, mlp="moe", scan_layers=False))
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): m for path, m in
            jax.tree_util.tree_flatten_with_path(moe.matrices, is_leaf=optim.base.is_matrix_leaf)[0]}
    assert flat["blocks/0/mlp/expert_up/kernel"] == Matrix((0,), (1,), (2,), ("experts",))  # one per expert
    assert flat["blocks/0/mlp/router"] is None


@pytest.mark.parametrize("layout", optim.muon_lib.LAYOUTS)
def test_muon_orthogonalizes_each_whole_matrix_whatever_splits_it(layout):
    """The update of matrices split over fsdp and tensor (and a stack's layers over data) is the one
    device's: the iteration acts on each whole matrix in every layout."""
    o = _settings("muon", clip_norm=0.0, muon_layout=layout)
    tx, _ = optim.make_optimizer(o, 10, DECAY, matrices=MATRICES)
    params, grads = _params(), _grads(_params(), 0)
    one = jax.jit(tx.update)(grads, tx.init(params), params, finite=jnp.bool_(True))[0]
    mesh = mesh_lib.make_mesh(axes.shape_of(data=2, fsdp=2, tensor=2))
    specs = {"w": P("fsdp", "tensor"), "tall": P("tensor", "fsdp"), "wq": P("fsdp", "tensor", None),
             "stack": P("data", "fsdp", "tensor"), "b": P("tensor")}
    rules = (("layers", "data"),)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        put = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}  # noqa: E731
        sharded_params = put(params)
        update = jax.jit(tx.update, out_shardings=(jax.tree.map(lambda x: x.sharding, sharded_params), None))
        many = update(put(grads), tx.init(sharded_params), sharded_params, finite=jnp.bool_(True))[0]
    # two programs (the split matmuls reorder sums), whose rounding five quintic iterations amplify, most under
    # XLA:CPU's elemental emitter (tests/conftest.py; benchmarks/BENCHMARKS.md, "The default test suite's time")
    floats.close(jax.device_get(many), jax.device_get(one), ulps=256)


# ----------------------------------------------------------------------------- the planner


@pytest.mark.parametrize("name", NAMES)
def test_the_planners_optimizer_state_is_the_real_states_bytes_on_each_device(name):
    extra = dict(optim__schedule="constant") if name == "schedule_free_adamw" else {}
    cfg = config.recipe("tiny", optim__name=name, model__d_model=128, model__n_layers=2, model__mlp_dim=256,
                        model__vocab_size=256, data__seq_len=32, mesh__data=2, mesh__fsdp=2, mesh__tensor=2, **extra)
    planned = memory.estimate(cfg, 8).row("optimizer state")
    setup = train_setup.build(cfg, jax.devices()[:8])  # real arrays, on the devices
    on_device_0 = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(setup.state.opt_state))
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(setup.state.opt_state))
    assert (planned.per_device_bytes, planned.total_bytes) == (on_device_0, total)
    assert planned.note == optim.OPTIMIZERS[name].state


# ----------------------------------------------------------------------------- Muon on meshes


SMALL = dict(model__vocab_size=128, model__d_model=64, model__n_layers=2, model__n_heads=4, model__n_kv_heads=4,
             model__mlp_dim=128, model__dtype="float32", data__seq_len=32, data__global_batch_size=16,
             data__tokenizer_vocab_size=128, optim__warmup_steps=0, optim__name="muon")


@functools.cache
def _one_device_losses() -> list[float]:
    return _losses(1, mesh__fsdp=1)


def _losses(devices: int, steps: int = 3, **overrides) -> list[float]:
    return step_losses({**SMALL, **overrides}, steps, devices)


MESHES = {"data8": dict(mesh__data=8, mesh__fsdp=1), "fsdp8": dict(mesh__fsdp=8),
          "data2-fsdp2-tensor2": dict(mesh__data=2, mesh__fsdp=2, mesh__tensor=2),
          **{f"data2-fsdp2-tensor2-{layout}": dict(mesh__data=2, mesh__fsdp=2, mesh__tensor=2, optim__muon_layout=layout)
             for layout in ("gather", "sharded")}}


@pytest.mark.slow  # ~8 s each (a train step compiled twice): the default suite's budget; Muon's update on a
@pytest.mark.parametrize("name", MESHES)  # split matrix is test_muon_orthogonalizes_each_whole_matrix_...
def test_muon_trains_alike_on_every_mesh(name):
    """The same losses in float32 on (data, fsdp, tensor) = (8,1,1), (1,8,1), (2,2,2), in every layout, as on
    one device: the Newton-Schulz iteration acts on each whole matrix however the mesh splits it."""
    want = _one_device_losses()
    assert _losses(8, **MESHES[name]) == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]


@pytest.mark.slow
def test_schedule_free_evaluates_its_averaged_parameters():
    """A schedule-free run's parameters to evaluate (`TrainSetup.eval_params`: the validation loss's) are its x,
    (y - (1 - b1) z) / b1, not the y the gradient is taken at."""
    setup = train_setup.build(config.recipe("tiny", **{**SMALL, "optim__name": "schedule_free_adamw",
                                                       "optim__schedule": "constant", "model__n_layers": 1}),
                              jax.devices()[:1])
    state = setup.state
    with jax.set_mesh(setup.mesh):
        for i in range(2):  # after one, x = y = z (the average of one iterate)
            state, _ = setup.train_step(state, setup.put_batch(random_batch(16, 32, 128, seed=i)))
    x = jax.device_get(setup.eval_params(state))
    sf = optim.schedule_free.find_state(state.opt_state)
    floats.close(x, optax.contrib.schedule_free_eval_params(sf, jax.device_get(state.params)))
    assert not np.allclose(x["unembed"]["kernel"], jax.device_get(state.params)["unembed"]["kernel"])
