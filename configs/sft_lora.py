"""Supervised fine-tuning with LoRA adapters, from a run or an imported Hugging Face model:

    python -m jaxlm.hf import --hf_dir=<a Hugging Face model directory> --output=runs/base
    python -m jaxlm.train --config=configs/sft_lora.py --config.run.init_from=runs/base \\
        --config.data.corpus=chats.jsonl

The architecture and the tokenizer come from run.init_from (its chat template renders the rows; set
data.chat_template for a tokenizer without one); the model keeps the base's context, data.seq_len is
only the rows' length. The defaults are those PEFT's and TRL's documentation and the QLoRA paper use:
adapters of rank 16 (alpha 32, dropout 0.05) on every projection but the unembedding, learning rate
2e-4 with 3% warmup and a cosine decay, Adam's beta2 0.999, no weight decay (the adapters start at
zero and are few), checkpoints by steps only. 15% of the conversations are held out (enough answer
tokens from the small built-in corpus; lower data.val_fraction for a large one), evaluated before the
first step (the base's loss) and every 100 steps. Without run.init_from it fine-tunes a
small random model on the built-in chat corpus, a check that everything runs in minutes (with
--config.data.chat_template=simple: a tokenizer trained here has no chat template).
"""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mlp_dim=384)  # (no init_from)
    c.data.update(corpus="builtin_chat", format="chat", seq_len=512, global_batch_size=16, val_fraction=0.15,
                  val_tokens=32768)
    c.lora.update(rank=16, alpha=32.0, dropout=0.05, targets="all")
    c.optim.update(peak_lr=2e-4, warmup_steps=30, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.0, b2=0.999)
    c.run.update(steps=1000, log_every=10, eval_every=100, eval_at_start="on")
    c.checkpoint.update(every_steps=200, every_minutes=0.0, keep_last=2)
    return c
