"""The compiled train step: same numbers on every mesh, accumulation, overfitting, schedules."""

import floats
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from helpers import random_batch, small_config
from jaxlm import axes, config, optim, steps, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.optim import OptimConfig

ONE, MESH = axes.shape_of(), axes.shape_of(data=2, fsdp=2, tensor=2)
# data alone is covered by MESH; expert (data parallelism for these dense models) with fsdp and tensor
MESHES = [ONE, axes.shape_of(fsdp=8), axes.shape_of(tensor=8), MESH, axes.shape_of(fsdp=2, expert=2, tensor=2)]


def _setup(mesh_shape, model_cfg, *, micro_batches=1, steps_total=100, **optim_overrides):
    cfg = config.recipe("tiny", **{f"optim__{k}": v for k, v in optim_overrides.items()})
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_spec = train_state.build_model_spec(model_cfg)
    tx, schedule = optim.make_optimizer(cfg.optim, steps_total, model_spec.decay_mask)
    mesh = mesh_lib.make_mesh(mesh_shape)
    state, shardings, model_spec = train_state.create(model_cfg, tx, mesh, rules, seed=0)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    step = steps.jit_train_step(
        steps.make_train_step(model_spec, tx, schedule, optim=OptimConfig(micro_batches=micro_batches), rules=rules),
        shardings, batch_sharding,
    )
    return mesh, state, step, batch_sharding, model_spec, rules


def _put(batch, sharding):
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}


def test_loss_and_gradients_agree_across_meshes():
    model_cfg = small_config()  # 8 heads, 8 kv heads: divisible by tensor=8
    batch = random_batch(16, 32, 96)
    # The same parameters on every mesh (no optimizer state needed), laid out by each mesh's rules.
    _, state, _, _, model_spec, rules = _setup(ONE, model_cfg)
    params = jax.device_get(state.params)
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p, b: steps.summed_loss(p, model_spec, b, None, 0.0)[0] / 1000.0))
    results = {}
    for shape in MESHES:
        mesh = mesh_lib.make_mesh(shape)
        with jax.set_mesh(mesh):
            on_mesh = jax.device_put(params, train_state.param_shardings(model_spec, mesh, rules))
            loss, grads = jax.device_get(loss_and_grad(on_mesh, _put(batch, mesh_lib.batch_sharding(mesh, rules))))
        results[shape] = (float(loss) * 1000.0, grads)
    ref_loss, ref_grads = results[ONE]
    for shape, (loss, grads) in results.items():
        np.testing.assert_allclose(loss, ref_loss, rtol=2e-6, err_msg=str(shape))
        jax.tree.map(lambda a, b, shape=shape: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(shape)),
                     grads, ref_grads)


@pytest.mark.parametrize("mesh_shape, ks", [(MESH, (1, 4))])
def test_k_micro_batches_equal_one_large_batch(mesh_shape, ks):
    model_cfg = small_config()
    batch = random_batch(16, 32, 96, seed=1)
    out = {}
    for k in ks:
        mesh, state, step, batch_sharding, _, _ = _setup(mesh_shape, model_cfg, micro_batches=k)
        with jax.set_mesh(mesh):
            new_state, metrics = step(state, _put(batch, batch_sharding))
        out[k] = (jax.device_get(metrics), jax.device_get(new_state.params))
    for k in ks[1:]:
        for key in ("loss", "grad_norm", "tokens"):
            np.testing.assert_allclose(out[k][0][key], out[1][0][key], rtol=1e-5, err_msg=f"k={k} {key}")
        # Parameters move by about lr = 1e-4 on this first step; agree to 1% of that.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), out[k][1], out[1][1])


def test_a_tiny_model_overfits_one_batch():
    model_cfg = small_config(n_layers=2)
    batch = random_batch(8, 32, 96, seed=2, packed=False)
    steps_total = 40  # the loss falls under a tenth of its first value within half of these
    mesh, state, step, batch_sharding, _, _ = _setup(
        axes.shape_of(fsdp=2), model_cfg, steps_total=steps_total, peak_lr=1e-2, warmup_steps=10, weight_decay=0.0,
        schedule="constant",
    )
    gbatch = _put(batch, batch_sharding)
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(steps_total):
            state, metrics = step(state, gbatch)
            losses.append(float(metrics["loss"]))
    assert int(state.step) == steps_total
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


