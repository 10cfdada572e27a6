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
import math
import pathlib
import platform
import re
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])

OPTIONS = {  # name -> overrides, per device count (None: the option is not distinct there)
    "fsdp (recipe)": lambda n: {},
    "data parallel": lambda n: {"mesh.data": -1, "mesh.fsdp": 1},
    "zero-1": lambda n: {"mesh.data": -1, "mesh.fsdp": 1, "mesh.rules.opt_state": "data"},
    "fsdp x tensor": lambda n: {"mesh.fsdp": -1, "mesh.tensor": min(8, n // 2)},
    "fsdp x tensor + sp": lambda n: {"mesh.fsdp": -1, "mesh.tensor": min(8, n // 2), "mesh.rules.act_seq": "tensor"},
    # mesh.hybrid=host on hosts of 8 devices: data = hosts, fsdp = 8 (the same program as this mesh)
    "hybrid (8 per host)": lambda n: {"mesh.data": n // 8, "mesh.fsdp": 8} if n > 8 else None,
}

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")  # name = shape op(
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLS = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(shape: str) -> int:
    return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in re.findall(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]", shape))


def device_groups(line: str, num_devices: int) -> np.ndarray:
    """[groups, group size] device ids of a collective, from its replica_groups in any of XLA's forms."""
    ids = np.arange(num_devices)
    # mesh['a'=8,'b'=8][, device_ids=..] {'b'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]([^{]*)\{([^}]*)\}", line)
    if m:
        axes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        d = re.search(r"device_ids=\(\[([\d,]+)\]T\(([\d,]+)\)\)", m.group(2))
        if d:
            ids = ids.reshape([int(x) for x in d.group(1).split(",")]).transpose([int(x) for x in d.group(2).split(",")])
        grid = ids.ravel().reshape([size for _, size in axes])
        names = [k for k, _ in axes]
        inner = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        outer = [i for i in range(len(names)) if i not in inner]
        return grid.transpose(outer + inner).reshape(-1, max(math.prod(grid.shape[i] for i in inner), 1))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)  # iota form
    if m:
        grid = ids.reshape([int(x) for x in m.group(3).split(",")])
        if m.group(4):
            grid = grid.transpose([int(x) for x in m.group(4).split(",")])
        return grid.ravel().reshape(int(m.group(1)), int(m.group(2)))
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m and m.group(1) != "{}":
        return np.array([[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))])
    return ids.reshape(1, -1)


def collectives(hlo: str, num_devices: int, per_host: int = 8) -> dict[str, dict[str, float]]:
    """{op: {"count": executions per step, "bytes": bytes one device sends per step, "cross_host_bytes":
    those in groups that span hosts of `per_host` consecutive devices}} from HLO text."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.startswith(" "):
            computations[current].append(_COMMENT.sub("", line))
    # How many times each computation runs per step: callers' counts times while-loop trip counts.
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in computations.items():
        for line in lines:
            trips = int(m.group(1)) if (m := _TRIP.search(line)) else 1
            for kind, callee in _CALLS.findall(line):
                edges[name].append((callee, trips if kind in ("body", "condition") else 1))
            for group in _BRANCHES.findall(line):
                edges[name] += [(b.strip().lstrip("%"), 1) for b in group.split(",") if b.strip()]
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for callee, factor in edges.get(name, ()):
            if callee in computations:
                visit(callee, times * factor)

    visit(entry, 1)
    out = {op: {"count": 0, "bytes": 0.0, "cross_host_bytes": 0.0} for op in COLLECTIVES}
    for name, lines in computations.items():
        for line in lines:
            m = _INSTRUCTION.search(line)
            if not m:
                continue
            op = m.group(2).removesuffix("-start")  # async pairs (GPU): count the start
            if op not in COLLECTIVES or m.group(2).endswith("-done"):
                continue
            groups = device_groups(line, num_devices)
            size, g = shape_bytes(m.group(1)), groups.shape[1]
            if op == "all-reduce":
                sent = 2 * (g - 1) / g * size
            elif op == "reduce-scatter":
                sent = (g - 1) * size  # the result is 1/g of the operand
            elif op == "collective-permute":
                sent = size
            else:
                sent = (g - 1) / g * size
            out[op]["count"] += runs[name]
            out[op]["bytes"] += runs[name] * sent
            if any(len(set(group // per_host)) > 1 for group in groups):
                out[op]["cross_host_bytes"] += runs[name] * sent
    return out


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

    from jaxlm import config, train_setup

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
                    mesh="x".join(map(str, setup.derived.mesh_shape)),
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
