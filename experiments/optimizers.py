"""AdamW, Muon, Lion and schedule-free AdamW on the tiny recipe on a CPU, each at its best learning rate
of a small sweep: which reaches the lowest validation loss in the same tokens, and in the same time?

`configs/tiny.py` (1.3M parameters, the built-in corpus, 300 steps of 16 x 128 tokens) with each
optimizer at three peak learning rates around its usual range, one seed: 12 runs. AdamW, Muon and Lion
keep the recipe's schedule (30 steps of warmup, cosine to 10%); schedule-free AdamW replaces the decay
by its averaging (`optim.schedule=constant` after the same warmup, the only schedule it takes). Muon
orthogonalizes the attention and MLP matrices with its default RMS-matched scaling (so its learning rate
is on AdamW's scale) and trains the rest with AdamW at the same rate. Lion's sign updates are larger per
step than Adam's: its rates are 3-10x lower and its weight decay 10x higher (1.0), as Chen et al.
recommend, so the decay per step (lr x weight_decay) stays in AdamW's range.

    python -m jaxlm.experiment experiments/optimizers.py --parallel 1 --results_dir experiments/results/optimizers

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
        **sweep("muon", (1e-3, 3e-3, 1e-2)),
        **sweep("lion", (1e-4, 3e-4, 1e-3), **{"optim.weight_decay": 1.0}),
        **sweep("schedule-free-adamw", (1e-3, 3e-3, 1e-2), **{"optim.schedule": "constant"}),
    },
    seeds=[0],
    metric="final_val_loss",
    columns=["params"],
)
