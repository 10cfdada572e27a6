"""The multi-process path's overhead: the tiny recipe on 1 process x 8 CPU devices vs 2 processes x 4.

    python benchmarks/multiprocess_runs.py [--steps 40] [--json mp.json]

Both layouts run the real CLI (`python -m jaxlm.train`) on localhost, the two processes joined by
`--coordinator` and talking through the gloo collectives, with the same global batches
(data.shards=2) so their losses must agree. Reported: the median step time after the first
`--skip` steps (compilation and warm-up), tokens/s, and the largest loss difference. Also the host
time one process spends per step agreeing on stop and save steps with the other
(`jaxlm.distributed.StepAgreement`: one read of the coordinator's key-value store per step).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, steps: int, out: pathlib.Path, extra: list[str]) -> dict:
    argv = ["--config=configs/tiny.py", f"--config.run.output_dir={out}", f"--config.run.name={processes}proc",
            f"--config.run.steps={steps}", "--config.run.log_every=10", "--config.run.eval_every=0",
            "--config.checkpoint.every_steps=0", "--config.checkpoint.every_minutes=0", "--config.data.shards=2",
            "--config.metrics.progress=lines", "--config.run.compile_cache_dir=", *extra]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
    coordinator = f"127.0.0.1:{free_port()}"
    layout = (lambda i: [f"--coordinator={coordinator}", f"--num_processes={processes}", f"--process_id={i}"]
              ) if processes > 1 else (lambda i: [])
    start = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxlm.train", *argv, *layout(i)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    for p in procs:
        _, err = p.communicate(timeout=3600)
        if p.returncode:
            raise RuntimeError(f"{processes} process(es): exit {p.returncode}: {err[-2000:]}")
    records = [json.loads(line) for line in (out / f"{processes}proc" / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.time() - start, "records": [r for r in records if "loss" in r]}


def agreement_worker(port: int, process_id: int, steps: int) -> None:
    from jaxlm import distributed

    distributed.initialize_from(f"127.0.0.1:{port}", 2, process_id, timeout_s=60)
    agreement = distributed.StepAgreement()
    start = time.perf_counter()
    for step in range(steps):
        agreement.due("stop", step)
        agreement.due("save", step)
    print(json.dumps({"process": process_id, "us_per_step": (time.perf_counter() - start) / steps * 1e6}), flush=True)
    distributed.barrier("done")


def agreement_cost(steps: int) -> list[float]:
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, "--agreement_worker", str(port), str(i), str(steps)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) for i in range(2)]
    return [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])["us_per_step"] for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--set", nargs="*", default=[], help="--config overrides, key=value")
    parser.add_argument("--json", default=None)
    parser.add_argument("--agreement_worker", nargs=3, type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agreement_worker:
        return agreement_worker(*args.agreement_worker)
    from train_throughput import report

    extra = [f"--config.{kv}" for kv in args.set]
    results, losses = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for processes in (1, 2):
            r = run(processes, args.steps, pathlib.Path(tmp), extra)
            times = [x["step_time_s"] for x in r["records"][args.skip:]]
            losses[processes] = [x["loss"] for x in r["records"]]
            step_s = statistics.median(times)
            results.append({
                "layout": f"{processes} x {8 // processes} cpu", "steps": args.steps,
                "median_step_s": round(step_s, 4),
                "tokens_per_s": round(r["records"][0]["tokens_per_s"] * r["records"][0]["step_time_s"] / step_s, 1),
                "first_step_s": round(r["records"][0]["step_time_s"], 2), "wall_s": round(r["wall_s"], 1),
            })
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses[2], losses[1])]
    for row in results:
        row["max_rel_loss_diff_vs_1proc"] = f"{max(diffs):.1e}"
        row["rel_loss_diff_first_5"] = f"{max(diffs[:5]):.1e}"
    print(json.dumps({"losses": losses, "relative_differences": diffs}), file=sys.stderr, flush=True)
    us = agreement_cost(2000)
    import jax

    print(f"jax {jax.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; step agreement: {us[0]:.0f} us (process 0, hosts the coordinator) and "
          f"{us[1]:.0f} us (process 1) of host time per step")
    report(results, list(results[0]), args.json)


if __name__ == "__main__":
    main()
