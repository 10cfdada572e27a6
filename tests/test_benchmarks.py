"""The MFU harness runs on CPU and its numbers are consistent with each other and with the config."""

import json
import os
import pathlib
import subprocess
import sys

import floats
import numpy as np
import pytest

from helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mfu_harness_sweeps_and_reports_consistent_numbers(tmp_path):
    out = tmp_path / "mfu.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/mfu.py", "--recipe", "tiny", "--steps", "2", "--warmup", "1",
         "--peak_tflops", "0.5", "--set", "data.global_batch_size=8", "--sweep", "model.remat=none,full,bogus",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "XLA_FLAGS": xla_flags()},  # one CPU device: compiles faster
    )
    assert result.returncode == 1, result.stderr[-2000:]  # one point failed, the others ran
    none, full, bogus = json.loads(out.read_text())
    assert bogus["status"].startswith("error:") and "model.remat" in bogus["status"]
    from jaxlm import config
    from jaxlm.models.transformer import ModelConfig, flops_per_token

    flops = flops_per_token(ModelConfig.from_config(config.load_recipe("tiny").model), 128) * 8 * 128
    for r in (none, full):
        assert r["status"] == "ok" and r["batch"] == "8x128"
        devices = int(r["devices"].split("x")[0])  # the tests' 8 fake CPU devices
        assert r["tokens_per_s"] == pytest.approx(8 * 128 / r["step_s"], rel=1e-3)
        assert r["tflops_per_device"] == pytest.approx(flops / r["step_s"] / devices / 1e12, rel=2e-2, abs=1e-3)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5, rel=2e-2, abs=2e-3)  # against --peak_tflops
        # a CPU keeps no memory counters: the peak is XLA's figure for the compiled step, nothing before it
        assert r["memory_source"] == "compiled" and r["compiled_memory_gib"] == r["peak_memory_gib"] > 0
        assert r["state_memory_gib"] is None
    assert full["loss"] == pytest.approx(none["loss"], rel=1e-3)  # remat recomputes, it does not change the math
    assert full["peak_memory_gib"] < none["peak_memory_gib"]  # and it is what saves memory
    table = result.stdout.strip().splitlines()
    assert table[-5].startswith("| batch | micro_batches | remat |")  # the table of every point comes last
    assert "| none |" in table[-3] and "| full |" in table[-2] and "error" in table[-1]


