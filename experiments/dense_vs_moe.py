"""Dense vs Mixture-of-Experts MLPs at the same active parameters per token, in the tiny model on a CPU.

Every variant's tokens go through 384 SwiGLU hidden units per layer, as the dense tiny model's do: top-1
routing to experts of 384 units, top-2 to experts of 192, and with one shared expert (which every token
uses, of model.mlp_dim units) the routed width shrinks to keep the sum: top-1 192 + shared 192, top-2
2 x 128 + shared 128. The experts (E = 4, 8, 16) add total parameters, not active ones (the router adds
E x 128 per layer). All MoE variants use capacity dispatch (capacity factor 1.25: the fast path on a CPU;
what does not fit is dropped, `aux/moe_dropped`), the default router (top-k logits softmaxed) and
balancing loss (0.01); E8-top2-dropless is the recipe configs/moe_tiny.py's variant with the dropless
grouped matmul instead, to show what the dropped tokens cost. Same tokens (data.seed), steps, batch and
learning rate for all: 300 steps of `configs/tiny.py` (16 x 128 tokens each) on the built-in corpus,
9 variants x 2 seeds: 18 runs. Validation loss is the cross-entropy alone; the training loss includes
the balancing loss. Measured: 38 minutes with `--parallel 2` on two CPU cores that other jobs were also
using (load average 8-11 for most of it, 5-6 at the end), so the table's tokens/s are not comparable
across variants: each run shared the cores with another and with a changing load.

What it found: at this scale (300 steps, 0.6M tokens, 4 layers of width 128) no MoE variant beat the dense
model by more than the seeds' spread, and most were worse. The best, E8-top2-shared, reached a final
validation loss of 4.091 ± 0.075 against the dense model's 4.113 ± 0.004: better by 0.073 with seed 1,
worse by 0.028 with seed 0. E8-top1-shared (4.127 ± 0.042), E16-top2 (4.148 ± 0.057) and E8-top2 (4.156 ±
0.036) lie within about one spread of dense. Top-1 routing without a shared expert was clearly worse, the
more so the more experts: E4 4.269 ± 0.042, E8 4.392 ± 0.021, E16 4.566 ± 0.157 (plausibly as each expert
trains on 1/E of a run this short's tokens; not tested here). Capacity dispatch dropped many pairs while
the router settled (from the runs' metrics.jsonl): the E16 variants 10-14% of their (token, expert) pairs
over the run (23-28% in the first 100 steps, 2-3% in the last 30, the table's column), the E8 ones 5-7%,
E4-top1 3-4%. The dropless E8-top2 did no better than the capacity one (4.187 ± 0.028 against 4.156 ±
0.036), so at E = 8 the drops cost no loss that two seeds can show. This tiny CPU run therefore does not
reproduce the literature's claim (lower loss at equal active compute), nor is it evidence against it:
those gains are reported at budgets of billions of tokens; here top-2 routing or a shared expert keeps MoE
about level with dense, and top-1 routing alone falls behind. The test would be thousands of steps with
three or more seeds. Speed, measured apart (two back-to-back rounds of each variant with `--parallel 1
--seeds 0 --set run.steps=60` in another output directory, load average about 1-3 and then 4-6; 60 steps
are a few seconds, so this is noisy too): the other capacity variants ran at 0.54-0.72x and 0.67-0.79x the
dense model's tokens/s, E16-top2 at 0.34x and 0.58x, the dropless E8-top2 at 0.14x and 0.28x.

    python -m jaxlm.experiment experiments/dense_vs_moe.py --parallel 2 --results_dir experiments/results/dense_vs_moe
"""

from jaxlm.experiment import Experiment


def moe(experts: int, top_k: int, width: int, shared: int = 0, **more) -> dict:
    return {"model.mlp": "moe", "model.mlp_dim": width, "model.moe_experts": experts, "model.moe_top_k": top_k,
            "model.moe_shared_experts": shared, **more}


EXPERIMENT = Experiment(
    recipe="tiny",
    base={"run.steps": 300, "run.eval_every": 50, "run.log_every": 25,
          "model.moe_impl": "capacity", "model.moe_capacity_factor": 1.25},  # (ignored by the dense variant)
    variants={
        "dense": {"model.mlp": "swiglu", "model.mlp_dim": 384},
        "E4-top1": moe(4, 1, 384),
        "E8-top1": moe(8, 1, 384),
        "E16-top1": moe(16, 1, 384),
        "E8-top2": moe(8, 2, 192),
        "E16-top2": moe(16, 2, 192),
        "E8-top1-shared": moe(8, 1, 192, shared=1),
        "E8-top2-shared": moe(8, 2, 128, shared=1),
        "E8-top2-dropless": moe(8, 2, 192, **{"model.moe_impl": "ragged"}),
    },
    seeds=[0, 1],
    metric="final_val_loss",
    # summary.json's parameter counts; the MoE metrics' means over the last 30 steps (none for the dense model)
    columns=["params", "active_params", "aux/moe_dropped", "aux/moe_balance", "aux/moe_load_max", "aux/moe_load_min",
             "aux/moe_load_entropy"],
)
