"""nanoGPT's own char-level Shakespeare CPU recipe run whole, beside the same recipe through `jaxlm.train`.

    python benchmarks/nanogpt_run.py --nanogpt_dir ~/nanoGPT --corpus input.txt
    python benchmarks/nanogpt_run.py --sides jax --corpus input.txt --jax-set model.dtype=bfloat16

The nanoGPT side is its README's command for a CPU (4 layers, width 128, 4 heads, context 64, batch 12,
2,000 iterations, no dropout, no torch.compile, 20 evaluation batches every 250 iterations), run from a
checkout of nanoGPT (`--nanogpt_dir`, not part of jaxlm) on `--corpus` (tinyshakespeare's input.txt, which
its data/shakespeare_char/prepare.py splits 90/10 and encodes one character per token). The jaxlm side is
the same model, batch, schedule (warmup 100, cosine from 1e-3 to 1e-4 over the 2,000 steps, AdamW b2 0.99,
weight decay 0.1, clipping 1.0) and evaluation cadence, on the same text with jaxlm's byte tokenizer (the
text is ASCII: one token per character, as nanoGPT's; a vocabulary of 260, 256 bytes and 4 specials, where
nanoGPT's is the text's 65 characters, so jaxlm's output layer is 4x larger: about 8% more FLOPs per
token), its documents the text's blank-line-separated speeches, 10% held out by jaxlm's hash, 15,360
held-out tokens (nanoGPT's 20 batches of 12 x 64); `model.dtype` left at auto unless `--jax-set` says
otherwise.

Each side is one whole process, timed from its start to its exit (imports, data, compilation, training,
evaluation and checkpoints included), one after the other so they never share the cores. The held-out
sets differ (nanoGPT's last 10% of the text, jaxlm's hashed speeches), so the final validation losses are
comparable in kind, not to the last digit. The table gives the wall time, the final validation loss and
the CPU's flags (its vector and bfloat16 extensions decide the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

from cpu_vs_torch import cpu_description  # benchmarks/: the same header as its tables

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 2000



def nanogpt_args(steps: int = STEPS) -> list[str]:
    """nanoGPT's README command for a CPU (its train.py's arguments)."""
    return ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
            "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
            "--n_embd=128", f"--max_iters={steps}", f"--lr_decay_iters={steps}", "--dropout=0.0"]


JAX_SETTINGS = {
    "model.variant": "gpt2", "model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 4,
    "model.head_dim": 0, "model.mlp_dim": 512, "model.max_seq_len": 64, "model.tie_embeddings": True,
    "model.dropout": 0.0, "model.vocab_size": 260, "data.tokenizer_type": "byte", "data.separator": "\\n\\n",
    "data.seq_len": 64,
    "data.global_batch_size": 12, "data.val_fraction": 0.1, "data.val_tokens": 20 * 12 * 64,
    "optim.peak_lr": 1e-3, "optim.warmup_steps": 100, "optim.schedule": "cosine", "optim.min_lr_ratio": 0.1,
    "optim.b2": 0.99, "optim.weight_decay": 0.1, "optim.clip_norm": 1.0, "optim.micro_batches": 1,
    "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "run.steps": STEPS, "run.eval_every": 250,
    "run.log_every": 250,
}


def jax_settings(steps: int = STEPS) -> dict:
    """The jaxlm config keys of the same recipe, over `steps` steps (evaluated every 250 and at the end)."""
    return {**JAX_SETTINGS, "run.steps": steps, "run.eval_every": min(250, steps), "run.log_every": min(250, steps)}


def run_nanogpt(nanogpt_dir: str, corpus: str, work: str, steps: int) -> dict:
    """nanoGPT's data preparation (not timed), then its training command, timed whole."""
    data = os.path.join(nanogpt_dir, "data", "shakespeare_char")
    shutil.copyfile(corpus, os.path.join(data, "input.txt"))
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "train.py", *nanogpt_args(steps), f"--out_dir={work}/nanogpt"], cwd=nanogpt_dir,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"nanoGPT failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    vals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", out.stdout)
    import torch  # noqa: PLC0415

    return {"side": "nanogpt", "wall_s": round(wall, 1), "final_val_loss": float(vals[-1][2]),
            "final_step": int(vals[-1][0]), "version": f"torch {torch.__version__}, {torch.get_num_threads()} threads"}


def run_jax(corpus: str, work: str, extra: list[str], steps: int) -> dict:
    """`python -m jaxlm.train` with the recipe above, timed whole (its tokenizer trained in the run)."""
    settings = {**jax_settings(steps), "data.corpus": corpus, "data.cache_dir": f"{work}/cache", "run.output_dir": work,
                "run.name": "jaxlm", "run.compile_cache_dir": ""}
    args = [f"--config.{k}={v}" for k, v in settings.items()] + [f"--config.{kv}" for kv in extra]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jaxlm.train", "--config=configs/tiny.py", *args], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"jaxlm failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    with open(os.path.join(work, "jaxlm", "summary.json")) as f:
        summary = json.load(f)
    dtype = next((ln for ln in (out.stdout + out.stderr).splitlines() if "compute " in ln and "model.dtype" in ln), "")
    import jax  # noqa: PLC0415

    return {"side": "jaxlm", "wall_s": round(wall, 1), "final_val_loss": summary.get("val_loss"),
            "final_step": summary.get("steps"), "version": f"jax {jax.__version__}",
            "dtype": dtype.strip()[:120]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="tinyshakespeare's input.txt")
    p.add_argument("--nanogpt_dir", help="a checkout of nanoGPT (github.com/karpathy/nanoGPT)")
    p.add_argument("--sides", nargs="+", default=["nanogpt", "jax"], choices=["nanogpt", "jax"])
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds of the sides")
    p.add_argument("--steps", type=int, default=STEPS, help="the recipe's 2,000 unless a shorter try is wanted")
    p.add_argument("--jax-set", nargs="*", default=[], metavar="KEY=VALUE", help="more jaxlm config overrides")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if "nanogpt" in args.sides and not args.nanogpt_dir:
        p.error("--nanogpt_dir is needed for the nanogpt side")
    if "nanogpt" in args.sides and not os.path.isfile(os.path.join(args.nanogpt_dir, "train.py")):
        p.error(f"--nanogpt_dir={args.nanogpt_dir} is not a checkout of nanoGPT (no train.py there)")
    if not os.path.isfile(args.corpus):
        p.error(f"--corpus={args.corpus} is not a file")
    corpus = os.path.abspath(args.corpus)
    print(f"# {time.strftime('%Y-%m-%d')} | {cpu_description()} | python {platform.python_version()}"
          + (f" | jaxlm overrides: {' '.join(args.jax_set)}" if args.jax_set else ""))
    rows = []
    for rep in range(args.repeats):
        for side in args.sides:
            with tempfile.TemporaryDirectory() as work:
                r = run_nanogpt(args.nanogpt_dir, corpus, work, args.steps) if side == "nanogpt" else \
                    run_jax(corpus, work, args.jax_set, args.steps)
            rows.append({"round": rep + 1, **r})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| side | round | wall (s) | final val loss | steps | version |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['side']} | {r['round']} | {r['wall_s']} | {r['final_val_loss']:.4f} | {r['final_step']} "
              f"| {r['version']}{'; ' + r['dtype'] if r.get('dtype') else ''} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
