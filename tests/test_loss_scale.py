"""float16 with dynamic loss scaling (jaxlm.loss_scale): the scale's rule, an injected overflow inside the
compiled step, and the config's bad combinations."""

from __future__ import annotations

import json

import floats
import jax
import numpy as np
import pytest

from helpers import random_batch
from jaxlm import config, loss_scale, precision, train_setup
from jaxlm.errors import UserError
from jaxlm.loss_scale import LossScale


def test_the_scale_halves_on_overflow_and_doubles_after_a_period_of_finite_steps():
    s = LossScale.create(8.0)
    s = s.update(np.bool_(False), 3)
    assert float(s.scale) == 4.0 and int(s.good_steps) == 0
    for expected_good in (1, 2):
        s = s.update(np.bool_(True), 3)
        assert float(s.scale) == 4.0 and int(s.good_steps) == expected_good
    s = s.update(np.bool_(True), 3)
    assert float(s.scale) == 8.0 and int(s.good_steps) == 0
    s = s.update(np.bool_(True), 3).update(np.bool_(False), 3)  # an overflow also restarts the count
    assert float(s.scale) == 4.0 and int(s.good_steps) == 0
    s = LossScale.create(1.0).update(np.bool_(False), 3)
    assert float(s.scale) == loss_scale.MIN_SCALE  # never below the floor


def float16_or_skip():
    """float16 runs where XLA:CPU compiles it. On an x86 processor without F16C (or `--xla_cpu_max_isa=SSE4_2`,
    as `make test-isa` runs) a float16 run is refused in one line: checked, then the test is skipped."""
    if precision.float16_computes():
        return
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("model.dtype", "float16")])
    with pytest.raises(UserError, match="needs the F16C instructions") as refused:
        train_setup.build(cfg, jax.devices()[:1])
    assert "\n" not in str(refused.value)
    pytest.skip("XLA:CPU compiles no float16 on this processor (no F16C): the run is refused in one line (checked)")


def tiny_fp16(*overrides):
    float16_or_skip()
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("model.dtype", "float16"), ("data.global_batch_size", "8"), *overrides])
    return cfg, train_setup.build(cfg, jax.devices()[:1])


@pytest.mark.slow  # the default suite's 10-minute budget; make test-slow runs it
def test_an_injected_overflow_skips_one_step_halves_the_scale_and_the_run_continues():
    cfg, setup = tiny_fp16(("optim.loss_scale_period", "1000"))
    assert setup.state.loss_scale is not None and float(setup.state.loss_scale.scale) == 32768.0
    batch = setup.put_batch(random_batch(8, cfg.data.seq_len, cfg.model.vocab_size))
    # a scale no float16 gradient survives: the backward pass starts at 2^28 / 1024 positions = 2^18, past
    # float16's 65504
    state = setup.state.replace(loss_scale=LossScale.create(2.0**28))
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = setup.train_step(state, batch)
    m = jax.device_get(metrics)
    assert m["overflow"] == 1 and m["skipped"] == 0 and np.isfinite(m["loss"]) and m["loss_scale"] == 2.0**28
    after = jax.device_get((state.params, state.opt_state))
    floats.identical(after, before, why=floats.MOVED)  # the skipped update: the state passed through
    assert float(state.loss_scale.scale) == 2.0**27 and int(state.step) == 1
    # the run goes on: the scale halves each overflow until the gradients fit, then the parameters move
    for _ in range(40):
        state, metrics = setup.train_step(state, batch)
        if not int(metrics["overflow"]):
            break
    m = jax.device_get(metrics)
    assert m["overflow"] == 0 and m["skipped"] == 0 and 1 <= m["loss_scale"] < 2.0**27
    moved = jax.device_get(state.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(moved)))


@pytest.mark.slow
def test_a_non_finite_loss_is_still_skipped_and_stops_the_run_by_policy():
    """Scaling does not hide a real problem: a NaN loss is `skipped` (the on_nonfinite policy applies)."""
    cfg, setup = tiny_fp16()
    batch = random_batch(8, cfg.data.seq_len, cfg.model.vocab_size)
    params = jax.tree.map(lambda p: p * np.nan if p.ndim == 2 else p, setup.state.params)
    state, metrics = setup.train_step(setup.state.replace(params=params), setup.put_batch(batch))
    m = jax.device_get(metrics)
    assert m["skipped"] == 1 and m["overflow"] == 0


@pytest.mark.parametrize("overrides, words", [
    ([("optim.loss_scale", "dynamic"), ("model.dtype", "float32")], "float32 gradients do not underflow"),
    ([("optim.loss_scale", "always")], "one of 'auto'"),
    ([("optim.loss_scale_init", "0.5")], "loss_scale_init=0.5"),
    ([("optim.loss_scale_period", "0")], "loss_scale_period=0"),
])
def test_bad_loss_scale_settings_are_one_line(overrides, words):
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, overrides)
    with pytest.raises(UserError, match=words):
        config.validate(cfg)


