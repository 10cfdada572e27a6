# ruff: noqa: E501  (a hand-written HLO module, one instruction per line)
"""jaxlm.roofline: the kernels of a compiled program, their FLOPs, bytes and roofline times.

The counting is checked three ways: on the real train step compiled here (its matmul FLOPs, times
the loops' trip counts, equal the model's count plus the masked half of attention, exactly); on a
small hand-written scheduled module whose every figure is known (slices, in-place updates, cuDNN
attention, cuBLAS, async collectives and what overlaps them); and, where the H100 compiler is
installed (`make h100-env`), on the H100 program itself.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxlm import config as config_lib
from jaxlm import hlo, roofline, train_setup
from jaxlm.models.transformer import flops_per_token

ROOT = pathlib.Path(__file__).resolve().parent.parent
H100_PYTHON = ROOT / ".venv-h100" / "bin" / "python"


def test_the_compiled_steps_matmul_flops_are_the_models_count_times_the_loops():
    # scanned layers: a loop per micro-batch; XLA's attention: the full square (the CPU's causal blocks skip some)
    cfg = config_lib.recipe("tiny", optim__micro_batches=2, model__attention="xla")
    setup = train_setup.build(cfg, devices=jax.devices()[:1], abstract=True)
    module = hlo.Module(setup.compile_train_step().as_text())
    assert module.unknown_trip_counts == 0
    m, seq_len, tokens = setup.model_cfg, cfg.data.seq_len, setup.derived.tokens_per_step
    kernels = roofline.kernels(module, roofline.H100, 1)
    counted = sum(k.flops * k.runs for k in kernels if k.kind == "gemm")
    causal_half = 6 * m.n_layers * seq_len * m.n_heads * m.head_dim * tokens  # XLA attention computes the whole square
    assert counted == flops_per_token(m, seq_len) * tokens + causal_half
    summary = roofline.summarize(kernels, roofline.H100, flops_per_token(m, seq_len) * tokens)
    assert summary["matmul_flops"] == counted and summary["exposed_communication_seconds"] == 0
    assert summary["step_seconds"] == pytest.approx(sum(k.seconds * k.runs for k in kernels))
    assert 0 < summary["roofline_mfu"] < 1
    # each kernel by the function that made it (attention's full square among the two largest, beside the
    # projections' matmuls), every kernel counted once
    by_function = summary["by_function"]
    assert "attend" in list(by_function)[:2]
    assert sum(r["seconds"] for r in by_function.values()) == pytest.approx(summary["compute_seconds"])
    assert sum(r["launches"] for r in by_function.values()) == summary["launches"]


# A scheduled module of the GPU pipeline's shape, small enough to count by hand. One device of 8:
# a layer loop of 4 trips slicing a stacked weight, a GEMM, cuDNN attention forward (causal) and
# backward, a cuBLAS call, an in-place update of a stacked buffer, an all-gather overlapped by the
# GEMM, and a synchronous all-reduce.
MODULE = """HloModule step, is_scheduled=true

%fused_slice (p0: bf16[4,64,128], p1: s32[]) -> bf16[64,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,64,128}
  ROOT %b = bf16[64,128]{1,0} bitcast(%ds)
}

