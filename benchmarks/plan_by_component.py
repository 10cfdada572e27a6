"""The memory plan against the compiled train step, per registered MLP and remat policy.

    JAXLM_TEST_FAST_COMPILE=1 python benchmarks/plan_by_component.py            # tiny, one CPU device
    python benchmarks/plan_by_component.py --recipe 125m --widths 0 --remat none dots

For each MLP of `jaxlm.models.mlps.MLPS`, hidden width (`model.mlp_dim`; 0 = the MLP's default) and
remat policy: the train step compiled on this machine's first device and its per-device figure
against the analytic plan of the same program (`jaxlm.memory.estimate`, CPU activations), printed as
a Markdown table of compiled / analytic. Results: benchmarks/BENCHMARKS.md ("the plan by MLP").
"""

from __future__ import annotations

import argparse

import jax

from jaxlm import memory, plan
from jaxlm.config import recipe
from jaxlm.models.mlps import MLPS


def ratio(recipe_name: str, mlp: str, width: int, remat: str) -> float:
    cfg = recipe(recipe_name, model__mlp=mlp, model__mlp_dim=width, model__remat=remat)
    report = plan.plan(cfg, 1, 80 * memory.GIB, compile=True, devices=jax.devices()[:1])
    analytic = memory.estimate(cfg, 1, platform="cpu", act_bytes=memory.cpu_act_bytes()).per_device_bytes
    return report["compiled"]["per_device_bytes"] / analytic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--widths", type=int, nargs="+", default=[0, 384])
    parser.add_argument("--remat", nargs="+", default=["none", "dots", "dots_mlp", "full"])
    args = parser.parse_args()
    columns = [(mlp, width) for mlp in MLPS for width in args.widths]
    print("| remat | " + " | ".join(f"{mlp} ({width or 'default'})" for mlp, width in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for remat in args.remat:
        cells = [f"{ratio(args.recipe, mlp, width, remat):.3f}" for mlp, width in columns]
        print(f"| {remat} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