def test_padding_targets_do_not_count():
    model_cfg = small_config()
    batch = random_batch(4, 32, 96, seed=3)
    mesh, state, _, batch_sharding, model_spec, _ = _setup(ONE, model_cfg)
    loss_sum, tokens = steps.summed_loss(state.params, model_spec, batch, None, 0.0)
    assert float(tokens) == float((batch["segment_ids"] > 0).sum())
    changed = dict(batch, targets=np.where(batch["segment_ids"] > 0, batch["targets"], 7).astype(np.int32))
    assert float(steps.summed_loss(state.params, model_spec, changed, None, 0.0)[0]) == pytest.approx(float(loss_sum))


def test_z_loss_adds_log_z_squared():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 11)) * 3
    targets = jnp.zeros((2, 5), jnp.int32)
    plain = steps.token_losses(logits, targets, 0.0)
    with_z = steps.token_losses(logits, targets, 1e-2)
    np.testing.assert_allclose(with_z - plain, 1e-2 * jax.nn.logsumexp(logits, -1) ** 2, rtol=1e-5)
    np.testing.assert_allclose(plain, -jax.nn.log_softmax(logits)[..., 0], rtol=1e-5)


def test_the_loss_reads_the_logits_in_two_reductions_and_matches_log_softmax():
    """`steps.token_losses`: the largest and the target's logit come out of one reduction
    (`steps.peak_and_target`), the shifted exponentials' sum out of the other, where logsumexp and a masked
    sum take three; the values and the gradient are log-softmax's, and a target outside the vocabulary
    (padding) picks no logit."""
    logits = (jax.random.normal(jax.random.key(0), (2, 5, 11)) * 3).at[0, 0, 3].set(40.0)
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11).at[1, 4].set(11).at[1, 3].set(-1)
    inside = (targets >= 0) & (targets < 11)  # a target outside the vocabulary (padding) picks nothing
    peak, picked = steps.peak_and_target(logits, targets)
    floats.identical(peak, logits.max(-1), why=floats.MOVED)  # a maximum is one of the logits, in any order
    gathered = jnp.take_along_axis(logits, targets[..., None] % 11, -1)[..., 0]
    # the masked sum adds one logit to zeros: that logit, in any order
    floats.identical(picked, jnp.where(inside, gathered, 0.0), why=floats.MOVED)

    weights = jax.random.uniform(jax.random.key(2), (2, 5))

    def reference(x):  # logsumexp and a masked sum of the target's logit: the loss before one reduction did both
        log_z = jax.nn.logsumexp(x, -1)
        target = jnp.sum(jnp.where(jnp.arange(11) == targets[..., None], x, 0.0), -1)
        return jnp.sum((log_z - target + 1e-2 * log_z ** 2) * weights)

    def ours(x):
        return jnp.sum(steps.token_losses(x, targets, 1e-2) * weights)

    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(reference)(logits), rtol=1e-5, atol=1e-7)

    def reductions_of_the_logits(jaxpr) -> int:
        return sum(e.primitive.name.startswith("reduce") and e.invars[0].aval.shape == logits.shape
                   for e in jaxpr.eqns) + sum(reductions_of_the_logits(sub) for e in jaxpr.eqns
                                              for sub in jax.extend.core.jaxprs_in_params(e.params))

    assert reductions_of_the_logits(jax.make_jaxpr(ours)(logits).jaxpr) == 2
    assert reductions_of_the_logits(jax.make_jaxpr(reference)(logits).jaxpr) == 3


def _optim_cfg(**kw):
    o = dict(peak_lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2, cycle_steps=20, schedule="cosine")
    o.update(kw)
    return ml_collections.ConfigDict(o)