@pytest.mark.slow  # a benchmark script's harness (the default suite keeps to its 10 minutes)
def test_hlo_audit_finds_the_float32_matmuls_and_no_collectives_on_one_device(tmp_path):
    """benchmarks/hlo_audit.py on the tiny recipe: in bf16 the only float32-operand matmuls are the XLA
    attention's two score-gradient dots per layer (bf16 by their dot algorithm), the per-step matmul
    FLOPs (loop trip counts included) are exactly the model's, and 1 device has no collectives; in
    float32 every matmul is reported as a float32 one (the check can fail)."""
    bf16, f32 = tmp_path / "bf16.json", tmp_path / "f32.json"
    # XLA's attention (the CPU's `auto` is the causal blocks, whose matmuls all take bfloat16 operands)
    for out, extra in ((bf16, ["--set", "model.attention=xla", "model.dtype=bfloat16"]),
                       (f32, ["--lowered_only", "--set", "model.dtype=float32", "model.attention=xla",
                              "model.matmul=xla"])):
        result = subprocess.run([sys.executable, "benchmarks/hlo_audit.py", "--recipe", "tiny", "--json", str(out), *extra],
                                cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1].startswith("| ")  # the summary table comes last
    from jaxlm import config
    from jaxlm.models.transformer import ModelConfig, flops_per_token

    m = ModelConfig.from_config(config.load_recipe("tiny").model)
    b, t, L, k, g, h = 16, 128, m.n_layers, m.n_kv_heads, m.n_heads // m.n_kv_heads, m.head_dim
    model_matmul_flops = (flops_per_token(m, t) + 6 * L * t * m.n_heads * h) * b * t  # + the masked attention half

    r = json.loads(bf16.read_text())
    mm = r["matmuls"]
    assert r["batch"] == f"{b}x{t}" and r["dtype"] == "bfloat16" and r["attention"] == "xla"
    assert mm["flops_per_step"] == model_matmul_flops  # every dot, times its loops' trip counts
    per_step = {key: group["per_step"] for key, group in mm["by_dtype"].items()}
    assert per_step == {
        # per layer: q, k, v, o, gate, up, down, each forward + 2 gradients, and the logits (x3), their float32
        # accumulation explicit (model.matmul=auto on a CPU: layers.accumulating_einsum); probs @ v (x3)
        "bf16 x bf16 -> f32": 7 * 3 * L + 3,
        "bf16 x bf16 -> bf16": 3 * L,
        "f32 x bf16 -> f32 [dot_bf16_bf16_f32]": 2 * L,  # d(scores) x k -> dq and d(scores) x q -> dk
        "bf16 x bf16 -> f32 [dot_bf16_bf16_f32]": L,  # the scores q k^T, float32 out
    }
    assert mm["dots_per_step"] == 27 * L + 3
    assert sorted((x["lhs"], x["rhs"], x["result"]) for x in mm["f32_operand"]) == [
        (f"f32[{b},{k},{t},{g},{t}]", f"bf16[{b},{t},{k},{g},{h}]", f"f32[{b},{k},{t},{h}]"),  # dk
        (f"f32[{b},{k},{t},{g},{t}]", f"bf16[{b},{t},{k},{h}]", f"f32[{b},{k},{t},{g},{h}]"),  # dq
    ]
    for x in mm["f32_operand"]:
        assert x["algorithm"] == "dot_bf16_bf16_f32" and x["executions"] == L and x["deliberate"]
        assert x["source"].startswith("jaxlm/models/attention.py:") and "(attend)" in x["source"]
    assert mm["f32_matmuls_in_text"] == mm["unexplained_f32_operand_in_text"] == 0

    opt = r["optimized"]
    assert all(c == {"in_text": 0, "per_step": 0} for c in opt["collectives"].values())  # 1 device
    copied = [x["origin"] for x in opt["materialized"] if x["origin"].startswith("step input")]
    # The donated parameters and Adam moments update in place (only scalar counters are copied); a
    # select of the moments after optax's update copied every one of them (jaxlm.optim).
    assert copied and not [o for o in copied if "state.params" in o or ".mu[" in o or ".nu[" in o]
    assert opt["by_origin"]["copy of step input (state or batch)"]["bytes_per_step"] < 1024
    assert opt["largest"] == opt["materialized"][:len(opt["largest"])]
    assert [x["bytes"] for x in opt["materialized"]] == sorted((x["bytes"] for x in opt["materialized"]), reverse=True)
    total = sum(c["bytes_per_step"] for c in opt["copies_transposes"].values())
    assert total == sum(x["bytes_per_step"] for x in opt["materialized"]) == sum(
        g["bytes_per_step"] for g in opt["by_origin"].values())

    r32 = json.loads(f32.read_text())["matmuls"]
    # float32 with the plain einsum (not the CPU's accumulating one, auto's), so each layer's q, k, v (grouped-query
    # heads) are one matmul and gate and up another (layers.project_qkv, project_gate_up): 9 dots per layer
    # fewer, the same FLOPs
    assert list(r32["by_dtype"]) == ["f32 x f32 -> f32"] and r32["dots_per_step"] == 18 * L + 3
    assert r32["f32_matmuls_in_text"] == r32["unexplained_f32_operand_in_text"] == r32["dots_in_text"] > 0
    assert r32["flops_per_step"] == model_matmul_flops


