"""Train-step throughput of recipes on whatever devices are here.

    python benchmarks/train_throughput.py                       # tiny and 125m, recipe shapes
    python benchmarks/train_throughput.py --recipes tiny --set model.dtype=bfloat16
    python benchmarks/train_throughput.py --recipes 1b --set data.global_batch_size=8

Batches are random tokens of the recipe's shape (the step's cost does not depend on the values), so
this measures the compiled step alone: compile time, then the mean step time over `--steps` steps
after `--warmup` steps, tokens/s and model TFLOP/s (FLOPs from `flops_per_token`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import numpy as np

from jaxlm import config, train_setup
from jaxlm.models.transformer import flops_per_token, param_count

# On a CPU the recipe-sized 125m step takes minutes; these shapes keep it to seconds per step.
CPU_OVERRIDES = {"125m": {"data.global_batch_size": 2, "data.seq_len": 512}}


def random_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.integers(0, vocab, (batch, seq), dtype=np.int32),
        "targets": rng.integers(0, vocab, (batch, seq), dtype=np.int32),
        "segment_ids": np.ones((batch, seq), np.int32),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
        "weights": np.ones((batch, seq), np.float32),
    }


def bench(recipe: str, overrides: dict[str, str], steps: int, warmup: int) -> dict:
    cfg = config.load_recipe(recipe)
    if jax.default_backend() == "cpu":
        overrides = {**{k: str(v) for k, v in CPU_OVERRIDES.get(recipe, {}).items()}, **overrides}
    config.apply_overrides(cfg, list(overrides.items()))
    setup = train_setup.build(cfg)
    d = cfg.data
    per_process = d.global_batch_size // jax.process_count()
    batches = [setup.put_batch(random_batch(per_process, d.seq_len, cfg.model.vocab_size, i)) for i in range(2)]
    packed = setup.expected_attention_choice()  # one document per row: what the trainer runs for it
    state = setup.state
    with jax.set_mesh(setup.mesh):
        t0 = time.perf_counter()
        state, metrics = setup.train_step(state, batches[0], packed)
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - t0
        for i in range(warmup):
            state, metrics = setup.train_step(state, batches[i % 2], packed)
        jax.block_until_ready(metrics)
        t0 = time.perf_counter()
        for i in range(steps):
            state, metrics = setup.train_step(state, batches[i % 2], packed)
        jax.block_until_ready(metrics)
        step_s = (time.perf_counter() - t0) / steps
    tokens = d.global_batch_size * d.seq_len
    flops = flops_per_token(setup.model_cfg, d.seq_len) * tokens
    return {
        "recipe": recipe,
        "overrides": overrides,
        "params_m": round(param_count(setup.model_cfg)["total"] / 1e6, 2),
        "batch": f"{d.global_batch_size}x{d.seq_len}",
        "dtype": np.dtype(setup.model_cfg.dtype).name,  # model.dtype=auto resolved
        "devices": f"{jax.device_count()}x {jax.devices()[0].device_kind}",
        "compile_s": round(compile_s, 2),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "model_tflops_per_s": round(flops / step_s / 1e12, 4),
        "tflops_per_device": round(flops / step_s / 1e12 / jax.device_count(), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["tiny", "125m"])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every recipe")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.set)
    print(f"# {time.strftime('%Y-%m-%d')} | jax {jax.__version__} | {jax.devices()[0].device_kind} x{jax.device_count()} "
          f"| python {platform.python_version()} | {platform.processor() or platform.machine()}")
    results = []
    for recipe in args.recipes:
        result = bench(recipe, overrides, args.steps, args.warmup)
        results.append(result)
        print(json.dumps(result), file=sys.stderr)
    cols = ["recipe", "params_m", "batch", "dtype", "devices", "compile_s", "step_s", "tokens_per_s", "tflops_per_device"]
    report(results, cols, args.json)


def report(results: list[dict], cols: list[str], json_path: str | None) -> None:
    """The results as one Markdown table on stdout, and all of them as JSON where asked."""
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
