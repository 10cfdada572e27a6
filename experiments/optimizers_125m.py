"""AdamW, Muon, Lion and schedule-free AdamW on the 125m-shaped model on a CPU: does the tiny recipe's
ranking (experiments/optimizers.py) hold at GPT-2 small's width and depth?

`configs/125m.py` (12 layers of width 768, 32k vocabulary, tied embeddings: 109.5M parameters) cut to what
a 2-core CPU trains in minutes a run: 200 steps of 8 sequences x 128 tokens (0.2M tokens), 20 steps of
warmup then cosine to 10%, on the first 8 MB of the built-in corpus, one micro-batch, one device. Each
optimizer at two or three peak learning rates a factor of 3 apart, around the rate that was best on the
tiny recipe relative to AdamW's; one seed. Settings per optimizer as in experiments/optimizers.py
(schedule-free AdamW on a constant schedule after the warmup; Lion with weight decay 1.0).

Status (2026-11-28): unfinished. The runs so far shared the machine with other jobs (their clocks are not
comparable: time comes from the quiet step times below). Final validation loss (nats per token on the
built-in corpus's validation split; evaluations at steps 50, 100, 150, 200):

| run | val loss at 50 / 100 / 150 / 200 |
|---|---|
| adamw lr 3e-4 | 3.744 / 2.881 / 2.427 / **2.248** |
| adamw lr 1e-3 | 3.980 / 2.958 / 2.481 / 2.253 |
| muon lr 1e-3 | 2.810 / 2.223 / 1.864 / 1.700 |
| muon lr 3e-3 | 2.843 / 2.289 / 1.780 / **1.580** |

Muon reaches AdamW's final loss in about half the tokens (2.22 at step 100 against AdamW's 2.25 at 200)
and ends 0.67 lower; its best rate so far is the sweep's edge (1e-2 added). Its steps, though, cost 4.3
times AdamW's here: quiet step times (benchmarks/train_throughput.py, same shapes, one CPU device, 10
steps after 2) AdamW 1.48 s, Lion 1.50 s, schedule-free AdamW 1.63 s, Muon 6.37 s. Newton-Schulz costs per
step, not per token: five iterations on every 768 x 768 and 768 x 2048 matrix in float32 are about 1.7
TFLOP, more than the forward and backward of 1,024 tokens (0.7 TFLOP in bfloat16). At equal time AdamW's 200
steps (296 s) are ahead of Muon's 46 (about step 50: 2.81-2.84). At the batch the 125m recipe trains
with (64 x 2048 tokens: 86 TFLOP a step) the same iterations would be about 2% of the FLOPs (estimated;
measured for the 1b recipe on 8 H100s: 3.3% of the step, benchmarks/BENCHMARKS.md), so this CPU's tiny
batch is the worst case for Muon's time. Lion and schedule-free AdamW: not run yet.

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
