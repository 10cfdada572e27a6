"""The tiny recipe as a Mixture of Experts, for CPUs: every MLP becomes 8 SwiGLU experts of 192 hidden
units with 2 routed per token, the same active parameters per token as tiny's 384-unit MLP (4x its MLP
parameters in all).

Capacity dispatch (each expert takes at most 1.25x its balanced share of a row's tokens, the rest
dropped and counted in aux/moe_dropped), what `model.moe_impl=auto` picks on a CPU: there the dropless
grouped matmul (`model.moe_impl=ragged`) runs as a masked dense matmul over every expert, several times
slower (benchmarks/BENCHMARKS.md).
"""

from jaxlm.config import load_recipe


def get_config():
    c = load_recipe("tiny")
    c.model.update(mlp="moe", mlp_dim=192, moe_experts=8, moe_top_k=2, moe_impl="capacity")
    return c
