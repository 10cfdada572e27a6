"""Writes tests/data/reference_a89b6fe.npz and tests/data/checkpoint_a89b6fe/ with the code of commit
a89b6fe (before issue 17's seams), for tests/test_reference.py. Kept to show how they were made; it
uses that commit's API, so it runs only in a checkout of it:

    git worktree add /tmp/old a89b6fe
    cd /tmp/old && XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        PYTHONPATH=/tmp/old python /path/to/make_reference.py /path/to/tests/data

It also writes reference_a89b6fe.machine.json, the machine it ran on (`floats.machine()`): the stored
record is of a machine where this script, rerun at a89b6fe with jaxlib 0.10.2, wrote the stored .npz's
bytes again.
"""

import json
import os
import sys

import numpy as np

CASES = {  # name: (recipe overrides, mesh)
    "llama": (dict(model__variant="llama", optim__micro_batches=2), (1, 1, 1)),
    "llama_mesh": (dict(model__variant="llama", optim__micro_batches=2), (2, 2, 2)),
    "gpt2": (dict(model__variant="gpt2", model__tie_embeddings=True), (1, 1, 1)),
    "gpt2_mesh": (dict(model__variant="gpt2", model__tie_embeddings=True), (2, 2, 2)),
}
COMMON = dict(model__vocab_size=128, model__d_model=32, model__n_layers=2, model__n_heads=4, model__n_kv_heads=2,
              model__mlp_dim=64, model__max_seq_len=16, data__seq_len=16, data__global_batch_size=8,
              optim__peak_lr=1e-2, optim__warmup_steps=1, run__steps=10)


def batch(rows=8, seq=16, vocab=128):
    rng = np.random.default_rng(0)
    first, pad = 9, 2
    seg = np.array([1] * first + [2] * (seq - first - pad) + [0] * pad, np.int32)
    pos = np.array(list(range(first)) + list(range(seq - first - pad)) + [0] * pad, np.int32)
    targets = np.where(seg[None] > 0, rng.integers(4, vocab, (rows, seq)), 0).astype(np.int32)
    return {"inputs": rng.integers(4, vocab, (rows, seq)).astype(np.int32), "targets": targets,
            "segment_ids": np.repeat(seg[None], rows, 0), "positions": np.repeat(pos[None], rows, 0)}


def flat(tree):
    import jax

    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


def main(out):
    import jax  # here, not at the top: tests/test_reference.py imports CASES, COMMON and batch from this file
    from flax import nnx

    from jaxlm import checkpoint, config, trainer

    b = batch()
    arrays = {}
    for name, (overrides, mesh) in CASES.items():
        mesh_keys = dict(zip(("mesh__data", "mesh__fsdp", "mesh__tensor"), mesh))
        cfg = config.recipe("tiny", **COMMON, **overrides, **mesh_keys)
        devices = jax.devices()[: int(np.prod(mesh))]
        t = trainer.build_trainer(cfg, devices)
        model = nnx.merge(t.spec.graphdef, jax.device_get(t.state.params))
        logits = jax.jit(lambda m, x: m(x["inputs"], x["positions"], x["segment_ids"]))(model, b)
        with jax.set_mesh(t.mesh):
            state, metrics = t.train_step(t.state, t.put_batch(b))
        arrays[f"{name}/logits"] = np.asarray(logits, np.float32)
        for key in ("loss", "grad_norm", "param_norm"):
            arrays[f"{name}/metrics/{key}"] = np.asarray(jax.device_get(metrics[key]))
        for path, value in flat(state.params).items():
            arrays[f"{name}/params/{path}"] = value
        if name == "llama":
            with checkpoint.Checkpointer(os.path.join(out, "checkpoint_a89b6fe")) as ckpt:
                ckpt.save(1, state, meta={"config": cfg.to_dict()}, force=True)
    np.savez_compressed(os.path.join(out, "reference_a89b6fe.npz"), **arrays)
    # The machine it was made on (tests/floats.py): test_reference compares to the bit there, within ulps elsewhere.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import floats

    with open(os.path.join(out, "reference_a89b6fe.machine.json"), "w") as f:
        json.dump(floats.machine(), f, indent=1)
    print("wrote", len(arrays), "arrays")


if __name__ == "__main__":
    main(sys.argv[1])
