"""Attention kernels side by side at a recipe's shapes, with packed documents (issue 7).

    python benchmarks/attention.py                                   # 1b shapes on a GPU, tiny on a CPU
    python benchmarks/attention.py --recipe 1b --batch 8 --doc_len 512 --json attention.json
    python benchmarks/attention.py --recipe tiny --seq 64 --batch 2   # CPU: XLA, blocked, the interpreted Pallas kernel

jaxlm's GPU path gives cuDNN packed documents in its packed layout on Hopper GPUs and the document
mask (a dense [B, 1, T, T] bias the kernel reads for every head) on older ones; this script measures
them against each other and the alternatives.
Each candidate is first checked: the forward output and the gradients of q, k and v (for a random
output cotangent, zero at padding) against the float32 reference
(`jaxlm.models.attention.reference_attention`) on the same random inputs, at every non-padding
position, as max |error| / max |reference|; "ok" under --tolerance, else WRONG. Then the mean time of
its jitted forward + backward over --steps calls after one warm-up call, the TFLOP/s that gives when
causal attention over whole rows is counted the way the MFU harness counts it (6 B T^2 N H), and the
compiled program's temporary memory.

Candidates (--impls):
  xla                  jax.nn.dot_product_attention on XLA, with the document mask (the reference path in tests)
  blocked              causal blocks (`model.attention=blocked`, `attention.blocked_attention`, the CPU's `auto`): a
                       block of queries at a time against only the keys up to it, FlashAttention-2's backward
  cudnn                cuDNN flash attention with the document mask (jaxlm's path before Hopper)
  cudnn_packed         cuDNN's packed ("ragged") layout, one segment per run of a segment id, at most
                       --max_segments per row, no mask tensor (Hopper or later): jaxlm's path there,
                       `attention.attend(..., max_segments=...)` with its masked fallback behind a conditional
  pallas               jax's Pallas (Triton) flash attention with segment ids (`model.attention=pallas`,
                       `attention.pallas_attention`), key/value heads repeated for grouped queries;
                       interpreted on a CPU (correct, not fast)
  splash               jax's Pallas TPU splash attention with segment ids (`model.attention=splash`, TPUs' `auto`,
                       `attention.splash_attention`), blocks above the diagonal skipped; interpreted off a TPU
  cudnn_causal         cuDNN with the causal mask only: attends across documents, so it is checked against a
                       causal-only reference; the time without any document masking, a bound for the others
A candidate that cannot run here is reported as skipped (cuDNN on a CPU) or failed, with the reason.

Documents: lengths drawn from an exponential distribution with mean --doc_len tokens (at least 1),
packed into each row in order; the last --pad tokens of each row are padding (segment id 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxlm import config  # noqa: E402
from jaxlm.models import attention  # noqa: E402
from jaxlm.models.transformer import ModelConfig  # noqa: E402
from jaxlm.table import Table  # noqa: E402

IMPLS = ("xla", "blocked", "cudnn", "cudnn_packed", "pallas", "splash", "cudnn_causal")
CUDNN = {"cudnn", "cudnn_packed", "cudnn_causal"}


def packed_rows(batch: int, seq: int, doc_len: float, pad: int, seed: int) -> np.ndarray:
    """[batch, seq] int32 segment ids: documents of exponential length (mean doc_len) in order, then `pad` zeros."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((batch, seq), np.int32)
    for row in rows:
        position, doc = 0, 1
        while position < seq - pad:
            length = max(1, int(rng.exponential(doc_len)))
            row[position:min(position + length, seq - pad)] = doc
            position, doc = position + length, doc + 1
    return rows


def segment_runs(segment_ids: np.ndarray) -> int:
    """The most runs of equal ids in any row: the number of segments the packed layout needs."""
    return int((np.diff(segment_ids, axis=1) != 0).sum(axis=1).max()) + 1


def candidate(name: str, *, max_segments: int):
    """(q, k, v, segment_ids) -> attention output, for one of IMPLS."""
    if name in ("xla", "blocked", "cudnn", "pallas", "splash"):  # the model's own kernels
        return lambda q, k, v, seg: attention.attend(q, k, v, segment_ids=seg, implementation=name)
    if name == "cudnn_causal":
        return lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if name == "cudnn_packed":
        return lambda q, k, v, seg: attention.attend(q, k, v, segment_ids=seg, implementation="cudnn",
                                                     max_segments=max_segments)
    raise SystemExit(f"attention.py: unknown candidate {name!r}; choose from {', '.join(IMPLS)}")


def loss_and_grads(fn):
    """jit of (q, k, v, seg, cotangent) -> (sum(out * cotangent) in float32, (dq, dk, dv)); padding rows ignored."""

    def loss(q, k, v, seg, cot):
        out = fn(q, k, v, seg).astype(jnp.float32)
        return jnp.sum(jnp.where((seg > 0)[:, :, None, None], out, 0.0) * cot), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v, seg, cot: grad(q, k, v, seg, cot))


