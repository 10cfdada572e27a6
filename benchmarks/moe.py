"""Mixture-of-Experts speed: the train step against the dense one of the same active size, the grouped
matmul against its alternatives, and the compiled H100 program of each dispatch (`model.moe_impl`).

    python benchmarks/moe.py train                       # CPU: tiny dense against its MoE variants, each moe_impl
    python benchmarks/moe.py matmul                      # CPU: one grouped matmul, forward + backward, 4 ways
    .venv-h100/bin/python benchmarks/moe.py h100         # compile-only H100: one MoE layer, and configs/moe_1b.py
    python benchmarks/moe.py train --set data.global_batch_size=4 --steps 2 --repeats 1 --json moe.json

`train`: the tiny recipe (dense SwiGLU of 384 units) against MoE variants with the same active
parameters per token (E=8 experts of 192 units, top-2; E=4 of 384, top-1), each under every dispatch
this machine has, on random tokens of the recipe's shape. Every variant is compiled first, then timed
in turns (`--repeats` rounds of `--steps` steps each, after `--warmup`), so a change of the machine's
load falls on all of them alike; a round's mean step time per variant, the median over rounds reported.

`matmul`: the experts' matmul alone, x [M, K] rows (M = tokens x k) by w [E, K, N], forward and both
gradients, in bfloat16 with float32 accumulation: `jax.lax.ragged_dot` (jaxlm's grouped_matmul),
tokamax's grouped matmul (where installed), every expert on every token (a dense einsum over [E, tokens,
K]: the `dense` dispatch) and a capacity-style batched einsum over [E, C, K] (C = 1.25 x M / E: the
`capacity` dispatch). Routed FLOPs are 3 x 2 M K N; the program's FLOPs are its dots' as compiled.

`h100`: compiled for compile-only H100s on this machine (no GPU; `make h100-env`, tokamax in it for the
tokamax rows): one MoE MLP layer of `--recipe`'s shape, forward and backward on `--tokens` tokens, for
each dispatch: the program's matmul FLOPs against the routed ones, its kernels (custom calls, fusions)
and their roofline time (`jaxlm.roofline`), XLA's memory analysis; then the whole recipe's train step on
`--devices` H100s by `python -m jaxlm.plan --target=h100`'s code: memory and roofline, all collectives.
"""

from __future__ import annotations

import os
import sys

if len(sys.argv) > 1 and sys.argv[1] == "h100":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: the CUDA plugin compiles without a GPU
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

# the variants of `train`: (name, model overrides); tiny's MLP is a 384-unit SwiGLU
VARIANTS = {
    "dense": {},
    "E8k2": {"model.mlp": "moe", "model.mlp_dim": "192", "model.moe_experts": "8", "model.moe_top_k": "2"},
    "E4k1": {"model.mlp": "moe", "model.mlp_dim": "384", "model.moe_experts": "4", "model.moe_top_k": "1"},
}
# the shapes of `matmul`: tokens, K (d_model), N (expert width), E, k
SHAPES = {
    "tiny": (2048, 128, 192, 8, 2),  # configs/moe_tiny.py, one 16 x 128 batch
    "tiny_E4k1": (2048, 128, 384, 4, 1),
    "moe_1b": (512, 1024, 2304, 8, 2),  # configs/moe_1b.py's expert, a quarter of one sequence
}
CAPACITY_FACTOR = 1.25


def versions() -> str:
    out = []
    for name in ("jax", "jaxlib", "flax", "jax-cuda13-plugin", "tokamax"):
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def metadata() -> dict:
    import jax

    return dict(date=str(datetime.date.today()), device=f"{jax.device_count()}x {jax.devices()[0].device_kind}",
                cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), versions=versions(),
                python=platform.python_version(), load_average=[round(x, 2) for x in os.getloadavg()])


def impls_here() -> list[str]:
    from jaxlm.models.mlps import moe

    return [i for i in moe.IMPLS if i != "tokamax" or moe.tokamax_available()]


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- train (CPU)


