"""Mixture-of-Experts checkpoints in and out of Hugging Face: Mixtral (MixtralForCausalLM) and Qwen3-MoE
(Qwen3MoeForCausalLM), checked against `transformers` itself.

Each test model is a small random one made by `transformers` (float32: 2 layers, 4 experts, top 2, width
64), its norms and biases perturbed, saved with `save_pretrained` (which writes the Hub's layout: one
Linear per expert). jaxlm's logits must equal transformers' within 1e-4 of the largest logit with either
dropless dispatch (`ragged`, what an import sets, and `dense`); an export must load in transformers as the
same class with the same logits and config, and re-import bit-identically.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd
from test_hf import IDS, VOCAB, Models, close, edit_config, error_of, jaxlm_logits, reference_logits, train_cli

from helpers import small_config
from jaxlm import hf, inference, train_state
from jaxlm import lora as lora_lib
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.models import hf as hf_map
from jaxlm.models import transformer
from jaxlm.models.mlps import MLPS, MoESpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ARCHS = ("mixtral", "qwen3_moe", "qwen3_moe_normalized", "qwen3_moe_dense")
EXPERTS = ("expert_down", "expert_gate", "expert_up")
MODEL_TYPE = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "qwen3_moe_normalized": "qwen3_moe",
              "qwen3_moe_dense": "qwen3_moe"}
# What each architecture's config.json says the model is, as transformers reads it (its own spelling of a field
# where versions differ: Qwen3-MoE's num_experts, written num_local_experts by transformers 5)
CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "max_position_embeddings", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "rope_parameters",
                 "sliding_window", "num_experts_per_tok", "router_aux_loss_coef")
MOE_FIELDS = {"mixtral": ("intermediate_size", "num_local_experts"),
              "qwen3_moe": ("num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                            "mlp_only_layers", "attention_bias", "use_sliding_window")}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_model(arch: str):
    """A small random MoE of `arch`, norms and biases perturbed away from 1 and 0."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=128, num_experts_per_tok=2)
    if arch == "mixtral":  # the top 2 probabilities renormalized; Mixtral's RoPE theta
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=96, num_local_experts=4, router_aux_loss_coef=0.02))
    elif arch == "qwen3_moe":  # the top 2 probabilities as they are; a head wider than 64 / 8; tied embeddings
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=96, intermediate_size=160, num_experts=4, head_dim=16,
            tie_word_embeddings=True, rope_theta=1e6))
    elif arch == "qwen3_moe_dense":  # its first layer dense (intermediate_size wide), experts in the other two
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3}, moe_intermediate_size=96, intermediate_size=160, num_experts=4,
            norm_topk_prob=True, mlp_only_layers=[0]))
    else:  # Qwen3-MoE with norm_topk_prob (renormalized, as Mixtral), attention biases, its own norm eps
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=96, num_experts=4, norm_topk_prob=True, attention_bias=True,
            rms_norm_eps=1e-5))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("hf-moe"), make_model)


def logits_with_impl(run: inference.LoadedRun, impl: str) -> np.ndarray:
    """The run's logits with its MoE dispatched by `impl` (the same parameters)."""
    model_cfg = dataclasses.replace(run.model_cfg, moe=dataclasses.replace(run.model_cfg.moe, impl=impl))
    graphdef = train_state.build_model_spec(model_cfg).graphdef
    with spmd.logical_axis_rules(run.rules), jax.set_mesh(run.mesh):
        return np.asarray(jax.jit(lambda m, ids: m(ids))(nnx.merge(graphdef, run.params), jnp.asarray(IDS)), np.float32)


# Qwen3-MoE's renormalized router is Mixtral's (in the default suite); its attention biases in the slow one. A
# dense first layer in the slow one too (the default suite's time): its logits against transformers' and its
# tensors written back stay in the default suite, unscanned (`test_unscanned_layers_read_and_write_each_expert`)
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow)
                                  if a in ("qwen3_moe_normalized", "qwen3_moe_dense") else a for a in ARCHS])
