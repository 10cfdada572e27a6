"""The notebook API (jaxlm.explore) on a real model, data pipeline and checkpoint, on 8 CPU devices."""

import math

import floats
import jax
import numpy as np
import pytest

from helpers import llama_layout_model
from jaxlm import explore, train_setup
from jaxlm.data.tokenizer import SentencePieceTokenizer
from jaxlm.errors import UserError
from jaxlm.mesh import axes_of, logical_to_spec
from jaxlm.models import transformer

SMALL = dict(model__vocab_size=512, model__d_model=64, model__n_layers=2, model__n_heads=4, model__n_kv_heads=2,
             model__mlp_dim=128, model__dtype="float32", data__seq_len=32, data__global_batch_size=8,
             data__builtin_max_bytes=400_000, data__val_fraction=0.3, data__val_tokens=512, run__steps=3,
             optim__warmup_steps=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explore")
    setup = explore.build("tiny", devices=jax.devices(), mesh=dict(data=2, fsdp=2, tensor=2),
                          data__cache_dir=str(tmp / "cache"), run__output_dir=str(tmp / "runs"), **SMALL)
    return setup, explore.load_data(setup), tmp


def test_the_parameter_table_says_what_the_rules_and_mesh_make_of_each_weight():
    setup = explore.build("tiny", devices=jax.devices(), mesh=dict(fsdp=4, tensor=2), abstract=True, **SMALL)
    params = explore.parameters(setup)
    sizes = dict(setup.mesh.shape)
    names = jax.tree_util.tree_leaves(setup.model_spec.logical_names, is_leaf=lambda x: isinstance(x, tuple))
    assert [p.logical_axes for p in params] == names
    for p in params:
        assert p.spec == logical_to_spec(p.logical_axes, setup.rules)
        split = [math.prod(sizes[a] for a in axes_of(axes)) for axes in p.spec]
        split += [1] * (len(p.shape) - len(split))
        assert p.shard_shape == tuple(n // k for n, k in zip(p.shape, split))
        assert p.bytes_per_device == math.prod(p.shard_shape) * 4
    by_name = {p.name: p for p in params}
    assert by_name["blocks.mlp.w_up.kernel"].shape == (2, 64, 128)
    assert by_name["blocks.mlp.w_up.kernel"].shard_shape == (2, 16, 64)  # embed over fsdp=4, mlp over tensor=2
    assert sum(p.count for p in params) == transformer.param_count(setup.model_cfg)["total"]
    table = explore.parameter_table(setup)
    assert f"{sum(p.count for p in params):,} parameters" in table.footer
    assert table.records()[0]["name"] == params[0].name and "| blocks.attn.wk.kernel |" in table.to_markdown()
    # The drawn 2-D view: the stacked layers axis dropped, head_dim merged into heads.
    wq, wo = by_name["blocks.attn.wq.kernel"].spec, by_name["blocks.attn.wo.kernel"].spec
    assert explore.sharding_view((2, 64, 4, 16), wq)[:2] == ((64, 64), jax.P("fsdp", "tensor"))
    assert explore.sharding_view((2, 4, 16, 64), wo)[:2] == ((64, 64), jax.P("tensor", "fsdp"))
    # on this mesh the layers' stage axis has size 1: unsplit; split into two pipeline stages, one stage is drawn
    assert "one slice of the leading dimension of 2" in explore.sharding_view((2, 64, 4, 16), wq, dict(setup.mesh.shape))[2]
    staged = explore.sharding_view((2, 64, 4, 16), wq, {**setup.mesh.shape, "stage": 2})
    assert staged[:2] == ((64, 64), jax.P("fsdp", "tensor")) and "split over stage" in staged[2]
    with pytest.raises(UserError, match="no parameter 'blocks.mlp.w_in.kernel'"):
        explore.find_parameter(setup, "blocks.mlp.w_in.kernel")


def test_forward_on_text_gives_the_loss_the_eval_step_gives(built):
    setup, data, _ = built
    text = "def add(a, b):\n    return a + b\n"
    result = explore.forward(setup, text, data.tokenizer)
    ids = [data.tokenizer.bos_id, *data.tokenizer.encode([text], add_bos=False, add_eos=False)[0]]
    assert result.ids == ids and result.logits.shape == (len(ids) - 1, 512)
    # The same tokens as an eval batch through the CLI's compiled eval step.
    n = len(ids) - 1
    batch = {k: np.zeros((8, 32), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    batch["inputs"][0, :n], batch["targets"][0, :n] = ids[:-1], ids[1:]
    batch["segment_ids"][0, :n], batch["positions"][0, :n] = 1, np.arange(n)
    batch["weights"] = (batch["segment_ids"] > 0).astype(np.float32)
    with jax.set_mesh(setup.mesh):
        val = train_setup.evaluate(setup, setup.state.params, [batch])
    assert result.loss == pytest.approx(val["val_loss"], rel=1e-5)
    log_probs = result.logits[0] - np.log(np.sum(np.exp(result.logits[0].astype(np.float64))))
    assert result.losses[0] == pytest.approx(-log_probs[ids[1]], rel=1e-5)
    two = explore.forward(setup, [text, "import os"], data.tokenizer)
    assert two[0].loss == pytest.approx(result.loss, rel=1e-5) and len(two[1].ids) < len(ids)
    llama = SentencePieceTokenizer(llama_layout_model())  # another tokenizer's BOS begins the text: Llama's 1
    assert explore.forward(setup, text, llama).ids == [1, *llama.encode([text], add_bos=False, add_eos=False)[0]]
    with pytest.raises(UserError, match="context is 32"):
        explore.forward(setup, "x = 1\n" * 200, data.tokenizer)


@pytest.mark.slow
def test_train_steps_then_save_and_load_give_back_the_same_model(built):
    setup, data, tmp = built
    step = int(jax.device_get(setup.state.step))
    before = jax.device_get(setup.state.params)
    history = list(explore.train_steps(setup, data, 2))
    assert [m["step"] for m in history] == [step + 1, step + 2] and all(math.isfinite(m["loss"]) for m in history)
    assert not np.allclose(jax.device_get(setup.state.params)["unembed"]["kernel"], before["unembed"]["kernel"])
    val = explore.evaluate(setup, data)
    assert val["val_perplexity"] == pytest.approx(math.exp(val["val_loss"]))

    run_dir = explore.save(setup, data, tmp / "runs" / "saved")
    loaded = explore.load(run_dir)
    assert loaded.step == step + 2 and loaded.mesh.shape == setup.mesh.shape
    floats.identical(loaded.params, setup.state.params, why=floats.MOVED)  # saved and loaded
    text = "for i in range(3):\n"
    assert explore.forward(loaded, text).loss == pytest.approx(explore.forward(setup, text, data.tokenizer).loss, rel=1e-6)


@pytest.mark.slow
def test_sampling_restoring_and_the_cli_continuing_a_notebooks_run(built):
    setup, data, tmp = built
    list(explore.train_steps(setup, data, 1))
    step = int(jax.device_get(setup.state.step))
    run_dir = explore.save(setup, data, tmp / "runs" / "notebook")
    loaded = explore.load(run_dir)
    greedy = explore.sample(setup, "def ", data.tokenizer, max_new_tokens=6, temperature=0)
    assert isinstance(greedy, str) and greedy == explore.sample(loaded, "def ", max_new_tokens=6, temperature=0)

    fresh = explore.build(setup.cfg, devices=jax.devices())  # restore onto a new setup, same mesh
    assert explore.restore(fresh, run_dir) == step
    floats.identical(fresh.state, setup.state, why=floats.MOVED)  # saved and restored

    # The command line's loop picks the notebook's checkpoint up and trains on from it.
    from jaxlm import train

    cfg = explore.make_config(setup.cfg, run__name="notebook", run__steps=step + 1)
    summary = train.run(cfg)
    assert summary["resumed_from"] == step and summary["steps"] == step + 1
    following = next(explore.train_steps(setup, data, 1))  # the same next batch, the same state
    assert summary["final_loss"] == pytest.approx(following["loss"], rel=1e-5)
