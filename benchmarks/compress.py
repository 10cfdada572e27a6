"""Bytes on the device, compression time and decoding speed of a quantized model (issue 20).

    python benchmarks/compress.py                       # the 125m recipe: int8, int4, int3 (RTN), int4 GPTQ
    python benchmarks/compress.py --recipe 350m --formats int4 --gptq_samples 0 --json out.json

A model of the recipe's shape with random float32 weights (no training is needed to count bytes or
time kernels) is compressed by `jaxlm.compress.methods.compress_params`, the function behind
`python -m jaxlm.compress`, every projection of the blocks targeted (groups of 128, symmetric).
Measured, not computed from the format:

- bytes: the `nbytes` of the arrays the device holds (codes, scales, the float embedding), whole
  model and the compressed projections alone, against the same weights in bfloat16;
- compression time: round to nearest, and GPTQ on `--gptq_samples` random token windows of
  `--gptq_seq_len` (its calibration and the Cholesky-based updates, all layers in sequence);
- decoding: greedy tokens per second of `jaxlm.generate.Generator` for one row (prefill of 16
  tokens, then `--new_tokens` one at a time), float32 and bfloat16 weights against the quantized
  ones (dequantized inside each compiled decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax


def _bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def _blocks_bytes(params) -> int:
    return _bytes({k: v for k, v in params["blocks"].items() if k in ("attn", "mlp")})


def decode_speed(model_cfg, params, mesh, rules, new_tokens: int) -> float:
    from jaxlm import generate

    gen = generate.Generator(model_cfg, params, mesh, rules)
    prompt = [[1] + list(range(3, 18))]
    gen.generate_ids(prompt, max_new_tokens=new_tokens, eos_id=None)  # compiles
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        gen.generate_ids(prompt, max_new_tokens=new_tokens, eos_id=None)
        best = min(best, time.perf_counter() - started)
    return new_tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="125m")
    parser.add_argument("--formats", default="int8,int4,int3")
    parser.add_argument("--gptq_samples", type=int, default=32, help="calibration windows for the GPTQ row (0: none)")
    parser.add_argument("--gptq_seq_len", type=int, default=512)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    from jaxlm import config, train_state
    from jaxlm import mesh as mesh_lib
    from jaxlm.compress import methods
    from jaxlm.models import transformer

    cfg = config.recipe(args.recipe)
    devices = jax.devices()[:1]
    model_cfg = transformer.ModelConfig.from_config(cfg.model, devices[0].platform, log_choice=False, dropout=0.0,
                                                    remat="none")
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    mesh = mesh_lib.make_mesh(config.mesh_shape(cfg, 1), devices)
    state, _, _ = train_state.create(model_cfg, optax.identity(), mesh, rules)
    params = state.params
    rows = []
    float_bytes, float_blocks = _bytes(params), _blocks_bytes(params)
    params_count = transformer.param_count(model_cfg)["total"]
    rows.append({"model": "float32", "bytes": float_bytes, "blocks_bytes": float_blocks, "seconds": 0.0,
                 "decode_tok_s": decode_speed(model_cfg, params, mesh, rules, args.new_tokens)})
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    bf16_cfg = dataclasses.replace(model_cfg, param_dtype=jnp.bfloat16)
    rows.append({"model": "bfloat16", "bytes": _bytes(bf16), "blocks_bytes": _blocks_bytes(bf16), "seconds": 0.0,
                 "decode_tok_s": decode_speed(bf16_cfg, bf16, mesh, rules, args.new_tokens)})
    del bf16
    settings = [(fmt, "rtn") for fmt in args.formats.split(",") if fmt]
    if args.gptq_samples:
        settings.append(("int4", "gptq"))
    for fmt, method in settings:
        section = ml_collections.ConfigDict(config.base_config().compress.to_dict())
        section.update(quantize=fmt, group=128, method=method)
        out_cfg = transformer.with_compress(model_cfg, section)
        calibration = None
        if method == "gptq":
            calibration = np.random.default_rng(0).integers(3, model_cfg.vocab_size,
                                                            (args.gptq_samples, args.gptq_seq_len)).astype(np.int32)
        started = time.perf_counter()
        with jax.set_mesh(mesh):
            out, _ = methods.compress_params(params, model_cfg, out_cfg, section, mesh=mesh, rules=rules,
                                             calibration=calibration)
            out = jax.block_until_ready(out)
        seconds = time.perf_counter() - started
        rows.append({"model": f"{fmt} {method} g128", "bytes": _bytes(out), "blocks_bytes": _blocks_bytes(out),
                     "seconds": seconds, "decode_tok_s": decode_speed(out_cfg, out, mesh, rules, args.new_tokens)})
        del out
    bf16_blocks = rows[1]["blocks_bytes"]
    print(f"{args.recipe}: {params_count / 1e6:.1f}M parameters, {devices[0].device_kind}, jax {jax.__version__}")
    print("| model | weight bytes | / bf16 | blocks' projections | / bf16 | compress s | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['bytes']:,d} | {r['bytes'] / rows[1]['bytes']:.3f} | {r['blocks_bytes']:,d} | "
              f"{r['blocks_bytes'] / bf16_blocks:.3f} | {r['seconds']:.1f} | {r['decode_tok_s']:.1f} |")
    if args.json:
        meta = {"recipe": args.recipe, "parameters": params_count, "device": devices[0].device_kind,
                "cpu_count": os.cpu_count(), "python": platform.python_version(),
                "versions": {p: importlib.metadata.version(p) for p in ("jax", "flax")}, "rows": rows,
                "gptq_calibration": [args.gptq_samples, args.gptq_seq_len]}
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=2)


if __name__ == "__main__":
    main()
