"""Llama-style 350M-class model (GPT-2 medium width and depth, tied embeddings, 32k vocabulary)."""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, mlp_dim=2816, tie_embeddings=True)
    c.data.update(seq_len=2048, global_batch_size=128, builtin_max_bytes=64_000_000)
    # micro_batches=0: as few as fit in device memory (jaxlm.plan): 1 on 8 GPUs, 8 on one 80 GB GPU.
    c.optim.update(peak_lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1, micro_batches=0)
    c.run.update(steps=40_000, log_every=50, eval_every=1000)
    return c
