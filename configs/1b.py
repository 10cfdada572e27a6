"""Llama-style 1.1B model (TinyLlama shape: 22 layers, width 2048, 32 heads, 4 KV heads), sequence 2048."""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp_dim=5632, tie_embeddings=False
    )
    c.data.update(seq_len=2048, global_batch_size=256, builtin_max_bytes=64_000_000)
    # 256 x 2048 = 0.5M tokens per step. Four micro-batches keep 8 sequences per device per
    # micro-batch on 8 GPUs (about 25 GB of bf16 activations without remat, by a rough count).
    c.optim.update(peak_lr=4e-4, warmup_steps=2000, min_lr_ratio=0.1, micro_batches=4)
    c.run.update(steps=100_000, log_every=50, eval_every=2000)
    return c