def test_hlo_audit_counts_collectives_times_loop_trips():
    """The collective counter the 1-device check relies on: an all-reduce in a 3-trip loop on 2 devices."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = importlib.util.spec_from_file_location("hlo_audit", ROOT / "benchmarks" / "hlo_audit.py")
    hlo_audit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hlo_audit)

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    sharded = NamedSharding(mesh, P("x"))

    def f(a):
        return jax.lax.fori_loop(0, 3, lambda i, c: c + jnp.sum(jnp.sin(a * i.astype(a.dtype))), 0.0)

    lowered = jax.jit(f, in_shardings=sharded, out_shardings=NamedSharding(mesh, P())).lower(
        jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharded))
    module = hlo_audit.Module(lowered.compile().as_text(), trip_counts_from="backend_config")
    assert hlo_audit.data_movement(module, 5)["collectives"]["all-reduce"] == {"in_text": 1, "per_step": 3}
    pre = hlo_audit.Module(lowered.as_text(dialect="hlo"), trip_counts_from="condition")
    assert pre.unknown_trip_counts == 0 and max(pre.runs.values()) == 3  # the loop body, from its condition


@pytest.mark.slow  # a benchmark script's harness (the default suite keeps to its 10 minutes)
def test_attention_benchmark_checks_each_kernel_against_the_reference(tmp_path):
    """On a CPU: XLA, the causal blocks and the interpreted Pallas kernel agree with the float32 reference on packed
    documents with padding; the cuDNN candidates say they were skipped; the table comes last."""
    out = tmp_path / "attention.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/attention.py", "--recipe", "tiny", "--seq", "64", "--batch", "2",
         "--doc_len", "20", "--pad", "5", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "XLA_FLAGS": xla_flags()},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {r["impl"]: r for r in report["rows"]}
    for name in ("xla", "blocked", "pallas", "splash"):
        assert rows[name]["check"] == "ok" and 0 < rows[name]["err_grad"] < 0.03 and rows[name]["ms"] > 0, name
    assert {rows[n]["check"] for n in ("cudnn", "cudnn_packed", "cudnn_causal")} == {
        "skipped: not a GPU"}
    assert report["documents"] > 2 * 2 and report["max_segments"] >= 3  # several documents per row, and padding
    assert result.stdout.strip().splitlines()[-1].startswith("tiny: batch 2 x 64")


def test_attention_benchmark_check_fails_a_kernel_that_crosses_documents():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from helpers import load_benchmark
    from jaxlm.models.attention import reference_attention

    bench = load_benchmark("attention")

    seg = jnp.asarray(bench.packed_rows(2, 32, 8, 3, seed=0))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cot = (jax.random.normal(key, (2, 32, 4, 16)) for key in keys)
    inputs = (q, k, v, seg, cot)

    def documents(q, k, v, seg):
        return reference_attention(q, k, v, segment_ids=seg)

    def causal_only(q, k, v, seg):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    assert bench.check(documents, documents, inputs, 1e-6)["check"] == "ok"
    wrong = bench.check(causal_only, documents, inputs, 0.03)
    assert wrong["check"] == "WRONG" and wrong["err_out"] > 0.1
    _, offsets, _ = bench.attention.packed_segments(seg, 32)
    assert bench.segment_runs(np.asarray(seg)) == int((offsets >= 0).sum(axis=1).max())  # the layout's M


@pytest.mark.slow  # 10 s: PyTorch and jaxlm each start a process
def test_cpu_vs_torch_runs_the_same_model_on_both_sides(tmp_path):
    """benchmarks/cpu_vs_torch.py builds, in PyTorch, the model jaxlm builds (the parameter counts agree to
    the parameter) and times one optimizer step of each; the table names both sides."""
    pytest.importorskip("torch")
    out = tmp_path / "cvt.json"
    result = subprocess.run([sys.executable, "benchmarks/cpu_vs_torch.py", "--shapes", "nanogpt", "--steps", "2",
                             "--warmup", "1", "--repeats", "1", "--profile", "2", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "XLA_FLAGS": xla_flags()})  # one CPU device
    assert result.returncode == 0, result.stderr[-2000:]
    torch_row, jax_row = json.loads(out.read_text())
    assert (torch_row["side"], jax_row["side"]) == ("torch", "jax")
    assert torch_row["params"] == jax_row["params"] > 800_000  # every weight and bias, tied embedding once
    assert torch_row["step_ms"] > 0 and jax_row["step_ms"] > 0
    assert "| nanogpt | torch |" in result.stdout and "| nanogpt | jax |" in result.stdout
    # --profile: both sides' time by category, the matmuls on each
    assert torch_row["profile_ms"]["matmuls"] > 0 and jax_row["profile_ms"]["matmuls"] > 0
    assert "| ms per step, profiled | nanogpt torch 1 | nanogpt jax 1 |" in result.stdout


def test_cpu_vs_torch_sorts_pytorchs_operators_as_profile_step_sorts_xlas_kernels():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_vs_torch

    expected = {"aten::mm": "matmuls", "aten::addmm": "matmuls", "aten::bmm": "matmuls",
                "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
                "aten::copy_": "copies and transposes", "aten::cat": "copies and transposes",
                "aten::sum": "reductions (input fusions)", "aten::linalg_vector_norm": "reductions (input fusions)",
                "aten::gelu_backward": "elementwise (loop fusions)", "aten::add_": "elementwise (loop fusions)",
                "Optimizer.step#AdamW.step": "elementwise (loop fusions)"}
    assert {name: cpu_vs_torch.torch_category(name) for name in expected} == expected


def test_the_nanogpt_run_trains_nanogpts_recipe_and_its_shape_is_nanogpts():
    """benchmarks/nanogpt_run.py: the jaxlm side's model, batch, context and steps are those of nanoGPT's
    command (read from its arguments), and the recipe's keys all exist."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nanogpt_run

    from jaxlm import config

    theirs = dict(arg[2:].split("=", 1) for arg in nanogpt_run.nanogpt_args(300) if arg.startswith("--"))
    ours = nanogpt_run.jax_settings(300)
    assert (ours["model.n_layers"], ours["model.n_heads"], ours["model.d_model"]) == \
        (int(theirs["n_layer"]), int(theirs["n_head"]), int(theirs["n_embd"]))
    assert (ours["data.seq_len"], ours["data.global_batch_size"], ours["run.steps"]) == \
        (int(theirs["block_size"]), int(theirs["batch_size"]), int(theirs["max_iters"])) == (64, 12, 300)
    assert ours["model.dropout"] == float(theirs["dropout"]) == 0.0 and ours["model.mlp_dim"] == 4 * ours["model.d_model"]
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, [(k, str(v)) for k, v in ours.items()])
    config.validate(cfg)


