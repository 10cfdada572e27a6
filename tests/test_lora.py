"""LoRA adapters on the projections (`config.lora`, `transforms.lora.Adapted.add_adapter`, `jaxlm.lora`):
a new adapter changes nothing, adapters shard like their kernels, only they train (base bit-equal, no
gradient or optimizer state for it), merging them into the kernels gives the same logits, and a LoRA
run starts from a base run's checkpoint with fresh adapters."""

import dataclasses
import json

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from command_forks import run_command
from flax import nnx

from helpers import random_batch, small_config
from jaxlm import axes, config, inference, init_from, lora, memory, optim, steps, train_setup, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.models import transformer
from jaxlm.models.transforms.lora import LoRA, lora_equations

ATTENTION = ("wq", "wk", "wv", "wo")
ALL_LLAMA = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

MESH = axes.shape_of(data=2, fsdp=2, tensor=2)


def lora_config(rank=4, targets=ATTENTION, ranks=(), dropout=0.0, **kw):
    return small_config(lora=LoRA(rank, 8.0, tuple(targets), tuple(ranks), dropout), **kw)


def params_of(cfg, seed=0):
    return nnx.to_pure_dict(nnx.state(train_state.build_model(cfg, seed)))


def forward(cfg, params, tokens, dropout_key=None):
    graphdef = train_state.build_model_spec(cfg).graphdef
    return jax.jit(lambda p, t, k: nnx.merge(graphdef, p)(t, dropout_key=k))(params, tokens, dropout_key)


def flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def with_random_b(params, seed=1, std=0.05):
    """The adapters' B drawn at random (at init it is zero): adapters that change the model."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        v + std * jax.random.normal(k, v.shape) if "lora_b" in jax.tree_util.keystr(p) else v
        for (p, v), k in zip(leaves, keys)])


TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 4, 96)


@pytest.mark.parametrize("kw", [{}, dict(scan_layers=False)])
def test_a_new_adapter_changes_nothing_and_the_base_weights_are_those_without_lora(kw):
    base_cfg, cfg = small_config(**kw), lora_config(targets=ALL_LLAMA + ("unembed",), **kw)
    base, adapted = params_of(base_cfg), params_of(cfg)
    assert lora.base_params(adapted).keys() == base.keys()
    assert flat(lora.base_params(adapted)).keys() == flat(base).keys()
    # One seed, one base model: each kernel drawn by the same initializer from the same key.
    floats.identical(flat(lora.base_params(adapted)), flat(base), why=floats.SAME_PROGRAM)
    b = [v for p, v in flat(adapted).items() if "lora_b" in p]
    a = [v for p, v in flat(adapted).items() if "lora_a" in p]
    assert len(a) == len(b) == 8 * (1 if kw.get("scan_layers", True) else 2) - (0 if kw.get("scan_layers", True) else 1)
    assert all(not x.any() for x in b) and all(x.std() > 0 for x in a)
    # Two programs (the adapted one adds the adapters' zero term): within ulps; a B not at zero moves percents.
    floats.close(forward(cfg, adapted, TOKENS), forward(base_cfg, base, TOKENS))


def test_adapter_shapes_and_logical_names_follow_the_kernels_and_shard_like_them():
    cfg = lora_config(targets=ALL_LLAMA + ("unembed",), n_kv_heads=4)
    spec = train_state.build_model_spec(cfg)
    names = spec.logical_names["blocks"]
    assert names["attn"]["wq"] == {"kernel": ("layers", "embed", "heads", "head_dim"),
                                   "lora_a": ("layers", "embed", "lora_rank"),
                                   "lora_b": ("layers", "lora_rank", "heads", "head_dim")}
    assert names["attn"]["wo"]["lora_a"] == ("layers", "heads", "head_dim", "lora_rank")
    assert names["attn"]["wo"]["lora_b"] == ("layers", "lora_rank", "embed")
    assert names["mlp"]["w_down"]["lora_a"] == ("layers", "mlp", "lora_rank")
    assert spec.logical_names["unembed"]["lora_b"] == ("lora_rank", "vocab")
    # Under a mesh with data, fsdp and tensor > 1 (the default rules): A and B split as the kernel's dims.
    mesh = mesh_lib.make_mesh(MESH)
    rules = mesh_lib.rules_from_config(mesh_lib.default_rules())
    abstract, *_ = train_state.abstract_state(cfg, optim.make_optimizer(config.base_config().optim, 10,
                                                                        spec.decay_mask)[0], mesh, rules, 0, spec)
    p = abstract.params
    wq, wo, down, unembed = p["blocks"]["attn"]["wq"], p["blocks"]["attn"]["wo"], p["blocks"]["mlp"]["w_down"], p["unembed"]
    P = jax.sharding.PartitionSpec
    assert wq["kernel"].sharding.spec == P("stage", "fsdp", "tensor", None)
    assert wq["lora_a"].sharding.spec == P("stage", "fsdp", None) and wq["lora_a"].shape == (2, 64, 4)
    assert wq["lora_b"].sharding.spec == P("stage", None, "tensor", None) and wq["lora_b"].shape == (2, 4, 8, 8)
    assert wo["lora_a"].sharding.spec == P("stage", "tensor", None, None) and wo["lora_a"].shape == (2, 8, 8, 4)
    assert wo["lora_b"].sharding.spec == P("stage", None, "fsdp") and wo["lora_b"].shape == (2, 4, 64)
    assert down["lora_a"].sharding.spec == P("stage", "tensor", None)
    assert down["lora_b"].sharding.spec == P("stage", None, "fsdp")
    assert unembed["lora_a"].sharding.spec == P("fsdp", None) and unembed["lora_b"].sharding.spec == P(None, "tensor")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(lora.adapter_params(p)))


def test_the_adapter_contractions_come_from_the_kernels_equation():
    assert lora_equations("btd,dnh->btnh") == ("btd,dr->btr", "btr,rnh->btnh")
    assert lora_equations("btnh,nhd->btd") == ("btnh,nhr->btr", "btr,rd->btd")
    assert lora_equations("btf,fd->btd") == ("btf,fr->btr", "btr,rd->btd")
    assert lora_equations("btr,rv->btv") == ("btr,rz->btz", "btz,zv->btv")  # a free letter for the rank


def test_per_module_ranks_and_param_count():
    cfg = lora_config(rank=4, targets=ALL_LLAMA, ranks=(("w_down", 2), ("wq", 16)))
    p = params_of(cfg)["blocks"]
    assert p["attn"]["wq"]["lora_a"].shape == (2, 64, 16) and p["attn"]["wq"]["lora_b"].shape == (2, 16, 8, 8)
    assert p["attn"]["wk"]["lora_a"].shape == (2, 64, 4)
    assert p["mlp"]["w_down"]["lora_a"].shape == (2, 128, 2) and p["mlp"]["w_down"]["lora_b"].shape == (2, 2, 64)
    counts = transformer.param_count(cfg)
    adapters = sum(x.size for x in jax.tree.leaves(lora.adapter_params(params_of(cfg))))
    assert counts["lora"] == adapters == 2 * (16 * (64 + 64) + 3 * 4 * (64 + 64) + 2 * 4 * (64 + 128) + 2 * (128 + 64))
    assert counts["total"] == sum(x.size for x in jax.tree.leaves(params_of(cfg)))
    # From the config: the scale is alpha / rank per module, as PEFT's rank_pattern
    settings = cfg.lora.peft_settings()
    assert settings["r"] == 4 and settings["rank_pattern"] == {"w_down": 2, "wq": 16}
    assert [s.scale for s in lora.sites(cfg) if s.name == "wq"] == [8.0 / 16]


def test_the_config_section_resolves_all_and_names_that_match_nothing_are_one_line():
    cfg = config.recipe("tiny", lora__rank=8, lora__targets="all", lora__ranks="w_up:2", lora__alpha=32.0)
    m = transformer.ModelConfig.from_config(cfg.model, "cpu", lora=cfg.lora)
    assert set(m.lora.targets) == set(ALL_LLAMA) and m.lora.rank_of("w_up") == 2 and m.lora.rank_of("wq") == 8
    assert m.lora.rank_of("unembed") == 0 and m.lora.alpha == 32.0
    gelu = config.recipe("tiny", model__variant="gpt2", lora__rank=8, lora__targets="all,unembed")
    assert transformer.ModelConfig.from_config(gelu.model, "cpu", lora=gelu.lora).lora.targets == (
        "w_in", "w_out", "wk", "wo", "wq", "wv", "unembed")
    assert transformer.ModelConfig.from_config(config.recipe("tiny").model, "cpu").lora is None  # default: off
    for overrides, message in [
        (dict(lora__targets="wq,q_proj"), r"config.lora.targets='wq,q_proj': 'q_proj' is not a projection of this "
                                          r"model; its projections: unembed, w_down, w_gate, w_up, wk, wo, wq, wv, "
                                          r"or 'all' \(every one but unembed\)$"),
        (dict(lora__targets="w_in"), "'w_in' is not a projection of this model"),  # GELU's, not SwiGLU's
        (dict(model__tie_embeddings=True, lora__targets="unembed"), "'unembed' is not a projection"),
        (dict(lora__targets=" , "), "names nothing"),
        (dict(lora__ranks="w_up:4"), r"'w_up' is not among config.lora.targets='wq,wk,wv,wo'"),
        (dict(lora__ranks="wq=4"), r"'wq=4' is not name:rank with a positive rank"),
        (dict(lora__rank=0, lora__ranks="wq:4"), r"needs config.lora.rank > 0"),
        (dict(lora__rank=-1), r"config.lora.rank=-1 is not allowed"),
        (dict(lora__alpha=0.0), r"config.lora.alpha=0.0 is not allowed"),
        (dict(lora__dropout=1.0), r"config.lora.dropout=1.0 is not allowed"),
    ]:
        with pytest.raises(UserError, match=message) as error:
            config.recipe("tiny", **{"lora__rank": 8, **overrides})
        assert "\n" not in str(error.value)


def test_with_adapters_only_they_train_unless_optim_trainable_says_more():
    cfg = lora_config()
    trains = flat(train_state.build_model_spec(cfg).trainable)
    assert {p for p, t in trains.items() if t} == {p for p in trains if "lora_" in p} != set()
    trains = flat(train_state.build_model_spec(cfg, "type:LoRAParam,final_norm").trainable)
    assert {p for p, t in trains.items() if t} == {p for p in trains if "lora_" in p or "final_norm" in p}
    assert all(flat(train_state.build_model_spec(small_config()).trainable).values())  # no adapters: all train


def _train(model_cfg, n_steps, mesh_shape=MESH, trainable="", lr=1e-2):
    cfg = config.recipe("tiny", optim__peak_lr=lr, optim__warmup_steps=0, optim__schedule="constant",
                        optim__trainable=trainable)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_spec = train_state.build_model_spec(model_cfg, trainable)
    tx, schedule = optim.make_optimizer(cfg.optim, n_steps, model_spec.decay_mask)
    mesh = mesh_lib.make_mesh(mesh_shape)
    state, shardings, model_spec = train_state.create(model_cfg, tx, mesh, rules, seed=0, model_spec=model_spec)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    step = steps.jit_train_step(steps.make_train_step(model_spec, tx, schedule, rules=rules), shardings, batch_sharding)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in random_batch(8, 32, 96).items()}
    before, losses = flat(jax.device_get(state.params)), []
    with jax.set_mesh(mesh):
        for _ in range(n_steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return model_spec, before, state, losses


def test_only_the_adapters_train_the_base_stays_bit_equal_and_the_loss_goes_down():
    cfg = lora_config(targets=ALL_LLAMA, dropout=0.1)
    model_spec, before, state, losses = _train(cfg, 12)
    after = flat(jax.device_get(state.params))
    adapters = [p for p in after if "lora_" in p]
    assert len(adapters) == 14 and len(after) > len(adapters)
    for path, value in after.items():
        if "lora_" in path:
            assert not np.array_equal(value, before[path]), path
        else:  # the frozen base: passed through every step, never updated
            floats.identical(value, before[path], why=floats.MOVED, err_msg=path)
    # One fixed batch: the adapters alone fit it, the loss falls at every step.
    assert losses[-1] < losses[0] - 0.2 and losses == sorted(losses, reverse=True), losses
    # AdamW's moments exist for the adapters only: the frozen base has no optimizer state (nor gradient).
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    assert set(flat(adam.mu)) == set(flat(adam.nu)) == set(adapters)
    shapes = {p: v.shape for p, v in flat(adam.mu).items()}
    assert shapes == {p: after[p].shape for p in adapters}
    opt_elements = sum(x.size for x in jax.tree.leaves(state.opt_state))
    assert opt_elements == 2 * transformer.param_count(cfg)["lora"] + 2  # mu, nu and two step counters


def test_the_planner_counts_gradients_and_moments_of_the_adapters_only():
    cfg = config.recipe("tiny", lora__rank=8, lora__targets="all")
    est = memory.estimate(cfg, 1, platform="cpu")
    m = transformer.ModelConfig.from_config(cfg.model, "cpu", lora=cfg.lora)
    built = jax.eval_shape(lambda: params_of(m))  # shapes alone
    adapters = sum(x.size for x in jax.tree.leaves(lora.adapter_params(built)))
    assert adapters == transformer.param_count(m)["lora"] > 0
    assert est.param_count == sum(x.size for x in jax.tree.leaves(built)) == transformer.param_count(m)["total"]
    assert est.row("gradients").total_bytes == 4 * adapters
    assert est.row("update temporaries").total_bytes == 4 * adapters
    assert 2 * 4 * adapters <= est.row("optimizer state").total_bytes < 2 * 4 * adapters + 64
    assert est.row("parameters").total_bytes == 4 * sum(x.size for x in jax.tree.leaves(built))


@pytest.mark.parametrize("kw", [{}, pytest.param(dict(scan_layers=False), marks=pytest.mark.slow),
                                dict(mlp="gelu", norm="layernorm", use_bias=True),
                                dict(qk_norm=True, n_kv_heads=2)])  # Qwen3's q/k norms: not projections, untouched
def test_merged_weights_give_the_adapted_models_logits(kw):
    mlp = ("w_in", "w_out") if kw.get("mlp") == "gelu" else ("w_gate", "w_up", "w_down")
    cfg = lora_config(targets=ATTENTION + mlp + ("unembed",), ranks=(("wo", 2),), **kw)
    params = with_random_b(params_of(cfg))
    adapted = forward(cfg, params, TOKENS)
    merged = lora.merge(params, cfg)
    base_cfg = lora.without_lora(cfg)
    assert jax.tree.structure(merged) == jax.tree.structure(params_of(base_cfg))
    np.testing.assert_allclose(forward(base_cfg, merged, TOKENS), adapted, rtol=1e-5, atol=1e-5)
    # The kernels without adapters are the same arrays, moved (bit-equal); each adapted one has changed.
    changed = [p for p, v in flat(merged).items() if not np.array_equal(v, flat(lora.base_params(params))[p])]
    assert len(changed) == len([p for p in flat(params) if "lora_a" in p])  # every adapted kernel, nothing else
    assert lora.merge(params_of(small_config(**kw)), small_config(**kw)).keys() == params_of(small_config(**kw)).keys()


def test_scanned_and_unscanned_layers_agree_with_adapters():
    scanned, unscanned = lora_config(targets=ALL_LLAMA + ("unembed",)), lora_config(targets=ALL_LLAMA + ("unembed",),
                                                                                      scan_layers=False)
    params = with_random_b(params_of(scanned))
    layers = {i: jax.tree.map(lambda x, i=i: x[i], params["blocks"]) for i in range(scanned.n_layers)}
    unstacked = {**params, "blocks": layers}
    assert jax.tree.structure(unstacked) == jax.tree.structure(params_of(unscanned))
    np.testing.assert_allclose(forward(unscanned, unstacked, TOKENS), forward(scanned, params, TOKENS),
                               rtol=1e-5, atol=1e-5)
    # and the export view is the same per layer
    a, b = lora.adapters(params, scanned), lora.adapters(unstacked, unscanned)
    assert [(x.name, x.layer, x.rank) for x in a] == [(x.name, x.layer, x.rank) for x in b]
    assert len(a) == 2 * 7 + 1 and a[-1].name == "unembed" and a[-1].layer is None
    for x, y in zip(a, b):  # `unstacked` is `params` sliced per layer
        floats.identical((x.a, x.b), (y.a, y.b), why=floats.MOVED, err_msg=f"{x.name} {x.layer}")
    wo = next(x for x in a if x.name == "wo" and x.layer == 1)
    assert wo.a.shape == (8, 8, 4) and wo.b.shape == (4, 64)
    assert (wo.input_names, wo.output_names) == (("heads", "head_dim"), ("embed",))


def test_adapter_dropout_acts_in_training_only():
    cfg = lora_config(dropout=0.5)
    params = with_random_b(params_of(cfg))
    plain = forward(cfg, params, TOKENS)
    # Without a key dropout is left out of the trace: both configs lower to the same program.
    floats.identical(forward(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, dropout=0.0)), params, TOKENS),
                     plain,
                     why=floats.SAME_PROGRAM)
    dropped = forward(cfg, params, TOKENS, jax.random.key(3))
    assert not np.allclose(dropped, plain, atol=1e-4)
    # model.dropout is 0: with adapters' B at zero, a dropout key changes nothing (two programs: the
    # keyed one drops into the adapters' zero term; within ulps, where a dropout of the base moves percents)
    floats.close(forward(cfg, params_of(cfg), TOKENS, jax.random.key(3)), forward(cfg, params_of(cfg), TOKENS))


# ----------------------------------------------------------------------------- a LoRA run, end to end


def _run_args(directory, source, name, *extra, steps=6):
    from tiny_run import finetune_args

    return finetune_args(directory, source, name, *extra, steps=steps, optim__peak_lr=1e-2, checkpoint__every_steps=3,
                         lora__rank=4, lora__targets="all", lora__alpha=8.0)


@pytest.mark.slow
def test_a_lora_run_starts_from_a_base_run_trains_its_adapters_and_evaluates_with_them(facts_run, tmp_path):
    from tiny_run import ONE_DEVICE, ROOT

    # In-process: the base weights come from the source, the adapters are fresh (B zero), the
    # optimizer state is the adapters' alone.
    cfg = init_from.config_from_cli(_run_args(tmp_path, facts_run, "inproc", "--config.mesh.fsdp=-1"))
    setup = train_setup.build(cfg, abstract=True)
    state, origin = init_from.load_state(setup)
    src = inference.load_run(facts_run)
    mine, theirs = flat(jax.device_get(state.params)), flat(jax.device_get(src.params))
    assert set(mine) - set(theirs) == {p for p in mine if "lora_" in p} != set()
    floats.identical({p: mine[p] for p in theirs}, theirs, why=floats.MOVED)  # read from the same checkpoint
    fresh = flat(params_of(setup.model_cfg, cfg.run.seed))  # what train_state.create gives: same seed, same A
    # Two programs (the sharded jitted init against this eager one): within ulps; another key is another A.
    floats.close({p: mine[p] for p in mine if "lora_" in p}, {p: fresh[p] for p in mine if "lora_" in p})
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    assert set(flat(adam.mu)) == {p for p in mine if "lora_" in p}

    # The CLI: train 6 steps, then evaluate the run: its own adapters are loaded and used.
    result = run_command("train", _run_args(tmp_path, facts_run, "lora"), cwd=ROOT, env=ONE_DEVICE, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "initialized from" in result.stdout
    run = inference.load_run(tmp_path / "lora")
    assert run.step == 6 and run.model_cfg.lora.rank == 4 and len(run.model_cfg.lora.targets) == 7
    tuned = flat(jax.device_get(run.params))
    # the base: bit-equal to the source's (read from its checkpoint, frozen, saved and read back)
    floats.identical({p: tuned[p] for p in theirs}, theirs, why=floats.MOVED)
    assert all(tuned[p].any() for p in tuned if "lora_b" in p)  # trained adapters
    tokens = jnp.asarray(src.tokenizer.encode(["alice likes apples. bob likes"], add_eos=False))
    float_cfg = dataclasses.replace(run.model_cfg, dtype=jnp.float32)
    params = jax.device_get(run.params)
    logits = forward(float_cfg, params, tokens)
    np.testing.assert_allclose(forward(lora.without_lora(float_cfg), lora.merge(params, float_cfg), tokens), logits,
                               rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(forward(lora.without_lora(float_cfg), lora.base_params(params), tokens)) - logits).max() > 1e-3
    # The checkpoint: the base once, the adapters' moments alone.
    import orbax.checkpoint as ocp
    from etils import epath

    saved = ocp.PyTreeCheckpointHandler().metadata(epath.Path(tmp_path / "lora" / "checkpoints" / "6" / "state")).tree
    arrays = {jax.tree_util.keystr(k): v.shape for k, v in
              jax.tree_util.tree_flatten_with_path(saved, is_leaf=lambda x: hasattr(x, "shape"))[0]}
    assert {k[len("['params']"):] for k in arrays if k.startswith("['params']")} == set(tuned)
    moments = [k for k, shape in arrays.items() if k.startswith("['opt_state']") and shape]
    assert len(moments) == 2 * len([p for p in tuned if "lora_" in p]) and all("['lora_" in k for k in moments)
    assert json.loads((tmp_path / "lora" / "config.json").read_text())["lora"]["rank"] == 4

    # A run from a LoRA run would lose its adapters: refused in one line.
    with pytest.raises(UserError, match=r"was trained with LoRA adapters .*merge them"):
        init_from.config_from_cli(_run_args(tmp_path, tmp_path / "lora", "again"))

    # Its adapter alone has no Hugging Face model to name (the source trained its own weights): refused in
    # one line, unless the base is written beside it (tests/test_hf.py: from an imported model, named).
    from jaxlm import hf

    with pytest.raises(UserError, match=r"which holds weights of its own, not a Hugging Face model as imported .*; "
                                        r"give the base model the adapter belongs to with --base_model"):
        hf.export_run(run.run_dir, tmp_path / "adapter", adapters="peft")
    assert not (tmp_path / "adapter").exists()
    out = hf.export_run(run.run_dir, tmp_path / "adapter", adapters="peft", with_base=True)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "base"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        out.resolve() / "base")
    assert (out / "base" / "config.json").is_file() and (out / "base" / "model.safetensors").is_file()


def test_a_run_saved_before_the_lora_section_existed_resumes_and_a_changed_lora_does_not():
    from jaxlm.run_dir import config_differences

    saved = json.loads(config.recipe("tiny").to_json())
    del saved["lora"]  # config.json of a run trained before the section existed: no adapters
    assert config_differences(saved, config.recipe("tiny"), config.base_config()) == []
    assert config_differences(saved, config.recipe("tiny", lora__rank=4), config.base_config()) == ["lora.rank: 0 -> 4"]
