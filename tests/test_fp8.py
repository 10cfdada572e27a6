"""float8 matmuls (`model.matmul=fp8`, jaxlm.models.layers.fp8_einsum): the contraction and its gradients
against float32, float8 in the lowered program, and a short training run against bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import config
from jaxlm.models import layers


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("equation, x_shape, k_shape", [
    ("btd,dnh->btnh", (2, 16, 64), (64, 4, 16)),  # wq
    ("btnh,nhd->btd", (2, 16, 4, 16), (4, 16, 64)),  # wo
    ("btd,df->btf", (2, 16, 64), (64, 96)),  # the MLP
])
def test_fp8_einsum_and_its_gradients_are_within_float8_rounding(equation, x_shape, k_shape):
    kx, kk, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(jnp.bfloat16)
    k = (0.05 * jax.random.normal(kk, k_shape, jnp.float32)).astype(jnp.bfloat16)
    reference = lambda x, k: jnp.einsum(equation, x.astype(jnp.float32), k.astype(jnp.float32))  # noqa: E731
    y = layers.fp8_einsum(equation, x, k)
    assert y.dtype == jnp.bfloat16 and relative_error(y, reference(x, k)) < 0.06  # e4m3: 3 mantissa bits
    g = jax.random.normal(kg, y.shape, jnp.float32).astype(jnp.bfloat16)
    dx, dk = jax.vjp(lambda x, k: layers.fp8_einsum(equation, x, k), x, k)[1](g)
    rdx, rdk = jax.vjp(reference, x, k)[1](g.astype(jnp.float32))
    assert dx.dtype == x.dtype and dk.dtype == k.dtype
    assert relative_error(dx, rdx) < 0.12 and relative_error(dk, rdk) < 0.12  # e5m2: 2 mantissa bits


def test_to_fp8_scales_to_the_formats_range_and_survives_zeros():
    t = jnp.array([0.001, -0.5, 2.0], jnp.float32)
    q, scale = layers.to_fp8(t, jnp.float8_e4m3fn)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0 and float(scale) == 224.0
    q, scale = layers.to_fp8(jnp.zeros(3), jnp.float8_e5m2)
    assert float(scale) == 1.0 and not np.any(np.asarray(q.astype(jnp.float32)))


def test_the_lowered_train_step_runs_the_projections_in_float8():
    from helpers import random_batch
    from jaxlm import train_setup

    cfg = config.load_recipe("tiny")
    # XLA's attention: its lowered program holds the layer's body once (the causal blocks' custom gradient
    # splits it into more functions), so each projection's matmuls are counted once
    config.apply_overrides(cfg, [("model.matmul", "fp8"), ("data.global_batch_size", "4"), ("model.attention", "xla")])
    setup = train_setup.build(cfg, jax.devices()[:1])
    batch = setup.put_batch(random_batch(4, cfg.data.seq_len, cfg.model.vocab_size))
    text = setup.train_step.lower(setup.state, batch).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    fp8 = [line for line in dots if "f8E4M3FN" in line or "f8E5M2" in line]
    # the 7 projections of the scanned layer body and the unembedding, each a forward (e4m3 x e4m3) and two
    # gradients (e5m2 with e4m3); attention's own matmuls (and their gradients) stay in the compute dtype
    assert cfg.model.scan_layers and len(fp8) == 3 * (7 + 1) and len(dots) > len(fp8)
    assert sum("f8E5M2" in line for line in fp8) == 2 * (7 + 1)
    state, metrics = setup.train_step(setup.state, batch)
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_fp8_trains_the_tiny_recipe_within_5_percent_of_bfloat16(tmp_path):
    from helpers import train_tiny

    def run(matmul):
        return train_tiny(tmp_path, matmul, ("model.matmul", matmul), ("run.steps", "200"), ("run.log_every", "100"))

    bf16, fp8 = run("auto"), run("fp8")
    assert abs(fp8["val_loss"] - bf16["val_loss"]) <= 0.05 * bf16["val_loss"], (fp8["val_loss"], bf16["val_loss"])


@pytest.mark.parametrize("platform, capability, refused", [
    ("gpu", "7.5", True), ("gpu", "8.0", True), ("gpu", "8.9", False), ("gpu", "9.0", False), ("cpu", None, False),
])
def test_fp8_is_refused_in_one_line_on_gpus_without_float8_tensor_cores(platform, capability, refused):
    from jaxlm import precision
    from jaxlm.errors import UserError

    if refused:
        with pytest.raises(UserError, match=f"this GPU is {capability}: use model.matmul=auto"):
            precision.check_fp8(platform, capability)
    else:
        precision.check_fp8(platform, capability)


def test_remat_dots_keeps_the_float8_operands_for_the_backward_pass():
    """Under `model.remat=dots` the projections' float8 inputs and weights (with their scales) are saved, not
    quantized again in the backward pass: on an H100 each amax is a reduction kernel of its own, 704 per
    1b step per projection input (benchmarks/BENCHMARKS.md, the H100 entry). `full` saves none of them."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxlm.models import transformer

    x = jnp.ones((2, 16, 64), jnp.bfloat16)
    k = jnp.full((64, 96), 0.01, jnp.bfloat16)

    def saved(policy):
        f = jax.checkpoint(lambda x, k: layers.fp8_einsum("btd,df->btf", jax.nn.silu(x), k).astype(jnp.float32).sum(),
                           policy=transformer.REMAT_POLICIES[policy])
        return sorted((str(aval.dtype), aval.shape) for aval, _ in saved_residuals(f, x, k))

    dots = saved("dots")
    assert ("float8_e4m3fn", (2, 16, 64)) in dots and ("float8_e4m3fn", (64, 96)) in dots
    assert sum(dtype == "float32" and shape == () for dtype, shape in dots) >= 2  # the two scales
    assert not any(dtype.startswith("float8") for dtype, _ in saved("full"))


