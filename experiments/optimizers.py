"""AdamW, Muon, Lion and schedule-free AdamW on the tiny recipe on a CPU, each at its best learning rate
of a small sweep: which reaches the lowest validation loss in the same tokens, and in the same time?

`configs/tiny.py` (1.3M parameters, the built-in corpus, 300 steps of 16 x 128 tokens) with each
optimizer at three or four peak learning rates around its usual range, one seed: 14 runs; then each
optimizer's best rate with seeds 1 and 2 (results/optimizers/best_3_seeds). AdamW, Muon and Lion
keep the recipe's schedule (30 steps of warmup, cosine to 10%); schedule-free AdamW replaces the decay
by its averaging (`optim.schedule=constant` after the same warmup, the only schedule it takes). Muon
orthogonalizes the attention and MLP matrices with its default RMS-matched scaling (so its learning rate
is on AdamW's scale) and trains the rest with AdamW at the same rate. Lion's sign updates are larger per
step than Adam's: its rates are 3-10x lower and its weight decay 10x higher (1.0), as Chen et al.
recommend, so the decay per step (lr x weight_decay) stays in AdamW's range.

What it found (2026-11-28, 2-core AMD EPYC, jax 0.10.2, `--parallel 1` on an otherwise quiet machine;
final validation loss, mean ± std over 3 seeds at each optimizer's best rate):

| optimizer | best peak lr (swept) | final val loss | tokens/s | 300 steps in | val loss at 26.2 s |
|---|---|---|---|---|
| Muon | 1e-2 (1e-3, 3e-3, 1e-2, 3e-2) | **3.586 ± 0.011** | 21,700 | 30.8 s | 3.69 |
| schedule-free AdamW | 3e-3 (1e-3, 3e-3, 1e-2) | 3.990 ± 0.037 | 24,800 | 27.2 s | 4.03 |
| AdamW | 3e-3 (1e-3, 3e-3, 1e-2) | 4.091 ± 0.038 | 24,700 | 26.2 s | 4.09 |
| Lion (weight decay 1.0) | 1e-3 (1e-4, 3e-4, 1e-3, 3e-3) | 4.339 ± 0.056 | 24,900 | 26.7 s | 4.35 |

Muon ends 0.50 nats below AdamW in the same tokens, thirteen times the seeds' spread, and is below it at
every evaluation from the first (step 50: 4.66 against 5.27). Its steps cost about 18% more here (the
Newton-Schulz iterations on every matrix, every step, and a few seconds more of compilation), and it is
ahead in time too: when AdamW ends its 300 steps (26.2 s, the mean over seeds), Muon's loss is 3.69
(each run's evaluations interpolated at that time; loss_vs_time.png). Its best rate, 1e-2, is about three
times AdamW's (3e-3), with 3e-2 (3.742) and 3e-3 (3.731) worse: the RMS-matched scaling did not make
AdamW's best rate Muon's. Schedule-free AdamW, with no decay, beat AdamW with its cosine decay by 0.10,
under three spreads; Lion at its best rate was 0.25 worse than AdamW (its weight decay not swept). At
this scale (1.3M parameters, 0.6M tokens) these are the optimizers' early-training speeds, not where they
converge; the 125m-shaped model is the next run to make.

    python -m jaxlm.experiment experiments/optimizers.py --parallel 1 --results_dir experiments/results/optimizers
    python -m jaxlm.experiment experiments/optimizers.py --parallel 1 --seeds 0,1,2 \
        --only muon-lr0.01,adamw-lr0.003,schedule-free-adamw-lr0.003,lion-lr0.001 \
        --results_dir experiments/results/optimizers/best_3_seeds

`--parallel 1` on an otherwise quiet machine: loss_vs_time.png compares the runs' own clocks.
"""

from jaxlm.experiment import Experiment


def sweep(name: str, rates, **settings) -> dict:
    return {f"{name}-lr{rate:g}": {"optim.name": name.replace("-", "_"), "optim.peak_lr": rate, **settings}
            for rate in rates}


EXPERIMENT = Experiment(
    recipe="tiny",
    base={"run.steps": 300, "run.eval_every": 50, "run.log_every": 10},
    variants={
        **sweep("adamw", (1e-3, 3e-3, 1e-2)),
        **sweep("muon", (1e-3, 3e-3, 1e-2, 3e-2)),
        **sweep("lion", (1e-4, 3e-4, 1e-3, 3e-3), **{"optim.weight_decay": 1.0}),
        **sweep("schedule-free-adamw", (1e-3, 3e-3, 1e-2), **{"optim.schedule": "constant"}),
    },
    seeds=[0],
    metric="final_val_loss",
    columns=["params"],
)