@pytest.mark.slow  # a 20-step run of jaxlm.train
def test_the_nanogpt_run_times_the_whole_jaxlm_run(tmp_path):
    corpus = tmp_path / "input.txt"
    corpus.write_text("\n\n".join(f"SPEAKER {i}:\nthe quick brown fox jumps over the lazy dog {i}." for i in range(400)))
    out = tmp_path / "run.json"
    result = subprocess.run([sys.executable, "benchmarks/nanogpt_run.py", "--sides", "jax", "--steps", "20",
                             "--corpus", str(corpus), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "XLA_FLAGS": xla_flags()})
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["side"] == "jaxlm" and row["final_step"] == 20 and 0 < row["final_val_loss"] < 6 and row["wall_s"] > 0
    assert "| jaxlm | 1 |" in result.stdout and "flags:" in result.stdout


def test_mfu_packed_batches_cut_rows_into_documents_with_positions_restarting():
    """`benchmarks/mfu.py --doc_len`: rows of several documents, each one's positions from 0, as the
    data pipeline packs them (the packed attention's speed depends on it)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mfu
    from train_throughput import random_batch

    batch = mfu.packed_batch(random_batch(4, 256, 100, 0), 40, seed=0)
    seg, pos = batch["segment_ids"], batch["positions"]
    starts = np.diff(seg, axis=1) != 0
    assert seg.shape == pos.shape == (4, 256) and (seg > 0).all() and starts.sum(axis=1).min() >= 1 and starts.sum() >= 12
    assert (pos[:, 0] == 0).all() and (pos[:, 1:][starts] == 0).all()
    assert (pos[:, 1:][~starts] == pos[:, :-1][~starts] + 1).all()
    assert batch["inputs"] is not None and batch["inputs"].shape == (4, 256)


@pytest.mark.slow
def test_profile_step_sums_the_steps_kernels_by_category(tmp_path):
    """benchmarks/profile_step.py on the tiny recipe (CPU: XLA's thunks): the categories add up to the
    kernels' sum, the matmuls are found among them, and the largest kernels are listed largest first."""
    out, again = tmp_path / "profile.json", tmp_path / "again.json"

    def run(*args):
        result = subprocess.run([sys.executable, "benchmarks/profile_step.py", *args], cwd=ROOT, capture_output=True,
                                text=True, timeout=600,
                                env={**os.environ, "XLA_FLAGS": xla_flags()})  # one CPU device
        assert result.returncode == 0, result.stderr[-2000:]
        return result

    result = run("--recipe", "tiny", "--steps", "2", "--set", "data.global_batch_size=8", "--doc_len", "40",
                 "--json", str(out), "--trace_dir", str(tmp_path / "trace"))
    r = json.loads(out.read_text())
    assert r["events"] == "cpu" and r["devices"].startswith("1x") and r["step_s"] > 0
    assert 0 < r["busy_ms"] <= r["span_ms"] and r["busy_ms"] <= r["kernel_ms"] + 1e-6
    run("--trace", str(tmp_path / "trace"), "--json", str(again))  # the kept trace, read again: the same sums
    floats.identical(json.loads(again.read_text())["categories"], r["categories"], why=floats.SAME_PROGRAM)
    categories = {c["category"]: c for c in r["categories"]}
    assert "matmuls" in categories and categories["matmuls"]["ms"] > 0
    assert sum(c["ms"] for c in r["categories"]) == pytest.approx(r["kernel_ms"], rel=1e-3, abs=0.01)
    assert sum(c["share"] for c in r["categories"]) == pytest.approx(1.0, abs=1e-3)
    largest = [k["ms"] for k in r["largest"]]
    assert largest == sorted(largest, reverse=True) and len(largest) == 15
    assert "| category | ms | share | kernels |" in result.stdout


def test_profile_step_counts_overlapping_events_once_as_busy():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_step

    # microseconds: [0, 10) and [5, 20) overlap, [30, 40) after a gap
    assert profile_step.busy_and_span([(30.0, 40.0), (0.0, 10.0), (5.0, 20.0)]) == {"busy_ms": 0.03, "span_ms": 0.04}
    assert profile_step.busy_and_span([]) == {"busy_ms": 0.0, "span_ms": 0.0}


def test_profile_step_takes_each_kernel_at_its_median_over_several_steps(tmp_path):
    """`--profiled N`: a kernel's figure is one step's, its launches per step at the median launch, so one
    launch stretched by other work on the machine does not count; busy and span are per step."""
    import gzip

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_step

    def thunk(name, ts, dur, module="jit_step_fn"):
        return {"ph": "X", "name": name, "pid": 1, "ts": ts, "dur": dur, "args": {"hlo_module": module, "hlo_op": name}}

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
    for step, stretched in enumerate((1, 100, 1)):  # three steps, dot.1 twice in each, once 100 times as long
        t0 = 1000.0 * step
        events += [thunk("dot.1", t0, 10.0 * stretched), thunk("dot.1", t0 + 200, 10.0), thunk("copy.2", t0 + 400, 4.0)]
    events.append(thunk("other_module_op", 0.0, 500.0, module="jit_other"))  # not the step's
    trace = tmp_path / "t.perfetto_trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    kernels, kind, _ = profile_step.device_kernels(str(trace), steps=3)
    assert kind == "cpu" and kernels == {"dot.1": [20.0, 2.0], "copy.2": [4.0, 1.0]}
    assert profile_step.device_kernels(str(trace))[0]["dot.1"] == [1000.0 + 50.0, 6]  # one step: the sums


def test_profile_step_sorts_kernel_names_into_categories():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_step

    expected = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "matmuls", "gemm_fusion_dot_530": "matmuls",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention", "ynn_fusion.165": "matmuls",
        "ncclDevKernel_AllGather_RING_LL": "collectives", "input_add_convert_reduce_fusion_64": "reductions (input fusions)",
        "loop_add_multiply_fusion_9": "elementwise (loop fusions)", "wrapped_transpose_153": "copies and transposes",
        "wrapped_convert_1": "elementwise (loop fusions)",
        "add_rsqrt_fusion.7": "elementwise (loop fusions)", "set_case_condition": "other",
    }
    assert {name: profile_step.category(name) for name in expected} == expected


