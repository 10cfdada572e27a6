"""The memory planner's analytic figures against the compiled train step, for recipes on a few meshes.

    python benchmarks/memory_plan.py                          # the cases below, on fake CPU devices
    python benchmarks/memory_plan.py --cases 7b:64 "1b:8:mesh.data=2,mesh.fsdp=4" --json plan.json
    .venv-h100/bin/python benchmarks/memory_plan.py --target h100   # the GPU program, compile-only H100s

A case is `recipe:devices[:key=value,...]`. For each: the analytic per-device estimate as planned
for GPUs (`jaxlm.memory.estimate`, cuDNN attention, bf16 activations) and its verdict against
`--device_memory_gib`; the train step compiled ahead of time on that many devices (fake CPU devices
unless there are enough accelerators; an abstract state, nothing allocated) with XLA's per-device
figure (arguments + outputs - aliases + temporaries); and the analytic estimate of that same
program (on CPU: XLA attention, float32 activations), with compiled / analytic.

`--target h100` (`make h100-env` first) compiles the real GPU program for compile-only H100s
instead (`TARGET_CASES` by default: the recipes at the micro-batches the planner picks and at
others), whose figure adds the cuDNN workspace a real GPU would give the program
(`jaxlm.plan.cudnn_workspace_estimate`), against the GPU plan itself.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

CASES = (
    "125m:8",
    "125m:8:mesh.data=2,mesh.fsdp=4",
    "125m:8:model.remat=full",
    "1b:8",
    "1b:8:mesh.data=2,mesh.fsdp=4",
    "1b:8:model.remat=full",
    "7b:8",
    "7b:8:mesh.fsdp=4,mesh.tensor=2",
    "7b:64",
    "7b:64:mesh.data=8,mesh.fsdp=8",
)
TARGET_CASES = (
    "125m:1", "125m:1:optim.micro_batches=2", "125m:8", "125m:8:model.vocab_size=16000",
    "350m:1", "1b:1", "1b:1:optim.micro_batches=16", "1b:1:optim.micro_batches=64", "1b:8",
    "1b:8:optim.micro_batches=4", "1b:1:model.remat=dots_mlp", "1b:8:model.remat=dots_mlp", "7b:8",
)


def parse_case(case: str) -> tuple[str, int, dict[str, str]]:
    recipe, devices, *rest = case.split(":", 2)
    overrides = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest and rest[0] else {}
    return recipe, int(devices), overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=None, help="recipe:devices[:key=value,...]")
    parser.add_argument("--target", choices=["h100"], default=None,
                        help="compile the GPU program for compile-only devices of this kind (no GPU needed)")
    parser.add_argument("--device_memory_gib", type=float, default=80.0)
    parser.add_argument("--no_compile", action="store_true", help="analytic figures only")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.cases = args.cases or list(TARGET_CASES if args.target else CASES)
    cases = [parse_case(c) for c in args.cases]

    import jax

    from jaxlm import memory, plan, roofline  # start no JAX backend: the CPU device count can still be set

    if args.target:  # compile-only devices: JAX itself runs on the CPU (the plugin needs no GPU then)
        jax.config.update("jax_platforms", "cpu")
    else:
        plan.use_cpu_devices(max(n for _, n, _ in cases))

    from jaxlm import axes, config

    gib = memory.GIB
    results = []
    for (recipe, n, overrides), case in zip(cases, args.cases):
        cfg = config.load_recipe(recipe)
        config.apply_overrides(cfg, list(overrides.items()))
        cfg = memory.for_gpus(cfg, n, args.device_memory_gib)  # micro_batches=0 as on those GPUs
        target = memory.estimate(cfg, n, platform="gpu")
        row = {
            "case": case,
            "mesh": axes.describe(target.mesh_shape),
            "remat": cfg.model.remat,
            "micro_batches": cfg.optim.micro_batches,
            "per_device_batch": target.per_device_batch,
            "gpu_analytic_gib": round(target.per_device_bytes / gib, 2),
            "fits": target.per_device_bytes <= args.device_memory_gib * gib,
        }
        if not args.no_compile:
            kind = roofline.TARGETS[args.target] if args.target else None
            devices = plan.target_devices(kind, n) if kind else plan.compile_devices(n)
            compiled = plan.compiled_memory(cfg, devices, kind)
            act_bytes = memory.cpu_act_bytes() if compiled["platform"] == "cpu" else None
            same = memory.estimate(cfg, n, platform=compiled["platform"], act_bytes=act_bytes)
            row.update(
                compiled_on=f"{n}x {compiled['device_kind'] if kind else compiled['platform']}",
                analytic_same_gib=round(same.per_device_bytes / gib, 2),
                compiled_gib=round(compiled["per_device_bytes"] / gib, 2),
                compiled_args_gib=round(compiled["argument_bytes"] / gib, 2),
                compiled_temp_gib=round(compiled["temp_bytes"] / gib, 2),
                **({"cudnn_workspace_gib": round(compiled["cudnn_workspace_bytes"] / gib, 2)} if kind else {}),
                ratio=round(compiled["per_device_bytes"] / same.per_device_bytes, 3),
                compile_s=compiled["compile_s"],
            )
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"jax {jax.__version__}, Python {platform.python_version()}, {jax.device_count()} {jax.default_backend()} devices")
    cols = list(results[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    from jaxlm.errors import UserError

    try:
        main()
    except UserError as e:  # e.g. --target without `make h100-env`: one line that says what to do
        sys.exit(f"memory_plan: error: {e}")
