"""How jaxlm computes fast on a CPU (issue 21 part 2; benchmarks/BENCHMARKS.md, benchmarks/cpu_vs_torch.py).

The projections' contraction (`model.matmul`): `accumulating_einsum`, the bfloat16 form XLA:CPU runs
natively, equals the plain einsum up to bfloat16 rounding, forward and backward, in every projection's
equation, and in float32 is XLA's einsum; `auto` picks it on every CPU (bfloat16 or float32 compute) and
nowhere else; and the compiled CPU step really runs the projections' dots on bfloat16 operands (where the
plain einsum gets them upcast to float32 dots), which is where its speed comes from. The layer scan
(`model.scan_unroll`) is unrolled on a CPU, with the same values."""

from __future__ import annotations

import collections
import re

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import config, train_setup
from jaxlm.errors import UserError
from jaxlm.models import layers, transformer
from tests.helpers import random_batch

EQUATIONS = {  # equation: (x shape, kernel shape), as the model's projections use them
    "btd,dnh->btnh": ((2, 8, 32), (32, 4, 8)),  # wq, wk, wv
    "btnh,nhd->btd": ((2, 8, 4, 8), (4, 8, 32)),  # wo
    "btd,df->btf": ((2, 8, 32), (32, 96)),  # the MLP's gate and up
    "btf,fd->btd": ((2, 8, 96), (96, 32)),  # its down projection (the weight gradient's operands swapped)
    "btd,vd->btv": ((2, 8, 32), (128, 32)),  # the tied unembedding
}
BF16_ULP = 2.0 ** -7  # bfloat16's relative spacing (8 significand bits)


