"""The init program's compiler options (`train_state.init_compiler_options`): on a CPU, LLVM's level 1 for the
one-off program that draws the parameters, the values those of XLA's default level."""

import floats
import jax
import numpy as np

from helpers import small_config
from jaxlm import axes, config, optim, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.models.transformer import ModelConfig


def _init_state(cfg: ModelConfig, options: dict):
    """The train state `train_state.create` makes, its init program compiled with `options`, on 2 x 2 devices."""
    recipe = config.recipe("tiny")
    mesh = mesh_lib.make_mesh(axes.shape_of(data=2, fsdp=2), jax.devices()[:4])
    rules = mesh_lib.rules_from_config(recipe.mesh.rules)
    spec = train_state.build_model_spec(cfg)
    tx, _ = optim.make_optimizer(recipe.optim, 10, spec.decay_mask)
    _, shardings, _, init = train_state.abstract_state(cfg, tx, mesh, rules, 0, spec)
    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=shardings).lower().compile(compiler_options=options)()


def test_the_cpu_init_program_draws_the_values_of_xlas_default_level():
    """Level 1 against level 2 (XLA's default; named, since `make test` compiles at level 0): every leaf of
    the state, the generators' normal draws included, within 2 ulps (the same bits on the CPUs measured)."""
    cfg = small_config(n_kv_heads=2)
    default = _init_state(cfg, {**train_state.INIT_COMPILER_OPTIONS, "xla_backend_optimization_level": 2})
    level1 = _init_state(cfg, {**train_state.INIT_COMPILER_OPTIONS, **train_state.CPU_INIT_COMPILER_OPTIONS})
    floats.close(jax.tree.map(np.asarray, level1), jax.tree.map(np.asarray, default), ulps=2)
    assert any(np.asarray(x).std() > 0 for x in jax.tree.leaves(default.params))  # drawn, not all constants


def test_a_cpu_gets_level_1_unless_xla_flags_name_a_level_and_other_platforms_the_common_options(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=3")
    assert train_state.init_compiler_options("cpu") == train_state.INIT_COMPILER_OPTIONS
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert train_state.init_compiler_options("cpu") == {**train_state.INIT_COMPILER_OPTIONS,
                                                        "xla_backend_optimization_level": 1}
    assert train_state.init_compiler_options("gpu") == train_state.init_compiler_options("tpu") == \
        train_state.INIT_COMPILER_OPTIONS