def test_bfloat16_and_float32_runs_carry_no_scale():
    import jax.numpy as jnp

    cfg = config.load_recipe("tiny")
    mode = cfg.optim.loss_scale
    assert loss_scale.enabled(mode, jnp.float16)
    assert not loss_scale.enabled(mode, jnp.bfloat16) and not loss_scale.enabled(mode, jnp.float32)
    config.apply_overrides(cfg, [("optim.loss_scale", "dynamic")])
    assert loss_scale.enabled(cfg.optim.loss_scale, jnp.bfloat16)


@pytest.mark.parametrize("platform, capability, expected", [
    ("gpu", "7.5", "float16"),  # T4: float16 tensor cores, no bfloat16 ones
    ("gpu", "7.0", "float16"),  # V100
    ("gpu", "8.0", "bfloat16"),  # A100
    ("gpu", "9.0", "bfloat16"),  # H100, H200
    ("gpu", None, "bfloat16"),  # unknown: the default
    ("tpu", None, "bfloat16"),
])
def test_auto_dtype_picks_float16_only_below_compute_capability_8(platform, capability, expected):
    from jaxlm import precision

    dtype, why = precision.auto_dtype(platform, capability)
    assert dtype == expected and why


X86_FLAGS = "flags\t\t: fpu vme sse sse2 avx f16c fma avx2 bmi2"
ARM_FEATURES = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm"


@pytest.mark.parametrize("cpuinfo, flags", [
    (f"processor\t: 0\n{X86_FLAGS}\n", []),  # an AVX2 laptop or a Zen 3 server: bfloat16 by conversion
    (f"{X86_FLAGS} avx512f avx512bw avx512vl\n", []),  # AVX-512 without its bfloat16 extension (Skylake-SP)
    (f"{X86_FLAGS} avx512f avx512_bf16\n", ["avx512_bf16"]),  # Cooper Lake, Zen 4
    (f"{X86_FLAGS} avx512f avx512_bf16 amx_bf16 amx_tile\n", ["avx512_bf16", "amx_bf16"]),  # Sapphire Rapids
    (f"{ARM_FEATURES}\n", []),  # Neoverse N1 (Graviton 2)
    (f"{ARM_FEATURES} sve i8mm bf16\n", ["bf16"]),  # Neoverse V1 (Graviton 3)
    ("model name\t: bf16 avx512_bf16 lookalike\n", []),  # only the flags' own lines count
])
def test_the_cpus_bfloat16_instructions_are_read_from_its_flags(cpuinfo, flags):
    from jaxlm import precision

    assert precision.bfloat16_flags(cpuinfo) == flags


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_is_float32_on_a_cpu_without_bfloat16_instructions(monkeypatch, native, expected):
    from jaxlm import precision

    monkeypatch.setattr(precision, "cpu_bfloat16", lambda: (native, "simulated"))
    dtype, why = precision.auto_dtype("cpu", None)
    assert dtype == expected and "simulated" in why


def test_auto_is_the_recipes_default_and_resolves_for_this_machine():
    import jax.numpy as jnp

    from jaxlm import precision
    from jaxlm.models.transformer import ModelConfig

    here = jnp.dtype(precision.auto_dtype("cpu", None)[0])  # bfloat16, or float32 on a CPU without its instructions
    cfg = config.load_recipe("tiny")
    assert cfg.model.dtype == "auto"
    assert ModelConfig.from_config(cfg.model, "cpu").dtype == here
    setup = train_setup.build(cfg, jax.devices()[:1], abstract=True)
    assert setup.model_cfg.dtype == here and setup.state.loss_scale is None


