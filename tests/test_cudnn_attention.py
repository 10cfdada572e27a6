"""cuDNN attention as a Hopper GPU runs it (issue 21's packed layout; issue 22's pipeline stages).

Packed documents reach cuDNN in its packed layout (`attention.cudnn_packed_attention`), with the masked
kernel as the fallback when a row holds more documents than the compiled bound: chosen on the host by the
trainer in one process (a static argument of the step, no conditional), else by a `lax.cond`; jaxlm's
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


def test_the_host_checks_the_packed_layout_as_the_device_does():
    """`packed_fits` on the host's NumPy segment ids (the trainer's choice of kernel) gives the answer the
    device's check gives, for rows of 1 to 12 runs (documents and padding) against bounds 1 to 12."""
    import numpy as np

    rng = np.random.default_rng(0)
    for trial in range(40):
        rows = np.zeros((3, 48), np.int32)
        for row in rows:
            cuts = np.sort(rng.choice(np.arange(1, 48), rng.integers(0, 11), replace=False))
            for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, 48])):
                row[a:b] = i + 1 if trial % 3 or i % 4 else 0  # some runs are padding (0)
        for bound in range(1, 13):
            host = attention.packed_fits(rows, bound)
            assert isinstance(host, np.bool_)
            assert bool(host) == bool(attention.packed_fits(jnp.asarray(rows), bound)), (rows, bound)


