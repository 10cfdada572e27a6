"""The H100 (or TPU) program of each recipe, compiled on this machine (no GPU, no TPU), and its roofline.

    make roofline                                          # installs .venv-h100 once, then the default set
    .venv-h100/bin/python benchmarks/roofline.py --recipe 1b --devices 1 8 --set optim.micro_batches=32
    .venv-h100/bin/python benchmarks/roofline.py --json roofline.json --top 20
    .venv-h100/bin/python benchmarks/roofline.py --recipe 125m --recipe 1b --devices 1 --snapshot-copy

For each (recipe, device count) the train step is compiled for compile-only H100s (XLA's own H100
description, `jaxlm.roofline.H100`) by `python -m jaxlm.plan --target=h100`'s code, with the
recipe's settings (`optim.micro_batches=0` resolved against the H100's 80 GB, as a run on one
would), and its optimized HLO is read kernel by kernel (`jaxlm.roofline`): per-device memory from
XLA's memory analysis; each kernel's time at its roof, max(FLOPs / 989 TFLOP/s, bytes / 3.35 TB/s),
times its launches per step; collectives at 450 GB/s per device within a host (NVLink) and 50 GB/s
between hosts, overlapped by the kernels scheduled between their start and done. The roofline-bound
MFU is the model's FLOPs over peak x (the kernels' sum + exposed communication): an upper bound of
what this program can reach, not a measurement. The program's matmul FLOPs are checked against the
model's count (exact, after cuDNN's recomputed scores) so the bound cannot be flattered by miscounting.

`--target=v5p|v5e|v6e` compiles for compile-only TPU chips instead (`make tpu-env`, then run it with
.venv-tpu/bin/python; `--devices` chips in Cloud's slice shape, `jaxlm.roofline.default_topology`), with
the chip's roofs (`jaxlm.roofline.TPU_V5P`, ...: Cloud's datasheet figures) and ICI across the slice:

    .venv-tpu/bin/python benchmarks/roofline.py --target v5p --recipe 1b --devices 8

`--snapshot-copy` compiles, instead of the train step, the copy of the train state that a checkpoint
save makes on the devices (`checkpoint.snapshot`): its kernels and roofline time.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: the CUDA plugin compiles without a GPU
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

DEFAULT = [("1b", 1), ("1b", 8), ("7b", 8)]


def versions() -> str:
    names = ("jax", "jaxlib", "jax-cuda13-plugin", "nvidia-cudnn-cu13", "libtpu")
    out = []
    for name in names:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def measure(recipe: str, devices: int, overrides: list[tuple[str, str]], top: int, target_name: str = "h100") -> dict:
    from jaxlm import config as config_lib
    from jaxlm import plan, roofline

    cfg = config_lib.load_recipe(recipe)
    config_lib.apply_overrides(cfg, overrides)
    config_lib.validate(cfg)
    started = time.perf_counter()
    target = roofline.TARGETS[target_name]
    platform = "tpu" if target.platform == "tpu" else "gpu"
    topology = roofline.default_topology(target, devices) if platform == "tpu" else None
    report = plan.plan(cfg, devices, target.memory_bytes, platform=platform, compile=True, target=target,
                       topology=topology)
    compiled = report["compiled"]
    r = compiled["roofline"]
    r["largest"] = r["largest"][:top]
    return dict(
        recipe=recipe, devices=devices, topology=topology, overrides=dict(overrides), mesh=report["mesh"],
        micro_batches=report["micro_batches"], remat=report["remat"], attention=compiled["attention"],
        per_device_bytes=compiled["per_device_bytes"], temp_bytes=compiled["temp_bytes"],
        cudnn_workspace_bytes=compiled.get("cudnn_workspace_bytes", 0),
        compile_s=compiled["compile_s"], seconds=round(time.perf_counter() - started, 1),
        flops_check=dict(program=r["matmul_flops"], model=r["model_flops"], recomputed_scores=r["attention_recompute_flops"],
                         other=r["matmul_flops"] - r["model_flops"] - r["attention_recompute_flops"]),
        roofline=r,
    )


def snapshot_copy(recipe: str, devices: int, overrides: list[tuple[str, str]]) -> dict:
    """The state copy of `checkpoint.snapshot=device` compiled for `devices` H100s: per-device bytes,
    kernels by kind, roofline seconds."""
    from jaxlm import checkpoint, hlo, plan, roofline, train_setup
    from jaxlm import config as config_lib

    cfg = config_lib.load_recipe(recipe)
    config_lib.apply_overrides(cfg, overrides)
    setup = train_setup.build(cfg, plan.target_devices(roofline.H100, devices), abstract=True)
    stored = checkpoint._stored(setup.state)
    compiled = checkpoint._device_copy.lower(stored).compile()
    analysis = compiled.memory_analysis()
    kernels = roofline.kernels(hlo.Module(compiled.as_text()), roofline.H100, devices)
    kinds: dict[str, int] = {}
    for k in kernels:
        kinds[k.kind] = kinds.get(k.kind, 0) + k.runs
    return dict(recipe=recipe, devices=devices, output_bytes=analysis.output_size_in_bytes,
                temp_bytes=analysis.temp_size_in_bytes, kernels=kinds,
                seconds=sum(k.total_seconds for k in kernels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", action="append", help="recipe(s); default: 1b on 1 and 8, 7b on 8")
    parser.add_argument("--devices", type=int, nargs="+", default=None, help="device counts for --recipe")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    parser.add_argument("--top", type=int, default=8, help="largest kernels to list per program")
    parser.add_argument("--json", default="", help="write every figure here")
    parser.add_argument("--target", default="h100", help="h100 (default), or a TPU: v5e, v5p, v6e (`make tpu-env`)")
    parser.add_argument("--snapshot-copy", action="store_true",
                        help="compile the checkpoint's on-device state copy instead of the train step")
    args = parser.parse_args()
    runs = [(r, n) for r in args.recipe for n in (args.devices or [1, 8])] if args.recipe else DEFAULT
    overrides = [tuple(kv.split("=", 1)) for kv in args.set]

    from jaxlm import config as config_lib
    from jaxlm import roofline, xla_flags

    def run_settings(recipe: str):
        cfg = config_lib.load_recipe(recipe)
        config_lib.apply_overrides(cfg, overrides)
        return cfg.run

    # XLA reads its flags once, when JAX starts (and libtpu its own, as it loads): the recipes measured together
    # must agree on theirs
    flags = {run_settings(recipe).xla_flags for recipe, _ in runs}
    if len(flags) > 1:
        sys.exit(f"these recipes set different run.xla_flags ({sorted(flags)}); measure them in separate runs")
    print(f"XLA_FLAGS={xla_flags.apply(flags.pop())}", flush=True)
    libtpu = {run_settings(recipe).libtpu_flags for recipe, _ in runs}
    if len(libtpu) > 1:
        sys.exit(f"these recipes set different run.libtpu_flags ({sorted(libtpu)}); measure them in separate runs")
    if args.target != "h100":
        print(f"LIBTPU_INIT_ARGS={xla_flags.apply_libtpu(libtpu.pop())}", flush=True)
    if args.target not in roofline.TARGETS:
        sys.exit(f"--target={args.target}: use one of {', '.join(roofline.TARGETS)}")
    target = roofline.TARGETS[args.target]
    tpu = target.platform == "tpu"
    if tpu:
        roofline.quiet_libtpu()  # before libtpu loads: no warnings about the TPU VM this machine is not
    if args.snapshot_copy and tpu:
        sys.exit("--snapshot-copy compiles for H100s only")
    try:
        roofline.target_devices(target, 1)
    except Exception as e:
        env = "tpu" if tpu else "h100"
        sys.exit(f"benchmarks/roofline.py --target={args.target} needs XLA's {'TPU' if tpu else 'CUDA'} compiler: "
                 f"`make {env}-env`, then run it with .venv-{env}/bin/python ({type(e).__name__})")
    what = f"TPU {target.name} chips" if tpu else "H100 SXM"
    header = (f"{datetime.date.today()}, compiled on {platform.processor() or platform.machine()} "
              f"({os.cpu_count()} cores) for compile-only {what}; {versions()}")
    print(header, flush=True)
    results = []
    for recipe, devices in runs:
        if args.snapshot_copy:
            res = snapshot_copy(recipe, devices, overrides)
            results.append(res)
            print(f"{recipe} on {devices} H100: state copy {res['output_bytes'] / 2**30:.2f} GiB per device, "
                  f"temporaries {res['temp_bytes'] / 2**30:.3f} GiB, kernels {res['kernels']}, "
                  f"roofline {res['seconds'] * 1e3:.2f} ms", flush=True)
            continue
        res = measure(recipe, devices, overrides, args.top, args.target)
        results.append(res)
        r = res["roofline"]
        kinds = ", ".join(f"{k} {v['seconds'] * 1e3:.0f}" for k, v in list(r["by_kind"].items())[:6])
        where = f"{res['topology']} ({target.name})" if tpu else f"{devices} H100"
        print(f"\n{recipe} on {where} ({' x '.join(f'{k}={v}' for k, v in res['mesh'].items())}), "
              f"{res['micro_batches']} micro-batches, remat={res['remat']}, attention {res['attention']}: "
              f"{res['per_device_bytes'] / 2**30:.1f} GiB per device; roofline step {r['step_seconds'] * 1e3:.0f} ms "
              f"(matmuls {r['matmul_seconds'] * 1e3:.0f}, "
              f"other kernels {(r['compute_seconds'] - r['matmul_seconds']) * 1e3:.0f}, exposed communication "
              f"{r['exposed_communication_seconds'] * 1e3:.0f} of {r['communication_seconds'] * 1e3:.0f}); "
              + (f"roofline-bound MFU {r['roofline_mfu']:.3f}" if r["roofline_mfu"] is not None
                 else f"no roofline-bound MFU ({r['incomplete']})"), flush=True)
        print(f"  ms by kind: {kinds}")
        fc = res["flops_check"]
        print(f"  FLOPs per device: program {fc['program'] / 1e12:.2f} T = model {fc['model'] / 1e12:.2f} T + cuDNN's "
              f"recomputed scores {fc['recomputed_scores'] / 1e12:.2f} T + other {fc['other'] / 1e12:.2f} T "
              f"(remat's recomputation, or a miscount)")
        print(f"  compiled in {res['compile_s']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, results=results), f, indent=1, default=float)


if __name__ == "__main__":
    main()
