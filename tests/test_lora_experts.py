"""LoRA and QLoRA on a Mixture-of-Experts' experts: `expert_gate`, `expert_up`, `expert_down` are projections
with a leading experts axis (`layers.Projection.batch_axes`), so adapters (A [E, inputs, r], B [E, r, outputs])
and quantized kernels apply to them by name as to every projection; the dispatches take each one's
`effective_weight` (W_e + scale A_e B_e, dequantized under QLoRA). Checked here: the targets and the counts
against the built model, the adapted experts against the merged weight computed by hand for every dispatch,
a frozen base under training, and the 4-bit experts. (An imported Mixtral's: tests/test_hf_moe.py.)"""

from __future__ import annotations

import dataclasses

import floats
import jax
import numpy as np
import pytest
from test_lora import _train, flat, forward, params_of, with_random_b

from helpers import small_config
from jaxlm import axes, config, lora, memory, quant, train_state
from jaxlm.errors import UserError
from jaxlm.models import quantized, transformer
from jaxlm.models.mlps import moe
from jaxlm.models.mlps.moe import MoESpec

HERE = [impl for impl in moe.IMPLS if impl != "tokamax" or moe.tokamax_available()]
EXPERTS = ("expert_gate", "expert_up", "expert_down")
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 4, 96)


def moe_config(impl="ragged", **kw) -> transformer.ModelConfig:
    """A small MoE (4 experts of width 32, top 2); capacity for every pair, so no dispatch drops one."""
    return small_config(**{"mlp": "moe", "mlp_dim": 32, **kw},
                        moe=MoESpec(experts=4, top_k=2, impl=impl, capacity_factor=4.0))


def section(targets="wq,expert_gate,expert_up,expert_down", rank=4, **kw) -> dict:
    return {"rank": rank, "alpha": 8.0, "targets": targets, "ranks": "", "dropout": 0.0, **kw}


def test_the_targets_take_the_experts_and_all_includes_them():
    cfg = transformer.with_lora(moe_config(), section("all"))
    assert set(cfg.lora.targets) == {"wq", "wk", "wv", "wo", *EXPERTS}
    # the router is a weight, not a projection: one line
    with pytest.raises(UserError, match="'router' is a weight of the model.mlp=moe layer, not a projection") as no:
        transformer.with_lora(moe_config(), section("wq,router"))
    assert "\n" not in str(no.value)
    # per-target ranks name them too; their adapters hold one A and one B per expert
    cfg = transformer.with_lora(moe_config(), section("wq,expert_up,expert_down", ranks="expert_down:2"))
    built = jax.eval_shape(lambda: params_of(cfg))
    mlp = built["blocks"]["mlp"]
    assert mlp["expert_up"]["lora_a"].shape == (2, 4, 64, 4) and mlp["expert_up"]["lora_b"].shape == (2, 4, 4, 32)
    assert mlp["expert_down"]["lora_a"].shape == (2, 4, 32, 2) and mlp["expert_down"]["lora_b"].shape == (2, 4, 2, 64)
    assert "lora_a" not in mlp["expert_gate"]
    names = transformer.abstract_model(cfg).blocks.mlp.expert_up
    assert names.lora_a.get_metadata()["out_sharding"] == ("layers", "experts", "embed", "lora_rank")
    assert names.lora_b.get_metadata()["out_sharding"] == ("layers", "experts", "lora_rank", "mlp")


