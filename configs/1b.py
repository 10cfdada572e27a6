"""Llama-style 1.1B model (TinyLlama shape: 22 layers, width 2048, 32 heads, 4 KV heads), sequence 2048."""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp_dim=5632, tie_embeddings=False,
        # Layers unrolled, not scanned: no stacking of the saved activations and no per-micro-batch zeroing
        # of the scan's buffers, and XLA schedules the weights' collectives across layers. Rematerialization
        # keeps the matmuls' outputs and the MLP's hidden activation and recomputes the rest of the
        # elementwise work (no matmul recomputed; remat=dots_mlp, gate and up one matmul). The H100
        # program compiled here (`python -m jaxlm.plan --target=h100 --choose`, benchmarks/BENCHMARKS.md):
        # roofline-bound MFU 0.804 on eight H100s (0.792 under remat=dots), against 0.653 scanned without
        # remat. On one H100 the planner fits it in 32 micro-batches: 0.804, with the weight gradients summed
        # in the matmuls (`layers.ComputeKernel`; 0.793 under remat=dots at 16). Compiling takes about 20 s
        # here for eight.
        scan_layers=False, remat="dots_mlp",
    )
    c.data.update(seq_len=2048, global_batch_size=256, builtin_max_bytes=64_000_000)
    # 256 x 2048 = 0.5M tokens per step. micro_batches=0: as few micro-batches as fit in device
    # memory, by the planner (`python -m jaxlm.plan --config=configs/1b.py --devices=N`): on 80 GB
    # GPUs 2 of 16 sequences per device on 8, 32 of 8 on one (16 of 16 under remat=dots).
    c.optim.update(peak_lr=4e-4, warmup_steps=2000, min_lr_ratio=0.1, micro_batches=0)
    c.run.update(steps=100_000, log_every=50, eval_every=2000)
    return c