def test_imported_moe_gives_transformers_logits_and_exports_back(models, arch, tmp_path):
    model, hf_dir = models[arch]
    # through the command line, `python -m jaxlm.hf import` (in this process)
    assert hf.main(["import", f"--hf_dir={hf_dir}", f"--output={tmp_path / 'run'}"]) == 0
    run = inference.load_run(tmp_path / "run", dtype="float32")
    m = run.cfg.model
    assert (m.mlp, m.moe_impl, m.moe_experts, m.moe_top_k, m.mlp_dim) == ("moe", "ragged", 4, 2, 96)
    assert m.moe_router == ("softmax_topk" if arch == "qwen3_moe" else "topk_softmax")
    assert (m.moe_dense_layers, m.moe_dense_dim) == ((1, 160) if arch == "qwen3_moe_dense" else (0, 0))
    assert m.moe_aux_loss == model.config.router_aux_loss_coef and run.model_cfg.qk_norm == (arch != "mixtral")
    want = reference_logits(model)
    close(jaxlm_logits(run), want)  # ragged: the dropless grouped matmul
    close(logits_with_impl(run, "dense"), want)  # every expert on every token, weighted by the gates

    # Export (sharded: small files), load in transformers: the same class, config and logits as the original.
    out = hf.export_run(run.run_dir, tmp_path / "exported", dtype="float32", max_shard_bytes=100_000)
    assert len(set(json.loads((out / hf.INDEX).read_text())["weight_map"].values())) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    for field in CONFIG_FIELDS + MOE_FIELDS[MODEL_TYPE[arch]]:
        assert getattr(reloaded.config, field) == getattr(model.config, field), field
    # Mixtral's head_dim null, or Qwen3-MoE's absent: hidden_size / heads, written out
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    assert reloaded.config.head_dim == head_dim
    # the original's weights, moved there and back, in the same class's forward
    floats.identical(reference_logits(reloaded), want, why=floats.SAME_PROGRAM)
    again = inference.load_run(hf.import_checkpoint(out, tmp_path / "again"), dtype="float32")
    floats.identical(again.params, run.params, why=floats.MOVED)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe_dense"])
def test_unscanned_layers_read_and_write_each_expert(models, tmp_path, arch):
    """A model whose blocks are a list (model.scan_layers=False): each layer's experts stacked from the
    checkpoint's Linears, and back into them; a dense first layer's MLP from its own."""
    model, hf_dir = models[arch]
    arch, keys = hf_map.model_keys(json.loads((hf_dir / "config.json").read_text()))
    cfg = hf._run_config(keys, arch, "float32", hf_dir / "unused")
    cfg.model.scan_layers = False
    model_cfg = inference.model_config(cfg, "cpu", "float32")
    spec = train_state.build_model_spec(model_cfg)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    mesh, abstract = inference.make_inference_mesh(cfg, model_cfg, spec, jax.devices(), rules)
    files = hf.SafetensorsFiles(hf_dir)
    params = hf._read_params(files, abstract, model_cfg, arch)
    first_moe = len(getattr(model.config, "mlp_only_layers", None) or [])
    assert params["blocks"][first_moe]["mlp"]["expert_gate"]["kernel"].shape == (4, 64, 96)
    with spmd.logical_axis_rules(rules), jax.set_mesh(mesh):
        logits = np.asarray(jax.jit(lambda m, ids: m(ids))(nnx.merge(spec.graphdef, params), jnp.asarray(IDS)))
    close(logits, reference_logits(model))
    written = dict(hf_map.hf_tensors(params, model_cfg, arch, np.float32))
    assert sorted(written) == files.names()
    floats.identical(written, {name: np.asarray(files.slice(name)[:]) for name in written}, why=floats.MOVED)


@pytest.mark.parametrize("arch, changes, words", [
    ("qwen3_moe", {"mlp_only_layers": [1]},
     "config.json: mlp_only_layers=[1]: layer 1 without experts (dense) after layer 0 with experts; jaxlm's MoE model "
     "has its dense layers first (model.moe_dense_layers)"),
    ("qwen3_moe", {"mlp_only_layers": [0, 1]}, "mlp_only_layers=[0, 1]: every layer dense: import it as a Qwen3"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "config.json: decoder_sparse_step=2: experts in one layer of every 2"),
    ("mixtral", {"sliding_window": 64}, "config.json: sliding_window=64: jaxlm has no sliding-window attention"),
    ("qwen3_moe", {"use_sliding_window": True}, "config.json: use_sliding_window=true"),
    ("mixtral", {"num_experts_per_tok": 5}, "config.json: num_experts_per_tok=5"),
    # transformers 5 writes Qwen3-MoE's experts as num_local_experts: the refusal names the file's own field
    ("qwen3_moe", {"num_local_experts": 1}, "config.json: num_local_experts=1"),
    ("mixtral", {"hidden_act": "gelu"}, 'config.json: hidden_act="gelu"'),
])
def test_moe_configs_jaxlm_cannot_represent_are_refused_naming_the_field(models, tmp_path, capsys, arch, changes,
                                                                         words):
    directory = tmp_path / arch
    shutil.copytree(models[arch][1], directory)
    edit_config(directory, **changes)
    err = error_of(capsys, "import", f"--hf_dir={directory}", f"--output={tmp_path / 'out'}")
    assert words in err
    assert not (tmp_path / "out").exists()


