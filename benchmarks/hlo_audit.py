"""HLO audit of a recipe's train step: matmul dtypes, copies, transposes and collectives.

    python benchmarks/hlo_audit.py                                        # 1b, its real batch, 1 device
    python benchmarks/hlo_audit.py --set data.global_batch_size=64 --json audit.json --hlo_dir hlo/
    python benchmarks/hlo_audit.py --recipe tiny --set model.dtype=float32 --lowered_only

The train step is lowered and compiled ahead of time with an abstract state (nothing allocated) on
`--devices` devices (1 by default; fake CPU devices unless there are that many accelerators), and
two modules are read:

1. The lowered module (before any XLA pass, the same for every platform, read as HLO text): every
   matmul (`dot`) with its operand and result dtypes and the dot algorithm, counted in the program
   text and per step (times the trip counts of the loops around it: scanned layers, micro-batches,
   loss chunks), with its FLOPs and the source line that made it. Dtypes are read here because
   XLA:CPU's own passes upcast bf16 dots to float32, so the optimized CPU module says nothing about
   what a GPU will be asked to multiply. A float32 operand in a bf16-compute recipe is listed with
   its shapes; a dot whose algorithm is `dot_bf16_bf16_f32` rounds its operands to bf16 (float32
   accumulation) whatever their storage dtype, so it is listed apart from true float32 matmuls.
2. The optimized module of the same step: copies, transposes and collectives, counted per step.
   A copy or transpose is "materialized" when it is its own instruction outside a fusion, or a
   fusion whose root is one (a pass over memory that writes the bytes listed); the ones inside
   other fusions are index arithmetic of a bigger kernel. Each is labelled by what it reads: a
   step input (the donated state, the batch), a broadcast (the zero-filled buffer that a scan's
   stacked outputs start from), a loop's carried value, or a computed value. On a CPU host this is
   XLA:CPU's pipeline (its layout assignment, fusion and copy insertion), not XLA:GPU's: it shows
   what the program asks for and where loops carry big buffers, not the GPU's kernels.

A summary table is printed last; `--json` writes everything (every materialized copy and
transpose with what it reads), `--hlo_dir` both modules' text.
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

from jaxlm.hlo import COLLECTIVES, Module, shape_bytes
from jaxlm.hlo import dims_attr as _dims
from jaxlm.hlo import dtype_dims as _dtype_dims
from jaxlm.hlo import format_shape as _fmt

BF16_ALGORITHMS = ("dot_bf16_bf16_f32", "dot_bf16_bf16_f32_x1", "dot_bf16_bf16_bf16")
WIDE_DTYPES = ("f32", "f64")
# Float32-operand dots we know to be deliberate: (what they are, predicate on a dot record).
DELIBERATE = [
    ("attention scores' backward in jax.nn.dot_product_attention(implementation='xla'): the float32 "
     "d(scores) times bf16 q or k, computed as BF16_BF16_F32 (jax issue 24047); on GPU "
     "model.attention=auto picks cuDNN and these dots are not in the program",
     lambda d: d["algorithm"] in BF16_ALGORITHMS and "BTNH,BSNH->BNTS" in d["op_name"]),
]


# ----------------------------------------------------------------------------- 1. matmuls (lowered)


def matmuls(module: Module) -> list[dict]:
    """Every dot of a module: dtypes, shapes, algorithm, FLOPs per execution, executions per step."""
    out = []
    for inst in module.instructions():
        if inst["op"] != "dot":
            continue
        (lhs_t, lhs), (rhs_t, rhs) = (_dtype_dims(module.shapes.get(o, "?")) for o in inst["operands"][:2])
        res_t, res = _dtype_dims(inst["shape"])
        contracted = math.prod(lhs[d] for d in _dims(inst["attrs"], "lhs_contracting_dims"))
        algorithm = m.group(1) if (m := re.search(r"\balgorithm=([\w]+)", inst["attrs"])) else ""
        op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', inst["attrs"])) else ""
        out.append(dict(
            name=inst["name"], lhs=_fmt(lhs_t, lhs), rhs=_fmt(rhs_t, rhs), result=_fmt(res_t, res),
            lhs_dtype=lhs_t, rhs_dtype=rhs_t, result_dtype=res_t, algorithm=algorithm, op_name=op_name,
            flops=2 * math.prod(res) * contracted, executions=module.runs.get(inst["computation"], 0),
            source=module.source(inst["attrs"]),
        ))
    return out


def matmul_report(dots: list[dict]) -> dict:
    groups: dict[str, dict] = {}
    for d in dots:
        key = f"{d['lhs_dtype']} x {d['rhs_dtype']} -> {d['result_dtype']}"
        key += f" [{d['algorithm']}]" if d["algorithm"] else ""
        g = groups.setdefault(key, dict(in_text=0, per_step=0, flops_per_step=0))
        g["in_text"] += 1
        g["per_step"] += d["executions"]
        g["flops_per_step"] += d["flops"] * d["executions"]
    total_flops = sum(g["flops_per_step"] for g in groups.values())
    for g in groups.values():
        g["flops_share"] = g["flops_per_step"] / total_flops if total_flops else 0.0
    wide = []
    for d in dots:
        if d["lhs_dtype"] in WIDE_DTYPES or d["rhs_dtype"] in WIDE_DTYPES:
            why = next((text for text, match in DELIBERATE if match(d)), "")
            wide.append({**d, "bf16_algorithm": d["algorithm"] in BF16_ALGORITHMS, "deliberate": why})
    return dict(
        dots_in_text=len(dots), dots_per_step=sum(d["executions"] for d in dots), flops_per_step=total_flops,
        by_dtype=dict(sorted(groups.items(), key=lambda kv: -kv[1]["flops_per_step"])),
        f32_operand=wide,
        f32_operand_in_text=len(wide),
        f32_operand_per_step=sum(d["executions"] for d in wide),
        f32_operand_flops_per_step=sum(d["flops"] * d["executions"] for d in wide),
        # float32 operands with no bf16 dot algorithm: the ones a GPU multiplies in float32 (or TF32)
        f32_matmuls_in_text=sum(not d["bf16_algorithm"] for d in wide),
        f32_matmuls_per_step=sum(d["executions"] for d in wide if not d["bf16_algorithm"]),
        unexplained_f32_operand_in_text=sum(not d["deliberate"] for d in wide),
    )


# ----------------------------------------------------------------------------- 2. copies (optimized)


def _fused_body(module: Module, inst: dict) -> tuple[list[dict], dict | None]:
    """A fusion's fused computation and its root instruction."""
    callee = module.callee(inst)
    body = module.computations.get(callee, [])
    return body, next((i for i in body if i["root"]), None)


