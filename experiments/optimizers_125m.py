"""AdamW, Muon, Lion and schedule-free AdamW on the 125m-shaped model on a CPU: does the tiny recipe's
ranking (experiments/optimizers.py) hold at GPT-2 small's width and depth?

`configs/125m.py` (12 layers of width 768, 32k vocabulary, tied embeddings: 109.5M parameters) cut to what
a 2-core CPU trains in minutes a run: 200 steps of 8 sequences x 128 tokens (0.2M tokens), 20 steps of
warmup then cosine to 10%, on the first 8 MB of the built-in corpus, one micro-batch, one device. Each
optimizer at two or three peak learning rates a factor of 3 apart, around the rate that was best on the
tiny recipe relative to AdamW's; one seed. Settings per optimizer as in experiments/optimizers.py
(schedule-free AdamW on a constant schedule after the warmup; Lion with weight decay 1.0).

What it found (2026-11-28, 2-core AMD EPYC, jax 0.10.2; the runs shared the machine with other jobs, so their
own clocks are not comparable: time comes from the quiet step times below). Validation loss (nats per token)
at steps 50, 100, 150 and 200, and the final training loss (the mean of the last 10% of the logged steps: every
batch is new text, one pass over a fraction of the corpus, so it is a held-out measure too):

| run | val loss at 50 / 100 / 150 / 200 | final train loss |
|---|---|---|
| muon lr 1e-3 | 2.810 / 2.223 / 1.864 / 1.700 | 4.128 |
| **muon lr 3e-3** | 2.843 / 2.289 / 1.780 / **1.580** | **3.986** |
| muon lr 1e-2 | 3.748 / 2.478 / 2.033 / 1.718 | 4.131 |
| **schedule-free adamw lr 3e-4** | 3.427 / 2.651 / 2.260 / **2.027** | **4.441** |
| schedule-free adamw lr 1e-3 | 3.642 / 2.719 / 2.316 / 2.103 | 4.579 |
| **adamw lr 3e-4** | 3.744 / 2.881 / 2.427 / **2.248** | **4.647** |
| adamw lr 1e-3 | 3.980 / 2.958 / 2.481 / 2.253 | 4.701 |
| **lion lr 1e-4** | 4.035 / 2.951 / 2.479 / **2.307** | **4.730** |
| lion lr 3e-4 | 4.159 / 3.309 / 2.642 / 2.413 | 4.807 |

- **In tokens, the tiny recipe's ranking holds at 125m**: Muon, then schedule-free AdamW, AdamW, Lion, by
  both measures. Muon at its best rate ends 0.67 below AdamW's best in validation loss (1.58 against 2.25)
  and 0.66 in training loss, and reaches AdamW's final validation loss in half the tokens (2.22 at step 100
  at 1e-3). Its best rate, 3e-3, is ten times AdamW's best (three times on the tiny recipe), and 1e-2, the
  tiny recipe's best, is worse here: sweep it. Schedule-free AdamW without decay ends 0.22 below AdamW with
  its cosine decay (0.10 on the tiny recipe); Lion ends 0.06 above AdamW.
- **Sweep edges**: AdamW's, schedule-free AdamW's and Lion's best rates are the lower ends of their sweeps.
  AdamW's two rates differ by 0.006 (flat: near its best); schedule-free AdamW's by 0.08 and Lion's by 0.11,
  so lower rates might narrow their gaps to Muon (not run).
- **In time, on this CPU, AdamW and schedule-free AdamW lead**: quiet step times (benchmarks/train_throughput.py,
  same shapes, one CPU device, 10 steps after 2) AdamW 1.48 s, Lion 1.50 s, schedule-free AdamW 1.63 s,
  Muon 6.37 s. Newton-Schulz costs per step, not per token: five iterations on every 768 x 768 and 768 x
  2048 matrix in float32 are about 1.7 TFLOP, more than the forward and backward of these 1,024 tokens (0.7
  TFLOP in bfloat16). When AdamW ends its 200 steps (296 s), schedule-free AdamW is near step 182 (validation
  about 2.1, interpolated) and Muon near step 46, before its first evaluation (2.84 at step 50). At the batch
  the 125m recipe trains with (64 x 2048 tokens: 86 TFLOP a step) the same iterations would be about 2% of
  the FLOPs (estimated; measured for the 1b recipe on 8 H100s: 3.3% of the step, benchmarks/BENCHMARKS.md):
  this CPU's tiny batch is the worst case for Muon's time.
- **The validation set is narrow**: with this corpus cap (8 MB) the held-out documents are 5 files of the
  standard library, 81% of their characters two generated codec mapping tables (cp866, mac_croatian), which
  the model learns fast from the many such tables it trains on; hence validation losses far below training
  losses. Both measures rank the runs alike; the training loss is the one to compare with other corpora.

One seed each; a 125m-shaped model's first 0.2M tokens, not where the optimizers converge.

    python -m jaxlm.experiment experiments/optimizers_125m.py --parallel 1 \
        --results_dir experiments/results/optimizers_125m
    python benchmarks/train_throughput.py --recipes 125m --set data.seq_len=128 data.global_batch_size=8 \
        optim.micro_batches=1 mesh.fsdp=1 data.builtin_max_bytes=8000000 optim.name=muon --steps 10
"""

from jaxlm.experiment import Experiment


def sweep(name: str, rates, **settings) -> dict:
    return {f"{name}-lr{rate:g}": {"optim.name": name.replace("-", "_"), "optim.peak_lr": rate, **settings}
            for rate in rates}


EXPERIMENT = Experiment(
    recipe="125m",
    base={"run.steps": 200, "run.eval_every": 50, "run.log_every": 10, "optim.warmup_steps": 20,
          "optim.micro_batches": 1, "data.seq_len": 128, "data.global_batch_size": 8,
          "data.builtin_max_bytes": 8_000_000, "mesh.fsdp": 1},
    variants={
        **sweep("adamw", (3e-4, 1e-3)),
        **sweep("muon", (1e-3, 3e-3, 1e-2)),
        **sweep("lion", (1e-4, 3e-4), **{"optim.weight_decay": 1.0}),
        **sweep("schedule-free-adamw", (3e-4, 1e-3), **{"optim.schedule": "constant"}),
    },
    seeds=[0],
    metric="final_val_loss",
    columns=["params"],
)
