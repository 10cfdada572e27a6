"""The mesh's axes are data (`jaxlm.axes.MESH_AXES`: data, stage, fsdp, tensor): naming a fifth axis there
is all it takes to get a 5-D mesh whose new axis defaults to size 1, through the config, the planner and
the train setup (as `stage`, the fourth, came in: tests/test_pipeline.py)."""

import os
import pathlib
import subprocess
import sys

from jaxlm import axes, config

ROOT = pathlib.Path(__file__).resolve().parent.parent

FOUR_AXES = """
import jaxlm.axes
jaxlm.axes.MESH_AXES = (*jaxlm.axes.MESH_AXES, "expert")  # before any other jaxlm module reads it

import jax
from jaxlm import config, memory, mesh, train_setup

cfg = config.load_recipe("tiny")
config.apply_overrides(cfg, [("mesh.data", "2"), ("mesh.tensor", "2")])
assert cfg.mesh.expert == 1, cfg.mesh
assert config.derive(cfg, 8).mesh_shape == (2, 1, 2, 2, 1)
assert mesh.make_mesh((2, 1, 2, 2, 1)).axis_names == ("data", "stage", "fsdp", "tensor", "expert")
assert memory.estimate(cfg, 8).mesh_shape == (2, 1, 2, 2, 1)
setup = train_setup.build(cfg, jax.devices()[:8], abstract=True)
assert dict(setup.mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "tensor": 2, "expert": 1}
setup.compile_train_step()
print("ok")
"""


def test_the_axes_helpers_follow_the_tuple():
    assert axes.shape_of(fsdp=8) == tuple(8 if a == "fsdp" else 1 for a in axes.MESH_AXES)
    assert axes.sizes_of(axes.shape_of(data=2, tensor=4)) == {a: {"data": 2, "tensor": 4}.get(a, 1) for a in axes.MESH_AXES}
    assert axes.describe(axes.shape_of(data=2, fsdp=4)) == "data=2 stage=1 fsdp=4 tensor=1"
    assert set(config.base_config().mesh) >= set(axes.MESH_AXES)


def test_a_fifth_axis_named_in_one_place_gives_a_5d_mesh_of_size_1():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", FOUR_AXES], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
