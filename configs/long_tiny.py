"""Context extension on a CPU: configs/tiny.py's trained model (runs/tiny, rows of 128 tokens) continued on
rows 4x as long (512 tokens) with its RoPE rescaled by YaRN (factor 4 around the 128 tokens it was trained
on), for 100 steps at a tenth of its learning rate. Two commands, the base first (about a minute on 2 CPU
cores), then the extension, which evaluates at the long length before its first step (YaRN, untrained:
step 0 in metrics.jsonl) and at the end:

    python -m jaxlm.train --config=configs/tiny.py         # the base: runs/tiny, trained at 128 tokens
    python -m jaxlm.train --config=configs/long_tiny.py    # the extension: runs/long_tiny, at 512 tokens
    python -m jaxlm.evaluate --run_dir=runs/long_tiny --seq_len=128   # the short context it still has

`run.init_from` reads runs/tiny's parameters (step 0, a fresh optimizer); its architecture is the source's, but
the RoPE settings this recipe sets and its own model.max_seq_len (set apart from data.seq_len) are the new
run's (`jaxlm.init_from.POSITION_MODEL_KEYS`). The base at 512 tokens without rescaling (positions it never
saw) is the same run with `--config.model.rope_scaling=none --config.run.name=long_tiny_plain`; linear
interpolation, `--config.model.rope_scaling=linear`. docs/parallelism.md, "Extending the context", has the
measurements; for a longer context than one device holds, add mesh.context (context parallelism, same page).
"""

from jaxlm.config import load_recipe

FACTOR = 4


def get_config():
    c = load_recipe("tiny")  # the base's data, tokenizer and model
    base_len = c.data.seq_len
    c.model.update(rope_scaling="yarn", rope_factor=float(FACTOR), rope_original_max_len=base_len)
    # tokens per step kept; the held-out set 64k tokens (128 rows of 512), the base recipe's 8k being 16 rows
    c.data.update(seq_len=FACTOR * base_len, global_batch_size=c.data.global_batch_size // FACTOR, val_tokens=65536)
    with c.unlocked():  # the model's context a key of its own: this run's, not the source's (run.init_from)
        del c.model["max_seq_len"]
        c.model.max_seq_len = FACTOR * base_len
    c.optim.update(peak_lr=c.optim.peak_lr / 10, warmup_steps=10)
    c.run.update(name="long_tiny", init_from="runs/tiny", steps=100, log_every=25, eval_every=50)
    return c
