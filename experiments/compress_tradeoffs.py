"""What compression costs at 10M parameters: perplexity against bits (round to nearest vs GPTQ) and against
sparsity (magnitude vs Wanda), one-shot and after a short fine-tune.

A 10.5M-parameter Llama-style model (d_model 256, 10 layers, 4 heads, SwiGLU 768, vocabulary 4096) is
trained for 600 steps of 16 x 256 tokens on the built-in corpus (the Python standard library's source,
16 MB of it), then compressed by `python -m jaxlm.compress`'s own function, every projection of the
blocks (the embedding and the output layer stay in float32):

- quantized to int8, int4 and int3 (symmetric, groups of 128) by round to nearest and by GPTQ (128
  calibration windows of 256 tokens from the training split, damp 0.01, act-order);
- pruned to 25%, 50% and 75% unstructured and to 2:4, by magnitude (per matrix) and by Wanda (per output);
  each pruned model at 50%, 75% and 2:4 is then fine-tuned for 60 steps (its masks kept, constant learning
  rate 3e-4, the base's data) and evaluated again, beside the dense model fine-tuned the same way.

Every figure is the validation split's loss, perplexity and bits per byte (the same 200k tokens for every
model). Results: experiments/results/compress/ (results.csv, results.md, bits.png, sparsity.png).

    python experiments/compress_tradeoffs.py            # about 70 minutes on two CPU cores (35 to train the base)
    python experiments/compress_tradeoffs.py --quick    # a smoke test: 40 steps, fewer points
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "compress_tradeoffs"
RESULTS = ROOT / "experiments" / "results" / "compress"
MODEL = {"model.d_model": 256, "model.n_layers": 10, "model.n_heads": 4, "model.n_kv_heads": 4,
         "model.mlp_dim": 768, "model.vocab_size": 4096, "data.seq_len": 256, "data.global_batch_size": 16,
         "data.builtin_max_bytes": 16_000_000}


def sh(args: list[str]) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, cwd=ROOT, check=True)


def train_base(steps: int) -> pathlib.Path:
    run = RUNS / "base"
    flags = {**MODEL, "run.steps": steps, "run.eval_every": 0, "run.log_every": 50, "run.output_dir": RUNS,
             "run.name": "base", "optim.warmup_steps": min(50, steps // 4), "checkpoint.every_steps": 200}
    sh([sys.executable, "-m", "jaxlm.train", "--config=configs/tiny.py", *(f"--config.{k}={v}" for k, v in flags.items())])
    return run


def fine_tune(source: pathlib.Path, steps: int) -> pathlib.Path:
    name = source.name + "-tuned"
    flags = {**{k: v for k, v in MODEL.items() if k.startswith("data.")}, "run.init_from": source,
             "run.output_dir": RUNS, "run.name": name, "run.steps": steps, "run.eval_every": 0,
             "run.log_every": max(steps // 3, 1), "optim.schedule": "constant", "optim.warmup_steps": 0,
             "optim.peak_lr": 3e-4}
    sh([sys.executable, "-m", "jaxlm.train", "--config=configs/tiny.py", *(f"--config.{k}={v}" for k, v in flags.items())])
    return RUNS / name


def quality(run_dir: pathlib.Path, docs) -> dict:
    from jaxlm import evaluate, inference

    run = inference.load_run(run_dir)
    return evaluate.perplexity(run, docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 40 steps, fewer points")
    args = parser.parse_args()
    steps, tune_steps = (40, 4) if args.quick else (600, 60)
    bits = ["int4"] if args.quick else ["int8", "int4", "int3"]
    sparsities = [0.5] if args.quick else [0.25, 0.5, 0.75]
    started = time.time()
    base = RUNS / "base"
    if not (base / "checkpoints" / str(steps)).is_dir():
        base = train_base(steps)

    from jaxlm import evaluate, inference
    from jaxlm.compress import cli as compress

    run = inference.load_run(base)
    docs, _ = evaluate.corpus_documents(run, "val", max_tokens=200_000)
    rows = [{"method": "float32", "setting": "dense", "bits": 32, "sparsity": 0.0, "stage": "one-shot",
             **quality(base, docs), "seconds": 0.0, "weight_bytes": None}]

    def record(name: str, overrides: list[tuple[str, str]], bits_: int, sparsity: float, method: str, setting: str):
        out = RUNS / name
        if not (out / "compress_report.json").is_file():
            compress.compress_run(base, out, overrides, corpus="none", gen_tokens=0)
        report = json.loads((out / "compress_report.json").read_text())
        rows.append({"method": method, "setting": setting, "bits": bits_, "sparsity": sparsity, "stage": "one-shot",
                     **quality(out, docs), "seconds": report["seconds"], "weight_bytes": report["after"]["device_bytes"]})
        return out

    for fmt in bits:
        for method in ("rtn", "gptq"):
            record(f"{fmt}-{method}", [("compress.quantize", fmt), ("compress.method", method),
                                       ("compress.group", "128")], int(fmt[3:]), 0.0, method, f"{fmt} g128")
    tuned = []
    for criterion in ("magnitude", "wanda"):
        for sparsity in sparsities:
            out = record(f"{criterion}-{sparsity:g}", [("compress.sparsity", str(sparsity)),
                                                       ("compress.criterion", criterion)], 32, sparsity, criterion,
                         f"{sparsity:.0%} unstructured")
            if sparsity >= 0.5:
                tuned.append((out, criterion, sparsity, f"{sparsity:.0%} unstructured"))
        out = record(f"{criterion}-2of4", [("compress.sparsity", "0.5"), ("compress.pattern", "2:4"),
                                           ("compress.criterion", criterion)], 32, 0.5, criterion, "2:4")
        tuned.append((out, criterion, 0.5, "2:4"))
    # The control: the dense model fine-tuned the same way (it improves too: the comparison is against it).
    for out, criterion, sparsity, setting in [(base, "float32", 0.0, "dense"), *tuned]:
        run_dir = RUNS / (out.name + "-tuned")
        if not (run_dir / "checkpoints" / str(tune_steps)).is_dir():
            run_dir = fine_tune(out, tune_steps)
        rows.append({"method": criterion, "setting": setting, "bits": 32, "sparsity": sparsity,
                     "stage": f"+{tune_steps} steps", **quality(run_dir, docs), "seconds": None, "weight_bytes": None})
    write(rows, steps, tune_steps, time.time() - started, args.quick)


def write(rows: list[dict], steps: int, tune_steps: int, seconds: float, quick: bool) -> None:
    import jax

    out = RESULTS if not quick else RUNS / "results"
    out.mkdir(parents=True, exist_ok=True)
    keys = ["method", "setting", "bits", "sparsity", "stage", "loss", "perplexity", "bits_per_byte", "seconds",
            "weight_bytes"]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    base = rows[0]
    lines = ["# compress_tradeoffs", "", (__doc__ or "").split("\n\n")[0].replace("\n", " "), "",
             f"Base: {steps} steps; fine-tunes: {tune_steps} steps. Measured {datetime.date.today()} on "
             f"{jax.devices()[0].device_kind} ({os.cpu_count()} cores), jax {jax.__version__}; this invocation "
             f"{seconds / 60:.0f} minutes (runs already on disk are reused). Validation: {base['tokens']:,} tokens.", "",
             "loss - dense: against the float32 model at the same stage (one-shot: the trained model; after the "
             "fine-tune: the dense model fine-tuned the same way).", "",
             "| method | setting | stage | loss | perplexity | bits/byte | loss - dense | compress s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    dense = {r["stage"]: r["loss"] for r in rows if r["method"] == "float32"}
    for r in rows:
        lines.append(f"| {r['method']} | {r['setting'] or '-'} | {r['stage']} | {r['loss']:.4f} | {r['perplexity']:.2f} "
                     f"| {r['bits_per_byte']:.4f} | {r['loss'] - dense[r['stage']]:+.4f} | "
                     f"{'-' if r['seconds'] is None else format(r['seconds'], '.1f')} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(rows, out)


def plot(rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0]["perplexity"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in ("rtn", "gptq"):
        pts = sorted((r["bits"], r["perplexity"]) for r in rows if r["method"] == method)
        ax.plot(*zip(*pts), "o-", label=method.upper())
    ax.axhline(base, color="gray", ls="--", label="float32")
    ax.set(xlabel="bits per weight (groups of 128)", ylabel="validation perplexity", yscale="log",
           title="quantization: round to nearest vs GPTQ")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "bits.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in ("magnitude", "wanda"):
        for stage, style in (("one-shot", "o-"), (next((r["stage"] for r in rows if r["stage"].startswith("+")), ""),
                                                   "s--")):
            pts = sorted((r["sparsity"], r["perplexity"]) for r in rows
                         if r["method"] == method and r["setting"].endswith("unstructured") and r["stage"] == stage)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{method}, {stage}")
    ax.axhline(base, color="gray", ls="--", label="dense")
    tuned = [r["perplexity"] for r in rows if r["method"] == "float32" and r["stage"] != "one-shot"]
    if tuned:
        ax.axhline(tuned[0], color="gray", ls=":", label="dense, fine-tuned alike")
    ax.set(xlabel="sparsity (unstructured)", ylabel="validation perplexity", yscale="log",
           title="pruning: magnitude vs Wanda")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "sparsity.png", dpi=120)


if __name__ == "__main__":
    main()