def relative_error(got, want, valid) -> float:
    got, want = np.asarray(got, np.float32)[valid], np.asarray(want, np.float32)[valid]
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check(fn, reference, inputs, tolerance: float) -> dict:
    """Output and gradient errors of `fn` against `reference`: a function like `fn`, or its
    (output, grads) from `loss_and_grads` already computed (the float32 reference is the costly one)."""
    q, k, v, seg, cot = inputs
    (_, out), grads = loss_and_grads(fn)(q, k, v, seg, cot)
    if callable(reference):
        (_, ref_out), ref_grads = loss_and_grads(reference)(q, k, v, seg, cot)
    else:
        ref_out, ref_grads = reference
    valid = np.asarray(seg) > 0
    err_out = relative_error(out, ref_out, valid)
    err_grad = max(relative_error(g, r, valid) for g, r in zip(grads, ref_grads))
    ok = err_out <= tolerance and err_grad <= tolerance
    return {"check": "ok" if ok else "WRONG", "err_out": err_out, "err_grad": err_grad}


def references(inputs) -> dict[bool, tuple]:
    """The float32 reference's (output, grads), with (True) and without (False) the document mask."""
    q, k, v, seg, cot = inputs
    result = {}
    for documents in (True, False):
        def reference(q, k, v, seg, documents=documents):
            return attention.reference_attention(q, k, v, segment_ids=seg if documents else None)

        (_, out), grads = loss_and_grads(reference)(q, k, v, seg, cot)
        result[documents] = jax.device_get((out, grads))
    return result


def measure(name: str, inputs, reference: tuple, *, steps: int, max_segments: int, tolerance: float) -> dict:
    q, k, v, seg, cot = inputs
    row = {"impl": name}
    if name in CUDNN and jax.default_backend() != "gpu":
        return {**row, "check": "skipped: not a GPU"}
    try:
        fn = candidate(name, max_segments=max_segments)
        row.update(check(fn, reference, inputs, tolerance))
        compiled = loss_and_grads(fn).lower(q, k, v, seg, cot).compile()
        jax.block_until_ready(compiled(q, k, v, seg, cot))
        t0 = time.perf_counter()
        for _ in range(steps):
            result = compiled(q, k, v, seg, cot)
        jax.block_until_ready(result)
        row["ms"] = 1e3 * (time.perf_counter() - t0) / steps
        b, t, n, h = q.shape
        row["tflops"] = 6 * b * t * t * n * h / (row["ms"] / 1e3) / 1e12
        analysis = compiled.memory_analysis()
        row["temp_mib"] = None if analysis is None else analysis.temp_size_in_bytes / 2**20
    except Exception as e:  # a kernel this backend, shape or version cannot run: reported, not fatal
        row["check"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = jax.default_backend() == "gpu"
    parser.add_argument("--recipe", default="1b" if gpu else "tiny",
                        help="shapes (heads, head size, sequence) of this recipe")
    parser.add_argument("--seq", type=int, default=0, help="sequence length (default: the recipe's)")
    parser.add_argument("--batch", type=int, default=8 if gpu else 2,
                        help="sequences (default: 8, 1b's micro-batch per H100)")
    parser.add_argument("--doc_len", type=float, default=512, help="mean document length in tokens")
    parser.add_argument("--pad", type=int, default=0, help="padding tokens at the end of each row")
    parser.add_argument("--max_segments", type=int, default=0,
                        help="segments per row of the packed layout (default: the most any row has)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--steps", type=int, default=10 if gpu else 1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tolerance", type=float, default=0.03, help="largest relative error called ok")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    m = ModelConfig.from_config(config.load_recipe(args.recipe).model)
    seq = args.seq or config.load_recipe(args.recipe).data.seq_len
    seg = packed_rows(args.batch, seq, args.doc_len, args.pad, args.seed)
    max_segments = args.max_segments or segment_runs(seg)
    keys = jax.random.split(jax.random.key(args.seed), 4)
    dtype = jnp.dtype(args.dtype)
    q = jax.random.normal(keys[0], (args.batch, seq, m.n_heads, m.head_dim), dtype)
    k = jax.random.normal(keys[1], (args.batch, seq, m.n_kv_heads, m.head_dim), dtype)
    v = jax.random.normal(keys[2], (args.batch, seq, m.n_kv_heads, m.head_dim), dtype)
    cot = jax.random.normal(keys[3], q.shape, jnp.float32)
    inputs = (q, k, v, jnp.asarray(seg), cot)
    docs = int(sum(len(np.unique(r[r > 0])) for r in seg))
    device = jax.devices()[0]
    header = (f"{args.recipe}: batch {args.batch} x {seq}, {m.n_heads} query / {m.n_kv_heads} key-value heads of "
              f"{m.head_dim}, {args.dtype}; {docs} documents (mean length {args.doc_len:g}), {args.pad} padding per "
              f"row, packed layout of {max_segments} segments per row; {device.device_kind}, jax {jax.__version__}")
    print(header, flush=True)

    expected = references(inputs)
    rows = []
    for name in args.impls:
        row = measure(name, inputs, expected[name != "cudnn_causal"], steps=args.steps, max_segments=max_segments,
                      tolerance=args.tolerance)
        rows.append(row)
        print(json.dumps(row), flush=True)

    cols = ["impl", "check", "err_out", "err_grad", "ms", "tflops", "temp_mib"]
    print(Table(cols, [["" if r.get(c) is None else r[c] for c in cols] for r in rows], footer=header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "device": device.device_kind, "jax": jax.__version__,
                       "python": platform.python_version(), "recipe": args.recipe, "batch": args.batch, "seq": seq,
                       "doc_len": args.doc_len, "pad": args.pad, "max_segments": max_segments, "documents": docs,
                       "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