def test_a_sliding_window_as_long_as_the_context_is_full_attention(models):
    """Mixtral's sliding_window at max_position_embeddings or beyond never masks a position: imported."""
    config = json.loads((models["mixtral"][1] / "config.json").read_text())
    for window in (128, 4096):
        assert hf_map.model_keys({**config, "sliding_window": window})[1]["mlp"] == "moe"


def test_a_qwen3_moe_needs_no_dense_width(models):
    """Qwen3-MoE's intermediate_size is its dense layers' width, which a model with experts in every layer
    never uses: the experts' is moe_intermediate_size, and a config.json without the other imports."""
    config = json.loads((models["qwen3_moe"][1] / "config.json").read_text())
    del config["intermediate_size"]
    assert hf_map.model_keys(config)[1]["mlp_dim"] == 96


def test_moe_models_without_a_hugging_face_counterpart_are_refused_naming_the_key():
    moe = MoESpec(experts=4, top_k=2)
    assert hf_map.architecture_of(small_config(mlp="moe", moe=moe)) == "mixtral"
    assert hf_map.architecture_of(small_config(mlp="moe", moe=moe, qk_norm=True)) == "qwen3_moe"
    assert hf_map.architecture_of(small_config(mlp="moe", moe=dataclasses.replace(moe, router="softmax_topk"),
                                               qk_norm=True, use_bias=True)) == "qwen3_moe"
    assert hf_map.architecture_of(small_config(mlp="moe", moe=dataclasses.replace(moe, impl="capacity"))) == "mixtral"
    for settings, words in (
            (dict(moe=dataclasses.replace(moe, router="sigmoid")), "model.moe_router=sigmoid"),
            (dict(moe=dataclasses.replace(moe, shared_experts=1), qk_norm=True), "model.moe_shared_experts=1"),
            (dict(moe=dataclasses.replace(moe, router="softmax_topk")), "model.moe_router=softmax_topk"),
            (dict(moe=moe, use_bias=True), "use_bias=True"),
            (dict(moe=dataclasses.replace(moe, dense_layers=1, dense_dim=64)), "model.moe_dense_layers=1"),
            (dict(moe=moe, norm="layernorm"), "norm=layernorm")):
        with pytest.raises(UserError, match=words) as refused:
            hf_map.architecture_of(small_config(mlp="moe", **settings))
        assert "\n" not in str(refused.value)


def test_every_moe_weight_has_a_place_in_both_architectures():
    """The MoE's declared weights (`weight_shapes`: the router; `expert_shapes`: the expert projections' kernels)
    are its parameters beside the other projections, and each architecture's layout (`hf_layouts`) places
    every one a softmax router has."""
    cfg = small_config(mlp="moe", moe=MoESpec(experts=4, top_k=2, router="sigmoid"))
    shapes = {**MLPS["moe"].weight_shapes(cfg), **MLPS["moe"].expert_shapes(cfg)}
    assert sum(int(np.prod(s)) for s in shapes.values()) == MLPS["moe"].other_params(cfg)
    for arch in MLPS["moe"].hf_architectures:
        assert set(MLPS["moe"].hf_modules(arch)) == set(shapes) - {"router_bias"}


def test_lora_on_an_imported_moe_adapts_attention_and_the_experts_not_the_router(models, tmp_path):
    """lora.targets=all: every projection, attention's and the experts' (and shared experts', where a model
    has them); the router, a weight, is refused in one line."""
    _, hf_dir = models["mixtral"]
    arch, keys = hf_map.model_keys(json.loads((hf_dir / "config.json").read_text()))
    base = inference.model_config(hf._run_config(keys, arch, "float32", hf_dir / "unused"), "cpu", "float32")
    lora = dict(rank=4, alpha=16.0, targets="all", ranks="", dropout=0.0)
    assert transformer.with_lora(base, lora).lora.targets == (*EXPERTS, "wk", "wo", "wq", "wv")
    shared = dataclasses.replace(base, moe=dataclasses.replace(base.moe, shared_experts=1))
    assert set(transformer.with_lora(shared, lora).lora.targets) == {
        "wk", "wo", "wq", "wv", *EXPERTS, "shared_gate", "shared_up", "shared_down"}
    with pytest.raises(UserError, match="'router' is a weight of the model.mlp=moe layer, not a projection") as no:
        transformer.with_lora(base, {**lora, "targets": "wq,router"})
    assert "\n" not in str(no.value)


