"""Schedule-free AdamW's evaluation point everywhere a checkpoint's parameters are read: `checkpoint.load_params`
(which `inference.load_run`, and so evaluate, generate, the Hugging Face export, explore and compress, and
`run.init_from` go through) gives x = (y - (1 - b1) z) / b1 from the checkpoint's y and z, checked in NumPy
against the raw checkpoint; an AdamW checkpoint's readers give y as before. The slow tests train a real
schedule-free run and check evaluate's validation loss against the run's own, the export and init_from."""

import dataclasses
import pathlib

import floats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from helpers import small_config
from jaxlm import axes, checkpoint, config, optim, pruning_masks, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError

SF = "schedule_free_adamw"
LINE = "evaluation point x = (y - (1 - b1) z) / b1"


def _numpy_x(step_dir: pathlib.Path) -> tuple[dict, dict]:
    """(x, y) from checkpoint `step_dir`'s raw arrays (Orbax, no jaxlm), x in NumPy float32."""
    raw = ocp.PyTreeCheckpointer().restore(step_dir / "state")
    found = []

    def walk(tree):
        if isinstance(tree, dict) and "z" in tree and "b1" in tree:
            found.append(tree)
        elif isinstance(tree, dict):
            [walk(v) for v in tree.values()]
        elif isinstance(tree, (list, tuple)):
            [walk(v) for v in tree]

    walk(raw["opt_state"])
    (state,) = found
    b1 = np.float32(state["b1"])
    y = jax.tree.map(np.asarray, raw["params"])
    return jax.tree.map(lambda y, z: (y - (np.float32(1) - b1) * np.asarray(z)) / b1, y, state["z"]), y


def _saved(directory, name: str) -> dict:
    """A train state of `name` (z moved off y, as training moves it) on an 8-way FSDP mesh, saved as step 3;
    returns its host copy."""
    cfg = config.recipe("tiny", optim__name=name, **(dict(optim__schedule="constant") if name == SF else {}))
    model_cfg = small_config(n_kv_heads=4)
    tx, _ = optim.make_optimizer(cfg.optim, 10, train_state.build_model_spec(model_cfg).decay_mask)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    state, _, _ = train_state.create(model_cfg, tx, mesh_lib.make_mesh(axes.shape_of(fsdp=8)), rules)

    def moved(s):
        if not isinstance(s, optax.contrib.ScheduleFreeState):
            return s
        z = jax.tree.map(lambda z: z + 0.05 * jnp.cos(jnp.arange(z.size, dtype=z.dtype).reshape(z.shape)), s.z)
        return s._replace(z=z)

    # one program for the whole optimizer state (eagerly, each operation on each shape compiles its own)
    opt_state = jax.jit(lambda o: jax.tree.map(moved, o, is_leaf=lambda s: isinstance(s, optax.contrib.ScheduleFreeState)),
                        out_shardings=jax.tree.map(lambda x: x.sharding, state.opt_state))(state.opt_state)
    state = state.replace(step=jnp.array(3, jnp.int32), opt_state=opt_state)
    with checkpoint.Checkpointer(directory) as ckpt:
        assert ckpt.save(3, state, meta={"config": cfg.to_dict()}, force=True)
    return jax.device_get(state)


def _target(dtype=jnp.float32):
    model_cfg = small_config(n_kv_heads=4)
    rules = mesh_lib.rules_from_config(config.recipe("tiny").mesh.rules)
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=2, tensor=4))
    abstract, *_ = train_state.abstract_state(model_cfg, optax.identity(), mesh, rules)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding), abstract.params)


def test_a_schedule_free_checkpoint_reads_as_x_and_an_adamw_one_as_y(tmp_path, capfd):
    """Onto another mesh (fsdp 2 x tensor 4), in float32 and bfloat16: a schedule-free checkpoint's
    parameters are x, NumPy's from its raw y and z (and not y), said in one line; an AdamW checkpoint's are its
    y exactly, nothing said."""
    _saved(tmp_path / "sf", SF)
    want, y = _numpy_x(tmp_path / "sf" / "3")
    target = _target()
    capfd.readouterr()
    got = checkpoint.load_params(tmp_path / "sf", target)
    said = [line for line in capfd.readouterr().err.splitlines() if LINE in line]
    assert len(said) == 1 and "checkpoint 3" in said[0] and "b1=0.9" in said[0]
    floats.close(jax.device_get(got), want, ulps=2)
    assert not np.allclose(got["unembed"]["kernel"], y["unembed"]["kernel"], atol=1e-3)
    assert jax.tree.map(lambda x: x.sharding, got) == jax.tree.map(lambda x: x.sharding, target)
    half = checkpoint.load_params(tmp_path / "sf", target, dtype=jnp.bfloat16)  # x in float32, then rounded
    for leaf in jax.tree.leaves(half):
        assert leaf.dtype == jnp.bfloat16
    floats.close(jax.device_get(half), jax.tree.map(lambda x: x.astype(jnp.bfloat16), want), ulps=2)

    adamw = _saved(tmp_path / "adamw", "adamw")
    capfd.readouterr()
    got = checkpoint.load_params(tmp_path / "adamw", target)
    assert LINE not in capfd.readouterr().err
    floats.identical(jax.device_get(got), adamw.params, why=floats.MOVED)


