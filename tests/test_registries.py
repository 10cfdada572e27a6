"""Every registered component through everything that asks it for its arithmetic.

An MLP declares its own parameters, matmuls, saved activations and Hugging Face names
(`jaxlm.models.mlps.base.MLP`), a norm its parameters (`transformer.NORMS`), a position encoding its
parameters and saved bytes (`jaxlm.models.positions`); nothing else in jaxlm keeps a formula of its own
for them. Every entry is run here, with no line of its own, through:
- the parameter count (LoRA's too) against the built model's, and the table against the built
  projections;
- the training FLOPs against the dots of the compiled train step;
- the planner's memory against the compiled step's;
- each Hugging Face architecture it claims: its weights, written as the export writes them
  (`models.hf.hf_tensors`, a safetensors file beside the config.json of `models.hf.hf_config`), load
  into `transformers`' own model of that architecture and give jaxlm's logits; with none, an export is
  refused in one line naming model.mlp.
"""

from __future__ import annotations

import dataclasses
import json

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import hlo_dot_flops, small_config
from jaxlm import memory, plan, train_setup
from jaxlm.config import recipe
from jaxlm.errors import UserError
from jaxlm.models import hf as hf_map
from jaxlm.models import layers
from jaxlm.models.mlps import MLPS
from jaxlm.models.positions import POSITIONS
from jaxlm.models.transformer import (
    NORMS,
    REMAT_POLICIES,
    ModelConfig,
    Transformer,
    flops_per_token,
    matmul_params,
    param_count,
)
from jaxlm.models.transforms import LoRA

NAMES = sorted(MLPS)
REGISTRIES = {"mlp": MLPS, "norm": NORMS, "position": POSITIONS}
COMPONENTS = [pytest.param(kind, name, id=f"{kind}-{name}") for kind, entries in REGISTRIES.items() for name in entries]
# The jaxlm variant (and settings) whose export is each Hugging Face architecture
HF_MODELS = {"llama": dict(), "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True, head_dim=16),
             "gpt2": dict(norm="layernorm", position="learned", use_bias=True, tie_embeddings=True, n_kv_heads=8),
             "mixtral": dict(), "qwen3_moe": dict(qk_norm=True, head_dim=16)}


# The tiny recipe's own entries (its variant's, llama's): in the compiled-program tests (FLOPs, memory) they make
# one program, which each would compile again alone
TINY_ENTRIES = {"mlp": "swiglu", "norm": "rmsnorm", "position": "rope"}
# Each program those tests compile: the entries it holds, (kind, name) pairs; every entry is in one
PROGRAMS = {"tiny": tuple(TINY_ENTRIES.items()),
            **{f"{kind}-{name}": ((kind, name),) for kind, entries in REGISTRIES.items() for name in entries
               if TINY_ENTRIES[kind] != name}}

# Settings an entry runs the compiled-program tests (FLOPs, memory) under: an MoE's capacity dispatch at
# capacity factor 1 computes exactly its routed pairs (E x C = tokens x k); its dropless grouped matmul
# computes and holds more on a CPU (ragged_dot lowers to a masked dense dot there, E times the rows)
COMPILED_SETTINGS = {"moe": dict(model__moe_impl="capacity", model__moe_capacity_factor=1.0)}


def _built(cfg: ModelConfig) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=0))


def _shapes(cfg: ModelConfig) -> Transformer:
    """The model built abstractly: its arrays' shapes and dtypes, none computed (the tests of sizes)."""
    return nnx.eval_shape(lambda: _built(cfg))


def test_every_entry_is_registered_under_its_own_name():
    assert all(entries and all(cls.name == name for name, cls in entries.items()) for entries in REGISTRIES.values())


