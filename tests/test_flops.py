"""`flops_per_token` against the FLOPs XLA's cost analysis reports for the compiled train step.

XLA's count differs from the model's in two known ways, both handled explicitly below:
- it counts the full T x T attention matmuls (the mask is applied after QK^T, nothing is skipped),
  where `flops_per_token` counts half of them (causal); so the matmul part is compared against
  `flops_per_token + the other half of the attention`;
- it also counts elementwise work (norms, softmax, RoPE, the loss, the optimizer update and, on CPU,
  the bf16 <-> f32 converts XLA inserts around bf16 dots), which the model FLOPs leave out.
The dot instructions of the compiled program, summed from its HLO, equal the matmul part exactly.
On CPU a scanned loop body is counted once, so layers are unrolled; no remat, one micro-batch.
"""

import jax
import pytest

from helpers import hlo_dot_flops
from jaxlm import config as config_lib
from jaxlm import train_setup
from jaxlm.models import attention
from jaxlm.models.transformer import flops_per_token, matmul_params

# Elementwise FLOPs as a fraction of the matmul FLOPs, measured on jax 0.10.2, CPU: 3.3% (llama-gqa
# below), 4.5% (gpt2-tied), 3.5% for the 4-layer tiny recipe, about half of it bf16 -> f32 converts
# around the dots; 1.2% at d_model=512. It shrinks as the model widens (elementwise work grows with
# d per token, matmuls with d^2), so these small models bound it from above.
ELEMENTWISE_TOLERANCE = 0.06


def _cost_flops(compiled) -> float:
    """`compiled.cost_analysis()['flops']`: a dict on jax 0.10; older versions return [dict]."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return float(analysis["flops"])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(model__n_layers=2),  # llama: RMSNorm, RoPE, SwiGLU, grouped-query (4 heads, 2 kv)
        dict(model__n_layers=2, model__variant="gpt2", model__tie_embeddings=True),  # GELU, biases, tied
    ],
    ids=["llama-gqa", "gpt2-tied"],
)
def test_flops_per_token_agrees_with_xla_cost_analysis(overrides):
    cfg = config_lib.recipe(  # XLA's attention: the full square under a mask (the blocked kind: below)
        "tiny", model__scan_layers=False, model__remat="none", optim__micro_batches=1, model__attention="xla",
        **overrides
    )
    setup = train_setup.build(cfg, devices=jax.devices()[:1], abstract=True)
    compiled = setup.compile_train_step()
    m, seq_len, tokens = setup.model_cfg, cfg.data.seq_len, setup.derived.tokens_per_step

    model_flops = flops_per_token(m, seq_len) * tokens
    causal_half = 6 * m.n_layers * seq_len * m.n_heads * m.head_dim * tokens  # XLA also runs the masked half
    matmul_flops = model_flops + causal_half
    assert matmul_flops == (6 * matmul_params(m) + 12 * m.n_layers * seq_len * m.n_heads * m.head_dim) * tokens

    # Exact: the compiled program's dots are the formula's matmuls plus the full attention square.
    assert hlo_dot_flops(compiled.as_text()) == matmul_flops

    # XLA's total: those matmuls plus a few percent of elementwise work, never less.
    xla_flops = _cost_flops(compiled)
    elementwise = xla_flops - matmul_flops
    assert 0 < elementwise <= ELEMENTWISE_TOLERANCE * matmul_flops, (xla_flops, matmul_flops, model_flops)
    assert model_flops < xla_flops


def test_blocked_attention_computes_only_the_blocks_at_or_before_the_diagonal():
    """`model.attention=blocked` (the CPU's `auto`): each query block multiplies only the keys up to its
    end, twice forward (scores, values) and five times backward (the scores recomputed, then the gradients
    of the values, the probabilities, the queries and the keys); the projections are as with XLA's. In one
    program without remat (here: layers unrolled) XLA merges the recomputed scores with the forward's: 6."""
    cfg = config_lib.recipe("tiny", model__scan_layers=False, model__remat="none", optim__micro_batches=1,
                            model__attention="blocked")
    setup = train_setup.build(cfg, devices=jax.devices()[:1], abstract=True)
    m, t, tokens = setup.model_cfg, cfg.data.seq_len, setup.derived.tokens_per_step
    assert m.attention == "blocked"
    block = attention.attention_block(t)
    assert 1 < block < t  # more than one block, or nothing would be skipped
    pairs = sum((min(start + block, t) - start) * min(start + block, t) for start in range(0, t, block))
    attention_flops = m.n_layers * 6 * 2 * m.n_heads * m.head_dim * pairs * (tokens // t)
    assert pairs <= t * t * 0.75  # two blocks or more: at most 3/4 of the square
    assert hlo_dot_flops(setup.compile_train_step().as_text()) == 6 * matmul_params(m) * tokens + attention_flops