def _origin(module: Module, by_name: dict[str, dict], name: str) -> str:
    """What a copy or transpose reads: a step input (the donated state or the batch), a broadcast
    (the zero-filled buffer a scan's stacked outputs start from), a loop's carried value, ..."""
    inst = by_name.get(name)
    if inst is None:
        return name
    if inst["op"] == "parameter" and inst["computation"] == module.entry:
        label = m.group(1) if (m := re.search(r'op_name="([^"]*)"', inst["attrs"])) else name
        return "step input " + label.replace("\\'", "'")
    if inst["op"] == "fusion" and (root := _fused_body(module, inst)[1]) and root["op"] == "broadcast":
        return "broadcast"
    return inst["op"]


def _category(origin: str) -> str:
    if origin.startswith("step input"):
        return "step input (state or batch)"
    names = {"broadcast": "broadcast (buffer init)", "get-tuple-element": "loop carry (get-tuple-element)"}
    return names.get(origin, "a computed value")


def data_movement(module: Module, top: int) -> dict:
    """Copies, transposes and collectives of an optimized module, per step."""
    kinds = ("copy", "transpose")
    out = {k: dict(instructions=0, materialized_in_text=0, materialized_per_step=0, bytes_per_step=0) for k in kinds}
    by_origin: dict[str, dict] = {}
    collectives = {op: dict(in_text=0, per_step=0) for op in COLLECTIVES}
    by_name = {i["name"]: i for i in module.instructions()}
    materialized = []
    for inst in module.instructions():
        op, fused = inst["op"], inst["computation"] in module.fused
        runs = module.runs.get(inst["computation"], 0)
        base = op.removesuffix("-start")
        if base in COLLECTIVES and not op.endswith("-done"):
            collectives[base]["in_text"] += 1
            collectives[base]["per_step"] += runs
        if op in ("copy", "copy-start", "transpose"):
            out["transpose" if op == "transpose" else "copy"]["instructions"] += 1
        if fused:
            continue
        kind = None
        if op in ("copy", "copy-start", "transpose"):
            kind = "transpose" if op == "transpose" else "copy"
        elif op == "fusion":
            body, root = _fused_body(module, inst)
            if root and root["op"] in ("copy", "transpose"):
                kind = "transpose" if any(i["op"] == "transpose" for i in body) else "copy"
        if kind is None:
            continue
        size = shape_bytes(inst["shape"])
        out[kind]["materialized_in_text"] += 1
        out[kind]["materialized_per_step"] += runs
        out[kind]["bytes_per_step"] += size * runs
        origin = _origin(module, by_name, inst["operands"][0]) if inst["operands"] else ""
        group = by_origin.setdefault(f"{kind} of {_category(origin)}", dict(in_text=0, per_step=0, bytes_per_step=0))
        group["in_text"] += 1
        group["per_step"] += runs
        group["bytes_per_step"] += size * runs
        op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', inst["attrs"])) else ""
        materialized.append(dict(kind=kind, name=inst["name"], shape=inst["shape"].split("{")[0], bytes=size,
                                 executions=runs, bytes_per_step=size * runs, computation=inst["computation"],
                                 origin=origin, op_name=op_name, source=module.source(inst["attrs"])))
    materialized.sort(key=lambda r: (-r["bytes"], -r["executions"], r["name"]))
    return dict(copies_transposes=out, by_origin=dict(sorted(by_origin.items(), key=lambda kv: -kv[1]["bytes_per_step"])),
                collectives=collectives, largest=materialized[:top], materialized=materialized)


