"""What delayed scaling would save float8's projections, read from the compiled H100 program (no GPU).

    .venv-h100/bin/python benchmarks/fp8_scaling.py                 # current and delayed, 1b's widths
    .venv-h100/bin/python benchmarks/fp8_scaling.py --layers 8 --rows 4

A stack of `--layers` MLP blocks of 1b's widths (RMSNorm, gate and up as one float8 matmul, SwiGLU, the down
projection, the residual add), forward and backward on `--rows` x `--seq` tokens, compiled for one
compile-only H100 twice:

- `current`: the library's float8 matmul as a step with micro-batches runs it
  (`layers.fp8_weight_grad_einsum`: the weight quantized once, the input's and the gradient's amax
  taken on the tensor itself before its cast: per-tensor current scaling);
- `delayed`: the same products with the input's and the gradient's scales given ahead, as a history of
  earlier steps' amax would give them (Transformer Engine's delayed scaling), each amax still taken to
  feed that history, but no cast waiting for it. A prototype for this measurement only: the library
  does not have it.

Each program is read kernel by kernel by `jaxlm.roofline` (every kernel at max(FLOPs / 989 TFLOP/s,
bytes / 3.35 TB/s)), the kernels outside the GEMMs listed by the source line that made them. The
weights' quantization is in both programs alike.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: the CUDA plugin compiles without a GPU
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import functools  # noqa: E402


def delayed_einsum():
    """`fp8_weight_grad_einsum` with the input's and the gradient's scales given (`scales`: [2]) instead of
    taken from the tensors; `scales`' cotangent carries the two amax out, as a history would record them."""
    import jax
    import jax.numpy as jnp

    from jaxlm.models import layers

    def cast(t, scale, dtype):
        top = float(jnp.finfo(dtype).max)
        q = jnp.clip(t.astype(jnp.float32) * scale, -top, top).astype(dtype)
        return q, jnp.max(jnp.abs(t)).astype(jnp.float32)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def einsum(equation, x, kq, sk, scales, grad):
        return forward(equation, x, kq, sk, scales, grad)[0]

    def forward(equation, x, kq, sk, scales, grad):
        xq, amax_x = cast(x, scales[0], layers.FP8_FORWARD)
        y = jnp.einsum(equation, xq, kq, preferred_element_type=x.dtype).astype(jnp.float32) / (scales[0] * sk)
        return y.astype(x.dtype), (xq, kq, sk, scales, amax_x)

    def backward(equation, residuals, g):
        xq, kq, sk, scales, amax_x = residuals
        inputs, out = equation.split("->")
        x_idx, k_idx = inputs.split(",")
        gq, amax_g = cast(g, scales[1], layers.FP8_BACKWARD)
        dx = jnp.einsum(f"{out},{k_idx}->{x_idx}", gq, kq, preferred_element_type=jnp.float32) / (scales[1] * sk)
        dk = jnp.einsum(f"{x_idx},{out}->{k_idx}", xq, gq, preferred_element_type=jnp.float32) / (scales[0] * scales[1])
        return dx.astype(g.dtype), None, None, jnp.stack([amax_x, amax_g]), dk

    einsum.defvjp(forward, backward)
    return einsum


def compile_stack(mode: str, layers_n: int, rows: int, seq: int, d: int, f: int) -> tuple[str, float]:
    """(the optimized HLO of the stack's gradient for one H100, its matmul FLOPs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlm import roofline
    from jaxlm.models import layers

    delayed = delayed_einsum()

    def rms(x, s):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * s).astype(jnp.bfloat16)

    def loss(weights, scales, x):
        for (w_in, w_out, norm), layer_scales in zip(weights, scales, strict=True):
            q = [layers.fp8_weight(jax.lax.stop_gradient(w).astype(jnp.bfloat16)) for w in (w_in, w_out)]

            def project(equation, h, i, q=q, grads=(w_in, w_out), layer_scales=layer_scales):
                if mode == "current":
                    return layers.fp8_weight_grad_einsum(equation, h, q[i].q, q[i].scale, grads[i])
                return delayed(equation, h, q[i].q, q[i].scale, layer_scales[i], grads[i])

            gate_up = project("btd,df->btf", rms(x, norm), 0)
            x = x + project("btf,fd->btd", jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:], 1)
        return 0.5 * jnp.sum(jnp.square(x.astype(jnp.float32)))  # the backward waits for the forward's output

    mesh = jax.sharding.Mesh(np.array(roofline.target_devices(roofline.H100, 1)), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    weights = [(spec((d, 2 * f), jnp.float32), spec((f, d), jnp.float32), spec((d,), jnp.float32))
               for _ in range(layers_n)]
    scales = [[spec((2,), jnp.float32) for _ in range(2)] for _ in range(layers_n)]
    x = spec((rows, seq, d), jnp.bfloat16)
    with roofline.kernel_checks_for(roofline.H100):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(weights, scales, x).lower().compile()
    return compiled.as_text(), 3 * 2.0 * rows * seq * 3 * d * f * layers_n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["current", "delayed"], choices=["current", "delayed"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2, help="sequences per micro-batch (1b on one H100: 2)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--d", type=int, default=2048, help="d_model (1b's)")
    parser.add_argument("--f", type=int, default=5632, help="the MLP's width (1b's)")
    parser.add_argument("--top", type=int, default=12, help="source lines listed")
    args = parser.parse_args()

    from moe_kernels import breakdown, report

    for mode in args.modes:
        text, flops = compile_stack(mode, args.layers, args.rows, args.seq, args.d, args.f)
        r = breakdown(text, flops, 1, 10**6, 0)  # every source line, for the count
        launches = sum(row["launches"] for row in r["by_source"])
        r["by_source"] = r["by_source"][: args.top]
        print(f"===== {mode}: {launches} kernel launches outside the matmuls")
        print(report(r))


if __name__ == "__main__":
    main()