@pytest.mark.parametrize("kw", [{}, dict(scan_layers=False)])
def test_param_counts_and_the_planner_equal_the_built_model(kw):
    cfg = transformer.with_lora(moe_config(**kw), section("all", ranks="expert_gate:2"))
    built = jax.eval_shape(lambda: params_of(cfg))
    adapters = sum(x.size for x in jax.tree.leaves(lora.adapter_params(built)))
    # per layer: wq wk wv wo 4 x (64 + 64) x 4; gate 4 experts x (64 + 32) x 2; up and down 2 x 4 x (64 + 32) x 4
    assert adapters == transformer.param_count(cfg)["lora"] == transformer.lora_param_count(cfg) == 2 * (
        4 * 128 * 4 + 4 * 96 * 2 + 2 * 4 * 96 * 4)
    assert sum(x.size for x in jax.tree.leaves(built)) == transformer.param_count(cfg)["total"]
    # the planner: the tiny recipe as an MoE with adapters on every projection, experts included
    recipe = config.recipe("tiny", model__mlp="moe", model__moe_experts=4, lora__rank=8, lora__targets="all")
    est = memory.estimate(recipe, 1, platform="cpu")
    m = transformer.ModelConfig.from_config(recipe.model, "cpu", lora=recipe.lora)
    assert {"expert_gate", "expert_up", "expert_down"} <= set(m.lora.targets)
    built = jax.eval_shape(lambda: params_of(m))
    adapters = sum(x.size for x in jax.tree.leaves(lora.adapter_params(built)))
    assert adapters == transformer.param_count(m)["lora"]
    assert est.param_count == sum(x.size for x in jax.tree.leaves(built)) == transformer.param_count(m)["total"]
    assert est.row("gradients").total_bytes == 4 * adapters
    assert est.row("parameters").total_bytes == 4 * sum(x.size for x in jax.tree.leaves(built))


def _merged_by_hand(params: dict, cfg) -> dict:
    """The base parameters with each adapted expert's kernel W_e + (alpha / rank) A_e B_e, in float64 NumPy,
    expert by expert and layer by layer."""
    out = lora.base_params(jax.tree.map(np.asarray, params))
    for name in EXPERTS:
        node = params["blocks"]["mlp"][name]
        if "lora_a" not in node:
            continue
        a, b = np.asarray(node["lora_a"], np.float64), np.asarray(node["lora_b"], np.float64)
        w = np.array(node["kernel"], np.float64)
        scale = cfg.lora.alpha / cfg.lora.rank_of(name)
        for layer in range(w.shape[0]):
            for e in range(w.shape[1]):
                w[layer, e] += scale * a[layer, e] @ b[layer, e]
        out["blocks"]["mlp"][name]["kernel"] = w.astype(np.float32)
    return out


# capacity (a CPU's choice) in the default suite, the others in the slow one (the dispatches' equality: test_moe.py)
@pytest.mark.parametrize("impl", [i if i == "capacity" else pytest.param(i, marks=pytest.mark.slow) for i in HERE])
def test_adapted_experts_are_the_merged_weights_in_every_dispatch(impl):
    """B = 0: the dispatch gets the base's expert weights bit for bit (and the base's logits); B != 0: the
    model's logits are those of the base whose expert kernels are W_e + scale A_e B_e, made by hand."""
    cfg = transformer.with_lora(moe_config(impl), section("expert_gate,expert_up,expert_down"))
    base_cfg = lora.without_lora(cfg)
    params = params_of(cfg)
    mlp = train_state.build_model(dataclasses.replace(cfg, scan_layers=False), 0).blocks[0].mlp
    for name in EXPERTS:  # x + 0.0 is x: the weights the dispatch takes are the base's
        projection = getattr(mlp, name)
        floats.identical(np.asarray(projection.effective_weight()), np.asarray(projection.kernel[...]),
                         why=floats.MOVED)
    floats.close(forward(cfg, params, TOKENS), forward(base_cfg, lora.base_params(params), TOKENS))
    params = with_random_b(params, std=0.2)
    adapted = forward(cfg, params, TOKENS)
    base = forward(base_cfg, lora.base_params(params), TOKENS)
    assert np.abs(adapted - base).max() > 1e-2 * np.abs(base).max()  # the experts' adapters move the logits
    by_hand = _merged_by_hand(params, cfg)
    floats.close(forward(base_cfg, by_hand, TOKENS), adapted, ulps=256)
    # lora.merge (what an export writes) is the same weights
    floats.close(flat(lora.merge(params, cfg)), flat(by_hand), ulps=8)


