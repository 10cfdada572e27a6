"""Communication per train step implied by the compiled HLO, per parallelism option.

    python benchmarks/communication.py                        # 7b on 8 and 64 devices, every option
    python benchmarks/communication.py --recipe tiny --devices 8 --json comm.json

For each option the train step is compiled ahead of time (an abstract state, nothing allocated) on
that many devices (fake CPU devices unless there are enough accelerators) and every collective in
the optimized HLO is counted, times the trip count of the loops around it (scanned layers,
micro-batches). Bytes are what one device sends per step with ring algorithms:

    all-reduce       2 (g - 1) / g x size          all-gather      (g - 1) / g x result size
    reduce-scatter   (g - 1) / g x operand size    all-to-all      (g - 1) / g x size
    collective-permute  size                       (g = devices in the collective's group)

Caveat: XLA's CPU pipeline has no reduce-scatter creation, so a reduce-scatter (FSDP's and ZeRO-1's
gradient reduction) appears as an all-reduce followed by a slice and is counted at twice its GPU
cost; GPU pipelines also combine and overlap collectives differently. The figures compare the
options' programs as GSPMD partitions them, not a GPU's wire bytes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import re
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from jaxlm import hlo  # noqa: E402
from jaxlm.hlo import COLLECTIVES, device_groups, shape_bytes  # noqa: E402,F401  (the tests use them from here)

OPTIONS = {  # name -> overrides, per device count (None: the option is not distinct there)
    "fsdp (recipe)": lambda n: {},
    "data parallel": lambda n: {"mesh.data": -1, "mesh.fsdp": 1},
    "zero-1": lambda n: {"mesh.data": -1, "mesh.fsdp": 1, "mesh.rules.opt_state": "data"},
    "fsdp x tensor": lambda n: {"mesh.fsdp": -1, "mesh.tensor": min(8, n // 2)},
    "fsdp x tensor + sp": lambda n: {"mesh.fsdp": -1, "mesh.tensor": min(8, n // 2), "mesh.rules.act_seq": "tensor"},
    # mesh.hybrid=host on hosts of 8 devices: data = hosts, fsdp = 8 (the same program as this mesh)
    "hybrid (8 per host)": lambda n: {"mesh.data": n // 8, "mesh.fsdp": 8} if n > 8 else None,
    # context parallelism over 8 devices (data over the rest): the keys and values all-gathered (and their
    # gradients reduce-scattered), or passed round the ring by collective permutes; the balanced layout's
    # reorders are collective permutes too
    "context 8 (allgather)": lambda n: {"mesh.data": n // 8, "mesh.fsdp": 1, "mesh.context": 8,
                                        "model.context_attention": "allgather"},
    "context 8 (ring)": lambda n: {"mesh.data": n // 8, "mesh.fsdp": 1, "mesh.context": 8,
                                   "model.context_attention": "ring"},
}

def collectives(hlo_text: str, num_devices: int, per_host: int = 8) -> dict[str, dict[str, float]]:
    """{op: {"count": executions per step, "bytes": bytes one device sends per step, "cross_host_bytes":
    those in groups that span hosts of `per_host` consecutive devices}} from HLO text (`jaxlm.hlo`)."""
    return hlo.Module(hlo_text).collectives(num_devices, per_host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="7b")
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), help=f"of: {', '.join(OPTIONS)}")
    parser.add_argument("--set", nargs="*", default=[], help="key=value overrides for every case")
    parser.add_argument("--json", default=None)
    parser.add_argument("--hlo_dir", default=None, help="also write each compiled HLO here")
    parser.add_argument("--per_host", type=int, default=8, help="devices per host, for cross_host_gb")
    args = parser.parse_args()

    from jaxlm import memory, plan  # no backend started yet: the CPU device count can still be set

    plan.use_cpu_devices(max(args.devices))
    import jax
    from train_throughput import report

    from jaxlm import axes, config, train_setup

    results = []
    sets = [tuple(kv.split("=", 1)) for kv in args.set]
    for n in args.devices:
        # micro_batches=0 resolved once, as the recipe's own mesh would on 80 GB GPUs, and kept for
        # every option, so that the options compare the same program
        base = config.load_recipe(args.recipe)
        config.apply_overrides(base, sets)
        micro = memory.for_gpus(base, n).optim.micro_batches
        for name in args.options:
            overrides = OPTIONS[name](n)
            if overrides is None:
                continue
            cfg = config.load_recipe(args.recipe)
            config.apply_overrides(cfg, sets + list(overrides.items()) + [("optim.micro_batches", micro)])
            row = {"recipe": args.recipe, "devices": n, "option": name}
            try:
                start = time.time()
                setup = train_setup.build(cfg, devices=plan.compile_devices(n), abstract=True)
                hlo = setup.compile_train_step().as_text()
                ops = collectives(hlo, n, args.per_host)
                if args.hlo_dir:
                    name_ = re.sub(r"\W+", "_", f"{args.recipe}_{n}_{name}").strip("_")
                    pathlib.Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                    (pathlib.Path(args.hlo_dir) / f"{name_}.hlo").write_text(hlo)
                row.update(
                    mesh=axes.describe(setup.derived.mesh_shape),
                    micro_batches=cfg.optim.micro_batches,
                    **{f"{op}_n": ops[op]["count"] for op in COLLECTIVES},
                    **{f"{op}_gb": float(f"{ops[op]['bytes'] / 1e9:.4g}") for op in COLLECTIVES},
                    total_gb=float(f"{sum(o['bytes'] for o in ops.values()) / 1e9:.4g}"),
                    cross_host_gb=float(f"{sum(o['cross_host_bytes'] for o in ops.values()) / 1e9:.4g}"),
                    state_gib_per_device=round(memory.tree_bytes(setup.state)[0] / 2**30, 2),
                    compile_s=round(time.time() - start, 1),
                )
            except Exception as e:  # noqa: BLE001 -- one failing option does not stop the others
                row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"jax {jax.__version__}, Python {platform.python_version()}, {jax.default_backend()} devices; "
          f"GB one device sends per step")
    cols = ["devices", "option", "mesh", "all-reduce_n", "all-reduce_gb", "all-gather_n", "all-gather_gb",
            "reduce-scatter_gb", "all-to-all_gb", "collective-permute_gb", "total_gb", "cross_host_gb",
            "state_gib_per_device"]
    report([{c: r.get(c, r.get("error", "") if c == "mesh" else "") for c in cols} for r in results], cols, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