%gemm_computation (g0: bf16[32,64], g1: bf16[64,128]) -> bf16[32,128] {
  %g0 = bf16[32,64]{1,0} parameter(0)
  %g1 = bf16[64,128]{1,0} parameter(1)
  ROOT %dot.1 = bf16[32,128]{1,0} dot(%g0, %g1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (u0: bf16[4,32,128], u1: bf16[32,128], u2: s32[]) -> bf16[4,32,128] {
  %u0 = bf16[4,32,128]{2,1,0} parameter(0)
  %u1 = bf16[32,128]{1,0} parameter(1)
  %u2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %r = bf16[1,32,128]{2,1,0} bitcast(%u1)
  ROOT %dus = bf16[4,32,128]{2,1,0} dynamic-update-slice(%u0, %r, %u2, %z, %z)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (carry: (s32[], bf16[4,64,128], bf16[32,64], bf16[4,32,128])) -> (s32[], bf16[4,64,128], bf16[32,64], bf16[4,32,128]) {
  %carry = (s32[], bf16[4,64,128]{2,1,0}, bf16[32,64]{1,0}, bf16[4,32,128]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %w = bf16[4,64,128]{2,1,0} get-tuple-element(%carry), index=1
  %x = bf16[32,64]{1,0} get-tuple-element(%carry), index=2
  %acc = bf16[4,32,128]{2,1,0} get-tuple-element(%carry), index=3
  %ag = (bf16[8,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %slice = bf16[64,128]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="slice the layer"}
  %gemm = bf16[32,128]{1,0} fusion(%x, %slice), kind=kCustom, calls=%gemm_computation, metadata={op_name="the projection"}
  %agd = bf16[64,64]{1,0} all-gather-done(%ag)
  %upd = bf16[4,32,128]{2,1,0} fusion(%acc, %gemm, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,64,128]{2,1,0}, bf16[32,64]{1,0}, bf16[4,32,128]{2,1,0}) tuple(%next, %w, %x, %upd)
}

%cond (c: (s32[], bf16[4,64,128], bf16[32,64], bf16[4,32,128])) -> pred[] {
  %c = (s32[], bf16[4,64,128]{2,1,0}, bf16[32,64]{1,0}, bf16[4,32,128]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (w: bf16[4,64,128], x: bf16[32,64], acc: bf16[4,32,128], q: bf16[2,256,4,64], k: bf16[2,256,4,64], v: bf16[2,256,4,64], g: f32[1024]) -> f32[1024] {
  %w = bf16[4,64,128]{2,1,0} parameter(0)
  %x = bf16[32,64]{1,0} parameter(1)
  %acc = bf16[4,32,128]{2,1,0} parameter(2)
  %q = bf16[2,256,4,64]{3,2,1,0} parameter(3)
  %k = bf16[2,256,4,64]{3,2,1,0} parameter(4)
  %v = bf16[2,256,4,64]{3,2,1,0} parameter(5)
  %g = f32[1024]{0} parameter(6)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,64,128]{2,1,0}, bf16[32,64]{1,0}, bf16[4,32,128]{2,1,0}) tuple(%zero, %w, %x, %acc)
  %loop = (s32[], bf16[4,64,128]{2,1,0}, bf16[32,64]{1,0}, bf16[4,32,128]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %fwd = (bf16[2,4,256,64]{3,1,2,0}, f32[2,4,256]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","4","256","256"]},"mask_type":"CAUSAL","bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]}}}
  %bwd = (bf16[2,256,4,64]{3,2,1,0}, bf16[2,256,4,64]{3,2,1,0}, bf16[2,256,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","4","256","256"]},"mask_type":"NO_MASK","bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]}}}
  %mm = (f32[32,32]{1,0}, s8[1024]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %ar = f32[1024]{0} all-reduce-start(%g), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  ROOT %ard = f32[1024]{0} all-reduce-done(%ar)
}
"""


def test_a_hand_counted_module():
    module = hlo.Module(MODULE)
    assert module.runs["body"] == 4 and module.unknown_trip_counts == 0
    kernels = {k.name: k for k in roofline.kernels(module, roofline.H100, 8)}
    # the loop's kernels (its counter's add and compare included) run 4 times, the entry's once
    assert set(kernels) == {"ag", "slice", "gemm", "upd", "next", "lt", "fwd", "bwd", "mm", "ar"}
    assert {k.name for k in kernels.values() if k.runs == 4} == {"ag", "slice", "gemm", "upd", "next", "lt"}

    # the slice reads one layer's weight (not the stacked four) and its index, and writes the layer
    assert kernels["slice"].bytes == 2 * 64 * 128 * 2 + 4
    assert kernels["slice"].kind == "loop fusion" and kernels["slice"].flops == 0
    # the GEMM: 2 M N K, reads both operands, writes its result; bound by bytes at this size
    gemm = kernels["gemm"]
    assert (gemm.kind, gemm.flops, gemm.dtype) == ("gemm", 2 * 32 * 128 * 64, "bf16")
    assert gemm.bytes == (32 * 64 + 64 * 128 + 32 * 128) * 2
    assert gemm.seconds == max(gemm.flops / 989e12, gemm.bytes / 3.35e12)
    # the in-place update reads and writes the update only, not the stacked buffer
    assert kernels["upd"].bytes == 2 * 32 * 128 * 2 + 4
    # cuDNN attention: 4 B H T S D, halved when causal; the backward 2.5 times the forward
    full = 4 * 2 * 4 * 256 * 256 * 64
    assert (kernels["fwd"].kind, kernels["fwd"].flops, kernels["fwd"].full_attention_flops) == ("attention", full / 2, full)
    assert (kernels["bwd"].kind, kernels["bwd"].flops) == ("attention backward", 2.5 * full)
    # cuBLAS: contracting dimension 1 of a [32, 64] operand, a [32, 32] result (the workspace left out)
    assert (kernels["mm"].kind, kernels["mm"].flops) == ("gemm", 2 * 32 * 32 * 64)

    # the all-gather sends 7/8 of its [64, 64] result over NVLink, overlapped by the two kernels
    # scheduled between its start and done; the synchronous all-reduce is all exposed
    ag = kernels["ag"]
    assert ag.kind == "all-gather" and ag.comm_bytes == 7 / 8 * 64 * 64 * 2
    assert ag.seconds == ag.comm_bytes / 450e9
    assert ag.exposed_seconds == pytest.approx(max(0.0, ag.seconds - kernels["slice"].seconds - gemm.seconds))
    ar = kernels["ar"]
    assert ar.comm_bytes == 2 * 7 / 8 * 1024 * 4 and ar.exposed_seconds == ar.seconds

    summary = roofline.summarize(list(kernels.values()), roofline.H100, model_flops_per_device=1e9)
    compute = [k for k in kernels.values() if k.kind not in hlo.COLLECTIVES]
    assert summary["compute_seconds"] == pytest.approx(sum(k.seconds * k.runs for k in compute))
    exposed = ag.exposed_seconds * 4 + ar.seconds
    assert summary["step_seconds"] == pytest.approx(summary["compute_seconds"] + exposed)
    assert summary["roofline_mfu"] == pytest.approx(1e9 / 989e12 / summary["step_seconds"])
    assert summary["matmul_flops"] == 4 * gemm.flops + full / 2 + 2.5 * full + kernels["mm"].flops
    assert summary["attention_recompute_flops"] == 0.5 * full
    assert "the projection" in roofline.format_summary(summary)


# An MoE's all-to-all as XLA:GPU schedules it (moe_1b on 8 compile-only H100s, expert parallelism): the start's
# shape is ((operands), result), its done's the result, a copy scheduled between them
ALL_TO_ALL = """HloModule a2a, entry_computation_layout={(bf16[8,1024,1024]{2,1,0})->bf16[8,1024,1024]{2,1,0}}

ENTRY %main (x: bf16[8,1024,1024]) -> bf16[8,1024,1024] {
  %x = bf16[8,1024,1024]{2,1,0} parameter(0)
  %a2a = ((bf16[8,1024,1024]{2,1,0}), bf16[8,1024,1024]{2,1,0}) all-to-all-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %y = bf16[8,1024,1024]{2,1,0} copy(%x)
  ROOT %done = bf16[8,1024,1024]{2,1,0} all-to-all-done(%a2a)
}
"""


def test_an_all_to_all_counts_what_it_sends_and_states_its_share():
    """The all-to-all sends 7/8 of its result (each device keeps its own block), not of its start's
    tuple (operands and result); the copy between start and done covers part of it; the summary's line
    of collectives states its bytes, time and share of the step."""
    kernels = {k.name: k for k in roofline.kernels(hlo.Module(ALL_TO_ALL), roofline.H100, 8)}
    a2a, copy = kernels["a2a"], kernels["y"]
    assert a2a.kind == "all-to-all" and a2a.comm_bytes == 7 / 8 * 8 * 1024 * 1024 * 2
    assert a2a.seconds == a2a.comm_bytes / 450e9
    assert a2a.exposed_seconds == pytest.approx(a2a.seconds - copy.seconds)
    summary = roofline.summarize(list(kernels.values()), roofline.H100, model_flops_per_device=1e9)
    assert summary["by_kind"]["all-to-all"]["exposed_seconds"] == pytest.approx(a2a.exposed_seconds)
    share = a2a.seconds / summary["step_seconds"]
    line = f"all-to-all {a2a.comm_bytes / 1e9:.2f} GB, {a2a.seconds * 1e3:.1f} ms ({share:.1%} of the step)"
    assert line in roofline.format_summary(summary)


RING = "\n".join([
    "HloModule ring, is_scheduled=true", "",
    "ENTRY %main (k: bf16[2,4096,4,64], ids: s32[2,4096]) -> bf16[2,4096,4,64] {",
    "  %k = bf16[2,4096,4,64]{3,2,1,0} parameter(0)", "  %ids = s32[2,4096]{1,0} parameter(1)",
    # a ring pass: each device's keys to the next device; then the keys and segment ids passed on together
    "  %cp = (bf16[2,4096,4,64]{3,2,1,0}, bf16[2,4096,4,64]{3,2,1,0}, u32[], u32[]) collective-permute-start(%k), "
    "channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}, "
    'backend_config={"collective_backend_config":{"is_sync":false}}',
    "  %y = bf16[2,4096,4,64]{3,2,1,0} copy(%k)",
    "  %passed = bf16[2,4096,4,64]{3,2,1,0} collective-permute-done(%cp)",
    "  %both = ((bf16[2,4096,4,64]{3,2,1,0}, s32[2,4096]{1,0}), (bf16[2,4096,4,64]{3,2,1,0}, s32[2,4096]{1,0}), "
    "u32[], u32[]) collective-permute-start(%passed, %ids), channel_id=2, "
    "source_target_pairs={{0,7},{1,0},{2,1},{3,2},{4,3},{5,4},{6,5},{7,6}}, "
    'backend_config={"collective_backend_config":{"is_sync":false}}',
    "  %back = (bf16[2,4096,4,64]{3,2,1,0}, s32[2,4096]{1,0}) collective-permute-done(%both)",
    "  ROOT %out = bf16[2,4096,4,64]{3,2,1,0} get-tuple-element(%back), index=0", "}",
])


def test_the_rings_collective_permutes_count_what_they_send():
    """Context parallelism's ring passes and the balanced layout's reorders are collective permutes: each
    counts its result (what one device sends to its neighbour), not its start's tuple of operands and
    results, over NVLink, the part the kernels between start and done leave exposed; a pass of the keys with
    their segment ids together counts both."""
    kernels = {k.name: k for k in roofline.kernels(hlo.Module(RING), roofline.H100, 8)}
    keys, ids = 2 * 4096 * 4 * 64 * 2, 2 * 4096 * 4
    one, both, copy = kernels["cp"], kernels["both"], kernels["y"]
    assert one.kind == both.kind == "collective-permute"
    assert one.comm_bytes == keys and both.comm_bytes == keys + ids
    assert one.seconds == keys / roofline.H100.link_bytes_per_s
    assert one.exposed_seconds == pytest.approx(one.seconds - copy.seconds)
    assert both.exposed_seconds == both.seconds  # nothing scheduled between its start and done
    summary = roofline.summarize(list(kernels.values()), roofline.H100, model_flops_per_device=1e9)
    assert summary["by_kind"]["collective-permute"]["exposed_seconds"] == pytest.approx(
        one.exposed_seconds + both.exposed_seconds)
    assert "collective-permute " in roofline.format_summary(summary)
    assert hlo.Module(RING).collectives(8)["collective-permute"]["bytes"] == 2 * keys + ids


def _tokamax_call(name: str, result: str, operands: str, lhs: str, rhs: str, dims: str, op: str) -> str:
    """A tokamax grouped-matmul custom call as XLA writes it: its op and arguments as JSON in op_name."""
    meta = (f'{{"op":{{"__type":"tokamax._src.ops.ragged_dot.{op}","config":{{"block_m":64}}}},"arguments":{{'
            f'"group_sizes":{{"num_groups":8,"total_size":4096}},"lhs":"{lhs}","preferred_element_type":"float32",'
            f'"ragged_dot_dimension_numbers":{dims},"rhs":"{rhs}"}}}}')
    target = "mosaic_gpu_v2" if "Mosaic" in op else "__gpu$xla.gpu.triton"
    return (f'  %{name} = {result} custom-call({operands}), custom_call_target="{target}", '
            f'metadata={{op_name="jit(step)/tokamax:{meta.replace(chr(34), chr(92) + chr(34))}/pallas_call"}}')


TOKAMAX_MODULE = "\n".join([
    "HloModule grouped, is_scheduled=true", "",
    "ENTRY %main (x: bf16[4096,1024], w: bf16[8,1024,2304], ct: bf16[4096,2304], lo: s32[8], hi: s32[8]) -> f32[4096,2304] {",
    "  %x = bf16[4096,1024]{1,0} parameter(0)", "  %w = bf16[8,1024,2304]{2,1,0} parameter(1)",
    "  %ct = bf16[4096,2304]{1,0} parameter(2)", "  %lo = s32[8]{0} parameter(3)", "  %hi = s32[8]{0} parameter(4)",
    _tokamax_call("fwd", "f32[4096,2304]{1,0}", "%x, %w, %lo, %hi", "bf16[4096,1024]", "bf16[8,1024,2304]",
                  '{"dot_dimension_numbers":[[[1],[1]],[[],[]]],"lhs_ragged_dimensions":[0],"rhs_group_dimensions":[0]}',
                  "pallas_mosaic_gpu.PallasMosaicGpuRaggedDot"),
    _tokamax_call("dx", "f32[4096,1024]{1,0}", "%ct, %w, %lo, %hi", "bf16[4096,2304]", "bf16[8,1024,2304]",
                  '{"dot_dimension_numbers":[[[1],[2]],[[],[]]],"lhs_ragged_dimensions":[0],"rhs_group_dimensions":[0]}',
                  "pallas_triton.PallasTritonRaggedDot"),
    _tokamax_call("dw", "f32[8,1024,2304]{2,1,0}", "%x, %ct, %lo, %hi", "bf16[4096,1024]", "bf16[4096,2304]",
                  '{"dot_dimension_numbers":[[[0],[0]],[[],[]]],"lhs_ragged_dimensions":[0],"rhs_group_dimensions":[]}',
                  "pallas_mosaic_gpu.PallasMosaicGpuRaggedDot"),
    "  ROOT %out = f32[4096,2304]{1,0} add(%fwd, %fwd)", "}",
])


def test_tokamax_grouped_matmuls_count_their_routed_flops():
    """tokamax's kernels (Triton or Mosaic GPU custom calls, model.moe_impl=tokamax) are GEMMs of 2 M K N
    FLOPs, M the grouped rows, read from the op and shapes tokamax writes into their op_name: the forward
    x [M, K] by w [E, K, N], the input gradient ct [M, N] by w's transpose, the weight gradient summed
    over each group's rows into [E, K, N]."""
    kernels = {k.name: k for k in roofline.kernels(hlo.Module(TOKAMAX_MODULE), roofline.H100, 1)}
    for name in ("fwd", "dx", "dw"):
        assert (kernels[name].kind, kernels[name].flops, kernels[name].dtype) == ("gemm", 2 * 4096 * 1024 * 2304, "bf16")
    assert kernels["out"].kind == "add" and kernels["out"].flops == 0


def test_a_target_without_its_compiler_is_one_line(tmp_path):
    """In an environment without the CUDA plugin (the default install), --target says how to get it."""
    if (pathlib.Path(sys.executable).parent / ".." / "lib").resolve() == (H100_PYTHON.parent / ".." / "lib").resolve():
        pytest.skip("this is the H100 environment")
    result = subprocess.run([sys.executable, "-m", "jaxlm.plan", "--config=configs/tiny.py", "--target=h100",
                             "--devices=1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "make h100-env" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
@pytest.mark.parametrize("devices", [1, 8])
def test_the_h100_program_counts_the_models_flops_and_fits(devices):
    """The tiny recipe compiled for H100s: cuDNN attention, memory from the target, the program's
    matmuls equal to the model's count plus the scores cuDNN's backward recomputes; on 8 devices
    the FSDP collectives are there and their bytes counted."""
    result = subprocess.run([str(H100_PYTHON), "-m", "jaxlm.plan", "--config=configs/tiny.py", "--target=h100",
                             f"--devices={devices}", "--config.optim.micro_batches=0", "--json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    compiled, r = report["compiled"], report["compiled"]["roofline"]
    assert compiled["platform"] == "gpu" and compiled["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert compiled["attention"] == "cudnn" and report["micro_batches"] == 1  # the target's 80 GB decided
    assert report["device_memory_bytes"] == roofline.H100.memory_bytes and r["unknown_trip_counts"] == 0
    assert {"gemm", "attention", "attention backward"} <= set(r["by_kind"])
    assert r["matmul_flops"] - r["attention_recompute_flops"] == pytest.approx(r["model_flops"], rel=1e-9)
    assert 0 < r["roofline_mfu"] < 1
    # compile-only: every cuDNN call (forward and backward in each of tiny's 4 layers) without its workspace,
    # and the verdict on the larger of the compiled and analytic figures
    assert compiled["compile_only"] and compiled["cudnn_calls_without_workspace"] == 2 * 4
    # ... to which the one workspace they share on a GPU is added: the packed layout's backward, sized for
    # tiny's rows (16 per device at one micro-batch on one, 2 on eight) x the bound of 16 documents
    from jaxlm import memory

    m = config_lib.load_recipe("tiny").model
    rows = 16 // devices * m.attention_segments
    workspace = memory.cudnn_packed_workspace(rows * m.n_heads * 128, m.head_dim or m.d_model // m.n_heads)
    assert compiled["cudnn_workspace_bytes"] == workspace
    assert compiled["per_device_bytes"] == compiled["compiled_bytes"] + workspace
    assert report["per_device_bytes"] == max(compiled["per_device_bytes"], report["analytic"]["per_device_bytes"])
    if devices == 1:  # the analytic plan counts the same workspace (on eight tiny's MiB are XLA's fixed buffers)
        assert compiled["within_tolerance"], compiled["ratio"]
    if devices == 8:
        assert r["by_kind"]["all-gather"]["bytes"] > 0 and r["communication_seconds"] > 0


def test_the_choice_is_the_best_roofline_that_fits_without_recompute_xla_adds(capsys):
    from jaxlm import memory, plan

    def row(remat, k, mfu, fits=True, recompute=False):
        return {"remat": remat, "micro_batches": k, "roofline_mfu": mfu, "fits": fits, "xla_recompute": recompute}

    rows = [row("none", 32, 0.635), row("none", 16, 0.70, recompute=True), row("dots", 16, 0.68),
            row("dots", 8, 0.75, fits=False), row("full", 4, 0.62)]
    assert plan.pick(rows) == rows[2]
    assert plan.pick([row("dots", 16, 0.68), row("dots", 8, 0.68), row("none", 8, 0.68)]) == row("none", 8, 0.68)
    assert plan.pick([row("none", 1, 0.9, fits=False)]) is None
    assert "none of them fits" in plan.format_choice({"rows": [], "best": None}, {})
    # XLA's recompute is judged against the policy's first program whose matmuls were all counted: one with a
    # loop the roofline cannot read (no MFU, its FLOPs undercounted; v6e's 32 micro-batches) neither sets the
    # reference nor is judged by it
    incomplete, whole = {"roofline_mfu": None, "matmul_flops": 400.0}, {"roofline_mfu": 0.7, "matmul_flops": 460.0}
    assert plan.xla_recomputes(incomplete, None) == (False, None)
    assert plan.xla_recomputes(whole, None) == (False, 460.0)  # the reference now
    assert plan.xla_recomputes({"roofline_mfu": 0.69, "matmul_flops": 475.0}, 460.0) == (True, 460.0)
    assert plan.xla_recomputes({"roofline_mfu": 0.7, "matmul_flops": 461.0}, 460.0) == (False, 460.0)  # within 0.5%
    # the micro-batch counts a batch allows: the divisors of its sequences per device
    assert memory.micro_batch_options(config_lib.recipe("1b"), 8) == [1, 2, 4, 8, 16, 32]
    # --choose compiles for a target's devices: without one, one line and exit 2
    assert plan.main(["--config=configs/tiny.py", "--devices=1", "--choose"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target=h100" in err[0]


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
def test_choose_compiles_each_policy_and_picks_the_best_it_measured():
    """1b on eight H100s: each remat policy compiled at micro-batch counts going down until one does
    not fit or XLA recomputes; the choice is the best eligible row, at least as good as the config's own."""
    result = subprocess.run([str(H100_PYTHON), "-m", "jaxlm.plan", "--config=configs/1b.py", "--target=h100",
                             "--devices=8", "--choose", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    rows, best = report["choice"]["rows"], report["choice"]["best"]
    assert {r["remat"] for r in rows} == {"none", "dots_mlp", "dots", "dots_no_batch", "full"}
    for policy in {r["remat"] for r in rows}:
        mine = [r for r in rows if r["remat"] == policy]
        assert [r["micro_batches"] for r in mine] == sorted((r["micro_batches"] for r in mine), reverse=True)
        assert all(r["fits"] and not r["xla_recompute"] for r in mine[:-1])  # it stops at the first that fails
        assert all(r["matmul_flops"] >= mine[0]["matmul_flops"] * (1 - 1e-9) for r in mine)
    eligible = [r for r in rows if r["fits"] and not r["xla_recompute"]]
    assert best in eligible and best["roofline_mfu"] == max(r["roofline_mfu"] for r in eligible)
    assert best["roofline_mfu"] >= report["compiled"]["roofline"]["roofline_mfu"] - 1e-9
    assert all(r["per_device_bytes"] <= 0.85 * roofline.H100.memory_bytes for r in eligible)


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
def test_a_program_with_a_loop_of_unknown_trip_count_gets_no_mfu():
    """XLA's pipelined all-gathers peel the layer loop into one whose trip count the parser cannot read:
    its kernels would count once and flatter the MFU (6.1 for 7b). The figure is withheld and says why."""
    env = {**os.environ, "XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=true"}
    result = subprocess.run([str(H100_PYTHON), "-m", "jaxlm.plan", "--config=configs/7b.py", "--target=h100",
                             "--devices=8", "--config.model.scan_layers=true", "--json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)["compiled"]["roofline"]
    assert r["unknown_trip_counts"] >= 1 and r["matmul_flops"] < r["model_flops"]
    assert r["roofline_mfu"] is None and "unknown trip count" in r["incomplete"]


INIT_FUSIONS = """
import re, sys, jax
from jaxlm import config, roofline, train_setup, train_state
cfg = config.load_recipe("1b")  # 1b's shapes, 4 of its unscanned layers
config.apply_overrides(cfg, [("model.n_layers", "4"), ("optim.micro_batches", "16")])
setup = train_setup.build(cfg, roofline.target_devices(roofline.H100, 1), abstract=True)
_, shardings, _, init = train_state.abstract_state(setup.model_cfg, setup.tx, setup.mesh, setup.rules, 0, setup.model_spec)
with jax.set_mesh(setup.mesh):
    lowered = jax.jit(init, out_shardings=shardings).lower()
    for options in ({}, train_state.INIT_COMPILER_OPTIONS):
        text = lowered.compile(compiler_options=options).as_text()
        generators = [line for line in text.splitlines() if " fusion(" in line and "calls=%fused_broadcast" not in line]
        outputs = [len(re.findall(r"f32\\[", line.split(" fusion(")[0])) for line in generators]  # zeros are not generators
        print(max(outputs, default=1))
"""


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
def test_the_tokamax_moe_h100_program_computes_the_routed_flops():
    """configs/moe_tiny.py with model.moe_impl=tokamax compiled for one H100 (tokamax told to compile for it:
    `roofline.kernel_checks_for`): the experts run in tokamax's grouped-GEMM kernels, whose FLOPs are the
    routed ones, so the program's matmuls are exactly the model's active count plus cuDNN's recomputed
    scores (jax's own ragged_dot computes E x the experts' FLOPs there)."""
    if subprocess.run([str(H100_PYTHON), "-c", "import tokamax"], capture_output=True).returncode:
        pytest.skip("tokamax is not installed in the H100 compiler environment")
    result = subprocess.run([str(H100_PYTHON), "-m", "jaxlm.plan", "--config=configs/moe_tiny.py", "--target=h100",
                             "--devices=1", "--config.model.moe_impl=tokamax", "--json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)["compiled"]["roofline"]
    assert r["matmul_flops"] - r["attention_recompute_flops"] == pytest.approx(r["model_flops"], rel=1e-9)
    assert 0 < r["roofline_mfu"] < 1


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
def test_the_init_program_keeps_each_random_generator_its_own_kernel():
    """XLA's GPU backend fuses the generators of all same-shaped parameters of unscanned layers into one
    multi-output kernel that takes minutes to compile (1b: 2 min 12 s on an H200); the init program
    is compiled without that pass, and then no generator fusion makes more than two parameters (the
    optimizer's zeros may still be made together: they compile fast)."""
    result = subprocess.run([str(H100_PYTHON), "-c", INIT_FUSIONS], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    fused_default, fused_ours = map(int, result.stdout.split())
    assert fused_default >= 4 and fused_ours <= 2, (fused_default, fused_ours)


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
def test_the_tiny_h100_step_is_a_few_host_launches_with_its_layers_unrolled():
    """benchmarks/host_launches.py on the tiny recipe's H100 program: unrolled (scan_unroll auto on a GPU
    without remat) the step is a few CUDA graphs and cuDNN calls around hundreds of kernels, with no host
    wait (the attention kernel chosen on the host); as a loop over layers, many more host launches."""
    def launches(*overrides):
        result = subprocess.run([str(H100_PYTHON), "benchmarks/host_launches.py", "--recipe", "tiny", *overrides],
                                cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    unrolled, loop = launches(), launches("model.scan_unroll=1")
    assert unrolled["waits"] == 0 and unrolled["host_syncs_hlo"] == 0
    assert unrolled["kernels"] > 10 * unrolled["launches"]  # most kernels inside CUDA graphs
    assert loop["launches"] > 5 * unrolled["launches"]


WEIGHT_GRADIENT_GEMMS = r"""
import dataclasses, json, os, re, sys
sys.path.insert(0, ".")
from jaxlm import config as config_lib, roofline, steps, train_setup
if sys.argv[1] == "off":  # the step without ComputeKernels
    steps.compute_kernels = lambda spec, rules, replicas: dataclasses.replace(spec, grad_kernels=frozenset(), joints=())
# tiny's batch and sequence, wider layers: tiny's own weight gradients are split-K GEMMs with a reduction apart
cfg = config_lib.recipe("tiny", optim__micro_batches=2, model__scan_layers=False, model__remat="dots_mlp",
                        model__d_model=1024, model__n_heads=8, model__n_kv_heads=2, model__mlp_dim=2816, model__n_layers=2)
setup = train_setup.build(cfg, roofline.target_devices(roofline.H100, 1), abstract=True)
with roofline.cudnn_checks_for(roofline.H100):
    text = setup.compile_train_step("expected").as_text()
# every GEMM fusion: the dtype it makes and its operand count
found = []
for line in text.splitlines():
    m = re.search(r"%gemm_fusion\S* = (f32|bf16)\[[^ ]* fusion\(([^)]*)\), kind=kCustom", line)
    if m:
        found.append((m.group(1), len(m.group(2).split(","))))
print(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
def test_the_h100_step_sums_the_weight_gradients_in_the_gemms():
    """With micro-batches (2 unrolled layers of width 1024, q, k, v and gate, up each one matmul), the H100
    program's weight gradients come from GEMMs that make float32 and take the float32 accumulator as a
    third operand (XLA fused `acc + g` into them: `layers.ComputeKernel`): per layer qkv, o, gate/up and
    down, and the unembedding. Without ComputeKernels no GEMM takes a third operand (the weight gradients
    come in bfloat16 and are added apart)."""
    def gemms(mode):
        result = subprocess.run([str(H100_PYTHON), "-c", WEIGHT_GRADIENT_GEMMS, mode], cwd=ROOT, capture_output=True,
                                text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    on, off = gemms("on"), gemms("off")
    assert sum(1 for dtype, operands in on if operands == 3) == 4 * 2 + 1, on
    assert all(dtype == "f32" for dtype, operands in on if operands == 3), on
    assert not any(operands == 3 for _, operands in off), off


@pytest.mark.slow
@pytest.mark.skipif(not H100_PYTHON.exists(), reason="the H100 compiler environment is not installed (make h100-env)")
def test_the_checkpoint_snapshot_copy_is_copies_of_the_state_and_nothing_else(tmp_path):
    """checkpoint.snapshot=device's state copy compiled for 8 H100s (the tiny recipe's FSDP state):
    one copy kernel per array, outputs the size of each device's shard of the state (plus the output
    tuple's pointers), no temporaries beyond a few hundred bytes of XLA's bookkeeping."""
    out = tmp_path / "copy.json"
    result = subprocess.run([str(H100_PYTHON), "benchmarks/roofline.py", "--recipe", "tiny", "--devices", "8",
                             "--snapshot-copy", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    setup = train_setup.build(config_lib.recipe("tiny"), devices=jax.devices()[:8], abstract=True)
    leaves = jax.tree.leaves(setup.state)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    assert r["kernels"] == {"copy": len(leaves)}, r
    assert r["temp_bytes"] <= 1024 and per_device <= r["output_bytes"] <= per_device + 8 * len(leaves)
    assert r["seconds"] > 0