def train(args) -> list[dict]:
    import jax
    from train_throughput import random_batch

    from jaxlm import config, train_setup
    from jaxlm.models.transformer import active_param_count, flops_per_token, param_count

    runs = []
    for variant in args.variants:
        for impl in ([None] if variant == "dense" else args.impls):
            overrides = {**VARIANTS[variant], **({"model.moe_impl": impl} if impl else {}), **args.overrides}
            cfg = config.load_recipe(args.recipe)
            config.apply_overrides(cfg, list(overrides.items()))
            config.validate(cfg)
            setup = train_setup.build(cfg, devices=jax.devices()[:1])
            d = cfg.data
            batches = [setup.put_batch(random_batch(d.global_batch_size, d.seq_len, cfg.model.vocab_size, i))
                       for i in range(2)]
            run = dict(variant=variant, impl=impl or "-", setup=setup, batches=batches, state=setup.state,
                       packed=setup.expected_attention_choice(), times=[], tokens=d.global_batch_size * d.seq_len,
                       params_m=round(param_count(setup.model_cfg)["total"] / 1e6, 3),
                       active_m=round(active_param_count(setup.model_cfg) / 1e6, 3),
                       flops=flops_per_token(setup.model_cfg, d.seq_len) * d.global_batch_size * d.seq_len)
            with jax.set_mesh(setup.mesh):
                t0 = time.perf_counter()
                run["state"], metrics = setup.train_step(run["state"], batches[0], run["packed"])
                jax.block_until_ready(metrics)
                run["compile_s"] = round(time.perf_counter() - t0, 2)
                for i in range(args.warmup):
                    run["state"], metrics = setup.train_step(run["state"], batches[i % 2], run["packed"])
                jax.block_until_ready(metrics)
            run["dropped"] = float(metrics.get("aux/moe_dropped", 0.0))
            runs.append(run)
            print(f"compiled {variant} {run['impl']} in {run['compile_s']} s", file=sys.stderr, flush=True)
    for _ in range(args.repeats):  # in turns: the machine's load falls on every variant alike
        for run in runs:
            setup = run["setup"]
            with jax.set_mesh(setup.mesh):
                t0 = time.perf_counter()
                for i in range(args.steps):
                    run["state"], metrics = setup.train_step(run["state"], run["batches"][i % 2], run["packed"])
                jax.block_until_ready(metrics)
                run["times"].append((time.perf_counter() - t0) / args.steps)
    dense_s = next((statistics.median(r["times"]) for r in runs if r["variant"] == "dense"), None)
    out = []
    for r in runs:
        step_s = statistics.median(r["times"])
        out.append(dict(variant=r["variant"], impl=r["impl"], params_m=r["params_m"], active_m=r["active_m"],
                        compile_s=r["compile_s"], step_ms=round(step_s * 1e3, 2),
                        spread_ms=f"{min(r['times']) * 1e3:.1f}-{max(r['times']) * 1e3:.1f}",
                        tokens_per_s=round(r["tokens"] / step_s), active_gflop_per_s=round(r["flops"] / step_s / 1e9, 2),
                        vs_dense=round(dense_s / step_s, 3) if dense_s else None, dropped=round(r["dropped"], 4),
                        step_ms_rounds=[round(t * 1e3, 2) for t in r["times"]]))
    return out


# ----------------------------------------------------------------------------- matmul (CPU)


def program_flops(compiled) -> float:
    """The compiled program's matmul FLOPs (its dots, and tokamax's kernels: `jaxlm.roofline.kernels`)."""
    from jaxlm import hlo, roofline

    return sum(k.flops * k.runs for k in roofline.kernels(hlo.Module(compiled.as_text()), roofline.H100, 1)
               if k.kind == "gemm")