def test_only_the_adapters_train_the_experts_base_stays_bit_equal():
    cfg = transformer.with_lora(moe_config("capacity"), section("wq,expert_gate,expert_up,expert_down"))
    _, before, state, losses = _train(cfg, 4, mesh_shape=axes.shape_of(data=2, fsdp=2))
    after = flat(jax.device_get(state.params))
    adapters = [p for p in after if "lora_" in p]
    assert len(adapters) == 8
    for path, value in after.items():
        if "lora_" in path:
            assert not np.array_equal(value, before[path]), path
        else:
            floats.identical(value, before[path], why=floats.MOVED, err_msg=path)
    assert losses[-1] < losses[0], losses


@pytest.mark.slow  # ~11 s: two models built and compared
def test_qlora_quantizes_the_experts_and_stays_close_to_the_float_model():
    """lora.quantize_base=nf4: the experts' kernels stored as 4-bit codes (a scale per 64 inputs), counted as
    the weights they stand for, computed with dequantized; the logits within the 4-bit error of the float
    model's, as a dense model's are."""
    float_cfg = transformer.with_lora(moe_config(d_model=128, n_heads=2, n_kv_heads=2, head_dim=64, mlp_dim=128),
                                      section())
    cfg = transformer.with_lora(lora.without_lora(float_cfg), section(quantize_base="nf4", quant_group=64))
    assert {*EXPERTS, "wq", "wo"} <= set(cfg.quantized.targets)
    params = params_of(cfg)
    gate = params["blocks"]["mlp"]["expert_gate"]
    assert "kernel" not in gate and gate["kernel_q"].dtype == np.uint8
    assert gate["kernel_q"].shape == (2, 4, 64, 128) and gate["kernel_scale"].shape == (2, 4, 2, 128)  # [L, E, D/2, F]
    assert params["blocks"]["mlp"]["expert_down"]["kernel_q"].shape == (2, 4, 64, 128)  # [L, E, F/2, D]
    assert transformer.param_count(cfg) == transformer.param_count(float_cfg)
    assert quant.count(params) == transformer.param_count(cfg)["total"]
    bytes_of = {p: v.nbytes for p, v in flat(params).items() if "expert_" in p and "lora" not in p}
    assert sum(bytes_of.values()) == 3 * 2 * 4 * 128 * 128 * (0.5 + 4 / 64)  # 4 bits and a float32 per 64
    # the planner holds the device's bytes: the 4-bit experts' among them
    recipe = config.recipe("tiny", model__mlp="moe", model__moe_experts=4, lora__rank=4, lora__targets="all",
                           lora__quantize_base="nf4")
    m = transformer.ModelConfig.from_config(recipe.model, "cpu", lora=recipe.lora)
    built = jax.eval_shape(lambda: params_of(m))
    assert built["blocks"]["mlp"]["expert_up"]["kernel_q"].dtype == np.uint8
    assert memory.estimate(recipe, 1, platform="cpu").row("parameters").total_bytes == sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(built))
    # each expert's weights within NF4's bound of the float ones (a group's absmax x the format's bound)
    float_params = params_of(float_cfg)
    dequantized = quantized.dequantize_params(params, cfg)
    for name in EXPERTS:
        w = np.asarray(float_params["blocks"]["mlp"][name]["kernel"])
        error = np.abs(np.asarray(dequantized["blocks"]["mlp"][name]["kernel"]) - w)
        absmax = np.repeat(np.abs(w.reshape(2, 4, 2, 64, 128)).max(axis=3), 64, axis=2)  # groups of 64 inputs
        assert np.all(error <= quant.error_bound(cfg.quantized.spec) * absmax * (1 + 1e-6)), name
        assert np.linalg.norm(error) / np.linalg.norm(w) < 0.12, name
    # the QLoRA model = the LoRA model over the dequantized base; as near the float one as a dense model is
    params = with_random_b(params)
    got = forward(cfg, params, TOKENS)
    floats.close(forward(dataclasses.replace(cfg, quantized=None), quantized.dequantize_params(params, cfg), TOKENS),
                 got, ulps=256)
    error = _relative_error(float_cfg, cfg, params)
    dense = dict(d_model=128, n_heads=2, n_kv_heads=2, head_dim=64, mlp_dim=128)
    dense_float = transformer.with_lora(small_config(**dense), section("wq,w_gate,w_up,w_down"))
    dense_q = transformer.with_lora(small_config(**dense), section("wq,w_gate,w_up,w_down", quantize_base="nf4"))
    dense_error = _relative_error(dense_float, dense_q, with_random_b(params_of(dense_q)))
    assert 1e-4 < error < 2 * dense_error, (error, dense_error)
    merged = lora.merge(params, cfg)  # float kernels, the experts' merged too
    assert merged["blocks"]["mlp"]["expert_gate"]["kernel"].dtype == np.float32
    floats.close(forward(lora.without_lora(cfg), merged, TOKENS), got, ulps=256)


