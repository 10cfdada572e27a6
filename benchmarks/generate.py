"""Generation speed of recipes on whatever devices are here: prefill and decode tokens/s with the KV cache.

    python benchmarks/generate.py                                  # 125m, batch 1 and 32
    python benchmarks/generate.py --recipes 125m 1b --batches 1 32 --prompt_len 512 --new_tokens 128
    python benchmarks/generate.py --param_dtype bfloat16 --json gen.json     # parameters held in bf16
    python benchmarks/generate.py --dtype float32                             # compute in float32

The model has random parameters (the recipe's initialisation): speed does not depend on their values,
and no training run is needed. Prompts are random tokens, all `--prompt_len` long, and EOS never
stops a row, so every row decodes `--new_tokens` tokens. The compiled functions of `jaxlm.generate`
are timed directly: the prefill (one call over the batch of prompts, filling the cache) and the mean
decode step (one new token per row, `--new_tokens - 1` steps), each after a compiling call.
Prefill tokens/s = batch x prompt_len / prefill time; decode tokens/s = batch / step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import report  # noqa: E402

from jaxlm import axes, config, inference, train_state  # noqa: E402
from jaxlm import mesh as mesh_lib  # noqa: E402
from jaxlm.generate import Generator, Sampling, SamplingArrays  # noqa: E402
from jaxlm.models.transformer import DTYPES, param_count  # noqa: E402


def build(recipe: str, param_dtype: str, devices, dtype: str | None = None) -> tuple[Generator, dict]:
    cfg = config.load_recipe(recipe)
    model_cfg = inference.model_config(cfg, devices[0].platform, dtype)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    # FSDP over every device, the default recipe mesh
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=len(devices)), devices)
    state, shardings, model_spec = train_state.create(model_cfg, optax.identity(), mesh, rules, cfg.run.seed)
    params = state.params
    if param_dtype != "float32":
        params = jax.tree.map(lambda x: x.astype(DTYPES[param_dtype]), params)
    gen = Generator(model_cfg, params, mesh, rules, shardings.params, graphdef=model_spec.graphdef)
    info = {"recipe": recipe, "params_m": round(param_count(model_cfg)["total"] / 1e6, 2),
            "dtype": np.dtype(model_cfg.dtype).name, "param_dtype": param_dtype}
    return gen, info


def bench(gen: Generator, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [[2, *rng.integers(4, gen.model_cfg.vocab_size, prompt_len - 1).tolist()] for _ in range(batch)]
    tokens, start, padding, cache_len, max_new = gen.prepare(prompts, new_tokens)
    prefill, decode = gen.compiled()
    sampling = SamplingArrays.of(Sampling(temperature=0.0), None)  # greedy; EOS never stops a row
    key = jax.random.PRNGKey(seed)

    def run_prefill():
        out = prefill(gen.params, tokens, start, padding, key, sampling, cache_len, max_new)
        return jax.block_until_ready(out)

    with jax.set_mesh(gen.mesh):
        t0 = time.perf_counter()
        cache, state = run_prefill()
        prefill_compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache, state = run_prefill()
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache, state = jax.block_until_ready(decode(gen.params, cache, state))
        decode_compile_s = time.perf_counter() - t0
        cache, state = run_prefill()  # a fresh cache: time every decode step of one generation
        t0 = time.perf_counter()
        for _ in range(max_new - 1):
            cache, state = decode(gen.params, cache, state)
        jax.block_until_ready(state)
        step_s = (time.perf_counter() - t0) / (max_new - 1)
    cache_bytes = 2 * cache.k.size * cache.k.dtype.itemsize
    return {
        "batch": batch, "prompt_len": prompt_len, "new_tokens": max_new,
        "devices": f"{len(gen.mesh.devices.flat)}x {gen.mesh.devices.flat[0].device_kind}",
        "prefill_compile_s": round(prefill_compile_s, 2), "decode_compile_s": round(decode_compile_s, 2),
        "prefill_s": round(prefill_s, 4), "prefill_tokens_per_s": round(batch * prompt_len / prefill_s, 1),
        "decode_step_s": round(step_s, 5), "decode_tokens_per_s": round(batch / step_s, 1),
        "cache_gib": round(cache_bytes / 2**30, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["125m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--param_dtype", default="float32", choices=sorted(DTYPES),
                        help="parameters as held on the devices (cast to the compute dtype where used)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="compute dtype (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    devices = jax.devices()
    print(f"# {time.strftime('%Y-%m-%d')} | jax {jax.__version__} | {devices[0].device_kind} x{len(devices)} "
          f"| python {platform.python_version()} | {platform.processor() or platform.machine()}")
    results = []
    for recipe in args.recipes:
        gen, info = build(recipe, args.param_dtype, devices, args.dtype)
        for batch in args.batches:
            result = {**info, **bench(gen, batch, args.prompt_len, args.new_tokens, args.seed)}
            results.append(result)
            print(json.dumps(result), file=sys.stderr)
    cols = ["recipe", "params_m", "dtype", "param_dtype", "batch", "prompt_len", "new_tokens", "prefill_compile_s",
            "decode_compile_s", "prefill_s", "prefill_tokens_per_s", "decode_step_s", "decode_tokens_per_s"]
    report(results, cols, args.json)


if __name__ == "__main__":
    main()