# ----------------------------------------------------------------------------- driver


def _gb(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e12:.3g} TB"
    return f"{n / 1e9:.3g} GB" if n >= 1e7 else f"{n / 1e6:.3g} MB" if n >= 1e4 else f"{n:.0f} B"


def audit(recipe: str, overrides: list[tuple[str, str]], num_devices: int, top: int, lowered_only: bool,
          hlo_dir: str | None) -> dict:
    import jax
    import numpy as np

    from jaxlm import axes, config, memory, plan, train_setup
    from jaxlm.models.transformer import flops_per_token

    cfg = config.load_recipe(recipe)
    config.apply_overrides(cfg, overrides)
    cfg = memory.for_gpus(cfg, num_devices)  # micro_batches=0 as on 80 GB GPUs, not as the host's memory allows
    setup = train_setup.build(cfg, devices=plan.compile_devices(num_devices), abstract=True)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), setup.state)
    start = time.perf_counter()
    with jax.set_mesh(setup.mesh):
        lowered = setup.train_step.lower(state, setup.batch_spec(), setup.expected_attention_choice())
    lower_s = time.perf_counter() - start
    pre_text = lowered.as_text(dialect="hlo", debug_info=True)
    pre = Module(pre_text, trip_counts_from="condition")
    m, d = setup.model_cfg, cfg.data
    tokens = d.global_batch_size * d.seq_len
    model_flops = flops_per_token(m, d.seq_len) * tokens
    causal_half = 6 * m.n_layers * d.seq_len * m.n_heads * m.head_dim * tokens  # XLA runs the masked half too
    device = setup.mesh.devices.flat[0]
    result = dict(
        recipe=recipe, overrides=dict(overrides), devices=f"{num_devices}x {device.device_kind}",
        pipeline=f"XLA:{device.platform.upper()}",
        mesh=axes.describe(setup.derived.mesh_shape), batch=f"{d.global_batch_size}x{d.seq_len}",
        micro_batches=cfg.optim.micro_batches, remat=cfg.model.remat, attention=m.attention,
        dtype=np.dtype(m.dtype).name, param_dtype=cfg.model.param_dtype, lower_s=round(lower_s, 1),
        matmuls=matmul_report(matmuls(pre)), unknown_trip_counts_lowered=pre.unknown_trip_counts,
        model_matmul_flops_per_step=model_flops + causal_half,
    )
    result["matmuls"]["flops_vs_model"] = result["matmuls"]["flops_per_step"] / (model_flops + causal_half)
    if hlo_dir:
        pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(hlo_dir) / "lowered.hlo").write_text(pre_text)
    if lowered_only:
        return result
    start = time.perf_counter()
    compiled = lowered.compile()
    result["compile_s"] = round(time.perf_counter() - start, 1)
    opt_text = compiled.as_text()
    if hlo_dir:
        (pathlib.Path(hlo_dir) / f"optimized_{device.platform}.hlo").write_text(opt_text)
    opt = Module(opt_text, trip_counts_from="backend_config")
    result["optimized"] = out = data_movement(opt, top)
    out["unknown_trip_counts"] = opt.unknown_trip_counts
    optimized_dots = matmuls(opt)
    out["dots_in_text"] = len(optimized_dots)
    out["f32_operand_dots_in_text"] = sum(
        x["lhs_dtype"] in WIDE_DTYPES or x["rhs_dtype"] in WIDE_DTYPES for x in optimized_dots)
    analysis = compiled.memory_analysis()
    out["temp_gib"] = round(analysis.temp_size_in_bytes / 2**30, 2)
    out["argument_gib"] = round(analysis.argument_size_in_bytes / 2**30, 2)
    return result