@pytest.mark.parametrize("use_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("kind, name", COMPONENTS)
def test_param_count_and_lora_count_equal_the_built_model(kind, name, use_bias):
    mlp_projections = (*MLPS[name].projections, *MLPS[name].expert_shapes(small_config(mlp=name))) if (
        kind == "mlp") else ()
    targets = (mlp_projections or ("wo",)) if kind == "mlp" else ("w_up",)
    cfg = small_config(**{kind: name}, use_bias=use_bias, n_kv_heads=2,
                       lora=LoRA(2, 16.0, ("wq", *targets), ((targets[0], 3),)))
    state = nnx.state(_shapes(cfg))
    assert param_count(cfg)["total"] == sum(x.size for x in jax.tree.leaves(state))
    assert param_count(cfg)["lora"] == sum(x.size for x in jax.tree.leaves(nnx.filter_state(state, nnx.LoRAParam)))


@pytest.mark.parametrize("use_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("name", NAMES)
def test_an_mlps_projection_table_is_the_built_model(name, use_bias):
    mlp = MLPS[name]
    cfg = small_config(mlp=name, use_bias=use_bias)
    # The table is what the block holds: each projection's kernel [inputs, outputs] (an MoE's experts'
    # [experts, inputs, outputs]), each bias (stacked over the layers).
    block_mlp = _shapes(cfg).blocks.mlp
    built = {path[-1]: p.kernel_shape for path, p in layers.projections(block_mlp)}
    table = {**mlp.projection_shapes(cfg), **mlp.expert_shapes(cfg)}
    assert built == table
    biases = {name: getattr(block_mlp, name).shape for name in mlp.biases if hasattr(block_mlp, name)}
    assert biases == {name: (cfg.n_layers, size) for name, size in
                      mlp.bias_shapes(cfg).items()}


@pytest.mark.parametrize("name", NAMES)
def test_the_default_width_is_the_mlps_own(name):
    cfg = ModelConfig.from_config(recipe("tiny", model__mlp=name, model__mlp_dim=0).model, "cpu", log_choice=False)
    assert cfg.mlp_dim == MLPS[name].default_dim(cfg.d_model) > 0


def _settings(program: str) -> dict:
    """The recipe overrides that build `program` (its entries, and their settings for a compiled program)."""
    entries = PROGRAMS[program]
    return {**{f"model__{kind}": name for kind, name in entries},
            **{k: v for _, name in entries for k, v in COMPILED_SETTINGS.get(name, {}).items()}}


def test_every_entry_is_in_one_compiled_program():
    held = [entry for entries in PROGRAMS.values() for entry in entries]
    assert sorted(held) == sorted((kind, name) for kind, entries in REGISTRIES.items() for name in entries)
    tiny = ModelConfig.from_config(recipe("tiny").model, "cpu", log_choice=False)  # the recipe's, none given
    assert {kind: getattr(tiny, kind) for kind in TINY_ENTRIES} == TINY_ENTRIES


# The default suite: the tiny recipe's program and the MoE's; every program in the slow one
@pytest.mark.parametrize("program", [p if p in ("tiny", "mlp-moe") else pytest.param(p, marks=pytest.mark.slow)
                                     for p in PROGRAMS])
def test_flops_per_token_are_the_compiled_steps_dots(program):
    """The dots of the compiled step (layers unrolled: XLA:CPU counts a loop body once) are exactly
    the model's matmuls, 6 FLOPs per weight per token, and the full T x T attention square."""
    cfg = recipe("tiny", **_settings(program), model__n_layers=2, model__scan_layers=False, model__remat="none",
                 optim__micro_batches=1, model__attention="xla")
    setup = train_setup.build(cfg, devices=jax.devices()[:1], abstract=True)
    m, seq_len, tokens = setup.model_cfg, cfg.data.seq_len, setup.derived.tokens_per_step
    assert all(getattr(m, kind) == name for kind, name in PROGRAMS[program])
    square = 12 * m.n_layers * seq_len * m.n_heads * m.head_dim * tokens
    assert hlo_dot_flops(setup.compile_train_step().as_text()) == 6 * matmul_params(m) * tokens + square
    assert flops_per_token(m, seq_len) * tokens == 6 * matmul_params(m) * tokens + square // 2  # causal: half


# The default suite: the tiny recipe's program on one device and the MoE's on 8 (its dispatch's own sharding);
# every program on both in the slow one (the default suite's 10-minute budget)
PLANNED_BY_DEFAULT = {("tiny", 1), ("mlp-moe", 8)}


@pytest.mark.parametrize("program, devices", [
    pytest.param(program, devices, id=f"{program}-{'1-device' if devices == 1 else 'data2-fsdp4'}",
                 marks=[] if (program, devices) in PLANNED_BY_DEFAULT else [pytest.mark.slow])
    for program in PROGRAMS for devices in (1, 8)])
def test_the_planner_agrees_with_the_compiled_step(program, devices):
    """Without remat (a CPU's default), where the MLP's saved activations and its backward pass's
    intermediates both count. (Under the dots policies XLA:CPU keeps less than the plan, which is fitted
    to H100 programs: 0.70-0.86 of it for the tiny recipe, whatever the MLP.)"""
    mesh = dict(mesh__data=2, mesh__fsdp=4) if devices == 8 else {}
    cfg = recipe("tiny", **_settings(program), model__mlp_dim=0, model__remat="none", **mesh)
    report = plan.plan(cfg, devices, 80 * memory.GIB, compile=True, devices=jax.devices()[:devices])
    analytic = memory.estimate(cfg, devices, platform="cpu", act_bytes=memory.cpu_act_bytes()).per_device_bytes
    assert abs(report["compiled"]["per_device_bytes"] / analytic - 1) <= memory.TOLERANCE


# GELU's GPT-2 (its own architecture, also in tests/test_hf.py) in the slow suite
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "gelu" else n for n in NAMES])
def test_hugging_face_architectures_load_the_weights_or_the_export_is_refused(name, tmp_path):
    cfg = small_config(mlp=name, n_kv_heads=2)
    if not MLPS[name].hf_architectures:
        with pytest.raises(UserError, match=f"model.mlp={name}") as refused:
            hf_map.architecture_of(cfg)
        assert "\n" not in str(refused.value)
        return
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import save_file

    for arch in MLPS[name].hf_architectures:
        arch_cfg = dataclasses.replace(cfg, **HF_MODELS[arch])
        assert hf_map.architecture_of(arch_cfg) == arch
        model = _built(arch_cfg)
        # Biases and norms away from 0 and 1, so that a weight moved to the wrong place shows.
        params = jax.tree.map(lambda x: np.asarray(x) + 0.05 * np.sin(np.arange(x.size).reshape(x.shape)),
                              nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, params)
        nnx.update(model, state)
        # As the export writes them, and transformers reads a checkpoint (which renames or fuses some tensors).
        directory = tmp_path / arch
        directory.mkdir()
        hf_cfg = hf_map.hf_config(arch_cfg, arch, bos_id=1, eos_id=2, pad_id=None, dtype="float32")
        (directory / "config.json").write_text(json.dumps(hf_cfg))
        save_file(dict(hf_map.hf_tensors(params, arch_cfg, arch, np.float32)), str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        reference, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                            output_loading_info=True)
        reference.eval()
        assert type(reference).__name__ == hf_cfg["architectures"][0]
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
        assert not unexpected and set(missing) <= ({"lm_head.weight"} if arch_cfg.tie_embeddings else set()), (
            missing, unexpected)
        ids = np.arange(24).reshape(2, 12) % arch_cfg.vocab_size
        with torch.no_grad():
            want = reference(torch.tensor(ids)).logits.numpy()
        got = np.asarray(model(jnp.asarray(ids)), np.float32)
        floats.close(got, want, ulps=1000)  # two programs (XLA, PyTorch): within 1.2e-4 of the largest logit


def test_the_planner_orders_every_remat_policy():
    """`plan.REMAT_ORDER` (most memory first: the knobs it suggests) holds every policy the model has."""
    assert sorted(plan.REMAT_ORDER) == sorted(("none", *REMAT_POLICIES))