@pytest.mark.parametrize("equation", EQUATIONS)
def test_accumulating_einsum_is_the_float32_einsum_rounded_forward_and_backward(equation):
    x_shape, k_shape = EQUATIONS[equation]
    kx, kk, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(jnp.bfloat16)
    kernel = jax.random.normal(kk, k_shape, jnp.float32).astype(jnp.bfloat16)
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(equation, a, b), x, kernel).shape
    g = jax.random.normal(kg, out_shape, jnp.float32).astype(jnp.bfloat16)

    def exact(fn_x, fn_k):  # the same contraction in float32 from the same bfloat16 values
        return jnp.einsum(equation, fn_x.astype(jnp.float32), fn_k.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)

    y, vjp = jax.vjp(lambda a, b: layers.accumulating_einsum(equation, a, b), x, kernel)
    dx, dk = vjp(g)
    _, exact_vjp = jax.vjp(exact, x, kernel)
    dx_exact, dk_exact = exact_vjp(g.astype(jnp.float32))
    assert y.dtype == dx.dtype == dk.dtype == jnp.bfloat16
    for got, want in ((y, exact(x, kernel)), (dx, dx_exact), (dk, dk_exact)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # float32 sums of exact bfloat16 products, rounded once: within one bfloat16 rounding of the exact value
        np.testing.assert_array_less(np.abs(got - want), BF16_ULP * np.abs(want) + 1e-6)
    # and not a no-op: the plain bfloat16 einsum is the same function
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(jnp.einsum(equation, x, kernel), np.float32),
                               rtol=2 * BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("equation", EQUATIONS)
def test_in_float32_the_accumulating_einsum_is_xlas_einsum_forward_and_backward(equation):
    """What `auto` runs on a CPU without bfloat16 instructions: the same function as `jnp.einsum`, its custom
    gradients those of autodiff (two programs: within float32 rounding)."""
    x_shape, k_shape = EQUATIONS[equation]
    kx, kk, kg = jax.random.split(jax.random.key(1), 3)
    x, kernel = jax.random.normal(kx, x_shape), jax.random.normal(kk, k_shape)
    g = jax.random.normal(kg, jax.eval_shape(lambda a, b: jnp.einsum(equation, a, b), x, kernel).shape)
    y, vjp = jax.vjp(lambda a, b: layers.accumulating_einsum(equation, a, b), x, kernel)
    y_xla, vjp_xla = jax.vjp(lambda a, b: jnp.einsum(equation, a, b, precision=jax.lax.Precision.HIGHEST), x, kernel)
    assert y.dtype == jnp.float32
    floats.close((y, *vjp(g)), (y_xla, *vjp_xla(g)), ulps=8)


def test_auto_accumulates_on_every_cpu_and_nowhere_else():
    def resolved(platform, **model):
        m = config.recipe("tiny", **{f"model__{k}": v for k, v in model.items()}).model
        return transformer.ModelConfig.from_config(m, platform, log_choice=False).matmul

    # on a CPU whatever the compute dtype: bfloat16's native dots, and the faster float32 step
    for dtype in ("bfloat16", "float32", "auto"):
        assert resolved("cpu", dtype=dtype) == "accumulate", dtype
    for dtype in ("bfloat16", "float32"):  # cuBLAS runs bf16 GEMMs natively: XLA's own einsum
        assert resolved("gpu", dtype=dtype) == "xla", dtype
    assert resolved("tpu") == "xla"
    # an explicit choice stands on every platform
    assert resolved("gpu", matmul="accumulate") == "accumulate"
    assert resolved("cpu", matmul="xla") == "xla"
    assert resolved("cpu", dtype="float32", matmul="xla") == "xla"


def test_a_matmul_that_does_not_exist_is_one_line():
    with pytest.raises(UserError, match=r"model\.matmul") as e:
        config.recipe("tiny", model__matmul="int8")
    assert "\n" not in str(e.value) and "accumulate" in str(e.value)


def _dots_by_operand_dtype(hlo: str) -> collections.Counter:
    """{(lhs dtype, rhs dtype): count} of the dots in an optimized HLO module's text."""
    out = collections.Counter()
    for computation in hlo.split("\n\n"):
        dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", computation))
        for lhs, rhs in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", computation):
            out[(dtypes.get(lhs), dtypes.get(rhs))] += 1
    return out


def _step_and_batch(matmul: str, layers_: int = 2):
    cfg = config.recipe("tiny", model__matmul=matmul, model__n_layers=layers_, model__scan_layers=False,
                        model__dtype="bfloat16", data__global_batch_size=4, data__seq_len=32)
    t = train_setup.build(cfg, jax.devices()[:1])
    batch = t.put_batch(random_batch(4, 32, cfg.model.vocab_size))
    return t, batch


def test_the_compiled_cpu_step_runs_the_projections_dots_in_bfloat16():
    n_layers = 2
    projections = n_layers * 7 + 1  # q, k, v, o, gate, up, down per layer; the unembedding
    # the plain einsum's q, k and v are one matmul (tiny has grouped-query heads: layers.project_qkv), and
    # so are gate and up (no remat: layers.project_gate_up)
    joint = n_layers * 4 + 1
    counts = {}
    for matmul in ("xla", "auto"):
        t, batch = _step_and_batch(matmul, n_layers)
        assert (t.model_cfg.matmul == "accumulate") is (matmul == "auto")
        with jax.set_mesh(t.mesh):
            counts[matmul] = _dots_by_operand_dtype(t.train_step.lower(t.state, batch).compile().as_text())
    # each projection: its forward dot and its two gradients' dots, all on bfloat16 operands
    assert counts["auto"][("bf16", "bf16")] >= 3 * projections, counts["auto"]
    # the plain einsum's are upcast: XLA:CPU computes them as float32 dots
    assert counts["xla"][("f32", "f32")] >= 3 * joint, counts["xla"]
    # what stays bfloat16 there is the attention's (the same dots in both programs)
    assert counts["xla"][("bf16", "bf16")] == counts["auto"][("bf16", "bf16")] - 3 * projections, counts


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])  # 4 s each
def test_no_weight_gradient_copies_the_mlps_hidden_input_transposed(dtype, monkeypatch):
    """`layers.weight_grad` puts the narrower operand on the dot's left: XLA:CPU's matmuls want that side's
    contracted dimension minor and copy it transposed, and for the MLP's down projection that is its gradient
    [tokens, d_model], not its input [tokens, mlp_dim]. In the compiled step no [mlp_dim, tokens] array is made;
    with the operands in the plain order, XLA copies one per layer (where its matmuls are YNNPACK's)."""
    n_layers, rows, seq = 1, 6, 32  # 192 tokens: unlike every width of the model
    cfg = config.recipe("tiny", model__n_layers=n_layers, model__scan_layers=False, model__dtype=dtype,
                        data__global_batch_size=rows, data__seq_len=seq)
    shape = re.compile(rf"= (f32|bf16)\[{cfg.model.mlp_dim},({rows * seq}|{rows},{seq})\]")

    def transposed_inputs() -> tuple[int, bool]:
        t = train_setup.build(cfg, jax.devices()[:1])
        assert t.model_cfg.matmul == "accumulate"
        with jax.set_mesh(t.mesh):
            hlo = t.train_step.lower(t.state, t.put_batch(random_batch(rows, seq, cfg.model.vocab_size))).compile().as_text()
        entry = hlo[hlo.index("\nENTRY"):]
        entry = entry[: entry.index("\n}")]
        return sum(bool(shape.search(line)) for line in entry.splitlines()), "ynn_fusion" in entry

    assert transposed_inputs()[0] == 0
    monkeypatch.setattr(layers, "weight_grad", lambda x_idx, out, kernel_idx, x, g: jnp.einsum(
        f"{x_idx},{out}->{kernel_idx}", x, g, preferred_element_type=jnp.float32))
    copies, ynnpack = transposed_inputs()
    if ynnpack:
        assert copies == n_layers


