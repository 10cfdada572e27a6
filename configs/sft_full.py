"""Full supervised fine-tuning (every parameter trains), from a run or an imported Hugging Face model:

    python -m jaxlm.train --config=configs/sft_full.py --config.run.init_from=runs/base \\
        --config.data.corpus=chats.jsonl

As configs/sft_lora.py (read its docstring), with the settings TRL's SFT examples use for full
fine-tuning: learning rate 2e-5 with 3% warmup and a cosine decay, no weight decay, Adam's beta2 0.999.
The optimizer holds two float32 moments per parameter (16 bytes per parameter with float32 weights):
`python -m jaxlm.plan` with the same flags says whether it fits, and what to change when it does not.
"""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mlp_dim=384)  # (no init_from)
    c.data.update(corpus="builtin_chat", format="chat", seq_len=512, global_batch_size=16, val_fraction=0.15,
                  val_tokens=32768)
    c.optim.update(peak_lr=2e-5, warmup_steps=30, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.0, b2=0.999)
    c.run.update(steps=1000, log_every=10, eval_every=100, eval_at_start="on")
    c.checkpoint.update(every_steps=200, every_minutes=0.0, keep_last=2)
    return c
