"""GRPO's rollout and update speed on whatever devices are here (`jaxlm.post_training.grpo`).

    python benchmarks/grpo.py                                   # tiny recipe, 8 prompts x G=8, 64 new tokens
    python benchmarks/grpo.py --recipe tiny --prompts 8 --group_size 8 --prompt_len 32 --new_tokens 64 --json g.json

The model has the recipe's random initialisation (speed does not depend on the values). Prompts are random
tokens, all `--prompt_len` long; sampling at temperature 1 with EOS never stopping a row, so every row
samples `--new_tokens` tokens. Timed after a compiling call of each: a rollout (`Sampler.__call__`: the
compiled prefill, the decode loop, the training layout and the old log-probs' forward, to the device
arrays being ready) and one optimizer step on its batch (`grpo.update`, AdamW, full training). Rollout
tokens/s = rows x new tokens / rollout time; the sampling share = rollout / (rollout + mu x update).
"""

from __future__ import annotations

import argparse
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
from jaxlm.generate import Generator  # noqa: E402
from jaxlm.models.transformer import param_count  # noqa: E402
from jaxlm.post_training import grpo  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mu", type=int, default=1, help="optimizer steps per rollout, for the sampling share")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)

    cfg = config.load_recipe(args.recipe)
    devices = jax.devices()
    model_cfg = inference.model_config(cfg, devices[0].platform, None)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=len(devices)), devices)
    tx = optax.adamw(1e-5)
    state, shardings, spec = train_state.create(model_cfg, tx, mesh, rules, cfg.run.seed)
    gen = Generator(model_cfg, state.params, mesh, rules, shardings.params, graphdef=spec.graphdef)
    settings = grpo.GRPOConfig(group_size=args.group_size, max_new_tokens=args.new_tokens,
                               max_prompt_len=args.prompt_len, temperature=1.0, mu=args.mu)
    sampler = grpo.Sampler.from_generator(gen, stop_ids=None, **grpo.Sampler.settings_kwargs(settings))
    rng = np.random.default_rng(0)
    prompts = [[2, *rng.integers(4, model_cfg.vocab_size, args.prompt_len - 1).tolist()] for _ in range(args.prompts)]
    rows = args.prompts * args.group_size

    def rollout(i):
        r = sampler(state.params, prompts, grpo.Sampler.key(0, i))
        jax.block_until_ready(r.old_logprobs)
        return r

    t = time.perf_counter()
    r = rollout(0)
    rollout_compile = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(args.repeats):
        r = rollout(i + 1)
    rollout_s = (time.perf_counter() - t) / args.repeats

    batch = r.batch()
    reward = rng.random(rows).astype(np.float32)
    batch["advantages"] = grpo.expand_advantages(grpo.group_advantages(reward, args.group_size),
                                                 *batch["inputs"].shape)
    step = grpo.update(spec, tx, settings, rules)
    params, opt_state = state.params, state.opt_state
    with jax.set_mesh(mesh):
        t = time.perf_counter()
        params, opt_state, out = step(params, opt_state, batch)
        jax.block_until_ready(out["loss"])
        update_compile = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.repeats):
            params, opt_state, out = step(params, opt_state, batch)
        jax.block_until_ready(out["loss"])
        update_s = (time.perf_counter() - t) / args.repeats

    result = {
        "recipe": args.recipe, "params_m": round(param_count(model_cfg)["total"] / 1e6, 2),
        "devices": f"{len(devices)}x{devices[0].platform}", "cpu": platform.processor() or platform.machine(),
        "rows": f"{args.prompts}x{args.group_size}", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "rollout_compile_s": round(rollout_compile, 2), "rollout_s": round(rollout_s, 3),
        "rollout_tokens_per_s": round(rows * args.new_tokens / rollout_s, 1),
        "update_compile_s": round(update_compile, 2), "update_s": round(update_s, 3),
        "update_tokens_per_s": round(rows * (args.prompt_len + args.new_tokens) / update_s, 1),
        "sampling_share": round(rollout_s / (rollout_s + args.mu * update_s), 3),
    }
    report([result], list(result), args.json or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
