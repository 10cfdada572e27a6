"""MFU harness: a recipe's compiled train step, timed after warm-up, with a sweep over config keys.

    python benchmarks/mfu.py --recipe 1b                                  # one H100: the MFU issue's number
    python benchmarks/mfu.py --recipe 1b --sweep data.global_batch_size=8,16 model.remat=none,dots
    python benchmarks/mfu.py --recipe tiny --steps 3 --set data.global_batch_size=8   # CPU smoke run
    python benchmarks/mfu.py --recipe 1b --doc_len 512   # rows packed with documents (mean 512 tokens)
    python benchmarks/mfu.py --recipe 1b --sweep "run.xla_flags=,--xla_gpu_enable_triton_gemm=false"  # vs XLA's defaults

Per configuration: compile time (the first step), mean step time over `--steps` steps after
`--warmup` steps (the loop never syncs inside the timed window), tokens/s, model TFLOP/s per device
(FLOPs from `flops_per_token`: all matmuls + causal attention, no remat), MFU against the device's
dense bf16 peak (`jaxlm.metrics.PEAK_BF16_FLOPS`, or `--peak_tflops`; unknown device -> n/a), and
peak memory (the device's own counter where it has one, else the compiled step's memory analysis).
Batches are random tokens, one document per row, or with `--doc_len` documents of exponential length
packed in each row as the data pipeline packs them (attention within documents; cuDNN's packed layout
on Hopper, `attention_masked` in the results says whether the masked kernel ran instead); the model
FLOPs count causal attention over whole rows either way, as MFU conventionally does.
A sweep is the cartesian product of its `key=v1,v2` lists; each point runs in its own process, so an
out-of-memory point is reported as such and the sweep goes on. The table of all points is printed
last; `--json` writes the full results.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def packed_batch(batch: dict, doc_len: float, seed: int) -> dict:
    """`batch` with its rows cut into documents of exponential length (mean `doc_len` tokens,
    `benchmarks/attention.py`'s generator): segment ids per document, positions restarting at each."""
    from attention import packed_rows

    segment_ids = packed_rows(*batch["segment_ids"].shape, doc_len, 0, seed)
    index = np.arange(segment_ids.shape[1])
    starts = np.concatenate([np.ones((len(segment_ids), 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {**batch, "segment_ids": segment_ids, "positions": positions.astype(np.int32)}


def build(recipe: str, overrides: dict[str, str], doc_len: float = 0) -> tuple:
    """(config, the overrides applied, `train_setup.build`'s setup, two host batches of random tokens) for
    a recipe in this process: the run's XLA flags set first, CPU_OVERRIDES under the given ones on a CPU,
    and with `doc_len` > 0 the rows packed with documents (`packed_batch`). Shared with profile_step.py."""
    import jax

    sys.path.insert(0, HERE)
    from train_throughput import CPU_OVERRIDES, random_batch

    from jaxlm import config, train_setup, xla_flags

    cfg = config.load_recipe(recipe)
    if "run.xla_flags" in overrides:  # before JAX starts its backends (jax.default_backend() below)
        xla_flags.apply(overrides["run.xla_flags"])
    if jax.default_backend() == "cpu":
        overrides = {**{k: str(v) for k, v in CPU_OVERRIDES.get(recipe, {}).items()}, **overrides}
    config.apply_overrides(cfg, list(overrides.items()))
    setup = train_setup.build(cfg)
    per_process = cfg.data.global_batch_size // jax.process_count()
    host = [random_batch(per_process, cfg.data.seq_len, cfg.model.vocab_size, i) for i in range(2)]
    if doc_len:
        host = [packed_batch(b, doc_len, i) for i, b in enumerate(host)]
    return cfg, overrides, setup, host


def attention_choice(setup, host: list[dict]):
    """The train step's attention kernel for these host batches, as the trainer chooses it (cuDNN's
    packed layout where every row of both fits: `TrainSetup.attention_choice`)."""
    return setup.attention_choice({"segment_ids": np.concatenate([b["segment_ids"] for b in host])})


def measure(recipe: str, overrides: dict[str, str], steps: int, warmup: int, peak_tflops: float,
            doc_len: float = 0, hlo: str | None = None) -> dict:
    """One configuration, in this process; `doc_len` > 0: documents of that mean length packed in each row
    (attention within documents only; 0: one document per row); `hlo`: write the compiled step's HLO
    text there (gzipped), to set beside the compile-only program `jaxlm.plan --target` reads."""
    import jax

    from jaxlm import metrics
    from jaxlm.models.transformer import flops_per_token, param_count
    from jaxlm.plan import CUDNN_WORKSPACE

    cfg, overrides, setup, host = build(recipe, overrides, doc_len)
    d = cfg.data
    segments = max(int((np.diff(b["segment_ids"], axis=1) != 0).sum(axis=1).max()) + 1 for b in host)
    batches = [setup.put_batch(b) for b in host]
    device = jax.devices()[0]
    before = metrics.device_memory(device)  # the state and two batches on the device, nothing compiled yet
    state = setup.state
    with jax.set_mesh(setup.mesh):
        t0 = time.perf_counter()
        compiled = setup.train_step.lower(state, batches[0], attention_choice(setup, host)).compile()
        compile_s = time.perf_counter() - t0
        for i in range(warmup):
            state, out = compiled(state, batches[i % 2])
        if warmup:
            jax.block_until_ready(out)
        t0 = time.perf_counter()
        for i in range(steps):
            state, out = compiled(state, batches[i % 2])
        jax.block_until_ready(out)
        step_s = (time.perf_counter() - t0) / steps
    loss = float(out["loss"])
    tokens = d.global_batch_size * d.seq_len
    flops = flops_per_token(setup.model_cfg, d.seq_len) * tokens
    n = jax.device_count()
    peak = metrics.peak_flops(device.device_kind, peak_tflops * 1e12)
    util = metrics.mfu(flops / tokens, tokens / step_s, n, peak)
    memory = metrics.device_memory(device)
    analysis = compiled.memory_analysis()
    compiled_bytes = None if analysis is None else (
        analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes)
    text = compiled.as_text()
    workspaces = [int(n) for n in CUDNN_WORKSPACE.findall(text)]
    if hlo:
        with gzip.open(hlo, "wt") as f:
            f.write(text)
    if memory:
        peak_bytes, memory_source = memory["peak_memory_bytes"], "device"
    else:
        peak_bytes, memory_source = compiled_bytes, "compiled"
    return {
        "recipe": recipe,
        "overrides": overrides,
        "params_m": round(param_count(setup.model_cfg)["total"] / 1e6, 2),
        "batch": f"{d.global_batch_size}x{d.seq_len}",
        "micro_batches": setup.cfg.optim.micro_batches,  # as resolved (optim.micro_batches=0: as few as fit)
        "remat": cfg.model.remat,
        "attention": setup.model_cfg.attention,
        "xla_flags": cfg.run.xla_flags,
        "devices": f"{n}x {device.device_kind}",
        "compile_s": round(compile_s, 2),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops_per_device": round(flops / step_s / n / 1e12, 3),
        "mfu": None if util is None else round(util, 4),
        "peak_memory_gib": round(peak_bytes / 2**30, 3),
        "memory_source": memory_source,
        # what the device held before the step compiled (state and batches), and XLA's own figure for the
        # compiled step (arguments + outputs - aliases + temporaries): with the device's peak they show
        # what the real program adds to the compile-only one `jaxlm.plan --target` reads
        "state_memory_gib": None if before is None else round(before["memory_bytes"] / 2**30, 3),
        "compiled_memory_gib": None if compiled_bytes is None else round(compiled_bytes / 2**30, 3),
        # of which XLA's temporaries (activations, gradients, workspaces), and the cuDNN calls' workspaces
        # summed (each call's own; XLA may share the bytes): a compile-only program has them all empty
        "temp_memory_gib": None if analysis is None else round(analysis.temp_size_in_bytes / 2**30, 3),
        "cudnn_workspace_gib": round(sum(workspaces) / 2**30, 3),
        "cudnn_calls": len(workspaces),
        "doc_len": doc_len,
        "segments_per_row_max": segments,
        # cuDNN's packed layout: the fraction of micro-batches that fell back to the document mask
        "attention_masked": float(out["attention_masked"]) if "attention_masked" in out else None,
        "loss": loss,
        "status": "ok",
    }


def sweep_points(sweep: list[str]) -> list[dict[str, str]]:
    """['a=1,2', 'b=x,y'] -> the 4 combinations as {key: value} dicts."""
    axes = []
    for item in sweep:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise SystemExit(f"mfu.py: --sweep takes key=v1,v2,...; got {item!r}")
        axes.append([(key, v) for v in values.split(",")])
    return [dict(point) for point in itertools.product(*axes)] or [{}]


def run_isolated(args: argparse.Namespace, overrides: dict[str, str]) -> dict:
    """One configuration in a child process (a crash or out-of-memory is reported, not fatal)."""
    command = [sys.executable, os.path.abspath(__file__), "--recipe", args.recipe, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--peak_tflops", str(args.peak_tflops), "--doc_len", str(args.doc_len), "--one",
               "--set", *[f"{k}={v}" for k, v in overrides.items()]]
    result = subprocess.run(command, capture_output=True, text=True)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    error = (result.stderr.strip().splitlines() or ["no output"])[-1]
    oom = "RESOURCE_EXHAUSTED" in result.stderr or "out of memory" in result.stderr.lower()
    status = "out of memory" if oom else "error"
    return {"recipe": args.recipe, "overrides": overrides, "status": f"{status}: {error[:200]}"}


COLUMNS = ["batch", "micro_batches", "remat", "attention", "compile_s", "step_s", "tokens_per_s", "tflops_per_device", "mfu",
           "peak_memory_gib", "compiled_memory_gib", "status"]


def table(results: list[dict], swept: list[str]) -> str:
    swept = [k for k in swept if k.rpartition(".")[2] not in COLUMNS]  # shown in their own column anyway
    cols = swept + COLUMNS
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        cells = []
        for c in cols:
            value = r["overrides"].get(c, r.get(c)) if c in swept else r.get(c)
            if c == "mfu" and isinstance(value, float):
                value = f"{100 * value:.1f}%"
            cells.append("" if value is None and c != "mfu" else "n/a" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="1b")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every point")
    parser.add_argument("--sweep", nargs="*", default=[], metavar="KEY=V1,V2", help="keys to sweep (cartesian product)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak_tflops", type=float, default=0.0, help="per-device peak; 0 = the device table")
    parser.add_argument("--doc_len", type=float, default=0,
                        help="documents of this mean length (tokens) packed in each row; 0 = one per row")
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--hlo", help="write the compiled step's HLO text to this file, gzipped (one point only)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one point, JSON out
    args = parser.parse_args(argv)
    if args.doc_len < 0:
        parser.error(f"--doc_len takes a mean document length in tokens (0: one document per row), not {args.doc_len:g}")
    base = dict(kv.split("=", 1) for kv in args.set)
    if args.one:
        print(json.dumps(measure(args.recipe, base, args.steps, args.warmup, args.peak_tflops, args.doc_len)))
        return 0
    if "run.xla_flags" in base:  # before the header below starts JAX; the points' processes inherit them
        from jaxlm import xla_flags

        xla_flags.apply(base["run.xla_flags"])
    import jax

    print(f"# {time.strftime('%Y-%m-%d')} | {args.recipe} | jax {jax.__version__} | "
          f"{jax.devices()[0].device_kind} x{jax.device_count()} | python {platform.python_version()}")
    points = [{**base, **point} for point in sweep_points(args.sweep)]
    results = []
    for overrides in points:
        result = run_isolated(args, overrides) if len(points) > 1 else measure(
            args.recipe, overrides, args.steps, args.warmup, args.peak_tflops, args.doc_len, args.hlo)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print()
    print(table(results, [item.partition("=")[0] for item in args.sweep]))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