def unchanged_after_one_step(dtype: str, scaling: str) -> tuple[int, float]:
    """Parameter entries one AdamW step (no weight decay) leaves exactly as they were (those whose gradient
    was exactly zero), and the step's own `grad_zero_fraction`. Small initial weights make small gradients,
    as late in training or in deep models."""
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [("model.dtype", dtype), ("optim.loss_scale", scaling), ("model.init_std", "0.002"),
                                 ("optim.weight_decay", "0"), ("data.global_batch_size", "2"), ("data.seq_len", "32"),
                                 ("metrics.grad_numerics", "true")])
    setup = train_setup.build(cfg, jax.devices()[:1])
    before = jax.device_get(setup.state.params)
    state, metrics = setup.train_step(setup.state, setup.put_batch(random_batch(2, 32, cfg.model.vocab_size)))
    assert int(metrics["skipped"]) == 0 and int(metrics.get("overflow", 0)) == 0
    assert float(metrics["grad_nonfinite_fraction"]) == 0
    after = jax.device_get(state.params)
    unchanged = sum(int(np.sum(a == b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))
    return unchanged, float(metrics["grad_zero_fraction"])


@pytest.mark.slow
def test_float16_without_scaling_loses_small_gradients_and_scaling_keeps_them():
    """float32 leaves the entries with a true zero gradient (embedding rows no token used, ...); float16
    without a loss scale adds thousands whose small gradients underflowed; with the scale, almost none."""
    float16_or_skip()
    (exact, zeros_exact), (unscaled, zeros_unscaled), (scaled, zeros_scaled) = (
        unchanged_after_one_step("float32", "none"), unchanged_after_one_step("float16", "none"),
        unchanged_after_one_step("float16", "auto"))
    assert unscaled - exact > 1000, (exact, unscaled)
    assert scaled - exact < 50, (exact, scaled)
    # the step's metric sees it too (metrics.grad_numerics): the flushed gradients are extra zeros
    assert zeros_unscaled - zeros_exact > 0.001 > abs(zeros_scaled - zeros_exact), (zeros_exact, zeros_unscaled)


@pytest.mark.slow
def test_float16_with_scaling_trains_the_tiny_recipe_like_bfloat16(tmp_path):
    """200 steps of the tiny recipe on its built-in corpus: float16 with the dynamic scale ends within 2% of
    bfloat16's validation loss, and says what its scale did."""
    float16_or_skip()
    from helpers import train_tiny

    def run(dtype):
        return train_tiny(tmp_path, dtype, ("model.dtype", dtype), ("run.steps", "200"), ("run.log_every", "100"))

    bf16, fp16 = run("bfloat16"), run("float16")
    assert abs(fp16["val_loss"] - bf16["val_loss"]) <= 0.02 * bf16["val_loss"], (fp16["val_loss"], bf16["val_loss"])
    assert fp16["skipped_steps"] == [] and bf16["overflow_steps"] == 0
    records = [json.loads(line) for line in (tmp_path / "float16" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss_scale"] >= 1 for r in records if "loss" in r)


@pytest.mark.slow
def test_a_killed_float16_run_resumes_its_scale_and_equals_the_uninterrupted_one(tmp_path):
    """The scale changes every 3 steps here; SIGKILL at step 7, resumed from the step-5 checkpoint: every
    step's loss and scale equal the uninterrupted run's, and the run's energy counts on from the checkpoint."""
    float16_or_skip()
    import signal

    from test_resume import args, losses, run, run_until

    from jaxlm import checkpoint

    extra = ("--config.model.dtype=float16", "--config.optim.loss_scale_period=3")
    code, _, err = run(args(tmp_path, "full", *extra, steps=12))
    assert code == 0, err[-3000:]
    killed = args(tmp_path, "killed", *extra, steps=12)
    code, _, _ = run_until(killed, "step      7/", signal.SIGKILL)
    assert code == -signal.SIGKILL
    code, out, err = run(killed)
    assert code == 0 and "resuming from step 5" in out, err[-3000:]
    floats.identical(losses(tmp_path / "killed"), losses(tmp_path / "full"), why=floats.SAME_PROGRAM)

    def scales(name):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss_scale"]) for r in records if "loss" in r]

    assert scales("killed") == scales("full") and len({s for _, s in scales("full")}) > 1
    with checkpoint.Checkpointer(tmp_path / "killed" / "checkpoints") as ckpt:
        at_5 = ckpt.read_meta(5)["energy_j"] if 5 in ckpt.all_steps() else None
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["energy_j"] > 0 and (at_5 is None or summary["energy_j"] > at_5)


@pytest.mark.slow
def test_a_resumed_auto_run_keeps_the_dtype_it_was_trained_in(tmp_path, monkeypatch):
    """A run started where auto meant float16 (a T4, simulated) and resumed where it means bfloat16 goes on
    in float16 with its loss scale: its state has one, and its config still says auto."""
    float16_or_skip()
    from helpers import train_tiny
    from jaxlm import checkpoint, precision

    def run(steps):
        return train_tiny(tmp_path, "t4", ("run.steps", str(steps)), ("checkpoint.every_steps", "3"))

    real = precision.auto_dtype
    monkeypatch.setattr(precision, "auto_dtype", lambda platform, capability: ("float16", "a T4, simulated"))
    run(3)
    monkeypatch.setattr(precision, "auto_dtype", real)
    summary = run(6)
    with checkpoint.Checkpointer(tmp_path / "t4" / "checkpoints") as ckpt:
        meta = ckpt.read_meta(6)
    assert meta["compute_dtype"] == "float16" and meta["config"]["model"]["dtype"] == "auto"
    records = [json.loads(line) for line in (tmp_path / "t4" / "metrics.jsonl").read_text().splitlines()]
    assert all("loss_scale" in r for r in records if "loss" in r) and summary["resumed_from"] == 3
