"""Where an MoE program's roofline time goes, by source line: the compiled H100 program of one MoE layer
or of a recipe's whole train step (compile-only: no GPU), each kernel at max(FLOPs / peak, bytes / HBM
bandwidth) as `jaxlm.roofline` counts it, the kernels grouped by the line of jaxlm's code that made them.

    .venv-h100/bin/python benchmarks/moe_kernels.py layer                 # configs/moe_1b.py's MoE layer
    .venv-h100/bin/python benchmarks/moe_kernels.py recipe --devices 8    # its train step on 8 H100s
    .venv-h100/bin/python benchmarks/moe_kernels.py recipe --hlo step.hlo # re-read a saved program

tokamax on PYTHONPATH for the tokamax dispatch (the recipe's `auto` on GPUs where it is installed).
`--save FILE` writes the optimized HLO text, `--hlo FILE` reads one instead of compiling (the source
lines are read from this checkout: re-read a program only against the code that made it). `--kernels N`
also lists the N costliest kernels one by one, with their bytes.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: the CUDA plugin compiles without a GPU
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

MATMUL_KINDS = ("gemm", "attention", "attention backward")


def layer_text(recipe: str, impl: str, tokens: int, overrides: list[tuple[str, str]]) -> tuple[str, float, int]:
    """One MoE layer of `recipe`'s model, forward and backward on `tokens` tokens, compiled for one H100:
    (optimized HLO, the layer's routed FLOPs, devices)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxlm import config as config_lib
    from jaxlm import roofline
    from jaxlm.models import transformer
    from jaxlm.models.mlps.moe import MoEMLP

    cfg = config_lib.load_recipe(recipe)
    config_lib.apply_overrides(cfg, overrides)
    m = transformer.ModelConfig.from_config(cfg.model, "gpu", log_choice=False)
    m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, impl=impl))
    devices = roofline.target_devices(roofline.H100, 1)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    graph, state = nnx.split(nnx.eval_shape(lambda: MoEMLP(m, rngs=nnx.Rngs(params=0))))

    def loss(state, x):  # squared: the backward pass waits for the forward's output, as in a model
        y, aux = nnx.merge(graph, state)(x)
        return 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32))) + aux["moe_balance_loss"]

    seq = min(tokens, cfg.data.seq_len)
    state_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), state)
    x_spec = jax.ShapeDtypeStruct((tokens // seq, seq, m.d_model), m.dtype, sharding=rep)
    with roofline.kernel_checks_for(roofline.H100):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state_spec, x_spec).lower().compile()
    d, f, e, k = m.d_model, m.mlp_dim, m.moe.experts, m.moe.top_k
    return compiled.as_text(), 3 * 2.0 * tokens * (k * 3 * d * f + d * e), 1


def recipe_text(recipe: str, devices: int, overrides: list[tuple[str, str]]) -> tuple[str, float, int]:
    """The recipe's train step on `devices` compile-only H100s, micro-batches as the planner resolves them:
    (optimized HLO, the model's FLOPs per device, devices)."""
    from jaxlm import config as config_lib
    from jaxlm import memory, roofline, train_setup
    from jaxlm.models import transformer

    cfg = config_lib.load_recipe(recipe)
    config_lib.apply_overrides(cfg, overrides)
    config_lib.validate(cfg)
    cfg, _ = memory.resolve_micro_batches(cfg, devices, roofline.H100.memory_bytes, "gpu")
    setup = train_setup.build(cfg, roofline.target_devices(roofline.H100, devices), abstract=True)
    with roofline.kernel_checks_for(roofline.H100):
        compiled = setup.compile_train_step("expected")
    flops = transformer.flops_per_token(setup.model_cfg, cfg.data.seq_len) * setup.derived.tokens_per_step / devices
    return compiled.as_text(), flops, devices


def breakdown(text: str, model_flops: float, devices: int, top: int, kernels_top: int) -> dict:
    """The roofline summary and the non-matmul kernels' time by source line."""
    from jaxlm import hlo, roofline

    ks = roofline.kernels(hlo.Module(text), roofline.H100, devices)
    summary = roofline.summarize(ks, roofline.H100, model_flops)
    by: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0.0])
    for k in ks:
        if k.kind in MATMUL_KINDS or k.comm_bytes or k.kind in hlo.COLLECTIVES:
            continue
        row = by[(k.kind, (k.source or k.op_name)[:110])]
        row[0] += k.runs
        row[1] += k.total_seconds
        row[2] += k.bytes * k.runs
    gemm = [k for k in ks if k.kind == "gemm"]
    out = dict(step_ms=summary["step_seconds"] * 1e3, compute_ms=summary["compute_seconds"] * 1e3,
               matmul_ms=summary["matmul_seconds"] * 1e3, gemm_ms=sum(k.total_seconds for k in gemm) * 1e3,
               exposed_ms=summary["exposed_communication_seconds"] * 1e3, matmul_tflop=summary["matmul_flops"] / 1e12,
               model_tflop=model_flops / 1e12, roofline_mfu=summary["roofline_mfu"],
               other_ms=sum(v[1] for v in by.values()) * 1e3,
               by_kind={kind: round(v["seconds"] * 1e3, 2) for kind, v in summary["by_kind"].items()},
               by_source=[dict(kind=kind, source=src, launches=n, ms=s * 1e3, gb=b / 1e9)
                          for (kind, src), (n, s, b) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]])
    if kernels_top:
        costly = sorted((k for k in ks if not k.comm_bytes), key=lambda k: -k.total_seconds)[:kernels_top]
        out["kernels"] = [dict(name=k.name, kind=k.kind, launches=k.runs, ms=k.total_seconds * 1e3,
                               gb=k.bytes * k.runs / 1e9, tflop=k.flops * k.runs / 1e12,
                               source=(k.source or k.op_name)[:100]) for k in costly]
    return out