def test_training_with_accumulating_dots_follows_the_plain_einsum():
    losses = {}
    for matmul in ("xla", "accumulate"):
        t, batch = _step_and_batch(matmul)
        state, out = t.state, []
        with jax.set_mesh(t.mesh):
            for _ in range(8):
                state, metrics = t.train_step(state, batch)
                out.append(float(metrics["loss"]))
        losses[matmul] = np.array(out)
    assert losses["xla"][-1] < losses["xla"][0] - 0.5  # it learns the batch
    np.testing.assert_allclose(losses["accumulate"], losses["xla"], rtol=5e-3)


@pytest.mark.slow  # 8 s: the default suite's budget
def test_the_layer_scan_is_unrolled_on_a_cpu_and_computes_the_same():
    def resolved(platform, **model):
        m = config.recipe("tiny", **{f"model__{k}": v for k, v in model.items()}).model
        return transformer.ModelConfig.from_config(m, platform, log_choice=False).scan_unroll

    assert resolved("cpu") == 4 and resolved("gpu") == 4 and resolved("tpu") == 1  # tiny: 4 layers
    assert resolved("cpu", remat="full") == 1 and resolved("gpu", remat="dots") == 1  # remat asks for memory:
    # the loop reuses its buffers
    assert resolved("cpu", scan_unroll=2) == 2 and resolved("gpu", scan_unroll=9) == 4
    with pytest.raises(UserError, match=r"model\.scan_unroll"):
        config.recipe("tiny", model__scan_unroll=-1)

    results = {}
    for unroll in (1, 0):  # a loop over the stacked layers; auto: every layer unrolled
        cfg = config.recipe("tiny", model__scan_unroll=unroll, model__dtype="float32", data__global_batch_size=4,
                            data__seq_len=32)
        t = train_setup.build(cfg, jax.devices()[:1])
        batch = t.put_batch(random_batch(4, 32, cfg.model.vocab_size))
        with jax.set_mesh(t.mesh):
            hlo = t.train_step.lower(t.state, batch).compile().as_text()
            _, metrics = t.train_step(t.state, batch)
        results[unroll] = (" while(" in hlo, float(metrics["loss"]), float(metrics["grad_norm"]))
    assert results[1][0] and not results[0][0], "the loop over layers is there with scan_unroll=1 only"
    np.testing.assert_allclose(results[0][1:], results[1][1:], rtol=1e-5)


@pytest.mark.slow  # 13 s: the default suite's budget (tests/test_model.py holds the kernel to the reference)
def test_training_with_the_causal_blocks_follows_xlas_attention():
    """The CPU's `auto` attention (`blocked`) trains as XLA's masked attention does: float32 to its rounding
    over 4 steps of packed documents with padding; the default bfloat16 to bfloat16's."""
    for dtype, rtol in (("float32", 1e-5), ("bfloat16", 5e-3)):
        losses = {}
        for kernel in ("xla", "blocked"):
            cfg = config.recipe("tiny", model__attention=kernel, model__n_layers=2, model__dtype=dtype,
                                data__global_batch_size=4, data__seq_len=64)
            t = train_setup.build(cfg, jax.devices()[:1])
            assert t.model_cfg.attention == kernel
            batch = t.put_batch(random_batch(4, 64, cfg.model.vocab_size))  # two documents a row, and padding
            state, out = t.state, []
            with jax.set_mesh(t.mesh):
                for _ in range(4):
                    state, metrics = t.train_step(state, batch)
                    out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
            losses[kernel] = np.array(out)
        assert losses["xla"][-1, 0] < losses["xla"][0, 0] - 0.1  # it learns the batch
        np.testing.assert_allclose(losses["blocked"], losses["xla"], rtol=rtol)
