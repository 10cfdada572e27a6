"""Supervised fine-tuning with QLoRA (Dettmers et al., 2023): LoRA adapters on a frozen base stored in
4-bit NormalFloat, from a run or an imported Hugging Face model:

    python -m jaxlm.train --config=configs/sft_qlora.py --config.run.init_from=runs/base \\
        --config.data.corpus=chats.jsonl

As configs/sft_lora.py (read its docstring), with the QLoRA paper's settings for models up to 13B:
the base in NF4 with double quantization, adapters of rank 64 (alpha 16, dropout 0.1) on every
projection but the unembedding, learning rate 2e-4 held constant after a 3% warmup, gradient clipping
at 0.3, Adam's beta2 0.999 and no weight decay. An adapter trained on this base fits the base
dequantized from NF4, not the original weights: export it merged, or with that base
(docs/fine-tuning.md).
"""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mlp_dim=384)  # (no init_from)
    c.data.update(corpus="builtin_chat", format="chat", seq_len=512, global_batch_size=16, val_fraction=0.15,
                  val_tokens=32768)
    c.lora.update(rank=64, alpha=16.0, dropout=0.1, targets="all", quantize_base="nf4", double_quant=True)
    c.optim.update(peak_lr=2e-4, warmup_steps=30, schedule="constant", weight_decay=0.0, b2=0.999, clip_norm=0.3)
    c.run.update(steps=1000, log_every=10, eval_every=100, eval_at_start="on")
    c.checkpoint.update(every_steps=200, every_minutes=0.0, keep_last=2)
    return c
