"""RMSNorm vs LayerNorm x SwiGLU vs GELU in the tiny Llama-style model.

Each component is a config override (`model.norm`, `model.mlp`), not a code change. The GELU MLP is
widened from 384 to 576 hidden units so that every variant has the same parameters (two 128 x 576
matrices hold as many as SwiGLU's three 128 x 384); LayerNorm has no bias, like the rest of the model.
150 steps of `configs/tiny.py` on the built-in corpus, 4 variants x 2 seeds: 8 runs. Measured: 20
minutes with `--parallel 2` on two CPU cores that other jobs were also using.

    python -m jaxlm.experiment experiments/norm_mlp.py --parallel 2 --results_dir experiments/results/norm_mlp
"""

from jaxlm.experiment import Experiment

EXPERIMENT = Experiment(
    recipe="tiny",
    base={"run.steps": 150, "run.eval_every": 25, "run.log_every": 25},
    variants={
        "rmsnorm-swiglu": {"model.norm": "rmsnorm", "model.mlp": "swiglu"},
        "rmsnorm-gelu": {"model.norm": "rmsnorm", "model.mlp": "gelu", "model.mlp_dim": 576},
        "layernorm-swiglu": {"model.norm": "layernorm", "model.mlp": "swiglu"},
        "layernorm-gelu": {"model.norm": "layernorm", "model.mlp": "gelu", "model.mlp_dim": 576},
    },
    seeds=[0, 1],
    metric="final_val_loss",
)
