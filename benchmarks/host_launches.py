"""What the host launches per train step of the H100 program, compiled here (no GPU needed).

XLA's GPU runtime walks a compiled program's thunks on the host: each kernel, cuDNN or cuBLAS call and
copy is one launch, except those gathered into a command buffer (a CUDA graph), launched once as a
whole; a loop's body is walked once per iteration; a conditional first copies its predicate to the
host and waits for the device to reach it (a host wait), then walks one branch. When a step's
kernels are small (a small model) the host's walk, not the device, sets the step's pace. This script
compiles a recipe's train step for compile-only H100s (the H100 compiler environment, `make
h100-env`), asks XLA for the thunk sequence it would run (`xla_dump_to`, as a compile option) and
counts per step: host launches (command buffers count 1), the kernels they hold, and host waits.
Loops are counted at XLA's known trip counts; a conditional at its expected (last) branch, as the
roofline does.

    .venv-h100/bin/python benchmarks/host_launches.py --recipe tiny --devices 1 [key=value ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
LABEL = re.compile(r"^\s*(condition|body|false_branch|true_branch|branch_\d+):\s*$")


def thunk_names(metadata: str) -> dict[int, str]:
    """thunk id -> the HLO instruction it runs (`profile_annotation`), from XLA's thunk metadata dump."""
    out = {}
    for block in metadata.split("thunk_metadata {")[1:]:
        name, tid = re.search(r'profile_annotation: "([^"]*)"', block), re.search(r"thunk_id: (\d+)", block)
        if name and tid:
            out[int(tid.group(1))] = name.group(1)
    return out


def count(sequence: str, trips: dict[int, int]) -> dict[str, int]:
    """Per step, from XLA's `thunk_sequence_after_thunk_passes` dump: host launches, kernels launched
    (inside command buffers too) and host waits; `trips`: a while thunk's id -> its trip count."""
    lines = [line for line in sequence.splitlines() if line.strip()]

    def block(i: int, depth: int, runs: int, in_graph: bool) -> tuple[int, dict[str, int]]:
        """Count the thunks at indentation `depth` from line i on; returns the next line to read."""
        totals = dict(launches=0, kernels=0, waits=0)
        while i < len(lines):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if indent < depth:
                break
            m = THUNK.match(line)
            if indent > depth or not m:  # a structured thunk's parts are read by its own case below
                i += 1
                continue
            kind = m.group(3)
            i += 1
            if kind == "kCommandBuffer":
                totals["launches"] += 0 if in_graph else runs
                i, inner = block(i, _indent(lines, i), runs, True) if _deeper(lines, i, indent) else (i, {})
                totals["kernels"] += inner.get("kernels", 0)
                totals["waits"] += inner.get("waits", 0)
                continue
            if kind in ("kWhile", "kConditional"):
                parts: dict[str, tuple[int, dict]] = {}
                # its parts' labels follow (XLA writes a nested loop's "condition:" unindented)
                while i < len(lines) and (label := LABEL.match(lines[i])):
                    if label.group(1) in parts or (kind == "kWhile") != (label.group(1) in ("condition", "body")):
                        break
                    start = i + 1
                    end, inner = block(start, _indent(lines, start), 1, in_graph)
                    parts[label.group(1)] = (end, inner)
                    i = end
                if kind == "kWhile":
                    n = trips.get(int(m.group(2)), 1)
                    chosen = [parts.get("body", (0, {}))[1]]
                else:
                    n = 1
                    names = [p for p in parts if p != "false_branch"] or list(parts)
                    chosen = [parts[names[-1]][1]] if parts else []
                    totals["waits"] += runs
                for inner in chosen:
                    for key in totals:
                        totals[key] += inner.get(key, 0) * runs * n
                continue
            if kind == "kDynamicSliceFusion":  # one launch of its fused copy or kernel
                while i < len(lines) and _indent(lines, i) > indent:
                    i += 1
            totals["launches"] += 0 if in_graph else runs
            totals["kernels"] += runs
        return i, totals

    return block(0, 0, 1, False)[1]


def _indent(lines: list[str], i: int) -> int:
    return len(lines[i]) - len(lines[i].lstrip()) if i < len(lines) else -1


def _deeper(lines: list[str], i: int, indent: int) -> bool:
    return i < len(lines) and _indent(lines, i) > indent


def measure(recipe: str, num_devices: int, overrides: list[tuple[str, str]]) -> dict:
    import jax

    from jaxlm import config, hlo, roofline, train_setup

    cfg = config.load_recipe(recipe)
    config.apply_overrides(cfg, overrides)
    config.validate(cfg)
    setup = train_setup.build(cfg, roofline.target_devices(roofline.H100, num_devices), abstract=True)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), setup.state)
    with tempfile.TemporaryDirectory(prefix="jaxlm_thunks_") as directory:
        with jax.set_mesh(setup.mesh), roofline.cudnn_checks_for(roofline.H100):
            lowered = setup.train_step.lower(state, setup.batch_spec(), setup.expected_attention_choice())
            compiled = lowered.compile({"xla_dump_to": directory, "xla_dump_hlo_module_re": "step_fn"})
        (sequence,) = glob.glob(os.path.join(directory, "*step_fn.thunk_sequence_after_thunk_passes.txt"))
        (metadata,) = glob.glob(os.path.join(directory, "*step_fn.thunk_metadata.txt"))
        sequence, names = open(sequence).read(), thunk_names(open(metadata).read())
    module = hlo.Module(compiled.as_text())
    whiles = {i["name"]: i for i in module.instructions() if i["op"] == "while"}
    trips = {}
    for tid, name in names.items():
        if name in whiles:
            m = hlo.TRIP.search(whiles[name]["attrs"])
            trips[tid] = int(m.group(1)) if m else 1
    return {"recipe": recipe, "devices": num_devices, "overrides": dict(overrides),
            "micro_batches": setup.cfg.optim.micro_batches, **count(sequence, trips),
            "host_syncs_hlo": module.host_syncs()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. model.scan_unroll=1)")
    args = parser.parse_args()
    overrides = [tuple(o.split("=", 1)) for o in args.overrides]
    print(json.dumps(measure(args.recipe, args.devices, overrides)))


if __name__ == "__main__":
    main()
