"""Llama-2-7B shape (32 layers, width 4096, 32 heads, MLP 11008, sequence 4096), for multi-GPU runs
and memory planning. Layers unrolled (no scan: no stacked activations, collectives scheduled across
layers) and rematerialization that keeps the matmuls' outputs and the MLP's hidden activation
(remat=dots_mlp: no matmul recomputed, unlike remat=full; gate and up one matmul). Its H100 program
on eight, compiled here: roofline-bound MFU 0.882 at the planner's 16 micro-batches (0.878 under
remat=dots), against 0.695 scanned with remat=full (`python -m jaxlm.plan --target=h100 --choose`;
benchmarks/BENCHMARKS.md)."""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, mlp_dim=11008, max_seq_len=4096, remat="dots_mlp",
        scan_layers=False,
    )
    c.data.update(seq_len=4096, global_batch_size=256, builtin_max_bytes=64_000_000)
    # 256 x 4096 = 1M tokens per step; micro_batches=0: as few as fit in device memory (jaxlm.plan):
    # 16 micro-batches of 2 sequences per device on 8 80 GB GPUs.
    c.optim.update(peak_lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1, micro_batches=0)
    c.run.update(steps=250_000, log_every=10, eval_every=2000)
    return c
