"""Each optimizer's share of the train step on H100s, compiled on this machine (no GPU).

    .venv-h100/bin/python benchmarks/optimizer_share.py                       # 1b on 8: adamw, muon gather, sharded
    .venv-h100/bin/python benchmarks/optimizer_share.py --recipe 1b --devices 8 --variant optim.name=lion

For each variant (config overrides) the recipe's train step is compiled for compile-only H100s as
`python -m jaxlm.plan --target=h100` compiles it, and its kernels are read at their roofline
(`jaxlm.roofline`): the optimizer's share is the time of the kernels whose source line is in
jaxlm/optim/ (collectives: the part of their time not covered by other kernels) over the step's
roofline time. The parameter update itself (`p + u`, in jaxlm/steps.py) is not counted in it; the
step's time against AdamW's is printed beside it.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: the CUDA plugin compiles without a GPU
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import time  # noqa: E402

VARIANTS = ["optim.name=adamw", "optim.name=muon,optim.muon_layout=gather", "optim.name=muon,optim.muon_layout=sharded"]
OPTIM_SOURCE = "jaxlm/optim/"


def measure(recipe: str, devices: int, variant: str) -> dict:
    from jaxlm import config as config_lib
    from jaxlm import hlo, plan, roofline, train_setup
    from jaxlm.models import transformer

    cfg = config_lib.load_recipe(recipe)
    config_lib.apply_overrides(cfg, [tuple(kv.split("=", 1)) for kv in variant.split(",") if kv])
    config_lib.validate(cfg)
    started = time.perf_counter()
    setup = train_setup.build(cfg, plan.target_devices(roofline.H100, devices), abstract=True)
    with roofline.kernel_checks_for(roofline.H100):
        compiled = setup.compile_train_step("expected")
    kernels = roofline.kernels(hlo.Module(compiled.as_text()), roofline.H100, devices)
    tokens = setup.derived.tokens_per_step
    model_flops = transformer.flops_per_token(setup.model_cfg, cfg.data.seq_len) * tokens / devices
    summary = roofline.summarize(kernels, roofline.H100, model_flops)
    mine = [k for k in kernels if OPTIM_SOURCE in k.source]
    collective = [k for k in mine if k.kind in hlo.COLLECTIVES]
    compute_s = sum(k.total_seconds for k in mine if k not in collective)
    exposed_s = sum(k.exposed_seconds * k.runs for k in collective)
    by_kind: dict[str, float] = {}
    for k in mine:
        by_kind[k.kind] = by_kind.get(k.kind, 0.0) + k.total_seconds
    return dict(variant=variant, step_s=summary["step_seconds"], optimizer_s=compute_s + exposed_s,
                optimizer_gemm_tflop=sum(k.flops * k.runs for k in mine if k.kind == "gemm") / 1e12,
                optimizer_comm_gb=sum(k.comm_bytes * k.runs for k in collective) / 1e9,
                collective_s=sum(k.total_seconds for k in collective), by_kind=by_kind,
                micro_batches=setup.cfg.optim.micro_batches, mfu=summary["roofline_mfu"],
                seconds=round(time.perf_counter() - started, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="1b")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--variant", action="append", help="comma-separated KEY=VALUE overrides, repeatable")
    args = parser.parse_args()
    base = None
    for variant in args.variant or VARIANTS:
        r = measure(args.recipe, args.devices, variant)
        base = base or r["step_s"]
        kinds = ", ".join(f"{k} {s * 1e3:.1f}" for k, s in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]))
        print(f"{args.recipe} on {args.devices} H100, {variant} ({r['micro_batches']} micro-batches): step "
              f"{r['step_s'] * 1e3:.1f} ms ({r['step_s'] / base - 1:+.1%} against the first), MFU {r['mfu'] or 0:.3f}; "
              f"optimizer {r['optimizer_s'] * 1e3:.1f} ms = {r['optimizer_s'] / r['step_s']:.1%} of the step "
              f"(its GEMMs {r['optimizer_gemm_tflop']:.2f} TFLOP, collectives {r['optimizer_comm_gb']:.2f} GB sent "
              f"in {r['collective_s'] * 1e3:.1f} ms; ms by kind: {kinds}) [{r['seconds']} s]", flush=True)


if __name__ == "__main__":
    main()
