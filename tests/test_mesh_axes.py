"""The mesh's axes are data (`jaxlm.axes.MESH_AXES`: data, stage, fsdp, context, expert, tensor): naming one more axis
there is all it takes to get a mesh with one more dimension whose new axis defaults to size 1, through the
config, the planner and the train setup (as `stage`, `expert` and `context` came in: tests/test_pipeline.py,
tests/test_parallelism.py)."""

import os
import pathlib
import subprocess
import sys

from jaxlm import axes, config

ROOT = pathlib.Path(__file__).resolve().parent.parent

ONE_MORE_AXIS = """
import jaxlm.axes
jaxlm.axes.MESH_AXES = (*jaxlm.axes.MESH_AXES, "probe")  # before any other jaxlm module reads it

import jax
from jaxlm import config, memory, mesh, train_setup

shape = jaxlm.axes.shape_of(data=2, fsdp=2, tensor=2)
assert len(shape) == len(jaxlm.axes.MESH_AXES) and shape[-1] == 1, shape
cfg = config.load_recipe("tiny")
config.apply_overrides(cfg, [("mesh.data", "2"), ("mesh.tensor", "2")])
assert cfg.mesh.probe == 1, cfg.mesh
assert config.derive(cfg, 8).mesh_shape == shape
assert mesh.make_mesh(shape).axis_names == jaxlm.axes.MESH_AXES
assert memory.estimate(cfg, 8).mesh_shape == shape
setup = train_setup.build(cfg, jax.devices()[:8], abstract=True)
assert dict(setup.mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2, "probe": 1}
setup.compile_train_step()
print("ok")
"""


def test_the_axes_helpers_follow_the_tuple():
    assert axes.shape_of(fsdp=8) == tuple(8 if a == "fsdp" else 1 for a in axes.MESH_AXES)
    assert axes.sizes_of(axes.shape_of(data=2, tensor=4)) == {a: {"data": 2, "tensor": 4}.get(a, 1) for a in axes.MESH_AXES}
    assert axes.describe(axes.shape_of(data=2, fsdp=4)) == "data=2 stage=1 fsdp=4 context=1 expert=1 tensor=1"
    assert set(config.base_config().mesh) >= set(axes.MESH_AXES)


def test_one_more_axis_named_in_one_place_gives_a_mesh_with_it_of_size_1():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", ONE_MORE_AXIS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_the_trace_platform_is_the_meshs_devices_platform_inside_jit(monkeypatch):
    """Kernels choose by the devices the program is compiled for (`mesh.trace_platform`): the mesh's inside jit
    (the planner's compile-only GPUs and TPUs, whose programs must not get the CPU's kernels), else JAX's
    default backend, asked anew at every trace. The default backend is made to say "gpu" here, so that the
    mesh's CPU devices are seen to win; tests/test_tpu.py compiles for TPU chips where libtpu is."""
    import jax

    from jaxlm.mesh import trace_platform

    seen = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jax.jit(lambda x: (seen.append(trace_platform()), x)[1])(1.0)
    with jax.set_mesh(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])):
        jax.jit(lambda x: (seen.append(trace_platform()), x)[1])(2.0)
    jax.jit(lambda x: (seen.append(trace_platform()), x)[1])(3.0)
    assert seen == ["gpu", "cpu", "gpu"]


def test_slices_group_a_tpu_runs_devices_and_planning_reads_the_planned_layout():
    """mesh.hybrid="slice": data across TPU slices, the rest within each. The groups come from the devices'
    `slice_index` (a TPU's; other devices are one slice); while planning for compile-only devices
    (`planned_devices`) the layout is theirs, not this machine's."""
    import types

    import jax

    from jaxlm import mesh as mesh_lib

    def chip(i, slice_, process):
        return types.SimpleNamespace(id=i, slice_index=slice_, process_index=process, platform="tpu")

    # two slices of four chips, on two hosts each, listed out of order
    chips = [chip(100000 + 100000 * s + c, s, 2 * s + c // 2) for s in (1, 0) for c in (3, 1, 2, 0)]
    groups = mesh_lib.device_groups(chips, "slice")
    assert [[d.id for d in g] for g in groups] == [[100000, 100001, 100002, 100003], [200000, 200001, 200002, 200003]]
    assert len(mesh_lib.device_groups(chips, "process")) == 4
    assert mesh_lib.hybrid_groups("slice") == 1 == len(mesh_lib.device_groups(jax.devices(), "slice"))
    with mesh_lib.planned_devices(chips):
        assert (mesh_lib.hybrid_groups("slice"), mesh_lib.hybrid_groups("host"), mesh_lib.hybrid_groups("")) == (2, 4, 1)
    assert mesh_lib.hybrid_groups("slice") == 1