@pytest.mark.parametrize("name", ["cosine", "wsd", "linear", "constant", "cyclic"])
def test_schedules_warm_up_linearly_to_the_peak(name):
    lr = optim.make_schedule(_optim_cfg(schedule=name), 110)
    np.testing.assert_allclose([float(lr(s)) for s in (0, 4, 9)], [0.1, 0.5, 1.0], rtol=1e-6)
    assert float(lr(10)) == pytest.approx(1.0)


def test_schedule_shapes_after_warmup():
    total = 110
    cosine = optim.make_schedule(_optim_cfg(schedule="cosine"), total)
    assert float(cosine(60)) == pytest.approx(0.55, rel=1e-5)  # halfway: mean of peak and floor
    assert float(cosine(110)) == pytest.approx(0.1, rel=1e-5)
    linear = optim.make_schedule(_optim_cfg(schedule="linear"), total)
    assert float(linear(60)) == pytest.approx(0.55, rel=1e-5)
    wsd = optim.make_schedule(_optim_cfg(schedule="wsd"), total)  # stable until 80% of the 100 post-warmup steps
    assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(90)) == pytest.approx(1.0)
    assert float(wsd(100)) == pytest.approx(0.55, rel=1e-5) and float(wsd(110)) == pytest.approx(0.1, rel=1e-5)
    assert float(optim.make_schedule(_optim_cfg(schedule="constant"), total)(100)) == pytest.approx(1.0)
    cyclic = optim.make_schedule(_optim_cfg(schedule="cyclic"), total)
    assert float(cyclic(20)) == pytest.approx(0.55, rel=1e-5)  # half a cycle
    assert float(cyclic(30)) == pytest.approx(1.0) and float(cyclic(50)) == pytest.approx(1.0)  # restarts


def test_learning_rate_metric_follows_the_schedule():
    model_cfg = small_config()
    batch = random_batch(4, 32, 96)
    mesh, state, step, batch_sharding, _, _ = _setup(ONE, model_cfg, peak_lr=1e-3, warmup_steps=4)
    lrs = []
    with jax.set_mesh(mesh):
        for _ in range(5):
            state, metrics = step(state, _put(batch, batch_sharding))
            lrs.append(float(metrics["lr"]))
    np.testing.assert_allclose(lrs[:4], [2.5e-4, 5e-4, 7.5e-4, 1e-3], rtol=1e-5)


def test_a_non_finite_loss_never_reaches_the_state():
    """An infinite loss (injected through z_loss) drops the update and flags the step."""
    model_cfg = small_config()
    batch = random_batch(4, 32, 96)
    cfg = config.recipe("tiny")
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_spec = train_state.build_model_spec(model_cfg)
    tx, schedule = optim.make_optimizer(cfg.optim, 10, model_spec.decay_mask)
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=2))
    state, shardings, model_spec = train_state.create(model_cfg, tx, mesh, rules)
    sharding = mesh_lib.batch_sharding(mesh, rules)
    before = jax.device_get((state.params, state.opt_state))
    for z_loss, skipped in ((float("inf"), 1), (0.0, 0)):
        step = steps.jit_train_step(
            steps.make_train_step(model_spec, tx, schedule, optim=OptimConfig(z_loss=z_loss), rules=rules), shardings,
            sharding)
        with jax.set_mesh(mesh):
            state, metrics = step(state, _put(batch, sharding))
        assert int(metrics["skipped"]) == skipped
        if skipped:
            assert not np.isfinite(float(metrics["loss"]))
            floats.identical(jax.device_get((state.params, state.opt_state)), before, why=floats.MOVED)  # kept
    assert int(state.step) == 2
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))
    # the finite step applied
    assert not np.array_equal(jax.device_get(state.params)["unembed"]["kernel"], before[0]["unembed"]["kernel"])