@pytest.mark.parametrize("arch, targets, ranks", [pytest.param("mixtral", "all", "expert_up:2", marks=pytest.mark.slow),
                                                  ("qwen3_moe", "wq,expert_up,expert_down", "")])
def test_expert_adapters_export_as_peft_adapters_of_the_fused_experts(models, arch, targets, ranks, tmp_path):
    """Adapters on the experts (random, B too) as PEFT's adapters of transformers' fused expert parameters
    (`target_parameters`: gate_up_proj, down_proj): `peft.PeftModel` over the original model computes jaxlm's
    logits. Mixtral: gate and up adapted with different ranks (one block-diagonal adapter of rank 4 + 2); Qwen3-MoE:
    up alone (gate's rows of gate_up_proj unadapted)."""
    peft = pytest.importorskip("peft")
    model, hf_dir = models[arch]
    run = inference.load_run(hf.import_checkpoint(hf_dir, tmp_path / "run"), dtype="float32")
    cfg = transformer.with_lora(run.model_cfg, dict(rank=4, alpha=16.0, targets=targets, ranks=ranks, dropout=0.0))
    fresh = nnx.to_pure_dict(nnx.state(train_state.build_model(cfg, 0)))
    adapters = jax.tree_util.tree_map_with_path(  # B drawn too: adapters that change the model
        lambda p, v: v + 0.1 * jax.random.normal(jax.random.key(len(jax.tree_util.keystr(p))), v.shape)
        if "lora_b" in jax.tree_util.keystr(p) else v, jax.tree.map(np.asarray, lora_lib.adapter_params(fresh)))
    params = lora_lib.fill_missing(jax.tree.map(np.asarray, run.params), adapters)
    want = jaxlm_logits(dataclasses.replace(run, model_spec=train_state.build_model_spec(cfg)), params)
    assert np.abs(want - reference_logits(model)).max() / np.abs(want).max() > 1e-2  # the adapters change it
    tensors, modules, fused = hf._peft_tensors(params, cfg, run.model_cfg, MODEL_TYPE[arch], np.float32)
    hf._write_peft(tmp_path / "adapter", str(hf_dir), None, tensors, modules, fused, cfg)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(config["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} - (
        set() if "expert_down" in cfg.lora.targets else {"mlp.experts.down_proj"})
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    close(reference_logits(peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()), want)


@pytest.mark.slow
def test_a_lora_fine_tune_of_an_imported_mixtral_exports_merged_and_as_a_peft_adapter(models, tmp_path):
    """`python -m jaxlm.train` from an imported Mixtral with LoRA on every projection (attention's and the
    experts'), a few steps: merged into the weights, transformers computes jaxlm's logits; as a PEFT adapter of
    the original model (the experts' on its fused expert parameters), too."""
    peft = pytest.importorskip("peft")
    original, hf_dir = models["mixtral"]
    imported = hf.import_checkpoint(hf_dir, tmp_path / "imported")
    tuned = train_cli(tmp_path, f"--config.run.init_from={imported}", "--config.run.name=lora", "--config.lora.rank=4",
                      "--config.lora.targets=all", "--config.optim.peak_lr=0.01")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    run = inference.load_run(tmp_path / "lora", dtype="float32")
    assert run.cfg.model.mlp == "moe" and run.model_cfg.lora.targets == (*EXPERTS, "wk", "wo", "wq", "wv")
    want = jaxlm_logits(run)
    assert np.abs(want - reference_logits(original)).max() / np.abs(want).max() > 1e-3  # the adapters changed it
    merged = hf.export_run(run.run_dir, tmp_path / "merged", dtype="float32")
    close(reference_logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval()), want)
    out = hf.export_run(run.run_dir, tmp_path / "adapter", dtype="float32", adapters="peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), out).eval()
    close(reference_logits(adapted), want)
