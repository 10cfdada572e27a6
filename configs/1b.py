"""Llama-style 1.1B model (TinyLlama shape: 22 layers, width 2048, 32 heads, 4 KV heads), sequence 2048."""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp_dim=5632, tie_embeddings=False,
        # Layers unrolled, not scanned: no stacking of the saved activations and no per-micro-batch zeroing
        # of the scan's buffers, and XLA schedules the weights' collectives across layers. No
        # rematerialization: with the weight gradients summed in the matmuls (`layers.ComputeKernel`) many
        # small micro-batches cost little more than a few large ones, and nothing is computed twice. The
        # H100 program compiled here (`python -m jaxlm.plan --target=h100 --choose`, benchmarks/BENCHMARKS.md):
        # roofline-bound MFU 0.815 on one H100 (the planner's 32 micro-batches) and 0.815 on eight (2), against
        # 0.804 and 0.804 under remat=dots_mlp (which keeps the matmuls' outputs and the MLP's hidden activation)
        # and 0.653 scanned without remat before. Compiling takes about 20 s here for eight.
        scan_layers=False, remat="none",
    )
    c.data.update(seq_len=2048, global_batch_size=256, builtin_max_bytes=64_000_000)
    # 256 x 2048 = 0.5M tokens per step. micro_batches=0: as few micro-batches as fit in device
    # memory, by the planner (`python -m jaxlm.plan --config=configs/1b.py --devices=N`): on 80 GB
    # GPUs 2 of 16 sequences per device on 8, 32 of 8 on one.
    c.optim.update(peak_lr=4e-4, warmup_steps=2000, min_lr_ratio=0.1, micro_batches=0)
    c.run.update(steps=100_000, log_every=50, eval_every=2000)
    return c