def test_the_optimizer_is_optax_adamw_and_keeps_its_state_unless_finite():
    """make_optimizer's AdamW (moments selected inside, for in-place updates) computes what
    optax.chain(clip, optax.adamw) does (to float32 rounding: another program), in the same state structure;
    with finite=False, even on NaN gradients, its state comes back unchanged."""
    o = config.recipe("tiny").optim
    params = {"w": jnp.linspace(-1.0, 1.0, 96).reshape(8, 12), "b": jnp.linspace(0.0, 0.5, 12)}
    mask = {"w": True, "b": False}
    ours, schedule = optim.make_optimizer(o, 50, mask)
    ref = optax.chain(optax.clip_by_global_norm(o.clip_norm), optax.adamw(
        schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask))
    state, ref_state = ours.init(params), ref.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    update = jax.jit(ours.update)
    key = jax.random.key(0)
    for i in range(4):
        grads = jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.fold_in(key, i), p.shape), params)
        u, state = update(grads, state, params, finite=jnp.bool_(True))
        ref_u, ref_state = jax.jit(ref.update)(grads, ref_state, params)
        floats.close((u, state), (ref_u, ref_state))
        params = optax.apply_updates(params, u)
    nan_grads = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan), params)
    _, kept = update(nan_grads, state, params, finite=jnp.bool_(False))
    floats.identical(kept, state, why=floats.MOVED)
    assert int(kept[1][0].count) == 4 and int(kept[1][2].count) == 4


def test_norms_by_group_split_the_global_norm_per_layer_scanned_or_not():
    """Per-layer and per-group norms square-sum to the global norm, scanned or unrolled, and a
    scanned model's layer i is the norm of slice i of its stacked block weights."""
    import optax
    from flax import nnx

    scanned, unrolled = small_config(n_layers=3), small_config(n_layers=3, scan_layers=False)
    params = {}
    for cfg in (scanned, unrolled):
        model_spec = train_state.build_model_spec(cfg)
        state = nnx.state(train_state.build_model(cfg, seed=0), nnx.Param)
        params[cfg.scan_layers] = (nnx.to_pure_dict(state), model_spec)
    norms = {}
    for scan, (tree, model_spec) in params.items():
        norms[scan] = {k: float(v) for k, v in steps.norms_by_group(tree, model_spec.logical_names).items()}
        assert set(norms[scan]) == {"layer_00", "layer_01", "layer_02", "embed", "final_norm", "unembed"}
        total = float(optax.tree.norm(tree))
        np.testing.assert_allclose(np.sqrt(sum(v * v for v in norms[scan].values())), total, rtol=1e-5)
    stacked, _ = params[True]
    for i in range(3):
        expected = float(optax.tree.norm(jax.tree.map(lambda x, i=i: x[i], stacked["blocks"])))
        np.testing.assert_allclose(norms[True][f"layer_{i:02d}"], expected, rtol=1e-5)
    assert len({round(norms[True][f"layer_{i:02d}"], 6) for i in range(3)}) == 3  # distinct layers


@pytest.mark.parametrize("mesh_shape", [ONE, MESH])
def test_chunked_loss_equals_the_plain_loss_value_and_gradient(mesh_shape):
    """Logits made 8 positions at a time (rematerialized in the backward) give the loss and the
    gradients (of the hidden states and of the projection) of the whole-sequence loss."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    b, t, d, v = 4, 32, 16, 96
    x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) / 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    weights = jnp.asarray(rng.random((b, t)) > 0.2, jnp.float32)
    mesh = mesh_lib.make_mesh(mesh_shape)
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    w = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))

    def plain(x, w):
        return jnp.sum(steps.token_losses(jnp.einsum("btd,dv->btv", x, w), targets, 1e-4) * weights)

    def chunked(x, w):
        return steps.chunked_loss_sum(lambda xc: jnp.einsum("btd,dv->btv", xc, w), x, targets, weights, 1e-4, 8)

    with jax.set_mesh(mesh):
        (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w) for f in (plain, chunked))
    np.testing.assert_allclose(v2, v1, rtol=1e-5)
    for a, b_ in zip(g2, g1):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="must divide"):
        steps.chunked_loss_sum(lambda xc: xc, x, targets, weights, 0.0, 5)


@pytest.mark.slow
def test_train_step_with_a_chunked_loss_follows_the_plain_one():
    """Three steps of the real train step with the logits made 8 positions at a time track the plain
    step's losses and gradient norms (on 8 devices, micro-batched, tied and untied embeddings)."""
    from jaxlm import train_setup

    batch = random_batch(16, 32, 96, seed=3)
    for tie in (False, True):
        results = []
        for chunk in (0, 8):
            cfg = config.recipe(
                "tiny", model__vocab_size=96, model__d_model=64, model__n_layers=2, model__n_heads=4,
                model__n_kv_heads=2, model__dtype="float32", model__tie_embeddings=tie, model__loss_chunk_len=chunk,
                data__seq_len=32, data__global_batch_size=16, optim__micro_batches=2,
            )
            setup = train_setup.build(cfg)
            state, out = setup.state, []
            with jax.set_mesh(setup.mesh):
                for _ in range(3):
                    state, metrics = setup.train_step(state, setup.put_batch(batch))
                    out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
            results.append(out)
        np.testing.assert_allclose(results[1], results[0], rtol=2e-5)


