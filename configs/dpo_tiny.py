"""DPO on a tiny model, on CPU in about a minute: the built-in preference set (each built-in chat
answer preferred to itself written backwards, `jaxlm.data.preferences.builtin_pairs`), rendered with
the `simple` chat template (a tokenizer trained here has none), the reference's log-probs computed
once before the first step (`jaxlm.objectives.dpo`):

    python -m jaxlm.train --config=configs/dpo_tiny.py

For a real model, start from it and give your pairs (JSONL of {prompt, chosen, rejected}):

    python -m jaxlm.train --config=configs/dpo_tiny.py --config.run.init_from=runs/sft \\
        --config.data.corpus=pairs.jsonl --config.data.chat_template= --config.lora.rank=16

(with LoRA the reference is the base with the adapters off; --config.dpo.reference=live computes it in
the step instead of before). The learning rate and beta are those of TRL's DPO examples for full
training of a small model (5e-7 there for 7B models; this model starts random, so higher here).
"""

from jaxlm.config import base_config


def get_config():
    c = base_config()
    c.objective.name = "dpo"
    c.dpo.update(beta=0.1, loss="sigmoid", reference="precomputed")
    c.model.update(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=192, dtype="float32")
    c.data.update(corpus="builtin_preferences", chat_template="simple", seq_len=192, global_batch_size=16,
                  val_fraction=0.1, val_tokens=192 * 64, tokenizer_type="bpe")
    c.optim.update(peak_lr=1e-3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.0)
    c.run.update(steps=60, log_every=10, eval_every=30, eval_at_start="on")
    c.checkpoint.update(every_steps=30, every_minutes=0.0, keep_last=2)
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    return c
