"""GRPO on a tiny model, on CPU: two-digit addition ("12+34=" -> "46") with the exact-match reward.

Two commands (the first SFTs a small model on part of the sums, the second trains it with GRPO and
reports the held-out exact-match accuracy, greedy, before the first step and at each evaluation):

    python -m jaxlm.train --config=configs/grpo_tiny.py:sft     # runs/grpo_tiny_sft: supervised on the sums
    python -m jaxlm.train --config=configs/grpo_tiny.py         # runs/grpo_tiny: GRPO from it

A random model never answers a sum right, so every group's rewards are equal and GRPO has nothing to
learn from (every advantage is 0): the SFT stage gives it a model that is sometimes right. Both read
`data.corpus=builtin_addition` (`jaxlm/data/builtin_addition.py`), with the same `data.val_fraction`
and seed, so that the prompts GRPO holds out were held out of SFT too. A byte tokenizer (no training):
every digit is a token.

For your own model and prompts (JSONL of {prompt, answer}; a prompt may be a list of chat messages):

    python -m jaxlm.train --config=configs/grpo_tiny.py --config.run.init_from=runs/sft \\
        --config.data.corpus=prompts.jsonl --config.lora.rank=16 --config.grpo.beta=0.04
"""

from jaxlm.config import base_config


def get_config(stage: str = "grpo"):
    if stage not in ("grpo", "sft"):
        raise ValueError(f"configs/grpo_tiny.py:{stage}: the stage is sft or grpo")
    c = base_config()
    c.model.update(vocab_size=288, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=192, dtype="float32")
    c.data.update(corpus="builtin_addition", seq_len=24, val_fraction=0.1, tokenizer_type="byte")
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.checkpoint.update(every_minutes=0.0, keep_last=2)
    if stage == "sft":
        c.run.update(name="grpo_tiny_sft", steps=450, log_every=50, eval_every=0)
        c.data.update(format="prompt_completion", global_batch_size=32)
        c.optim.update(peak_lr=3e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.0)
        c.checkpoint.update(every_steps=450)
        return c
    c.objective.name = "grpo"
    c.grpo.update(group_size=8, max_prompt_len=16, max_new_tokens=8, temperature=1.0, rewards="exact_match", mu=2,
                  beta=0.0, loss_aggregation="token")
    # 128 prompts x 8 completions per rollout, two optimizer steps on each: with fewer prompts (8 to 32) the
    # gradient's noise outweighed its signal and the held-out accuracy fell; with one step per rollout it rose
    # at half the pace (docs/post-training.md, GRPO, has the measurements)
    c.data.update(global_batch_size=1024)
    c.optim.update(peak_lr=3e-4, warmup_steps=10, schedule="constant", weight_decay=0.0)
    c.run.update(name="grpo_tiny", init_from="runs/grpo_tiny_sft", steps=400, log_every=50, eval_every=50,
                 eval_at_start="on")
    c.checkpoint.update(every_steps=400)
    return c