def _one_kernel_step(attention: str, shape, batch):
    """(loss, parameters) after one train step (2 micro-batches) with `attention` on a mesh of `shape`, the
    small model with grouped-query heads; on a mesh the kernel must run per shard (a shard_map in the step)."""
    model_cfg = small_config(n_kv_heads=4, head_dim=16, attention=attention)
    mesh, state, step, batch_sharding, _, _ = _setup(shape, model_cfg, micro_batches=2)
    with jax.set_mesh(mesh):
        b = _put(batch, batch_sharding)
        if shape != ONE:
            assert "shard_map" in str(jax.make_jaxpr(step)(state, b))
        state, metrics = step(state, b)
        return jax.device_get((metrics["loss"], state.params))


@pytest.mark.slow
def test_pallas_attention_trains_like_xla_attention_on_a_mesh():
    """The Pallas (Triton) kernel, interpreted on CPU, with grouped-query heads and packed documents:
    one train step (2 micro-batches) gives XLA attention's loss and parameters, on one device and per
    shard on data x fsdp x tensor = 2 x 2 x 2 (batch over data x fsdp, heads over tensor), not on gathered inputs."""
    batch = random_batch(16, 32, 96, seed=2)
    results = {(attention, shape): _one_kernel_step(attention, shape, batch)
               for attention, shape in (("xla", ONE), ("pallas", ONE), ("pallas", MESH))}
    ref_loss, ref_params = results["xla", ONE]
    for key in (("pallas", ONE), ("pallas", MESH)):
        loss, params = results[key]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(key))
        jax.tree.map(lambda a, b, key=key: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(key)),
                     params, ref_params)


def test_splash_attention_trains_like_xla_attention_on_a_mesh():
    """JAX's Pallas TPU splash kernel, interpreted on CPU, with grouped-query heads and packed documents of
    32 tokens (padded to its 128): one train step (2 micro-batches) gives XLA attention's loss and
    parameters, per shard on data x fsdp x tensor = 2 x 2 x 2 (batch over data x fsdp, heads over tensor)."""
    batch = random_batch(16, 32, 96, seed=2)
    (loss, params), (ref_loss, ref_params) = (_one_kernel_step("splash", MESH, batch),
                                              _one_kernel_step("xla", ONE, batch))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)


