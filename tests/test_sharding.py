"""Parameters are born sharded exactly as each recipe's rules table says."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import small_config
from jaxlm import axes, config, optim, train_state
from jaxlm import mesh as mesh_lib

MESH = axes.shape_of(data=2, fsdp=2, tensor=2)


def _create(recipe: str, shape=MESH, **rule_overrides):
    cfg = config.recipe(recipe, **{f"mesh__rules__{k}": v for k, v in rule_overrides.items()})
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_cfg = small_config(n_kv_heads=4)
    model_spec = train_state.build_model_spec(model_cfg)
    tx, _ = optim.make_optimizer(cfg.optim, 10, model_spec.decay_mask)
    mesh = mesh_lib.make_mesh(shape)
    state, shardings, model_spec = train_state.create(model_cfg, tx, mesh, rules)
    return state, rules, model_spec


def _flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


# Hand-written expectations, so the test does not only compare the rules with themselves. The stacked layers
# are split over `stage` (pipeline parallelism), of size 1 here.
EXPECTED_DEFAULT = {
    "['blocks']['attn']['wq']['kernel']": P("stage", "fsdp", "tensor", None),
    "['blocks']['attn']['wk']['kernel']": P("stage", "fsdp", "tensor", None),
    "['blocks']['attn']['wo']['kernel']": P("stage", "tensor", None, "fsdp"),
    "['blocks']['mlp']['w_gate']['kernel']": P("stage", "fsdp", "tensor"),
    "['blocks']['mlp']['w_down']['kernel']": P("stage", "tensor", "fsdp"),
    "['blocks']['attn_norm']['scale']": P("stage", None),
    "['embed']['embedding']": P("tensor", "fsdp"),
    "['unembed']['kernel']": P("fsdp", "tensor"),
    "['final_norm']['scale']": P(None),
}


@pytest.mark.parametrize(
    "recipe, overrides, expected",
    [
        ("tiny", {}, EXPECTED_DEFAULT),
        ("7b", {}, EXPECTED_DEFAULT),
        # 1b with pure FSDP over both axes (no tensor parallelism), as one would on a single node.
        (
            "1b",
            dict(embed="fsdp,tensor", mlp="", heads="", kv_heads="", vocab=""),
            {
                "['blocks']['attn']['wq']['kernel']": P("stage", ("fsdp", "tensor"), None, None),
                "['blocks']['mlp']['w_down']['kernel']": P("stage", None, ("fsdp", "tensor")),
                "['embed']['embedding']": P(None, ("fsdp", "tensor")),
                "['unembed']['kernel']": P(("fsdp", "tensor"), None),
            },
        ),
    ],
)
def test_every_parameter_is_sharded_as_the_rules_say(recipe, overrides, expected):
    state, rules, model_spec = _create(recipe, **overrides)
    params = _flat(state.params)
    names = _flat(jax.tree.map(lambda n: mesh_lib.logical_to_spec(n, rules), model_spec.logical_names,
                               is_leaf=lambda x: isinstance(x, tuple)))
    assert params.keys() == names.keys()
    for path, array in params.items():
        assert array.sharding.spec == names[path], path
        # Each device holds only its shard: never a full copy of a sharded weight.
        factor = [np.prod([array.sharding.mesh.shape[a] for a in mesh_lib.axes_of(s)])
                  for s in tuple(names[path]) + (None,) * (array.ndim - len(names[path]))]
        shard_shape = tuple(d // f for d, f in zip(array.shape, factor))
        assert {s.data.shape for s in array.addressable_shards} == {shard_shape}, path
    for path, want in expected.items():
        assert params[path].sharding.spec == want, path


def test_optimizer_moments_are_sharded_like_their_parameters():
    state, _, _ = _create("tiny")
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    for moments in (adam.mu, adam.nu):
        jax.tree.map(lambda m, p: np.testing.assert_equal(m.sharding.spec, p.sharding.spec), moments, state.params)


def test_activation_rules_skip_axes_already_used():
    rules = mesh_lib.rules_from_config(mesh_lib.default_rules())
    batch = ("data", "fsdp", "expert")
    # the sequence over context (context parallelism, size 1 unless asked for)
    assert mesh_lib.logical_to_spec(("act_batch", "act_seq", "act_embed"), rules) == P(batch, "context", None)
    # A table that maps both dims to fsdp yields fsdp once instead of a duplicate-axis error.
    assert mesh_lib.logical_to_spec(("embed", "embed"), rules) == P("fsdp", None)


def test_uneven_shards_are_a_clear_error():
    from jaxlm.errors import UserError

    cfg = config.recipe("tiny")
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_cfg = small_config(n_heads=8, n_kv_heads=2, vocab_size=100)
    model_spec = train_state.build_model_spec(model_cfg)
    tx, _ = optim.make_optimizer(cfg.optim, 10, model_spec.decay_mask)
    with pytest.raises(UserError, match="kv_heads"):
        train_state.create(model_cfg, tx, mesh_lib.make_mesh(axes.shape_of(tensor=8)), rules)


@pytest.mark.slow  # 15 s: the default suite's budget (make test-slow runs it)
def test_the_1b_recipe_compiles_for_8_devices_with_its_state_sharded_and_donated():
    """Ahead of time, nothing allocated: each device's arguments are 1/8 of the state (plus its
    rows of the batch), and the new state reuses the donated buffers."""
    from jaxlm import train_setup

    cfg = config.recipe("1b", mesh__fsdp=8, data__global_batch_size=32)  # 4 micro-batches of 8
    setup = train_setup.build(cfg, abstract=True)
    memory = setup.compile_train_step().memory_analysis()
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.state))
    batch_bytes = 4 * 32 * 2048 * 4  # four int32 arrays
    assert state_bytes > 3 * 4 * 1.0e9  # params, Adam mu and nu in float32: 1.1B parameters
    assert memory.argument_size_in_bytes == pytest.approx((state_bytes + batch_bytes) / 8, rel=1e-3)
    assert memory.alias_size_in_bytes == pytest.approx(state_bytes / 8, rel=1e-3)


def test_building_under_an_active_mesh_works():
    """Notebooks often run inside `with jax.set_mesh(...)`: shardings still come from the rules only."""
    from jaxlm import train_setup

    cfg = config.recipe("tiny", model__n_layers=2, mesh__fsdp=2, mesh__data=-1)
    with jax.set_mesh(mesh_lib.make_mesh(axes.shape_of())):
        for abstract in (True, False):
            setup = train_setup.build(cfg, abstract=abstract)
            assert setup.state.params["blocks"]["mlp"]["w_up"]["kernel"].sharding.spec == P("stage", "fsdp", "tensor")