def matmul_cases(tokens: int, k_in: int, n_out: int, experts: int, top_k: int, seed: int = 0):
    """{name: (fn(x, w) -> out, x, w, cotangent)}: one grouped matmul of `tokens` x `top_k` rows, 4 ways."""
    import jax.numpy as jnp
    import numpy as np

    from jaxlm.models.mlps import moe

    rng = np.random.default_rng(seed)
    m = tokens * top_k
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1)
    sizes = jnp.asarray(np.bincount(chosen, minlength=experts), jnp.int32)
    bf16 = jnp.bfloat16
    w = jnp.asarray(rng.standard_normal((experts, k_in, n_out)) / math.sqrt(k_in), bf16)
    rows = jnp.asarray(rng.standard_normal((m, k_in)), bf16)
    tok = jnp.asarray(rng.standard_normal((tokens, k_in)), bf16)
    c = max(1, math.ceil(CAPACITY_FACTOR * m / experts))
    slots = jnp.asarray(rng.standard_normal((experts, c, k_in)), bf16)

    def cot(shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    cases = {"ragged_dot": (lambda x, w: moe.grouped_matmul(x, w, sizes), rows, w, cot((m, n_out)))}
    if moe.tokamax_available():
        cases["tokamax"] = (lambda x, w: moe.tokamax_grouped_matmul(x, w, sizes), rows, w, cot((m, n_out)))
    cases["dense_einsum"] = (lambda x, w: jnp.einsum("nd,edf->enf", x, w, preferred_element_type=jnp.float32), tok, w,
                             cot((experts, tokens, n_out)))
    cases["capacity_einsum"] = (lambda x, w: jnp.einsum("ecd,edf->ecf", x, w, preferred_element_type=jnp.float32),
                                slots, w, cot((experts, c, n_out)))
    return cases


def matmul(args) -> list[dict]:
    import jax
    import jax.numpy as jnp

    out = []
    for shape in args.shapes:
        tokens, k_in, n_out, experts, top_k = SHAPES[shape]
        routed = 3 * 2.0 * tokens * top_k * k_in * n_out
        timed = []
        for name, (fn, x, w, ct) in matmul_cases(tokens, k_in, n_out, experts, top_k).items():
            def loss(x, w, fn=fn, ct=ct):
                return jnp.sum(fn(x, w) * ct)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            compiled = step.lower(x, w).compile()
            jax.block_until_ready(step(x, w))
            timed.append(dict(name=name, step=step, x=x, w=w, flops=program_flops(compiled), times=[]))
        for _ in range(args.repeats):  # in turns, as `train`
            for t in timed:
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    result = t["step"](t["x"], t["w"])
                jax.block_until_ready(result)
                t["times"].append((time.perf_counter() - t0) / args.iters)
        for t in timed:
            s = statistics.median(t["times"])
            out.append(dict(shape=shape, tokens=tokens, K=k_in, N=n_out, E=experts, k=top_k, impl=t["name"],
                            ms=round(s * 1e3, 3), spread_ms=f"{min(t['times']) * 1e3:.2f}-{max(t['times']) * 1e3:.2f}",
                            routed_gflop=round(routed / 1e9, 3), program_gflop=round(t["flops"] / 1e9, 3),
                            flops_ratio=round(t["flops"] / routed, 2), routed_gflop_per_s=round(routed / s / 1e9, 2)))
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------------------- h100 (compile-only)


def layer_program(cfg_model, impl: str, tokens: int, seq: int):
    """One MoE MLP layer of `cfg_model`'s shape with dispatch `impl`, forward and backward on `tokens`
    tokens (rows of `seq`), compiled for one compile-only H100: its figures."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxlm import hlo, roofline
    from jaxlm.models import transformer
    from jaxlm.models.mlps.moe import MoEMLP

    m = transformer.ModelConfig.from_config(cfg_model, "gpu", log_choice=False)
    m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, impl=impl))
    devices = roofline.target_devices(roofline.H100, 1)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    graph, state = nnx.split(nnx.eval_shape(lambda: MoEMLP(m, rngs=nnx.Rngs(params=0))))

    def loss(state, x):
        y, aux = nnx.merge(graph, state)(x)
        return jnp.sum(y.astype(jnp.float32)) + aux["moe_balance_loss"]

    state_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), state)
    x_spec = jax.ShapeDtypeStruct((tokens // seq, seq, m.d_model), m.dtype, sharding=rep)
    with roofline.kernel_checks_for(roofline.H100):
        t0 = time.perf_counter()
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state_spec, x_spec).lower().compile()
        compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    kernels = roofline.kernels(hlo.Module(text), roofline.H100, 1)
    gemm = [k for k in kernels if k.kind == "gemm"]
    d, f, e, k = m.d_model, m.mlp_dim, m.moe.experts, m.moe.top_k
    routed = 3 * 2.0 * tokens * (k * 3 * d * f + d * e)  # forward and backward: the k experts' and the router's
    analysis = compiled.memory_analysis()
    calls = Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    kinds = Counter(k.kind for k in kernels if not k.comm_bytes)
    return dict(impl=impl, tokens=tokens, d_model=d, expert_dim=f, experts=e, top_k=k,
                program_gflop=round(sum(g.flops * g.runs for g in gemm) / 1e9, 1), routed_gflop=round(routed / 1e9, 1),
                flops_ratio=round(sum(g.flops * g.runs for g in gemm) / routed, 2),
                roofline_ms=round(sum(x.total_seconds for x in kernels) * 1e3, 3),
                gemm_ms=round(sum(g.total_seconds for g in gemm) * 1e3, 3),
                temp_mib=round(analysis.temp_size_in_bytes / 2**20, 1), custom_calls=dict(calls),
                kernels=dict(kinds.most_common()), compile_s=round(compile_s, 1))


def recipe_program(recipe: str, devices: int, impl: str, overrides: list[tuple[str, str]]) -> dict:
    """The recipe's train step on `devices` compile-only H100s (`jaxlm.plan.plan`, compiled): its plan,
    compiled memory and roofline."""
    from jaxlm import config as config_lib
    from jaxlm import plan, roofline

    cfg = config_lib.load_recipe(recipe)
    config_lib.apply_overrides(cfg, [("model.moe_impl", impl), *overrides])
    config_lib.validate(cfg)
    report = plan.plan(cfg, devices, roofline.H100.memory_bytes, compile=True, target=roofline.H100)
    c = report["compiled"]
    r = c["roofline"]
    gemm = r["by_kind"].get("gemm", {})
    comm = {kind: round(v["seconds"] * 1e3, 1) for kind, v in r["by_kind"].items()
            if kind in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")}
    return dict(recipe=recipe, devices=devices, impl=impl, mesh=report["mesh"], micro_batches=report["micro_batches"],
                remat=report["remat"], planned_gib=round(report["analytic"]["per_device_bytes"] / 2**30, 2),
                compiled_gib=round(c["per_device_bytes"] / 2**30, 2), compiled_over_planned=round(c["ratio"], 3),
                compile_s=c["compile_s"],
                step_ms=round(r["step_seconds"] * 1e3, 1), gemm_ms=round(gemm.get("seconds", 0.0) * 1e3, 1),
                communication_ms=round(r["communication_seconds"] * 1e3, 1),
                exposed_ms=round(r["exposed_communication_seconds"] * 1e3, 1), collectives_ms=comm,
                program_tflop=round(r["matmul_flops"] / 1e12, 2), model_tflop=round(r["model_flops"] / 1e12, 2),
                roofline_mfu=None if r["roofline_mfu"] is None else round(r["roofline_mfu"], 3),
                incomplete=r.get("incomplete", ""),
                by_kind_ms={kind: round(v["seconds"] * 1e3, 1) for kind, v in list(r["by_kind"].items())[:8]})


def h100(args) -> dict:
    from jaxlm import config as config_lib
    from jaxlm import roofline

    try:
        roofline.target_devices(roofline.H100, 1)
    except Exception as e:
        sys.exit(f"benchmarks/moe.py h100 needs XLA's CUDA compiler: `make h100-env`, then run it with "
                 f".venv-h100/bin/python ({type(e).__name__})")
    impls = args.impls or impls_here()
    cfg = config_lib.load_recipe(args.recipe)
    config_lib.apply_overrides(cfg, args.overrides_list)
    layers = []
    for impl in impls:
        layers.append(layer_program(cfg.model, impl, args.tokens, min(args.tokens, cfg.data.seq_len)))
        print(json.dumps(layers[-1]), file=sys.stderr, flush=True)
    recipes = []
    for devices in args.devices:
        for impl in args.recipe_impls or impls:
            recipes.append(recipe_program(args.recipe, devices, impl, args.overrides_list))
            print(json.dumps(recipes[-1]), file=sys.stderr, flush=True)
    return dict(layer=layers, recipe=recipes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    p_train = sub.add_parser("train", help="CPU train-step tokens/s: tiny dense against its MoE variants")
    p_train.add_argument("--recipe", default="tiny")
    p_train.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p_train.add_argument("--impls", nargs="+", default=None, help="dispatches (default: every one here)")
    p_train.add_argument("--steps", type=int, default=5, help="steps per round")
    p_train.add_argument("--warmup", type=int, default=2)
    p_train.add_argument("--repeats", type=int, default=5, help="rounds")
    p_matmul = sub.add_parser("matmul", help="CPU: one grouped matmul, forward and backward, each way")
    p_matmul.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p_matmul.add_argument("--iters", type=int, default=5, help="calls per round")
    p_matmul.add_argument("--repeats", type=int, default=5, help="rounds")
    p_h100 = sub.add_parser("h100", help="compile-only H100: one MoE layer per dispatch, and the recipe's step")
    p_h100.add_argument("--recipe", default="configs/moe_1b.py")
    p_h100.add_argument("--tokens", type=int, default=8192, help="the layer's tokens (4 sequences of 2048)")
    p_h100.add_argument("--devices", type=int, nargs="*", default=[1, 8], help="H100s for the recipe's step")
    p_h100.add_argument("--impls", nargs="+", default=None, help="dispatches (default: every one here)")
    p_h100.add_argument("--recipe_impls", nargs="+", default=None, help="the recipe's dispatches (default: --impls)")
    for p in (p_train, p_matmul, p_h100):
        p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
        p.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    args.overrides = dict(kv.split("=", 1) for kv in args.set)
    args.overrides_list = list(args.overrides.items())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_throughput's random_batch
    if args.part == "train" and args.impls is None:
        args.impls = impls_here()

    meta = metadata()
    print(f"# {meta['date']} | {meta['device']} | {meta['cpu']} ({meta['cores']} cores), load {meta['load_average']} "
          f"| {meta['versions']}", flush=True)
    if args.part == "train":
        results = train(args)
        print(table(results, ["variant", "impl", "params_m", "active_m", "compile_s", "step_ms", "spread_ms",
                              "tokens_per_s", "vs_dense", "dropped"]))
    elif args.part == "matmul":
        results = matmul(args)
        print(table(results, ["shape", "impl", "ms", "spread_ms", "routed_gflop", "program_gflop", "flops_ratio",
                              "routed_gflop_per_s"]))
    else:
        results = h100(args)
        print(table(results["layer"], ["impl", "program_gflop", "routed_gflop", "flops_ratio", "roofline_ms", "gemm_ms",
                                       "temp_mib", "custom_calls"]))
        print(table(results["recipe"], ["devices", "impl", "micro_batches", "remat", "planned_gib", "compiled_gib",
                                        "compiled_over_planned", "step_ms", "gemm_ms", "communication_ms", "exposed_ms",
                                        "program_tflop", "model_tflop", "roofline_mfu"]))
    meta["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"# load average after: {meta['load_average_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, part=args.part, args=sys.argv[1:], results=results), f, indent=1, default=str)


if __name__ == "__main__":
    main()
