"""The ring's cuDNN blocks against their XLA emulation, on one GPU (`jaxlm.models.context_parallel`).

    python benchmarks/ring_blocks.py --json ring_blocks.json          # on a GPU: cuDNN against the emulation
    python benchmarks/ring_blocks.py --blocks xla                      # anywhere: the emulation against itself

Context parallelism's ring with `model.attention=cudnn` runs each step's block with cuDNN's flash attention
(`CudnnBlocks`). The CPU tests build the ring on `XlaBlocks`, which emulates what the ring relies on (the
diagonal block's causal and document masks, the off-diagonal blocks' padding mask, the backward given the
whole attention's output and log-sum-exp), and check it against plain attention. This script closes the loop
on a GPU: each of the four calls of `CudnnBlocks` against `XlaBlocks` on the same random bfloat16 inputs
(packed documents of uneven lengths, grouped-query heads, random padding lengths, a backward given an output
and log-sum-exp other than the block's own), compared where the ring uses them (the rows and keys inside the
padding mask), as max |error| / max |emulation|. One GPU is enough: the blocks are what differs from the CPU
path; the ring's passes around the context axis are the same code as on CPUs. Exit code 1 when any error is
over --tolerance.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxlm.models import context_parallel  # noqa: E402


def _segments(rng, batch: int, t: int, doc_len: int) -> np.ndarray:
    """Documents of mean length `doc_len` packed in order, the rows' last tokens padding (id 0)."""
    ids = np.zeros((batch, t), np.int32)
    for row in range(batch):
        at, doc, end = 0, 0, t - 3 * row
        while at < end:
            n = min(max(1, int(rng.exponential(doc_len))), end - at)
            doc += 1
            ids[row, at:at + n] = doc
            at += n
    return ids


def _error(got, want, where=None) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if where is not None:
        where = np.broadcast_to(where, got.shape)
        got, want = got[where], want[where]
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="cudnn", choices=["cudnn", "xla"], help="the blocks checked")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512, help="the block's queries and keys (a chunk's t)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--doc_len", type=int, default=96)
    parser.add_argument("--tolerance", type=float, default=2e-2, help="bfloat16: a few of its ulps")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    checked = context_parallel.RING_BLOCKS["cudnn"] if args.blocks == "cudnn" else context_parallel.XlaBlocks()
    emulated = context_parallel.XlaBlocks()
    rng = np.random.default_rng(0)
    b, t, n, kv, h = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv, h), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
    segment_ids = jnp.asarray(_segments(rng, b, t, args.doc_len))
    q_len = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
    kv_len = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
    rows = np.arange(t)[None] < np.asarray(q_len)[:, None]  # [B, t]
    key_rows = np.arange(t)[None] < np.asarray(kv_len)[:, None]

    noise = jax.random.uniform(keys[4], (b, n, t), jnp.float32, 0.0, 1.0)

    def calls(blocks, q, k, v, d_out, segment_ids, q_len, kv_len, noise):
        out, lse = blocks.diagonal(q, k, v, segment_ids)
        # the backward is given another attention's output and log-sum-exp (the ring gives the whole one's)
        other_out = (out.astype(jnp.float32) * 0.5).astype(out.dtype)
        other_lse = lse + noise
        diagonal_grads = blocks.diagonal_grads(q, k, v, segment_ids, other_out, other_lse, d_out)
        p_out, p_lse = blocks.padded(q, k, v, q_len, kv_len)
        padded_grads = blocks.padded_grads(q, k, v, q_len, kv_len, other_out, other_lse, d_out)
        return out, lse, diagonal_grads, p_out, p_lse, padded_grads

    inputs = (q, k, v, d_out, segment_ids, q_len, kv_len, noise)
    got = jax.jit(functools.partial(calls, checked))(*inputs)
    want = jax.jit(functools.partial(calls, emulated))(*inputs)
    errors = {
        "diagonal out": _error(got[0], want[0]),
        "diagonal lse": _error(got[1], want[1]),
        **{f"diagonal d{x}": _error(g, w) for x, g, w in zip("qkv", got[2], want[2])},
        "padded out": _error(got[3], want[3], rows[:, :, None, None]),
        "padded lse": _error(got[4], want[4], rows[:, None]),
        "padded dq": _error(got[5][0], want[5][0], rows[:, :, None, None]),
        "padded dk": _error(got[5][1], want[5][1], key_rows[:, :, None, None]),
        "padded dv": _error(got[5][2], want[5][2], key_rows[:, :, None, None]),
    }
    ok = all(e <= args.tolerance for e in errors.values())
    for name, e in errors.items():
        print(f"{name:<14} {e:.2e} {'ok' if e <= args.tolerance else 'WRONG'}")
    print(f"ring blocks ({args.blocks} on {jax.default_backend()}, jax {jax.__version__}): "
          f"{'ok' if ok else 'WRONG'} at tolerance {args.tolerance}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"blocks": args.blocks, "backend": jax.default_backend(), "jax": jax.__version__,
                       "shape": dict(batch=b, seq=t, heads=n, kv_heads=kv, head_dim=h), "errors": errors, "ok": ok,
                       "tolerance": args.tolerance}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