def _relative_error(float_cfg, cfg, params) -> float:
    """The largest logit difference of the QLoRA model `cfg` (`params`) from the float model over the same
    random base and the same adapters, relative to the largest logit."""
    float_params = lora.fill_missing(lora.base_params(params_of(float_cfg)), lora.adapter_params(params))
    want = forward(float_cfg, float_params, TOKENS)
    return float(np.abs(forward(cfg, params, TOKENS) - want).max() / np.abs(want).max())


def test_compress_leaves_the_experts_and_names_them_in_one_line():
    cfg = moe_config()
    c = dict(quantize="int8", sparsity=0.0, targets="blocks", group=64, symmetric=True, qat=False)
    assert not set(EXPERTS) & set(transformer.with_compress(cfg, c).quantized.targets)
    with pytest.raises(UserError, match="'expert_\\*' names the MoE's expert projections") as no:
        transformer.with_compress(cfg, {**c, "targets": "wq,expert_*"})
    assert "\n" not in str(no.value)


def _expert_lora_losses(devices: int, **mesh) -> tuple[np.ndarray, object]:
    """A 2-layer MoE (8 experts, top 2, capacity dispatch) in float32 with LoRA on its experts, 3 steps."""
    from helpers import random_batch
    from jaxlm import train_setup

    sizes = {"data": 1, "fsdp": 1, "expert": 1, **mesh}
    cfg = config.recipe("tiny", model__mlp="moe", model__moe_experts=8, model__moe_top_k=2, model__mlp_dim=64,
                        model__n_layers=2, model__dtype="float32", model__moe_impl="capacity", lora__rank=4,
                        lora__targets="expert_gate,expert_up,expert_down", optim__peak_lr=0.05,
                        data__global_batch_size=16, data__seq_len=32,
                        **{f"mesh__{axis}": size for axis, size in sizes.items()})
    setup = train_setup.build(cfg, devices=jax.devices()[:devices])
    state, out = setup.state, []
    batch = setup.put_batch(random_batch(16, 32, 2048))
    for _ in range(3):
        state, metrics = setup.train_step(state, batch)
        out.append(float(metrics["loss"]))
    return np.asarray(out, np.float32), setup


@pytest.mark.slow  # two 8-device programs: ~15 s of CPU
def test_expert_adapters_split_over_the_expert_axis_and_train_as_on_one_device():
    """Expert parallelism (mesh.expert=2, fsdp=4): each device holds its experts' adapters beside their
    kernels, and the adapted model trains with one device's losses."""
    want, _ = _expert_lora_losses(1)
    got, setup = _expert_lora_losses(8, expert=2, fsdp=4)
    floats.close(got, want, ulps=64)
    assert want[-1] < want[0], want
    mlp = setup.state.params["blocks"]["mlp"]["expert_up"]
    assert mlp["lora_a"].sharding.spec[1] == mlp["lora_b"].sharding.spec[1] == "expert"  # [layers, experts, ...]
    assert mlp["kernel"].sharding.spec[1] == "expert"