THUNKS = """\
000: kCommandBuffer [source | next=010 (1)]
    001: kCustomKernel [source | sink] a grid: [1, 1, 1]
    002: kCustomKernel [source | sink] b grid: [1, 1, 1]
    003: kCopy         [source | sink] kCopy
010: kWhile [prev=000 (1) | sink]
condition:
    011: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    012: kCustomKernel [source | next=013 (1)] c grid: [1, 1, 1]
    013: kConditional [prev=012 (1) | next=020 (1)]
      false_branch:
        014: kCustomKernel [source | sink] d grid: [1, 1, 1]
      true_branch:
        000: kCommandBuffer [source | sink]
            015: kCustomKernel [source | sink] e grid: [1, 1, 1]
            016: kCuDnn [source | sink] kCuDnn
    020: kWhile [prev=013 (1) | sink]
condition:
        021: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1]
      body:
        022: kDynamicSliceFusion [source | sink] params=1, results=1
            023: kCopy [source | sink] kCopy
"""


def test_host_launches_counts_graphs_once_loops_by_trips_and_conditionals_as_waits():
    """benchmarks/host_launches.py reads XLA's thunk sequence: a command buffer is one launch of the
    kernels it holds; a loop's body counts its trip count times (the nested loop's unindented
    "condition:" as XLA writes it); a conditional is a host wait and its expected (true) branch."""
    from helpers import load_benchmark

    bench = load_benchmark("host_launches")
    got = bench.count(THUNKS, {10: 3, 20: 2})
    # launches: the first graph, then per outer iteration c, the true branch's graph and 2 slices
    assert got == {"launches": 1 + 3 * (1 + 1 + 2), "kernels": 3 + 3 * (1 + 2 + 2), "waits": 3}
    assert bench.thunk_names('thunk_metadata {\n  thunk_info {\n    profile_annotation: "while.7"\n'
                             '    thunk_id: 10\n  }\n  thunk_kind: "kWhile"\n}\n') == {10: "while.7"}


