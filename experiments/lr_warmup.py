"""Peak learning rate x warmup length on the tiny recipe: which learning rate is best at this scale,
and does a warmup matter with gradient clipping on?

150 steps of `configs/tiny.py` (1.3M parameters, the built-in corpus, cosine decay to 10%) for each of
3 peak learning rates x 2 warmup lengths x 2 seeds: 12 runs. Measured: 43 minutes with `--parallel 2`
on two CPU cores that other jobs were also using (results/lr_warmup/results.csv has each run's time).

    python -m jaxlm.experiment experiments/lr_warmup.py --parallel 2 --results_dir experiments/results/lr_warmup
    python -m jaxlm.experiment experiments/lr_warmup.py --search random --trials 8   # the search space instead
"""

from jaxlm.experiment import Experiment, IntUniform, LogUniform, grid

EXPERIMENT = Experiment(
    recipe="tiny",
    base={"run.steps": 150, "run.eval_every": 25, "run.log_every": 25},
    variants=grid({"optim.peak_lr": [1e-3, 3e-3, 1e-2], "optim.warmup_steps": [0, 40]}),
    seeds=[0, 1],
    metric="final_val_loss",
    search_space={"optim.peak_lr": LogUniform(3e-4, 3e-2), "optim.warmup_steps": IntUniform(0, 60)},
)
