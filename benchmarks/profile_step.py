"""Where a recipe's train step spends its time, kernel by kernel, from one profiled step.

    python benchmarks/profile_step.py --recipe 1b --doc_len 512          # on a GPU: the step's kernels
    python benchmarks/profile_step.py --recipe tiny --set model.matmul=fp8 --json profile.json
    python benchmarks/profile_step.py --trace runs/tiny/profile    # a training run's own trace (profile.steps)

The step is compiled, run `--warmup` times, timed over `--steps` steps without the profiler, then run
once under `jax.profiler.trace` (a Perfetto trace; `--trace_dir` keeps it), or `--profiled` times, each
kernel then at the median of its launches (on a machine shared with other work). The trace's device events
are summed by kernel name: on a GPU the kernels of the `/device:GPU:*` streams (cuBLAS's and Triton's
GEMMs, cuDNN's attention, XLA's fusions, copies, NCCL's collectives), on a CPU the thunks XLA:CPU's
executor ran for the step's program (several at once on several cores: their sum can exceed the wall
time). Each kernel falls into a category by its name (`CATEGORIES`, first match): the table gives the
milliseconds per step of each, their share of the kernels' sum, and the largest kernels. This is the
measurement behind the H100 entries of benchmarks/BENCHMARKS.md ("where the step's time goes").
Batches are `benchmarks/mfu.py`'s (random tokens; `--doc_len`: documents packed in the rows).
Busy is the union of the device events' intervals against their span (first start to last end): with
`--trace`, a trace the trainer wrote (`--config.profile.steps=10:12`), where the device waits for the
host shows as busy well under the span.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (category, pattern on the kernel's name), first match wins; the names are cuBLAS's (nvjet_*, *gemm*),
# cuDNN's (cudnn_*, *fmha*, *sdpa*), NCCL's and XLA's own (loop_/input_ fusions on a GPU; the thunks'
# HLO names on a CPU: ynn_fusion and dot are its matmuls)
CATEGORIES = (
    ("attention", r"cudnn|fmha|flash|sdpa|attention"),
    ("collectives", r"nccl|all-?reduce|all-?gather|reduce-?scatter|all-?to-?all|collective-permute"),
    ("matmuls", r"nvjet|gemm|cutlass|cublas|xmma|^dot|ynn_fusion|onednn|matmul|convolution"),
    ("copies and transposes", r"memcpy|memset|copy|transpose"),
    ("reductions (input fusions)", r"^input_|reduce"),
    ("elementwise (loop fusions)", r"^loop_|^wrapped_|fusion"),
    ("other", r""),
)


def category(name: str) -> str:
    return next(label for label, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE))


def device_kernels(trace_file: str, module: str = "jit_step_fn",
                   steps: int = 1) -> tuple[dict[str, list[float]], str, dict]:
    """{kernel name: [total microseconds, count]} of the trace's device work, which kind it was ('gpu':
    events of the /device:GPU:* processes; 'cpu': XLA:CPU thunks of `module`), and {'busy_ms', 'span_ms'}.

    `steps` > 1: the trace holds that many steps, and each kernel's figures are one step's: its launches
    per step, each at the median of its launches' durations (a machine shared with other work stretches
    some launches many times over; the median of several steps does not see them); busy and span per step."""
    with gzip.open(trace_file) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in processes.items() if re.match(r"/device:GPU:\d+", name)}
    kernels: dict[str, list[float]] = {}
    durations: dict[str, list[float]] = collections.defaultdict(list)
    intervals = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        if gpu:
            if e["pid"] not in gpu:
                continue
        elif args.get("hlo_module") != module or not args.get("hlo_op"):
            continue
        durations[e["name"]].append(float(e.get("dur", 0)))
        intervals.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    for name, times in durations.items():
        per_step = len(times) // steps if len(times) % steps == 0 else round(len(times) / steps, 2)
        kernels[name] = [statistics.median(times) * per_step if steps > 1 else sum(times), per_step]
    busy = busy_and_span(intervals)
    return dict(kernels), "gpu" if gpu else "cpu", {k: round(v / steps, 3) for k, v in busy.items()}


def busy_and_span(intervals: list[tuple[float, float]]) -> dict[str, float]:
    """Milliseconds covered by at least one interval (microseconds in), and from the first start to the last end."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = (max(stop for _, stop in intervals) - min(start for start, _ in intervals)) if intervals else 0.0
    return {"busy_ms": round(busy / 1e3, 3), "span_ms": round(span / 1e3, 3)}