def test_moe_matmul_benchmark_counts_each_ways_flops(tmp_path):
    """benchmarks/moe.py matmul on the tiny shape (E = 8, k = 2): the compiled programs' FLOPs against the
    routed ones are E for ragged_dot (a masked dense dot over every expert on a CPU), E / k for every expert
    on every token, the capacity factor for the capacity einsum; the table comes last but for the load."""
    out = tmp_path / "matmul.json"
    result = subprocess.run([sys.executable, "benchmarks/moe.py", "matmul", "--shapes", "tiny", "--iters", "1",
                             "--repeats", "1", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "XLA_FLAGS": xla_flags()})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["meta"]["versions"].startswith("jax ") and report["meta"]["load_average"]
    ratios = {r["impl"]: r["flops_ratio"] for r in report["results"]}
    assert {k: v for k, v in ratios.items() if k != "tokamax"} == {"ragged_dot": 8.0, "dense_einsum": 4.0,
                                                                   "capacity_einsum": 1.25}
    assert ratios.get("tokamax", 8.0) == 8.0  # on a CPU tokamax falls back to ragged_dot
    assert all(r["ms"] > 0 and r["routed_gflop"] == round(3 * 2 * 4096 * 128 * 192 / 1e9, 3) for r in report["results"])
    assert result.stdout.strip().splitlines()[-2].startswith("| tiny | capacity_einsum |")