def report(r: dict) -> str:
    mfu = r["roofline_mfu"]
    lines = [f"roofline step {r['step_ms']:.2f} ms (kernels {r['compute_ms']:.2f}: matmuls {r['matmul_ms']:.2f}, "
             f"of which GEMMs {r['gemm_ms']:.2f}; other kernels {r['other_ms']:.2f}; exposed communication "
             f"{r['exposed_ms']:.2f}); matmul {r['matmul_tflop']:.3f} TFLOP, model {r['model_tflop']:.3f} TFLOP; "
             f"roofline MFU " + (f"{mfu:.3f}" if mfu is not None else "n/a"),
             "by kind: " + ", ".join(f"{k} {v}" for k, v in r["by_kind"].items()), "",
             f"{'ms':>8} {'GB':>8} {'launch':>6} {'kind':14s} source"]
    lines += [f"{x['ms']:8.2f} {x['gb']:8.2f} {x['launches']:6d} {x['kind']:14s} {x['source']}" for x in r["by_source"]]
    if r.get("kernels"):
        lines += ["", f"{'ms':>8} {'GB':>8} {'TFLOP':>7} {'launch':>6} {'kind':14s} {'name':24s} source"]
        lines += [f"{x['ms']:8.3f} {x['gb']:8.3f} {x['tflop']:7.3f} {x['launches']:6d} {x['kind']:14s} "
                  f"{x['name'][:24]:24s} {x['source']}" for x in r["kernels"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["layer", "recipe"])
    parser.add_argument("--recipe", default="configs/moe_1b.py")
    parser.add_argument("--impl", default="tokamax", help="the layer's dispatch (layer only)")
    parser.add_argument("--tokens", type=int, default=8192, help="the layer's tokens (layer only)")
    parser.add_argument("--devices", type=int, default=8, help="H100s for the recipe's step (recipe only)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--top", type=int, default=25, help="source lines listed")
    parser.add_argument("--kernels", type=int, default=0, help="also the N costliest kernels one by one")
    parser.add_argument("--save", default="", help="write the optimized HLO text here")
    parser.add_argument("--hlo", default="", help="read this HLO text instead of compiling (with --model_tflop)")
    parser.add_argument("--model_tflop", type=float, default=0.0, help="with --hlo: the model's TFLOP per device")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args()
    overrides = [tuple(s.split("=", 1)) for s in args.set]
    start = time.perf_counter()
    if args.hlo:
        with open(args.hlo) as f:
            text = f.read()
        flops, devices = args.model_tflop * 1e12, args.devices if args.what == "recipe" else 1
    elif args.what == "layer":
        from jaxlm.models.mlps import moe

        if args.impl == "tokamax":
            moe._tokamax()  # installed, and absl's flags marked parsed before argparse's are seen
        text, flops, devices = layer_text(args.recipe, args.impl, args.tokens, overrides)
    else:
        text, flops, devices = recipe_text(args.recipe, args.devices, overrides)
    compile_s = time.perf_counter() - start
    if args.save:
        with open(args.save, "w") as f:
            f.write(text)
    r = breakdown(text, flops, devices, args.top, args.kernels)
    r.update(what=args.what, recipe=args.recipe, devices=devices, overrides=args.set, compile_s=round(compile_s, 1))
    print(report(r))
    print(f"compiled in {compile_s:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
