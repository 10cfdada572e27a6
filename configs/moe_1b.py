"""A Mixture of Experts of about 1B parameters, 0.33B active per token, for GPUs: the 1b recipe's
training setup (sequence 2048, 256 rows per step, AdamW schedule, layers unrolled without remat) with a
narrower residual stream (1024, 16 layers, 16 heads of 64, 4 KV heads) and in every layer 8 SwiGLU
experts of 2304 hidden units, 2 routed per token (`model.mlp=moe`).

`model.moe_impl=auto`: tokamax's grouped GEMM on GPUs where it is installed (the `cuda12` extra), else
capacity dispatch: jax's own grouped matmul costs the experts' FLOPs times E there (benchmarks/BENCHMARKS.md).
"""

from jaxlm.config import load_recipe


def get_config():
    c = load_recipe("1b")
    c.model.update(d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4, mlp="moe", mlp_dim=2304, moe_experts=8,
                   moe_top_k=2)
    return c
