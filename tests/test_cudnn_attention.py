"""cuDNN attention as a Hopper GPU runs it (issue 21's packed layout; issue 22's pipeline stages).

Packed documents reach cuDNN in its packed layout (`attention.cudnn_packed_attention`), with the masked
kernel as the fallback of a `lax.cond` when a row holds more documents than the compiled bound; jaxlm's
batching rules for jax's cuDNN primitives (`jaxlm.models.cudnn_batching`) let the data-replica and
pipeline-stage vmaps run them. Without a GPU the kernels are emulated (tests/cudnn_emulation.py: the
same primitives, jax's own wrappers and partitioning, lowered to float32 XLA on the CPU), in the H100
compiler environment (`make h100-env`), which holds the CUDA plugin jax wants before it lowers cuDNN
attention at all; the H100 program itself is compiled there too. The default suite checks the
resolution of the setting and the roofline's reading of conditionals.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import pytest

from jaxlm import config, hlo, roofline
from jaxlm.errors import UserError
from jaxlm.models import attention, transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
H100_PYTHON = ROOT / ".venv-h100" / "bin" / "python"
needs_h100_env = pytest.mark.skipif(not H100_PYTHON.exists(),
                                    reason="the H100 compiler environment is not installed (make h100-env)")


def _checks(kind: str) -> dict:
    result = subprocess.run([str(H100_PYTHON), "tests/cudnn_checks.py", kind], cwd=ROOT, capture_output=True,
                            text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_packed_layout_is_resolved_only_where_it_runs():
    m = config.recipe("tiny").model
    assert transformer.ModelConfig.from_config(m, "cpu").attention_segments == 0  # XLA's attention there
    # compile-only GPU devices (this machine, jaxlm.roofline): cuDNN, and the configured bound
    assert transformer.ModelConfig.from_config(m, "gpu", attention="cudnn").attention_segments == 16
    assert transformer.ModelConfig.from_config(m, "gpu", attention="xla").attention_segments == 0
    m.attention_segments = 0
    assert transformer.ModelConfig.from_config(m, "gpu", attention="cudnn").attention_segments == 0
    assert attention.packed_layout_supported("9.0") and not attention.packed_layout_supported("8.9")
    assert not attention.packed_layout_supported(None)
    with pytest.raises(UserError, match="model.attention_segments"):
        config.recipe("tiny", model__attention_segments=-1)


def test_a_conditional_counts_its_true_branch_only():
    """The roofline counts the expected branch of a conditional (jaxlm's convention: lax.cond's true
    branch, the packed kernel), not both."""
    def f(pred, x):
        return jax.lax.cond(pred, lambda x: x @ x @ x, lambda x: x @ x, x)

    x = jnp.ones((32, 32))
    module = hlo.Module(jax.jit(f).lower(True, x).compile().as_text())
    kernels = roofline.kernels(module, roofline.H100, 1)
    flops = sum(k.flops * k.runs for k in kernels if k.kind == "gemm")
    assert flops == 2 * (2 * 32 ** 3)  # two matmuls (the true branch), not three (both)


@pytest.mark.slow
@needs_h100_env
def test_cudnn_attention_packed_fallback_and_vmapped_equals_the_reference():
    """Output and gradients of the model's cuDNN attention: the packed layout (every row fits the
    bound), its masked fallback (a row does not), the mask alone; each equal to the float32 reference
    to bfloat16 precision (the emulation computes in float32), and vmapped over two replicas equal to
    each replica alone (jaxlm's batching rules), the conditional kept under the vmap."""
    out = _checks("attention")
    assert out["packed"]["fits"] is True and out["fallback"]["fits"] is False
    for name in ("packed", "fallback", "masked"):
        assert out[name]["error"] < 1e-2 and out[name]["vmap_error"] < 1e-5, (name, out[name])
        assert out[name]["shared_segments_vmap_error"] < 1e-5, (name, out[name])
    for name in ("packed", "fallback"):  # one cuDNN call per branch, one conditional (forward, and its transpose)
        assert out[name]["forward_calls"] == 2 and out[name]["conditionals"] == 2
        assert out[name]["vmapped_conditionals"] == 2  # the whole batch decides: not a select of both kernels
    assert out["masked"]["forward_calls"] == 1 and out["masked"]["conditionals"] == 0
    # the doctor's checks of the masked and packed paths (jaxlm.doctor, on a Hopper GPU) pass
    assert all(status.startswith("usable") for status in out["doctor"].values()), out["doctor"]


@pytest.mark.slow
@needs_h100_env
def test_train_steps_with_cudnn_attention_equal_xlas_on_data_replica_and_pipelined_meshes():
    """Three steps on 8 devices with cuDNN attention (packed; and a bound of 1: always the fallback)
    under data x fsdp x tensor, data with 2 micro-batches, and 2 pipeline stages (GPipe; circular with
    data): the losses equal XLA attention's to bfloat16 precision. Before jaxlm's batching rules,
    data > 1 and stages did not compile with cuDNN attention at all."""
    out = _checks("train")
    for name, runs in out.items():
        for kernel in ("packed", "fallback"):
            assert runs[kernel] == pytest.approx(runs["xla"], rel=2e-3), (name, kernel, runs)
        assert runs["xla"][-1] < runs["xla"][0]  # it trains


COMPILE_TINY = """
import json, sys
from jaxlm import config, plan, roofline
devices = roofline.target_devices(roofline.H100, 8)
out = {}
for name, mesh in (("data2", dict(mesh__data=2, mesh__fsdp=4)), ("stage2", dict(mesh__stage=2, mesh__fsdp=4)),
                   ("circular", dict(mesh__stage=2, mesh__fsdp=4, pipeline__schedule="circular", pipeline__repeats=2))):
    cfg = config.recipe("tiny", model__attention="cudnn", model__scan_layers=True, **mesh)
    from jaxlm import train_setup
    setup = train_setup.build(cfg, devices, abstract=True)
    with roofline.cudnn_checks_for(roofline.H100):
        text = setup.compile_train_step().as_text()
    out[name] = dict(conditionals=text.count(" conditional("), packed=text.count('"max_seg_per_batch": 16'),
                     masked=text.count("fmhaScaleBiasSoftmax\\""))
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_h100_env
def test_the_h100_program_with_data_replicas_and_stages_has_packed_cudnn_attention():
    """The tiny recipe compiled for 8 H100s with data=2, with 2 pipeline stages, and with 2 stages of the
    circular schedule: each compiles (jax's own cuDNN batching rules failed on the first two; XLA's GPU
    compiler rejected the circular schedule's per-stage gather of its layer groups, now a select), and
    holds the packed kernel and its masked fallback behind conditionals."""
    result = subprocess.run([str(H100_PYTHON), "-c", COMPILE_TINY], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name, program in out.items():
        assert program["conditionals"] > 0 and program["packed"] > 0 and program["masked"] > 0, (name, program)


def test_the_step_reports_the_micro_batches_that_fall_back_to_the_mask():
    """`attention_masked`: the fraction of micro-batches with a row of more documents than the packed
    layout's bound (micro-batch i holds rows i, i + k, ...)."""
    import numpy as np

    from jaxlm import steps, train_setup
    from tests.helpers import random_batch

    setup = train_setup.build(config.recipe("tiny", model__n_layers=1, data__global_batch_size=4, data__seq_len=32,
                                            model__max_seq_len=32), jax.devices()[:1])
    batch = random_batch(4, 32, setup.model_cfg.vocab_size)  # two documents and padding: 3 runs per row
    batch["segment_ids"][1] = np.repeat(np.arange(1, 9), 4)  # row 1 (micro-batch 1 of 2): 8 documents
    step = jax.jit(steps.make_train_step(setup.model_spec, setup.tx, setup.schedule, micro_batches=2,
                                         attention_segments=4))
    _, metrics = step(setup.state, jax.tree.map(jnp.asarray, batch))
    assert float(metrics["attention_masked"]) == 0.5  # micro-batch 0 fits (3 runs a row), 1 does not
