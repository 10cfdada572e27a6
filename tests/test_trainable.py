"""Trainable and frozen parameters (`optim.trainable`): gradients, optimizer state and updates for
the trainable part only; frozen parameters pass through the step bit-unchanged."""

import floats
import jax
import numpy as np
import pytest

from helpers import random_batch, small_config
from jaxlm import axes, config, optim, steps, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.optim import OptimConfig

FSDP2, MESH = axes.shape_of(fsdp=2), axes.shape_of(data=2, fsdp=2, tensor=2)


def _step(trainable: str, mesh_shape=FSDP2, micro_batches=1):
    cfg = config.recipe("tiny", optim__clip_norm=0.0, optim__trainable=trainable)
    model_cfg = small_config()
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_spec = train_state.build_model_spec(model_cfg, trainable)
    tx, schedule = optim.make_optimizer(cfg.optim, 10, model_spec.decay_mask)
    mesh = mesh_lib.make_mesh(mesh_shape)
    state, shardings, model_spec = train_state.create(model_cfg, tx, mesh, rules, seed=0, model_spec=model_spec)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    step_fn = steps.make_train_step(model_spec, tx, schedule, rules=rules, optim=OptimConfig(micro_batches=micro_batches))
    step = steps.jit_train_step(step_fn, shardings, batch_sharding)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in random_batch(8, 32, 96).items()}
    before = jax.device_get(state.params)
    with jax.set_mesh(mesh):
        after, metrics = step(state, batch)
    return model_spec, before, after, metrics


def _flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, micro_batches", [(FSDP2, 1), (MESH, 2)])
def test_frozen_parameters_stay_and_trainable_ones_move_as_in_full_training(mesh_shape, micro_batches):
    _, before, full, _ = _step("", mesh_shape, micro_batches)
    model_spec, _, part, _ = _step("mlp/,final_norm", mesh_shape, micro_batches)
    trains = _flat(model_spec.trainable)
    assert any(trains.values()) and not all(trains.values())
    full, part, before = _flat(jax.device_get(full.params)), _flat(jax.device_get(part.params)), _flat(before)
    for path, trainable in trains.items():
        if trainable:  # Adam is per parameter and clipping is off: the same update as in full training
            assert "mlp" in path or "final_norm" in path
            assert not np.array_equal(part[path], before[path]), path
            np.testing.assert_allclose(part[path], full[path], rtol=1e-6, atol=1e-7, err_msg=path)
        else:
            floats.identical(part[path], before[path], why=floats.MOVED, err_msg=path)  # passed through the step


def test_optimizer_state_exists_for_trainable_parameters_only():
    model_spec, _, state, metrics = _step("type:Param")  # every parameter is an nnx.Param: all train
    assert all(jax.tree.leaves(model_spec.trainable)) and model_spec.split(model_spec.trainable)[1] == {}
    model_spec, _, state, _ = _step("wq")
    adam = state.opt_state[0]  # (scale_by_adam, ...): mu and nu keyed like the trainable parameters
    trainable_part = model_spec.split(model_spec.trainable)[0]
    assert jax.tree_util.tree_structure(adam.mu) == jax.tree_util.tree_structure(trainable_part)
    assert set(_flat(adam.mu)) == {"['blocks']['attn']['wq']['kernel']"}


def test_a_filter_that_matches_nothing_or_is_not_a_regex_is_one_clear_error():
    with pytest.raises(UserError, match=r"optim.trainable='type:LoRAParam' matches no parameter"):
        train_state.build_model_spec(small_config(), "type:LoRAParam")
    with pytest.raises(UserError, match=r"optim.trainable: '\[' is not a regular expression"):
        train_state.build_model_spec(small_config(), "[")


def test_the_memory_plan_counts_frozen_parameters_without_gradients_or_moments():
    from jaxlm import memory

    full = memory.estimate(config.recipe("tiny"), 1, platform="cpu")
    part = memory.estimate(config.recipe("tiny", optim__trainable="mlp/"), 1, platform="cpu")
    m = config.recipe("tiny").model
    mlp_bytes = 4 * m.n_layers * 3 * m.d_model * m.mlp_dim  # w_gate, w_up, w_down in float32
    assert part.row("parameters").total_bytes == full.row("parameters").total_bytes
    assert part.row("gradients").total_bytes == mlp_bytes < full.row("gradients").total_bytes
    assert part.row("update temporaries").total_bytes == mlp_bytes
    # AdamW's mu and nu for the MLP's weights only, plus the step counters.
    assert 2 * mlp_bytes <= part.row("optimizer state").total_bytes < 2 * mlp_bytes + 64
