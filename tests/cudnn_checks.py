"""Run by tests/test_cudnn_attention.py in the H100 compiler environment (jax's CUDA plugin installed), on
8 CPU devices, with cuDNN's attention kernels emulated (tests/cudnn_emulation.py). Prints one JSON object.

    python tests/cudnn_checks.py attention   # the model's cuDNN paths against the float32 reference
    python tests/cudnn_checks.py train       # train steps with cuDNN attention against XLA's, on meshes
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
# No YNNPACK fusions: with them, XLA:CPU (jax 0.10.2) left one bfloat16 dot with a float32 result outside any
# fusion in the pipeline-stage mesh's step with one cuDNN kernel and no conditional, and its plain dot
# thunk cannot run that ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_experimental_ynn_fusion_type=")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudnn_emulation  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import roofline  # noqa: E402
from jaxlm.models import attention  # noqa: E402

cudnn_emulation.install()


def packed_rows(batch: int, seq: int, docs: int, pad: int, seed: int) -> np.ndarray:
    """[batch, seq] segment ids: `docs` documents of random lengths per row, then `pad` padding tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq - pad), docs - 1, replace=False))
        row = np.zeros(seq, np.int32)
        for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, seq - pad])):
            row[a:b] = i + 1
        rows.append(row)
    return np.stack(rows)


def relative_error(got, want) -> float:
    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
               / float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for g, w in zip(got, want))