def _amaxes(jaxpr, in_loop: bool = False) -> tuple[int, int]:
    """(reduce_max equations outside any loop, inside the micro-batch loop: a scan) of a jaxpr, inner ones
    included."""
    outside = inside = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_max":
            inside, outside = (inside + 1, outside) if in_loop else (inside, outside + 1)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            o, i = _amaxes(sub, in_loop or eqn.primitive.name in ("scan", "while"))
            outside, inside = outside + o, inside + i
    return outside, inside


def test_micro_batches_quantize_each_float8_weight_once_per_step(monkeypatch):
    """With micro-batches, each float8 projection's weight is quantized once per step, before the micro-batch
    loop (`layers.Fp8Weight` in its `layers.ComputeKernel`), not in every micro-batch: one amax per projection
    leaves the loop, whose body keeps the activations' and gradients' own; and the step computes what
    quantizing in every micro-batch computes (the same float8 operands), its weight gradients in float32."""
    from helpers import random_batch
    from jaxlm import train_setup

    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("model.matmul", "fp8"), ("model.dtype", "float32"), ("model.scan_layers", "false"),
                                 ("model.attention", "xla"), ("model.n_layers", "2"), ("data.seq_len", "32"),
                                 ("data.global_batch_size", "4"), ("optim.micro_batches", "2")])
    batch = random_batch(4, cfg.data.seq_len, cfg.model.vocab_size)

    def step():
        setup = train_setup.build(cfg, jax.devices()[:1])
        data = setup.put_batch(batch)
        amaxes = _amaxes(jax.make_jaxpr(setup.train_step)(setup.state, data).jaxpr)
        state, metrics = setup.train_step(setup.state, data)
        return setup.model_spec, amaxes, float(metrics["loss"]), state.params

    spec, (outside, inside), loss, params = step()
    projections = len(spec.grad_kernels)  # every projection of every layer, and the unembedding
    assert projections == 7 * cfg.model.n_layers + 1
    monkeypatch.setattr(layers.Projection, "takes_compute_kernel", property(lambda self: self.fusable))
    old_spec, (old_outside, old_inside), old_loss, old_params = step()
    assert not old_spec.grad_kernels  # float8 projections are not fusable: each micro-batch quantized them
    assert (outside, inside) == (old_outside + projections, old_inside - projections)
    assert loss == old_loss  # the same float8 operands
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), params, old_params)