@pytest.mark.parametrize("mesh_shape", [axes.shape_of(fsdp=2), pytest.param(axes.shape_of(data=2), marks=pytest.mark.slow)])
def test_weights_cast_once_per_step_give_the_same_step(mesh_shape):
    """With micro-batches, the weights the forward only casts to bfloat16 are cast once per step
    (`ModelSpec.cast_for_compute`), not in every micro-batch: the same losses, gradients and update,
    on the plain and the replica-local accumulation paths."""
    import dataclasses

    model_cfg = small_config(dtype=jnp.bfloat16)
    batch = random_batch(16, 32, 96, seed=4)
    mesh, state, step, batch_sharding, model_spec, rules = _setup(mesh_shape, model_cfg, micro_batches=4)
    trainable, _ = model_spec.split(state.params)
    cast = model_spec.cast_for_compute(trainable)
    assert cast["blocks"]["attn"]["wq"]["kernel"].dtype == jnp.bfloat16
    assert cast["embed"]["embedding"].dtype == cast["unembed"]["kernel"].dtype == jnp.bfloat16
    assert cast["blocks"]["attn_norm"]["scale"].dtype == jnp.float32  # the norms compute in float32
    cfg = config.recipe("tiny")
    tx, schedule = optim.make_optimizer(cfg.optim, 100, model_spec.decay_mask)
    state2, shardings, _ = train_state.create(model_cfg, tx, mesh, rules, seed=0)  # the step donates its state
    uncast = dataclasses.replace(model_spec, cast_dtypes=None)
    plain = steps.jit_train_step(
        steps.make_train_step(uncast, tx, schedule, optim=OptimConfig(micro_batches=4), rules=rules), shardings,
        batch_sharding)
    gbatch = _put(batch, batch_sharding)
    with jax.set_mesh(mesh):
        ours, m1 = jax.device_get(step(state, gbatch))
        theirs, m2 = jax.device_get(plain(state2, gbatch))
    # two programs (the cast out of the micro-batch loop or in it): their sums may run in another order
    floats.close({key: m1[key] for key in ("loss", "grad_norm")}, {key: m2[key] for key in ("loss", "grad_norm")})
    floats.close(ours.params, theirs.params)


@pytest.mark.parametrize("mesh_shape,dtype", [(axes.shape_of(tensor=2), jnp.float32),
                                              pytest.param(axes.shape_of(data=2), jnp.float32, marks=pytest.mark.slow),
                                              pytest.param(axes.shape_of(tensor=2), jnp.bfloat16, marks=pytest.mark.slow)])
def test_compute_kernels_make_the_step_without_them(mesh_shape, dtype):
    """With micro-batches, the plain projections' kernels reach the model as `layers.ComputeKernel`s (q, k,
    v and gate, up joined once per step) whose weight gradients come from the matmuls in float32: each
    micro-batch's weight-gradient matmuls produce float32 (9 here: per layer the joint qkv, o, the joint
    gate/up and down, and the unembedding), none without them, and the step is the same: in float32 to
    rounding, in bfloat16 to bfloat16's rounding of the gradients it no longer makes. Tensor-parallel (the
    plain accumulation) and data-parallel (replica-local) meshes."""
    import dataclasses
    import re

    model_cfg = small_config(n_kv_heads=4, scan_layers=False, remat="dots_mlp", dtype=dtype, tie_embeddings=False)
    batch = random_batch(16, 32, 96, seed=5)
    mesh, state, step, batch_sharding, model_spec, rules = _setup(mesh_shape, model_cfg, micro_batches=4)
    assert len(model_spec.joints) == 4 and len(model_spec.grad_kernels) == 15
    with jax.set_mesh(mesh):
        assert steps.compute_kernels(model_spec, rules, steps.data_replicas(model_spec, rules)) is model_spec
    cfg = config.recipe("tiny")
    tx, schedule = optim.make_optimizer(cfg.optim, 100, model_spec.decay_mask)
    state2, shardings, _ = train_state.create(model_cfg, tx, mesh, rules, seed=0)  # the step donates its state
    without = dataclasses.replace(model_spec, grad_kernels=frozenset(), joints=())
    plain = steps.jit_train_step(
        steps.make_train_step(without, tx, schedule, optim=OptimConfig(micro_batches=4), rules=rules), shardings,
        batch_sharding)
    gbatch = _put(batch, batch_sharding)
    with jax.set_mesh(mesh):
        if dtype == jnp.bfloat16:  # weight gradients (batch and positions contracted) made in float32
            widening = r"dot_general[^\n]*contracting_dims = \[0, 1\] x \[0, 1\][^\n]*xbf16>\) -> tensor<[^>]*xf32>"
            assert len(re.findall(widening, step.lower(state, gbatch).as_text())) == 9
            assert not re.findall(widening, plain.lower(state2, gbatch).as_text())
        ours, m1 = jax.device_get(step(state, gbatch))
        theirs, m2 = jax.device_get(plain(state2, gbatch))
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6 if dtype == jnp.float32 else 1e-3)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=rtol)
    if dtype == jnp.float32:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), ours.params, theirs.params)