def _fwd_bwd(fn, seg, cot, q, k, v):
    """(sum of fn's output x cot over the real tokens, its q/k/v gradients)."""
    def loss(q, k, v):
        out = fn(q, k, v, seg).astype(jnp.float32)
        return jnp.sum(jnp.where((seg > 0)[..., None, None], out, 0.0) * cot)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _attention_case(docs: int, bound: int, q, k, v, cot) -> dict:
    b = q.shape[0]
    seg = jnp.asarray(packed_rows(b, q.shape[1], docs, 4, seed=docs))

    def reference(q, k, v, s):
        return attention.reference_attention(q, k, v, segment_ids=s)

    def cudnn(q, k, v, s):
        return attention.attend(q, k, v, segment_ids=s, implementation="cudnn", max_segments=bound)

    want = jax.jit(lambda q, k, v: _fwd_bwd(reference, seg, cot, q, k, v))(q, k, v)
    got = jax.jit(lambda q, k, v: _fwd_bwd(cudnn, seg, cot, q, k, v))(q, k, v)
    text = str(jax.make_jaxpr(lambda q, k, v: _fwd_bwd(cudnn, seg, cot, q, k, v))(q, k, v))

    # vmapped over 2 replicas of b/2 rows (the data-replica vmap of jaxlm.steps), against each alone
    def halves(x):
        return x.reshape(2, b // 2, *x.shape[1:])

    def replica(q, k, v, s, c):
        return _fwd_bwd(cudnn, s, c, q, k, v)

    args = tuple(halves(x) for x in (q, k, v, seg, cot))
    with attention.whole_batch_segments(halves(seg)):
        vmapped = jax.jit(jax.vmap(replica))(*args)
        vmapped_text = str(jax.make_jaxpr(jax.vmap(replica))(*args))
    alone = [jax.jit(replica)(*(x[i] for x in args)) for i in (0, 1)]
    stacked = jax.tree.map(lambda a, c: jnp.stack([a, c]), *alone)
    # the same rows' segment ids shared by every vmapped slice (unbatched: the rules broadcast them)
    shared_args = (halves(q), halves(k), halves(v), seg[: b // 2], halves(cot))
    with attention.whole_batch_segments(seg[: b // 2]):
        shared = jax.jit(jax.vmap(replica, in_axes=(0, 0, 0, None, 0)))(*shared_args)
    shared_alone = [jax.jit(replica)(*(x if j == 3 else x[i] for j, x in enumerate(shared_args))) for i in (0, 1)]
    shared_stacked = jax.tree.map(lambda a, c: jnp.stack([a, c]), *shared_alone)
    return {
        "error": relative_error(jax.tree.leaves(got), jax.tree.leaves(want)),
        "vmap_error": relative_error(jax.tree.leaves(vmapped), jax.tree.leaves(stacked)),
        "shared_segments_vmap_error": relative_error(jax.tree.leaves(shared), jax.tree.leaves(shared_stacked)),
        "forward_calls": text.count("dot_product_attention_fwd"),
        "conditionals": text.count("cond["),
        "vmapped_conditionals": vmapped_text.count("cond["),
        "fits": bool(attention.packed_segments(seg, bound)[2]) if bound else None,
    }


def check_attention() -> dict:
    """Output and q/k/v gradients of `attend(implementation='cudnn')`: the packed layout when every row
    fits, its masked fallback when one does not, the mask alone (max_segments=0); and vmapped over
    replicas (jaxlm's batching rules) against each replica alone. Also which primitives the program holds."""
    b, t, n, kv, h = 4, 64, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv, h), jnp.bfloat16)
    cot = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
    from jaxlm import doctor

    with roofline.cudnn_checks_for(roofline.H100):
        out = {name: _attention_case(docs, bound, q, k, v, cot)
               for name, docs, bound in (("packed", 3, 8), ("fallback", 6, 4), ("masked", 5, 0))}
        # the doctor's checks of the two cuDNN paths against XLA's attention (what it runs on a Hopper GPU)
        out["doctor"] = {str(bound): doctor._checked_attention(jax.devices()[0], bound, "cudnn")["status"]
                         for bound in (0, 4)}
    return out


TRAIN = dict(model__vocab_size=128, model__d_model=64, model__n_heads=4, model__n_kv_heads=2, model__mlp_dim=128,
             model__n_layers=4, model__max_seq_len=64, model__dtype="bfloat16", data__seq_len=64,
             data__global_batch_size=16, data__tokenizer_vocab_size=128, optim__peak_lr=1e-2, optim__warmup_steps=1)
MESHES = {
    "data2_fsdp2_tensor2": dict(mesh__data=2, mesh__fsdp=2, mesh__tensor=2),
    "data2_fsdp4_2_micro_batches": dict(mesh__data=2, mesh__fsdp=4, optim__micro_batches=2),
    "stage2_fsdp2_tensor2": dict(mesh__stage=2, mesh__fsdp=2, mesh__tensor=2),
    "stage2_data2_fsdp2_circular": dict(mesh__stage=2, mesh__data=2, mesh__fsdp=2, pipeline__schedule="circular",
                                        pipeline__repeats=2),
}


def check_train() -> dict:
    """Three train steps of a small model on packed documents under each mesh, with cuDNN attention
    (packed layout, 16 segments; and with a bound of 1, so every batch takes the masked fallback; and
    each kernel alone, chosen on the host) against XLA's attention: the losses, and an evaluation's after them."""
    from jaxlm import config, train_setup
    from jaxlm.models import transformer

    batch = {}
    seg = packed_rows(16, 64, 3, 4, seed=1)
    rng = np.random.default_rng(0)
    batch["segment_ids"] = seg
    batch["inputs"] = rng.integers(4, 128, seg.shape).astype(np.int32)
    batch["targets"] = np.where(seg > 0, rng.integers(4, 128, seg.shape), 0).astype(np.int32)
    batch["weights"] = (seg > 0).astype(np.float32)
    starts = np.concatenate([np.ones((16, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run_start = np.maximum.accumulate(np.where(starts, np.arange(64)[None], 0), axis=1)
    batch["positions"] = np.where(seg > 0, np.arange(64)[None] - run_start, 0).astype(np.int32)

    original = transformer.ModelConfig.from_config.__func__

    def losses(kernel: str, segments: int, mesh: dict, packed: bool | None = None) -> list[float]:
        def from_config(cls, m, platform=None, **kw):  # the kernel a Hopper GPU would get, on these CPUs
            cfg = original(cls, m, platform, **kw)
            return cfg if kernel == "xla" else dataclasses.replace(cfg, attention="cudnn", attention_segments=segments)

        transformer.ModelConfig.from_config = classmethod(from_config)
        try:
            t = train_setup.build(config.recipe("tiny", **TRAIN, **mesh), jax.devices()[:8])
        finally:
            transformer.ModelConfig.from_config = classmethod(original)
        state, out = t.state, []
        with jax.set_mesh(t.mesh), roofline.cudnn_checks_for(roofline.H100):
            for _ in range(3):
                state, metrics = t.train_step(state, t.put_batch(batch), packed)
                out.append(float(metrics["loss"]))
            # then the evaluation's loss, its kernel chosen on the host (`TrainSetup.attention_choice`)
            out.append(train_setup.evaluate(t, state.params, [batch])["val_loss"])
        return out

    # packed, fallback: the conditional on the device; host_packed, host_masked: the kernel chosen on the
    # host (the step's static `packed`, as the trainer passes it in one process)
    return {name: {"xla": losses("xla", 0, mesh), "packed": losses("cudnn", 16, mesh),
                   "fallback": losses("cudnn", 1, mesh), "host_packed": losses("cudnn", 16, mesh, True),
                   "host_masked": losses("cudnn", 16, mesh, False)} for name, mesh in MESHES.items()}


if __name__ == "__main__":
    print(json.dumps({"attention": check_attention, "train": check_train}[sys.argv[1]]()))