def trace_file(path: str) -> str:
    """`path` itself, or the newest Perfetto trace under it."""
    if os.path.isfile(path):
        return path
    files = sorted(glob.glob(os.path.join(path, "**", "*perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not files:
        raise SystemExit(f"profile_step.py: no *perfetto_trace.json.gz under {path} (a run writes one with "
                         f"--config.profile.steps=START:END)")
    return files[-1]


def summarize(kernels: dict[str, list[float]], top: int) -> dict:
    """Milliseconds per category and the `top` largest kernels."""
    by_category: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, (us, count) in kernels.items():
        entry = by_category[category(name)]
        entry[0] += us / 1e3
        entry[1] += count
    total = sum(ms for ms, _ in by_category.values())
    rows = [{"category": c, "ms": round(ms, 3), "share": round(ms / total, 4) if total else 0.0, "kernels": n}
            for c, (ms, n) in sorted(by_category.items(), key=lambda kv: -kv[1][0])]
    largest = [{"kernel": name, "category": category(name), "ms": round(us / 1e3, 3), "count": count}
               for name, (us, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"kernel_ms": round(total, 3), "categories": rows, "largest": largest}


def profile(recipe: str, overrides: dict[str, str], steps: int, warmup: int, doc_len: float, top: int,
            trace_dir: str | None, profiled: int = 1) -> dict:
    import jax

    sys.path.insert(0, HERE)
    from mfu import attention_choice, build

    _, overrides, setup, host = build(recipe, overrides, doc_len)
    batches = [setup.put_batch(b) for b in host]
    directory = trace_dir or tempfile.mkdtemp(prefix="jaxlm_profile_")
    state = setup.state
    with jax.set_mesh(setup.mesh):
        compiled = setup.train_step.lower(state, batches[0], attention_choice(setup, host)).compile()
        for i in range(max(1, warmup)):
            state, out = compiled(state, batches[i % 2])
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for i in range(steps):
            state, out = compiled(state, batches[i % 2])
        jax.block_until_ready(out)
        step_s = (time.perf_counter() - t0) / max(1, steps)
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for i in range(profiled):
                state, out = compiled(state, batches[i % 2])
                jax.block_until_ready(out)
            profiled_s = (time.perf_counter() - t0) / profiled
    kernels, kind, busy = device_kernels(trace_file(directory), steps=profiled)
    if trace_dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    device = jax.devices()[0]
    return {
        "recipe": recipe, "overrides": overrides, "doc_len": doc_len,
        "devices": f"{jax.device_count()}x {device.device_kind}", "jax": jax.__version__,
        "micro_batches": setup.cfg.optim.micro_batches, "step_s": round(step_s, 4),
        "profiled_step_s": round(profiled_s, 4), "profiled_steps": profiled, "events": kind, "loss": float(out["loss"]),
        **busy, **summarize(kernels, top),
    }


def table(result: dict) -> str:
    profiled = result.get("profiled_steps", 1)
    head = (f"{result['recipe']} on {result['devices']}, step {result['step_s']:.4f} s ("
            + (f"{profiled} profiled, each kernel at its median, per step: " if profiled > 1 else "one profiled: ")
            + f"{result['profiled_step_s']:.4f} s); " if "recipe" in result else f"{result['trace']} (every step in it): ")
    lines = [head + f"{result['events']} events: kernels {result['kernel_ms']:,.1f} ms, busy {result['busy_ms']:,.1f} "
             f"of {result['span_ms']:,.1f} ms",
             "| category | ms | share | kernels |", "|---|---:|---:|---:|"]
    lines += [f"| {r['category']} | {r['ms']:,.1f} | {100 * r['share']:.1f}% | {r['kernels']:,} |"
              for r in result["categories"]]
    lines += ["", "| largest kernels | category | ms | count |", "|---|---|---:|---:|"]
    lines += [f"| {k['kernel'][:70]} | {k['category']} | {k['ms']:,.1f} | {k['count']:,} |" for k in result["largest"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="1b")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--steps", type=int, default=3, help="steps timed without the profiler")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--doc_len", type=float, default=0,
                        help="documents of this mean length (tokens) packed in each row; 0 = one per row")
    parser.add_argument("--profiled", type=int, default=1,
                        help="steps under the profiler; above 1 each kernel is taken at the median of its launches")
    parser.add_argument("--top", type=int, default=15, help="largest kernels listed")
    parser.add_argument("--trace_dir", help="keep the trace here (default: a temporary directory, removed)")
    parser.add_argument("--trace", help="summarize this trace (a file, or the newest under a directory) instead")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.profiled < 1:
        parser.error(f"--profiled takes the number of steps to profile (1 or more), not {args.profiled}")
    if args.doc_len < 0:
        parser.error(f"--doc_len takes a mean document length in tokens (0: one document per row), not {args.doc_len:g}")
    if args.trace:
        path = trace_file(args.trace)
        kernels, kind, busy = device_kernels(path)
        if not kernels:
            raise SystemExit(f"profile_step.py: no device events of a train step in {path}")
        result = {"trace": path, "events": kind, **busy, **summarize(kernels, args.top)}
    else:
        result = profile(args.recipe, dict(kv.split("=", 1) for kv in args.set), args.steps, args.warmup,
                         args.doc_len, args.top, args.trace_dir, args.profiled)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