def test_a_conditional_is_a_host_sync_per_execution_and_a_known_loop_is_not():
    """`Module.host_syncs`: a GPU stops for the host at every conditional it runs (its predicate is copied
    back before a branch is launched) and at a loop of unknown trip count; a scan does not."""
    def body(x, _):
        return jax.lax.cond(x[0, 0] > 0, lambda x: x @ x @ x, lambda x: x @ x, x), None

    def scanned(x):
        return jax.lax.scan(body, x, None, length=3)[0]

    def open_ended(x):  # a while loop on a value: its trip count is unknown
        return jax.lax.while_loop(lambda x: x[0, 0] < 100.0, lambda x: x @ x + 1.0, x)

    x = jnp.ones((32, 32))
    module = hlo.Module(jax.jit(lambda x: open_ended(scanned(x))).lower(x).compile().as_text())
    assert module.host_syncs() == 3 + 1  # the conditional in each of 3 iterations; the loop (once)
    plain = hlo.Module(jax.jit(lambda x: jax.lax.scan(lambda c, _: (c @ c, None), x, None, length=3)[0])
                       .lower(x).compile().as_text())
    assert plain.host_syncs() == 0


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
    data > 1 and stages did not compile with cuDNN attention at all. Each kernel alone (chosen on the host,
    as the trainer does in one process) too, and an evaluation after the steps."""
    out = _checks("train")
    for name, runs in out.items():
        assert all(len(losses) == 4 for losses in runs.values())  # 3 steps, then an evaluation
        for kernel in ("packed", "fallback", "host_packed", "host_masked"):
            assert runs[kernel][:3] == pytest.approx(runs["xla"][:3], rel=2e-3), (name, kernel, runs)
            # the evaluation (its kernel chosen on the host) against the run with the conditional: the same
            # kernels (XLA's attention drifts further from them in bfloat16 over three updates: 0.24%)
            assert runs[kernel][3] == pytest.approx(runs["packed"][3], rel=2e-3), (name, kernel, runs)
        assert runs["xla"][2] < runs["xla"][0]  # it trains


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
    for packed in ("expected", None, False):
        with roofline.cudnn_checks_for(roofline.H100):
            text = setup.compile_train_step(packed).as_text()
        out[f"{name} {packed}"] = dict(conditionals=text.count(" conditional("),
                                       packed=text.count('"max_seg_per_batch": 16'),
                                       masked=text.count("fmhaScaleBiasSoftmax\\""))
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_h100_env
def test_the_h100_program_with_data_replicas_and_stages_has_packed_cudnn_attention():
    """The tiny recipe compiled for 8 H100s with data=2, with 2 pipeline stages, and with 2 stages of the
    circular schedule: each compiles (jax's own cuDNN batching rules failed on the first two; XLA's GPU
    compiler rejected the circular schedule's per-stage gather of its layer groups, now a select). The
    program the trainer runs for batches that fit (`compile_train_step`'s default) holds the packed
    kernel and no conditional; with the choice left to the device (`packed=None`, several processes),
    the packed kernel and its masked fallback behind conditionals; for a batch that does not fit, the
    masked kernel alone."""
    result = subprocess.run([str(H100_PYTHON), "-c", COMPILE_TINY], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out) == 9
    for name, program in out.items():
        kernels = (program["conditionals"] > 0, program["packed"] > 0, program["masked"] > 0)
        want = {"expected": (False, True, False), "None": (True, True, True), "False": (False, False, True)}
        assert kernels == want[name.split()[1]], (name, program)


@pytest.mark.slow  # ~17 s; the default suite's 10-minute budget (make test-slow runs it)
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
    import dataclasses

    from jaxlm.optim import OptimConfig

    # cuDNN's packed layout compiled for 4 documents a row (a GPU's setting; on this CPU the step only counts)
    spec = dataclasses.replace(setup.model_spec, cfg=dataclasses.replace(setup.model_cfg, attention_segments=4))
    step = jax.jit(steps.make_train_step(spec, setup.tx, setup.schedule, optim=OptimConfig(micro_batches=2)))
    _, metrics = step(setup.state, jax.tree.map(jnp.asarray, batch))
    assert float(metrics["attention_masked"]) == 0.5  # micro-batch 0 fits (3 runs a row), 1 does not
    # the kernel chosen on the host (the step's static `packed`): every micro-batch ran it
    step = jax.jit(steps.make_train_step(spec, setup.tx, setup.schedule, optim=OptimConfig(micro_batches=2)),
                   static_argnums=2)
    for packed, masked in ((True, 0.0), (False, 1.0)):
        _, metrics = step(setup.state, jax.tree.map(jnp.asarray, batch), packed)
        assert float(metrics["attention_masked"]) == masked
    assert setup.attention_choice(batch) is None  # no packed layout on this CPU: the step decides (it has none)
    packed_setup = dataclasses.replace(setup, model_cfg=dataclasses.replace(setup.model_cfg, attention_segments=4))
    assert packed_setup.attention_choice(batch) is False  # row 1's 8 documents: the masked kernel
    assert packed_setup.attention_choice(random_batch(4, 32, 64)) is True  # 3 runs a row fit
    assert packed_setup.expected_attention_choice() is True


@pytest.mark.slow  # the default suite's 10-minute budget; make test-slow runs it
def test_the_trainer_passes_each_batchs_kernel_and_leaves_a_recompiling_interval_untimed(tmp_path, monkeypatch):
    """The trainer hands each step the kernel `TrainSetup.attention_choice` picks for its host batch; a
    choice not seen before compiles another program in that step's dispatch, whose interval (logged as
    the step before) the run's mean step time leaves out, as it leaves out the first. On this CPU there is
    no packed layout, so the choices are stood in: None for steps 1-3, then False (the masked kernel)."""
    import json

    from jaxlm import train_setup
    from tests.helpers import train_tiny

    choices = []

    def choice(self, batch):
        choices.append(None if len(choices) < 3 else False)
        return choices[-1]

    monkeypatch.setattr(train_setup.TrainSetup, "attention_choice", choice)
    steps = 8
    summary = train_tiny(tmp_path, "k", ("run.steps", str(steps)), ("run.log_every", "4"), ("run.eval_every", "0"),
                         ("data.builtin_max_bytes", "400000"), ("model.vocab_size", "512"))
    assert choices == [None] * 3 + [False] * (steps - 3)  # one choice per step
    rows = [json.loads(line) for line in (tmp_path / "k" / "metrics.jsonl").read_text().splitlines()]
    seconds = {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}
    assert sorted(seconds) == list(range(1, steps + 1))
    timed = [seconds[s] for s in range(2, steps + 1) if s != 3]  # step 4's compilation fell in step 3's interval
    tokens_per_step = rows[0]["tokens"]
    assert summary["tokens_per_s"] == pytest.approx(tokens_per_step * len(timed) / sum(timed), rel=1e-9)
    assert summary["final_loss"] < summary["first_loss"]