def test_schedule_free_with_pruning_masks_is_refused_in_one_line():
    """A pruned model's updates are masked after the optimizer (`pruning_masks.keep_pruned`), so y stays zero
    at pruned weights but z does not: x would not be. Checked on the optimizer itself first."""
    o = config.recipe("tiny", optim__name=SF, optim__schedule="constant", optim__warmup_steps=0).optim
    params = {"w": jnp.where(jnp.arange(8) % 2 == 0, 1.0, 0.0).reshape(2, 4)}
    masks = {"w": params["w"] != 0}
    tx, _ = optim.make_optimizer(o, 10, {"w": True}, extra=[pruning_masks.keep_pruned()])
    state = tx.init(params)
    for i in range(3):
        updates, state = tx.update({"w": jnp.full((2, 4), 0.5 + i)}, state, params, masks=masks, finite=jnp.array(True))
        params = optax.apply_updates(params, updates)
    x = np.asarray(optim.eval_params(o, state, params)["w"])
    pruned = ~np.asarray(masks["w"])
    assert not np.any(np.asarray(params["w"])[pruned]) and np.all(np.abs(x[pruned]) > 1e-4)  # y zero there, x not
    with pytest.raises(UserError, match=r"optim.name='schedule_free_adamw'.*compress.sparsity"):
        config.recipe("tiny", optim__name=SF, optim__schedule="constant", compress__sparsity=0.5,
                      compress__prune_end=10)


# ----------------------------------------------------------------------------- a real schedule-free run (slow)


@pytest.fixture(scope="module")
def sf_run(tmp_path_factory):
    """The facts run (tests/tiny_run.py) trained schedule-free for 6 steps, evaluated and saved at step 6."""
    from tiny_run import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("sf"), steps=6, extra=(
        f"--config.optim.name={SF}", "--config.optim.schedule=constant", "--config.optim.warmup_steps=0",
        "--config.run.eval_every=6"))


@pytest.mark.slow  # ~10 s with the fixture (a 6-step run in a subprocess): past the default suite's budget
def test_evaluate_reads_x_and_gives_the_runs_own_validation_loss(sf_run):
    """`load_run` gives NumPy's x; `jaxlm.evaluate`'s validation loss in the run's dtype is the training loop's
    at that step (the same held-out batches, the same x); y's is not."""
    import json

    from jaxlm import evaluate, inference

    want, y = _numpy_x(sf_run / "checkpoints" / "6")
    run = inference.load_run(sf_run, dtype="float32")
    floats.close(jax.device_get(run.params), want, ulps=2)
    in_training = [json.loads(line) for line in (sf_run / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val_loss"] for r in in_training if "val_loss" in r and r["step"] == 6][-1]
    bf16 = inference.load_run(sf_run)
    docs, _ = evaluate.corpus_documents(bf16, "val")
    got = evaluate.perplexity(bf16, docs)["loss"]
    at_y = evaluate.perplexity(dataclasses.replace(bf16, params=jax.device_put(y, bf16.param_shardings)), docs)["loss"]
    print(f"val_loss in training {val_loss:.6f}, evaluate at x {got:.6f}, at y {at_y:.6f}")
    assert got == pytest.approx(val_loss, rel=1e-5)
    assert abs(at_y - val_loss) > 100 * abs(got - val_loss)


@pytest.mark.slow  # the run above, its export, and a new run built from it
def test_the_hf_export_and_init_from_hold_x(sf_run, tmp_path):
    import safetensors.numpy

    import tiny_run
    from jaxlm import hf, init_from, train_setup

    want, _ = _numpy_x(sf_run / "checkpoints" / "6")
    out = hf.export_run(sf_run, tmp_path / "sf-hf")
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(safetensors.numpy.load_file(f))
    floats.close(tensors["model.embed_tokens.weight"], want["embed"]["embedding"], ulps=2)

    cfg = init_from.config_from_cli(tiny_run.finetune_args(tmp_path, sf_run, "ft", "--config.mesh.data=1",
                                                           "--config.mesh.fsdp=-1"))
    setup = train_setup.build(cfg)
    floats.close(jax.device_get(setup.state.params), want, ulps=2)