def report(r: dict, top: int = 10) -> str:
    """The detail lists, then one summary table (last)."""
    mm, lines, where = r["matmuls"], [], f"optimized, {r['pipeline']}"
    lines.append(f"## {r['recipe']} {r['batch']} ({r['micro_batches']} micro-batches, remat {r['remat']}, "
                 f"attention {r['attention']}, dtype {r['dtype']}), {r['devices']}, mesh {r['mesh']}")
    if r["pipeline"] == "XLA:CPU":
        lines.append("")
        lines.append("The optimized module is XLA:CPU's (its layout assignment, fusion, copy insertion and bf16 -> f32 "
                     "dot upcasts), not XLA:GPU's.")
    lines.append("")
    lines.append("### Matmuls by dtype (lowered module, before XLA's passes)")
    lines.append("")
    lines.append("| lhs x rhs -> result [algorithm] | in program text | per step | TFLOP per step | share of matmul FLOPs |")
    lines.append("|---|---|---|---|---|")
    for key, g in mm["by_dtype"].items():
        lines.append(f"| {key} | {g['in_text']} | {g['per_step']} | {g['flops_per_step'] / 1e12:.4g} | "
                     f"{100 * g['flops_share']:.2f}% |")
    lines.append("")
    lines.append("### Matmuls with a float32 operand (lowered module)")
    lines.append("")
    if not mm["f32_operand"]:
        lines.append("none")
    for x in mm["f32_operand"][:top]:
        lines.append(f"- `{x['lhs']} x {x['rhs']} -> {x['result']}` algorithm={x['algorithm'] or 'default'}, "
                     f"{x['executions']} per step, {x['flops'] * x['executions'] / 1e12:.4g} TFLOP per step; "
                     f"op `{x['op_name']}`; {x['source']}")
        lines.append(f"  - {'deliberate: ' + x['deliberate'] if x['deliberate'] else 'NOT EXPLAINED: a float32 matmul'}")
    if len(mm["f32_operand"]) > top:
        lines.append(f"- ... {len(mm['f32_operand']) - top} more (--top, --json)")
    opt = r.get("optimized")
    if opt:
        lines.append("")
        lines.append(f"### Largest materialized copies and transposes (optimized module, {r['pipeline']})")
        lines.append("")
        lines.append("| kind | shape | bytes | per step | in computation | reads | op_name | source |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for x in opt["largest"]:
            lines.append(f"| {x['kind']} | `{x['shape']}` | {_gb(x['bytes'])} | {x['executions']} | {x['computation']} | "
                         f"{x['origin']} | {x['op_name'][-60:]} | {x['source'].split(' ')[0]} |")
    lines.append("")
    rows = [
        ("matmuls (dot): in program text / per step", "lowered", f"{mm['dots_in_text']} / {mm['dots_per_step']}"),
        ("matmul TFLOP per step (vs the model's count incl. the masked attention half)", "lowered",
         f"{mm['flops_per_step'] / 1e12:.4g} ({mm['flops_vs_model']:.4f}x)"),
    ]
    rows += [(f"matmuls {key}: in text / per step / FLOP share", "lowered",
              f"{g['in_text']} / {g['per_step']} / {100 * g['flops_share']:.2f}%") for key, g in mm["by_dtype"].items()]
    rows += [
        ("matmuls with a float32 operand: in text / per step / FLOP share", "lowered",
         f"{mm['f32_operand_in_text']} / {mm['f32_operand_per_step']} / "
         f"{100 * mm['f32_operand_flops_per_step'] / max(mm['flops_per_step'], 1):.2f}%"),
        ("... of which float32 matmuls (no bf16 dot algorithm): in text / per step", "lowered",
         f"{mm['f32_matmuls_in_text']} / {mm['f32_matmuls_per_step']}"),
        ("... of which not explained as deliberate", "lowered", str(mm["unexplained_f32_operand_in_text"])),
        ("loops whose trip count could not be read (counted once)", "lowered", str(r["unknown_trip_counts_lowered"])),
    ]
    if opt:
        for kind in ("copy", "transpose"):
            c = opt["copies_transposes"][kind]
            rows.append((f"{kind}: instructions in text / materialized in text / materialized per step / bytes per step",
                         where, f"{c['instructions']} / {c['materialized_in_text']} / "
                         f"{c['materialized_per_step']} / {_gb(c['bytes_per_step'])}"))
        rows += [(f"{key}: in text / per step / bytes per step", where,
                  f"{g['in_text']} / {g['per_step']} / {_gb(g['bytes_per_step'])}") for key, g in opt["by_origin"].items()]
        if opt["largest"]:
            x = opt["largest"][0]
            rows.append(("largest materialized copy/transpose", where,
                         f"{x['kind']} `{x['shape']}` {_gb(x['bytes'])} x {x['executions']} per step"))
        for op, c in opt["collectives"].items():
            rows.append((f"{op}: in text / per step", where, f"{c['in_text']} / {c['per_step']}"))
        rows.append((f"dots with a float32 operand after {r['pipeline']}'s passes (XLA:CPU upcasts bf16 dots)", where,
                     f"{opt['f32_operand_dots_in_text']} of {opt['dots_in_text']}"))
        rows.append(("compile time", r["pipeline"], f"{r['compile_s']} s"))
    lines.append("| check | module | value |")
    lines.append("|---|---|---|")
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="1b")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--devices", type=int, default=1,
                        help="devices to compile for (fake CPU devices unless there are enough accelerators)")
    parser.add_argument("--top", type=int, default=10, help="largest copies/transposes to list")
    parser.add_argument("--lowered_only", action="store_true", help="matmul dtypes only: skip XLA's compile")
    parser.add_argument("--json", help="write the full audit to this file")
    parser.add_argument("--hlo_dir", help="write the lowered and optimized HLO text here")
    args = parser.parse_args(argv)

    from jaxlm import plan  # no backend started yet: the CPU device count can still be set

    plan.use_cpu_devices(args.devices)
    import jax

    overrides = [tuple(kv.split("=", 1)) for kv in args.set]
    print(f"# {time.strftime('%Y-%m-%d')} | {args.recipe} | jax {jax.__version__} | {jax.default_backend()} | "
          f"python {platform.python_version()}", flush=True)
    result = audit(args.recipe, overrides, args.devices, args.top, args.lowered_only, args.hlo_dir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(report(result, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