@pytest.mark.slow  # compiles a train step per variant
def test_moe_train_benchmark_times_dense_and_each_dispatch(tmp_path):
    out = tmp_path / "train.json"
    result = subprocess.run([sys.executable, "benchmarks/moe.py", "train", "--variants", "dense", "E8k2", "--impls",
                             "capacity", "ragged", "--steps", "1", "--warmup", "0", "--repeats", "2", "--set",
                             "data.global_batch_size=2", "data.seq_len=32", "model.n_layers=1", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "XLA_FLAGS": xla_flags()})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {(r["variant"], r["impl"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("dense", "-"), ("E8k2", "capacity"), ("E8k2", "ragged")}
    assert rows["dense", "-"]["vs_dense"] == 1.0
    # the same active parameters but the router's (d_model x E per layer)
    assert rows["E8k2", "ragged"]["active_m"] - rows["dense", "-"]["active_m"] == pytest.approx(128 * 8 / 1e6, abs=1e-3)
    assert all(len(r["step_ms_rounds"]) == 2 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["E8k2", "ragged"]["dropped"] == 0.0


def test_moe_kernels_breakdown_sums_a_programs_kernels_by_source_line(tmp_path):
    """benchmarks/moe_kernels.py on a saved program (here a CPU one: the tiny MoE layer's forward and
    backward, ragged dispatch): every non-matmul kernel's time lands on a source line, the lines sum to the
    kernels' total, and the MoE's own lines are among them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from helpers import small_config
    from jaxlm.models.mlps.moe import MoEMLP, MoESpec

    cfg = small_config(mlp="moe", mlp_dim=32, moe=MoESpec(experts=4, top_k=2, impl="ragged"))
    graph, state = nnx.split(MoEMLP(cfg, rngs=nnx.Rngs(params=0)))

    def loss(state, x):
        return jnp.sum(jnp.square(nnx.merge(graph, state)(x)[0]))

    x = jnp.ones((2, 8, cfg.d_model), jnp.float32)
    saved = tmp_path / "layer.hlo"
    saved.write_text(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text())
    out = tmp_path / "kernels.json"
    result = subprocess.run([sys.executable, "benchmarks/moe_kernels.py", "layer", "--hlo", str(saved), "--model_tflop",
                             "1e-6", "--top", "1000", "--kernels", "5", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            # this checkout's jaxlm, whose files the program's frames name, whatever is installed
                            env={**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["by_source"]
    assert rows and all(r["ms"] >= 0 and r["launches"] >= 1 for r in rows)
    floats.close(np.float64(sum(r["ms"] for r in rows)), np.float64(report["other_ms"]))
    assert report["other_ms"] > 0
    assert any("jaxlm/models/mlps/moe.py" in r["source"] for r in rows)
    floats.close(np.float64(report["step_ms"]), np.float64(report["compute_ms"] + report["exposed_ms"]))
    assert len(report["kernels"]) == 5 and report["kernels"][0]["ms"] >= report["kernels"][-1]["ms"]
    assert result.stdout.startswith("roofline step ")
