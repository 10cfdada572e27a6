"""Llama-style 125M-class model (GPT-2 small width and depth, tied embeddings, 32k vocabulary)."""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, mlp_dim=2048, tie_embeddings=True)
    c.data.update(seq_len=2048, global_batch_size=64, builtin_max_bytes=64_000_000)
    # micro_batches=0: as few as fit in device memory (jaxlm.plan): 1 on 8 GPUs, 1 on one 80 GB GPU.
    c.optim.update(peak_lr=6e-4, warmup_steps=1000, min_lr_ratio=0.1, micro_batches=0)
    c.run.update(steps=20_000, log_every=50, eval_every=1000)
    return c
