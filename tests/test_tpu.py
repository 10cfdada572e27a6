"""Compile-only TPU targets (`python -m jaxlm.plan --target=v5p --topology=v5p:2x2x1`): the chips' figures, the
slice shapes, the refusals, and the roofline of XLA:TPU's program: its matmuls are convolutions (a batched
matmul's batch a padded, dilated window) and its loops carry no trip count. The last test compiles tiny's
train step for four v5p chips where libtpu is installed (`make tpu-env`), else it is skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxlm import hlo, metrics, plan, roofline, xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
TPU_PYTHON = ROOT / ".venv-tpu" / "bin" / "python"
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
GIB = 2**30

# Four v5p chips, x: bf16[8, 128, 256] sharded over its batch, w: bf16[256, 512] over its rows, compiled by
# .venv-tpu's jax 0.10.2 and libtpu 0.0.42.1 (tests/data/tpu_v5p_matmuls.hlo):
#     y = jnp.einsum("btd,df->btf", x, w)   # w all-gathered: a convolution with a window of 1
#     s = jnp.einsum("bqf,bkf->bqk", y, y)  # per batch element: a convolution whose window is the batch
#     return s.astype(jnp.float32).sum()    # an all-reduce over the batch's shards
TPU_MODULE = (ROOT / "tests" / "data" / "tpu_v5p_matmuls.hlo").read_text()
# The gradient of splash attention's summed output (`model.attention=splash`), one v5p chip: q bf16[2, 1024, 4, 64],
# k and v bf16[2, 1024, 2, 64], packed segment ids, blocks of 512 (tests/data/tpu_v5p_splash.hlo, compiled as
# above, the Mosaic kernels' serialized bodies cut out); its kernels' metadata printed over several lines
SPLASH_MODULE = (ROOT / "tests" / "data" / "tpu_v5p_splash.hlo").read_text()  # a dq and a dkv kernel
SPLASH_FUSED_MODULE = (ROOT / "tests" / "data" / "tpu_v5p_splash_fused.hlo").read_text()  # one backward kernel


def test_the_tpu_targets_carry_clouds_figures():
    figures = {  # name: (device kind, bf16 FLOP/s, int8 OP/s, HBM GiB, HBM B/s, ICI B/s one way, chips per host)
        "v4": ("TPU v4", 275e12, 275e12, 32, 1200e9, 270e9, 4),
        "v5e": ("TPU v5 lite", 197e12, 393e12, 16, 819e9, 200e9, 8),
        "v5p": ("TPU v5", 459e12, 918e12, 95, 2765e9, 600e9, 4),
        "v6e": ("TPU v6 lite", 918e12, 1836e12, 32, 1640e9, 400e9, 8),
    }
    for name, (kind, bf16, int8, hbm_gib, hbm_bw, ici, per_host) in figures.items():
        t = roofline.TARGETS[name]
        assert (t.name, t.device_kind, t.platform) == (name, kind, "tpu")
        assert (t.peak("bf16"), t.peak("s8"), t.peak("f32")) == (bf16, int8, bf16)  # f32 dots: bf16 passes' roof
        assert (t.memory_bytes, t.hbm_bytes_per_s, t.link_bytes_per_s) == (hbm_gib * GIB, hbm_bw, ici)
        assert t.devices_per_host == per_host and t.network_bytes_per_s < t.link_bytes_per_s
        assert t.config is None and t.capability is None  # XLA:GPU's description and CUDA's capability: GPUs only
        assert metrics.peak_flops(kind) == bf16  # the trainer's MFU divides by the same peak on a real chip
        assert t.link_domain(64) == 64  # ICI joins the whole slice, across hosts
    assert roofline.H100.link_domain(64) == 8


def test_topologies_are_parsed_and_defaulted_as_clouds_slices():
    v5p, v5e, v6e = roofline.TPU_V5P, roofline.TPU_V5E, roofline.TPU_V6E
    assert roofline.parse_topology(v5p, "v5p:2x2x1") == (2, 2, 1)
    assert roofline.parse_topology(v5p, "v5p:2x4x4") == (2, 4, 4)  # 32 chips on 8 hosts
    assert roofline.parse_topology(v5e, "v5e:2x4") == roofline.parse_topology(v5e, "v5litepod:2x4") == (2, 4)
    assert [roofline.default_topology(v5p, n) for n in (1, 4, 8, 16, 32, 64, 128, 256)] == [
        "v5p:1x1x1", "v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8", "v5p:4x8x8"]
    assert [roofline.default_topology(v6e, n) for n in (1, 4, 8, 16, 32, 64, 256)] == [
        "v6e:1x1", "v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:4x8", "v6e:8x8", "v6e:16x16"]
    refusals = [(v5p, "v6e:2x4", "--target=v6e"), (v5p, "v5p:2x4", "3-D grid"), (v6e, "v6e:2x2x2", "2-D grid"),
                (v5p, "2x2x1", "e.g. v5p:2x2x1"), (v5e, "v5e:0x4", "2-D grid")]
    for target, topology, says in refusals:
        with pytest.raises(ValueError, match=says):
            roofline.parse_topology(target, topology)
    with pytest.raises(ValueError, match="power of two"):
        roofline.default_topology(v5p, 6)


def _one_line(capsys, argv: list[str]) -> str:
    assert plan.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_tpu_plan_refuses_in_one_line(capsys):
    tiny = "--config=configs/tiny.py"
    assert "is a v6e slice, not a v5p one" in _one_line(capsys, [tiny, "--target=v5p", "--topology=v6e:2x4"])
    assert "has 4 chips, not --devices=8" in _one_line(capsys, [tiny, "--target=v5p", "--topology=v5p:2x2x1",
                                                                "--devices=8"])
    assert "add --target=v5e, v5p or v6e" in _one_line(capsys, [tiny, "--devices=4", "--topology=v5p:2x2x1"])
    assert "is a TPU slice's shape" in _one_line(capsys, [tiny, "--target=h100", "--devices=8",
                                                                     "--topology=v5p:2x2x1"])
    assert "--devices is required" in _one_line(capsys, [tiny, "--target=v5p"])
    assert "power of two" in _one_line(capsys, [tiny, "--target=v6e", "--devices=6",
                                                    "--config.data.global_batch_size=24"])
    assert "'v4', 'v5e', 'v5p', 'v6e'" in _one_line(capsys, [tiny, "--devices=4", "--target=v7"])  # the known ones


@pytest.mark.skipif(HAVE_LIBTPU, reason="libtpu is installed in this environment")
def test_a_tpu_target_without_libtpu_is_one_line():
    result = subprocess.run([sys.executable, "-m", "jaxlm.plan", "--config=configs/tiny.py", "--target=v5p",
                             "--topology=v5p:2x2x1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "make tpu-env" in lines[0] and "Traceback" not in result.stderr


def test_xla_tpus_convolutions_are_counted_as_the_matmuls_they_are():
    module = hlo.Module(TPU_MODULE)
    kernels = {k.name: k for k in roofline.kernels(module, roofline.TPU_V5P, 4)}
    # one fusion holds both matmuls: x's shard [2, 128, 256] by w [256, 512], then [2, 128, 512] by its transpose
    # per batch element (the convolution whose 2-wide window, dilated by 2, meets the batch's diagonal only)
    gemm = kernels["convert_reduce_fusion"]
    assert (gemm.kind, gemm.dtype) == ("gemm", "bf16")
    assert gemm.flops == 2 * 2 * 128 * 512 * 256 + 2 * 2 * 128 * 128 * 512
    assert gemm.bytes == 256 * 512 * 2 + 4  # w (through a nested fusion) and the f32[] from HBM; x's shard on chip
    prefetch = kernels["copy-start"]  # x's shard, moved into on-chip memory by an asynchronous copy
    assert (prefetch.kind, prefetch.dma, prefetch.bytes) == ("copy", True, 2 * 128 * 256 * 2)
    gather = kernels["all-gather.1"]  # w's rows from the four chips, over ICI
    assert gather.comm_bytes == 3 / 4 * 256 * 512 * 2 and gather.seconds == gather.comm_bytes / 600e9
    assert kernels["all-reduce"].kind == "all-reduce" and module.unknown_trip_counts == 0
    assert not any("AllocateBuffer" in k.kind for k in kernels.values())
    summary = roofline.summarize(list(kernels.values()), roofline.TPU_V5P, model_flops_per_device=gemm.flops)
    assert summary["matmul_flops"] == gemm.flops and 0 < summary["roofline_mfu"] <= 1


def test_splash_attentions_kernels_are_counted_by_the_causal_blocks_they_visit():
    module = hlo.Module(SPLASH_MODULE)
    assert module.unknown_trip_counts == 0 and "\n}}" in SPLASH_MODULE  # instructions over several lines read whole
    kernels = {k.name.split(".")[0]: k for k in roofline.kernels(module, roofline.TPU_V5P, 1) if "attention" in k.kind}
    b, n, h, block = 2, 4, 64, 512  # of 1024 positions
    matmul = 2 * b * n * block * block * h  # one [512, 512] x 64 matmul over every row and head
    visited, blocks = 3, 4  # of the 2 x 2 blocks, the one above the diagonal is skipped
    for name, kind, matmuls, recomputed in (("splash_mha_fwd_segmented_residuals", "attention", 2, 0),
                                            ("splash_mha_dq_segmented_no_residuals", "attention backward", 3, 2),
                                            ("splash_mha_dkv_segmented_no_residuals", "attention backward", 4, 1)):
        k = kernels[name]
        assert (k.kind, k.dtype, k.runs) == (kind, "bf16", 1), name
        assert (k.flops, k.full_attention_flops, k.recompute_flops) == (
            matmuls * visited * matmul, matmuls * blocks * matmul, recomputed * visited * matmul), name
    summary = roofline.summarize(roofline.kernels(module, roofline.TPU_V5P, 1), roofline.TPU_V5P, 1.0)
    # over the visited blocks: the forward's 2 matmuls, the backward's 7 (dq's 3, dkv's 4), 3 of them recomputed
    assert summary["matmul_flops"] == (2 + 7) * visited * matmul
    assert summary["attention_recompute_flops"] == 3 * visited * matmul

    # splash's fused backward, as jaxlm now compiles it: dq, dk and dv from one kernel (5 matmuls per block,
    # the scores recomputed once), its dq written per key block and summed after
    module = hlo.Module(SPLASH_FUSED_MODULE)
    kernels = [k for k in roofline.kernels(module, roofline.TPU_V5P, 1) if "attention" in k.kind]
    backward = [k for k in kernels if k.kind == "attention backward"]
    assert len(backward) == 1 and "splash_mha_dkv" in backward[0].name
    assert (backward[0].flops, backward[0].recompute_flops) == (5 * visited * matmul, visited * matmul)
    summary = roofline.summarize(kernels, roofline.TPU_V5P, 1.0)
    assert summary["matmul_flops"] == (2 + 5) * visited * matmul


# A gradient's all-reduce across two v5p slices as XLA:TPU compiles it (one slice's program, the DCN part a send to
# the host's megascale runtime, lines as in a compiled tiny recipe's), beside a fusion the transfer overlaps
MULTISLICE = """HloModule jit_step, is_scheduled=true, num_partitions=4

%fused (param_0: f32[1048576]) -> f32[1048576] {
  %param_0 = f32[1048576]{0} parameter(0)
  ROOT %exp = f32[1048576]{0} exponential(%param_0)
}

ENTRY %main (p: bf16[16,8,128], q: f32[1048576]) -> (bf16[16,8,128], f32[1048576]) {
  %p = bf16[16,8,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %q = f32[1048576]{0} parameter(1)
  %after-all.15 = token[] after-all()
  %send.15 = (bf16[16,8,128]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}, token[]) send(%p, %after-all.15), channel_id=4, \
is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",\
_xla_host_transfer_rendezvous="all-reduce.82_0",_xla_megascale_reduce_operation="SUM",\
_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv.15 = (bf16[16,8,128]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}, token[]) recv(%after-all.15), channel_id=3, \
is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",\
_xla_host_transfer_rendezvous="all-reduce.82_0",_xla_megascale_reduce_operation="SUM",\
_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %fusion.1 = f32[1048576]{0} fusion(%q), kind=kLoop, calls=%fused
  %send-done.15 = token[] send-done(%send.15), channel_id=4, is_host_transfer=true
  %recv-done.15 = (bf16[16,8,128]{2,1,0:T(8,128)(2,1)}, token[]) recv-done(%recv.15), channel_id=3, is_host_transfer=true
  %get-tuple-element.1 = bf16[16,8,128]{2,1,0:T(8,128)(2,1)} get-tuple-element(%recv-done.15), index=0
  ROOT %tuple.1 = (bf16[16,8,128]{2,1,0:T(8,128)(2,1)}, f32[1048576]{0}) tuple(%get-tuple-element.1, %fusion.1)
}
"""


def test_a_collective_across_tpu_slices_runs_at_dcns_bandwidth_and_overlaps_what_runs_beside_it():
    kernels = roofline.kernels(hlo.Module(MULTISLICE), roofline.TPU_V5P, 4)
    assert [k.name for k in kernels] == ["send.15", "fusion.1"]  # the recv: the same transfer, counted once
    dcn, fusion = kernels
    size = 16 * 8 * 128 * 2
    assert (dcn.kind, dcn.comm_bytes) == ("all-reduce", 2 * (2 - 1) / 2 * size)  # a ring over the 2 slices
    assert dcn.seconds == dcn.comm_bytes / roofline.TPU_V5P.network_bytes_per_s
    assert fusion.seconds == 2 * 4 * 2**20 / roofline.TPU_V5P.hbm_bytes_per_s
    assert dcn.exposed_seconds == pytest.approx(dcn.seconds - fusion.seconds)  # until its send-done
    summary = roofline.summarize(kernels, roofline.TPU_V5P, 1.0)
    assert summary["by_kind"]["all-reduce"]["bytes"] == dcn.comm_bytes == summary["network_bytes"]
    assert summary["exposed_communication_seconds"] == pytest.approx(dcn.seconds - fusion.seconds)


def test_window_pairs_count_the_positions_that_read_an_input_element():
    # brute force over small windows: stride, padding, both dilations
    import itertools

    def brute(size_in, kernel, size_out, stride, pad, lhs_dilate, rhs_dilate):
        span = (size_in - 1) * lhs_dilate
        return sum(1 for o, k in itertools.product(range(size_out), range(kernel))
                   if 0 <= (p := o * stride + k * rhs_dilate - pad) <= span and p % lhs_dilate == 0)

    for args in itertools.product((1, 3, 4), (1, 2, 4), (1, 2, 5), (1, 3), (0, 1, 3), (1, 2), (1, 2)):
        assert roofline._window_pairs(*args) == brute(*args), args


# A loop as XLA:TPU writes it: no known_trip_count; its condition compares the counter with 6, from 2
LOOP = """HloModule loop

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[]{:T(128)}, f32[4]{0:T(256)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(6)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[]{:T(128)}, f32[4]{0:T(256)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  %x = f32[4]{0:T(256)} get-tuple-element(%q), index=1
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%j, %one)
  %y = f32[4]{0:T(256)} negate(%x)
  ROOT %t = (s32[]{:T(128)}, f32[4]{0:T(256)}) tuple(%next, %y)
}

ENTRY %main (a: f32[4]) -> (s32[], f32[4]) {
  %a = f32[4]{0:T(256)} parameter(0)
  %two = s32[]{:T(128)} constant(2)
  %start = s32[]{:T(128)} copy(%two)
  %init = (s32[]{:T(128)}, f32[4]{0:T(256)}) tuple(%start, %a)
  ROOT %w = (s32[]{:T(128)}, f32[4]{0:T(256)}) while(%init), condition=%cond, body=%body
}
"""


# XLA:TPU's windowed matmul loop: the counter after the buffers (element 1), two steps per iteration
WINDOWED = """HloModule windowed

%cond (p: (f32[4], s32[])) -> pred[] {
  %p = (f32[4]{0:T(256)}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=1
  %n = s32[]{:T(128)} constant(7)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

%body (q: (f32[4], s32[])) -> (f32[4], s32[]) {
  %q = (f32[4]{0:T(256)}, s32[]{:T(128)}) parameter(0)
  %x = f32[4]{0:T(256)} get-tuple-element(%q), index=0
  %j = s32[]{:T(128)} get-tuple-element(%q), index=1
  %two = s32[]{:T(128)} constant(2)
  %next = s32[]{:T(128)} add(%j, %two)
  %y = f32[4]{0:T(256)} negate(%x)
  ROOT %t = (f32[4]{0:T(256)}, s32[]{:T(128)}) tuple(%y, %next)
}

ENTRY %main (a: f32[4]) -> (f32[4], s32[]) {
  %a = f32[4]{0:T(256)} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %init = (f32[4]{0:T(256)}, s32[]{:T(128)}) tuple(%a, %zero)
  ROOT %w = (f32[4]{0:T(256)}, s32[]{:T(128)}) while(%init), condition=%cond, body=%body
}
"""


def test_a_loop_without_a_known_trip_count_runs_from_its_start_to_its_bound():
    module = hlo.Module(LOOP)
    assert module.runs["body"] == 4 and module.unknown_trip_counts == 0
    unknown = hlo.Module(LOOP.replace("%start = s32[]{:T(128)} copy(%two)", "%start = s32[]{:T(128)} negate(%two)"))
    assert unknown.unknown_trip_counts == 1  # a start that is not a constant: not guessed
    windowed = hlo.Module(WINDOWED)  # 0, 2, 4, 6: four iterations
    assert windowed.runs["body"] == 4 and windowed.unknown_trip_counts == 0
    copied = hlo.Module(WINDOWED.replace("%next = s32[]{:T(128)} add(%j, %two)",  # the counter read through a copy
                                         "%jc = s32[]{:T(128)} copy(%j)\n  %next = s32[]{:T(128)} add(%jc, %two)"))
    assert copied.runs["body"] == 4 and copied.unknown_trip_counts == 0


# XLA:TPU's asynchronous slices of a weight into on-chip memory (S(1)), joined by a bitcast
DMA = """HloModule dma

ENTRY %main (a: s8[4096]) -> bf16[1024] {
  %a = s8[4096]{0:T(1024)} parameter(0)
  %s0 = ((s8[4096]{0:T(1024)}), s8[1024]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:1024]}
  %s1 = ((s8[4096]{0:T(1024)}), s8[1024]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[1024:2048]}
  %d0 = s8[1024]{0:T(1024)S(1)} slice-done(%s0)
  %d1 = s8[1024]{0:T(1024)S(1)} slice-done(%s1)
  ROOT %c = bf16[1024]{0:T(1024)S(1)} custom-call(%d0, %d1), custom_call_target="ConcatBitcast"
}
"""


def test_an_asynchronous_slice_moves_its_slice_and_a_bitcast_nothing():
    kernels = {k.name: k for k in roofline.kernels(hlo.Module(DMA), roofline.TPU_V6E, 1)}
    assert set(kernels) == {"s0", "s1"}  # the done halves and the ConcatBitcast launch nothing
    # the slice read from HBM, not the weight; written to on-chip memory, which costs HBM nothing
    assert all(k.kind == "slice" and k.dma and k.bytes == 1024 for k in kernels.values())


# XLA:TPU's asynchronous collective fusion (v5e's default for FSDP's all-gathers), lines as in the compiled 1b
# step: a fusion that starts the all-gather, a kernel beside it, a fusion that waits for it
ASYNC_COLLECTIVE = """HloModule async_collective, is_scheduled=true, num_partitions=8

%start_body (p0: bf16[256,4,64]) -> (bf16[256,4,64], bf16[2048,4,64], u32[]) {
  %p0 = bf16[256,4,64]{0,2,1:T(8,128)(2,1)} parameter(0)
  %ag = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)} all-gather(%p0), channel_id=3, \
replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  ROOT %cc = (bf16[256,4,64]{0,2,1:T(8,128)(2,1)}, bf16[2048,4,64]{0,2,1:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) \
custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}

%done_body (d0: bf16[256,4,64], d1: bf16[2048,4,64], d2: u32[]) -> bf16[2048,4,64] {
  %d0 = bf16[256,4,64]{0,2,1:T(8,128)(2,1)} parameter(0)
  %d1 = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)S(1)} parameter(1)
  %d2 = u32[]{:S(2)} parameter(2)
  %ag2 = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)} all-gather(%d0), channel_id=3, \
replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  ROOT %cd = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)S(1)} custom-call(%d0, %d1, %ag2, %d2), \
custom_call_target="AsyncCollectiveDone"
}

%exp (e0: f32[%N%]) -> f32[%N%] {
  %e0 = f32[%N%]{0} parameter(0)
  ROOT %e = f32[%N%]{0} exponential(%e0)
}

ENTRY %main (w: bf16[256,4,64], y: f32[%N%]) -> bf16[2048,4,64] {
  %w = bf16[256,4,64]{0,2,1:T(8,128)(2,1)} parameter(0)
  %y = f32[%N%]{0} parameter(1)
  %async-collective-start.2 = (bf16[256,4,64]{0,2,1:T(8,128)(2,1)}, bf16[2048,4,64]{0,2,1:T(8,128)(2,1)S(1)}, \
u32[]{:S(2)}) fusion(%w), kind=kCustom, calls=%start_body
  %beside = f32[%N%]{0} fusion(%y), kind=kLoop, calls=%exp
  %g0 = bf16[256,4,64]{0,2,1:T(8,128)(2,1)} get-tuple-element(%async-collective-start.2), index=0
  %g1 = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)S(1)} get-tuple-element(%async-collective-start.2), index=1
  %g2 = u32[]{:S(2)} get-tuple-element(%async-collective-start.2), index=2
  ROOT %async-collective-done.2 = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)S(1)} fusion(%g0, %g1, %g2), kind=kCustom, \
calls=%done_body
}
"""


@pytest.mark.parametrize("elements", [1024, 4 * 2**20])  # the kernel beside it: shorter, then longer
def test_an_asynchronous_collective_fusion_is_the_collective_overlapping_the_kernels_beside_it(elements):
    target = roofline.TPU_V5E
    kernels = {k.name: k for k in roofline.kernels(hlo.Module(ASYNC_COLLECTIVE.replace("%N%", str(elements))),
                                                   target, 8)}
    assert set(kernels) == {"async-collective-start.2", "beside"}  # the done fusion launches nothing
    gather, beside = kernels["async-collective-start.2"], kernels["beside"]
    size = 2048 * 4 * 64 * 2
    assert (gather.kind, gather.comm_bytes) == ("all-gather", 7 / 8 * size)  # a ring over the 8 chips
    assert gather.seconds == gather.comm_bytes / target.link_bytes_per_s
    assert beside.seconds == 2 * 4 * elements / target.hbm_bytes_per_s
    assert gather.exposed_seconds == pytest.approx(max(0.0, gather.seconds - beside.seconds))
    summary = roofline.summarize(list(kernels.values()), target, 1.0)
    assert summary["step_seconds"] == pytest.approx(beside.seconds + gather.exposed_seconds)


# A gradient's reduce-scatter offloaded to the chip's SparseCores (MaxText's
# ENABLE_SPARSECORE_OFFLOADING_FOR_REDUCE_SCATTER flags), as libtpu compiles it for v6e: a call-start on the
# "sparsecore" thread whose computation is the collective, its call-done later, a kernel between the two
SPARSE_CORE_REDUCE_SCATTER = """HloModule sparse_core_reduce_scatter, is_scheduled=true, num_partitions=8

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%offloaded (p0: bf16[2048,4,64], p1: token[]) -> bf16[256,4,64] {
  %p1 = token[] parameter(1)
  %p0 = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)} parameter(0)
  ROOT %reduce-scatter.7 = bf16[256,4,64]{0,2,1:T(8,128)(2,1)} reduce-scatter(%p0), channel_id=5, \
replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}, execution_thread="sparsecore"

%exp (e0: f32[%N%]) -> f32[%N%] {
  %e0 = f32[%N%]{0} parameter(0)
  ROOT %e = f32[%N%]{0} exponential(%e0)
}

ENTRY %main (g: bf16[2048,4,64], y: f32[%N%]) -> (bf16[256,4,64], f32[%N%]) {
  %g = bf16[2048,4,64]{0,2,1:T(8,128)(2,1)} parameter(0)
  %y = f32[%N%]{0} parameter(1)
  %prepare_start = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %prepare_done = token[] custom-call(%prepare_start), custom_call_target="PrepareAsyncCallDone"
  %reduce-scatter.7.call-start = ((bf16[2048,4,64]{0,2,1:T(8,128)(2,1)}, token[]), \
bf16[256,4,64]{0,2,1:T(8,128)(2,1)}) call-start(%g, %prepare_done), async_execution_thread="sparsecore", \
to_apply=%offloaded
  %beside = f32[%N%]{0} fusion(%y), kind=kLoop, calls=%exp
  %reduce-scatter.7.call-done = bf16[256,4,64]{0,2,1:T(8,128)(2,1)} call-done(%reduce-scatter.7.call-start)
  ROOT %out = (bf16[256,4,64]{0,2,1:T(8,128)(2,1)}, f32[%N%]{0}) tuple(%reduce-scatter.7.call-done, %beside)
}
"""


@pytest.mark.parametrize("elements", [1024, 4 * 2**20])  # the kernel beside it: shorter, then longer
def test_a_collective_offloaded_to_the_sparse_cores_overlaps_the_kernels_beside_it(elements):
    target = roofline.TPU_V6E
    module = hlo.Module(SPARSE_CORE_REDUCE_SCATTER.replace("%N%", str(elements)))
    kernels = {k.name: k for k in roofline.kernels(module, target, 8)}  # the prepare calls launch nothing
    assert set(kernels) == {"reduce-scatter.7.call-start", "beside"}
    scatter, beside = kernels["reduce-scatter.7.call-start"], kernels["beside"]
    assert (scatter.kind, scatter.comm_bytes) == ("reduce-scatter", 7 * 256 * 4 * 64 * 2)  # a ring over 8 chips
    assert scatter.seconds == scatter.comm_bytes / target.link_bytes_per_s
    assert scatter.exposed_seconds == pytest.approx(max(0.0, scatter.seconds - beside.seconds))
    summary = roofline.summarize(list(kernels.values()), target, 1.0)
    assert summary["step_seconds"] == pytest.approx(beside.seconds + scatter.exposed_seconds)


# XLA:TPU's all-reduce-scatter fusion (a gradient's reduce-scatter over FSDP's chips when the collective matmul
# is off): the whole gradient all-reduced in the fusion's body, each chip keeping its slice
REDUCE_SCATTER_FUSION = """HloModule reduce_scatter, is_scheduled=true, num_partitions=8

%all-reduce-scatter.1 (input_0: bf16[2048,256]) -> bf16[256,256] {
  %input_0 = bf16[2048,256]{1,0:T(8,128)(2,1)} parameter(0)
  %all-reduce.1 = bf16[2048,256]{1,0:T(8,128)(2,1)} all-reduce(%input_0), channel_id=1, \
replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %pid = u32[] partition-id()
  %c = u32[] constant(256)
  %offset = u32[] multiply(%pid, %c)
  %zero = u32[] constant(0)
  ROOT %ds = bf16[256,256]{1,0:T(8,128)(2,1)} dynamic-slice(%all-reduce.1, %offset, %zero), \
dynamic_slice_sizes={256,256}
}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

ENTRY %main (g: bf16[2048,256]) -> bf16[256,256] {
  %g = bf16[2048,256]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %fusion.1 = bf16[256,256]{1,0:T(8,128)(2,1)S(1)} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1
}
"""


def test_a_fused_all_reduce_scatter_is_the_reduce_scatter_it_is():
    target = roofline.TPU_V6E
    (kernel,) = roofline.kernels(hlo.Module(REDUCE_SCATTER_FUSION), target, 8)
    shard = 256 * 256 * 2
    assert (kernel.kind, kernel.comm_bytes) == ("reduce-scatter", (8 - 1) * shard)  # a ring over the 8 chips
    assert kernel.exposed_seconds == kernel.seconds == kernel.comm_bytes / target.link_bytes_per_s  # synchronous


# Memory-space assignment's prefetch of a weight into on-chip memory (S(1)) beside a square matmul that
# leaves HBM idle part of its time (%between), then a matmul that reads the prefetched weight from on-chip memory
PREFETCH = """HloModule prefetch, is_scheduled=true

%matmul (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {
  %p0 = bf16[4096,4096]{1,0} parameter(0)
  %p1 = bf16[4096,4096]{1,0} parameter(1)
  ROOT %dot = bf16[4096,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%onchip (q0: bf16[4096,4096], q1: bf16[4096,4096]) -> bf16[4096,4096] {
  %q0 = bf16[4096,4096]{1,0} parameter(0)
  %q1 = bf16[4096,4096]{1,0:S(1)} parameter(1)
  ROOT %dot2 = bf16[4096,4096]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%exp (e0: f32[4096,4096]) -> f32[4096,4096] {
  %e0 = f32[4096,4096]{1,0} parameter(0)
  ROOT %e = f32[4096,4096]{1,0} exponential(%e0)
}

ENTRY %main (x: bf16[4096,4096], w: bf16[4096,4096], v: bf16[4096,4096], y: f32[4096,4096]) -> bf16[4096,4096] {
  %x = bf16[4096,4096]{1,0} parameter(0)
  %w = bf16[4096,4096]{1,0} parameter(1)
  %v = bf16[4096,4096]{1,0} parameter(2)
  %y = f32[4096,4096]{1,0} parameter(3)
  %cs = (bf16[4096,4096]{1,0:S(1)}, bf16[4096,4096]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %between = bf16[4096,4096]{1,0} fusion(%x, %v), kind=kOutput, calls=%matmul
  %cd = bf16[4096,4096]{1,0:S(1)} copy-done(%cs)
  ROOT %after = bf16[4096,4096]{1,0} fusion(%between, %cd), kind=kOutput, calls=%onchip
}
"""


def test_a_prefetch_into_on_chip_memory_overlaps_the_slack_of_the_kernels_beside_it():
    """XLA:TPU's asynchronous copies share HBM with the kernels: a copy between copy-start and copy-done is hidden
    only by the time those kernels leave HBM idle (their slack), never by their own HBM traffic, and two copies
    in flight share that slack; on-chip operands cost a kernel no HBM bytes."""
    target, size = roofline.TPU_V6E, 4096 * 4096 * 2
    kernels = {k.name: k for k in roofline.kernels(hlo.Module(PREFETCH), target, 1)}
    copy, between, after = kernels["cs"], kernels["between"], kernels["after"]
    assert (copy.kind, copy.dma, copy.bytes) == ("copy", True, size)  # read from HBM once
    assert copy.seconds == size / target.hbm_bytes_per_s and copy.exposed_seconds == 0.0
    assert after.bytes == 2 * size  # its input and output; the weight is read on chip
    flops = 2 * 4096**3
    assert between.seconds == flops / target.peak("bf16") > 3 * size / target.hbm_bytes_per_s  # compute-bound
    summary = roofline.summarize(list(kernels.values()), target, model_flops_per_device=2 * flops)
    assert summary["compute_seconds"] == between.seconds + after.seconds  # the prefetch hidden
    assert summary["by_kind"]["copy"]["seconds"] == copy.seconds

    # memory-bound between start and done: no slack, the step waits for the whole copy
    bound = PREFETCH.replace("%between = bf16[4096,4096]{1,0} fusion(%x, %v), kind=kOutput, calls=%matmul",
                             "%between = f32[4096,4096]{1,0} fusion(%y), kind=kLoop, calls=%exp")
    bound = bound.replace("fusion(%between, %cd)", "fusion(%x, %cd)")
    kernels = {k.name: k for k in roofline.kernels(hlo.Module(bound), target, 1)}
    assert kernels["cs"].exposed_seconds == kernels["cs"].seconds
    summary = roofline.summarize(list(kernels.values()), target, model_flops_per_device=flops)
    assert summary["compute_seconds"] == pytest.approx(kernels["between"].seconds + kernels["after"].seconds
                                                       + kernels["cs"].seconds)

    # two copies in flight: the slack covers the first fully, the second with what is left, not twice
    two = PREFETCH.replace("  %between", "  %cs2 = (bf16[4096,4096]{1,0:S(1)}, bf16[4096,4096]{1,0}, u32[]{:S(2)}) "
                                         "copy-start(%v)\n  %between")
    two = two.replace("  %cd = ", "  %cd2 = bf16[4096,4096]{1,0:S(1)} copy-done(%cs2)\n  %cd = ")
    for n in (2, 4):  # two copies, then two four times bigger, in the same matmul's slack
        text = two if n == 2 else two.replace("bf16[4096,4096]{1,0:S(1)}", "bf16[4096,16384]{1,0:S(1)}")
        kernels = {k.name: k for k in roofline.kernels(hlo.Module(text), target, 1)}
        first, second, between = kernels["cs"], kernels["cs2"], kernels["between"]
        slack = between.seconds - between.bytes / target.hbm_bytes_per_s
        need = first.seconds + second.seconds
        assert first.exposed_seconds + second.exposed_seconds == pytest.approx(max(0.0, need - slack))
        assert first.exposed_seconds == pytest.approx(max(0.0, first.seconds - slack))


TPU_COMPILER = sys.executable if HAVE_LIBTPU else str(TPU_PYTHON)


@pytest.mark.skipif(not (HAVE_LIBTPU or TPU_PYTHON.exists()),
                    reason="the TPU compiler environment is not installed (make tpu-env)")
def test_tinys_train_step_compiles_for_four_v5p_chips():
    """The tiny recipe compiled for a v5p:2x2x1 slice: four chips of a TPU v5, its memory against 95 GiB,
    the state sharded over them (fsdp=4: a quarter of it per chip, gathered asynchronously and reduced over
    ICI), and a roofline whose matmuls are the model's count plus, from splash attention's kernels, the masked
    half of their one block and what their backward recomputes, exactly."""
    result = subprocess.run([TPU_COMPILER, "-m", "jaxlm.plan", "--config=configs/tiny.py", "--target=v5p",
                             "--topology=v5p:2x2x1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip() == "", result.stderr[-2000:]  # libtpu's warnings silenced
    report = json.loads(result.stdout)
    compiled, r = report["compiled"], report["compiled"]["roofline"]
    assert (compiled["platform"], compiled["device_kind"], compiled["num_devices"]) == ("tpu", "TPU v5", 4)
    assert report["mesh"]["fsdp"] == 4 and report["platform"] == "tpu" and compiled["attention"] == "splash"
    assert report["device_memory_bytes"] == 95 * GIB and report["fits"] and report["decided_by"] == "compiled"
    assert 0 < compiled["per_device_bytes"] == report["per_device_bytes"] < GIB
    state = sum(row["total_bytes"] for row in report["analytic"]["rows"]
                if row["name"] in ("parameters", "optimizer state"))
    # sharded: a quarter of the parameters and optimizer state per chip (with the batch, and TPU tiles padding
    # tiny's narrow dims) is well under half of them
    assert compiled["argument_bytes"] < 0.5 * state
    assert r["unknown_trip_counts"] == 0 and r["host_syncs"] == 0
    assert {"gemm", "attention", "attention backward", "all-gather"} <= set(r["by_kind"]) and r["communication_seconds"] > 0
    # run.libtpu_flags' default makes fsdp's all-gathers asynchronous: part of their time hidden by the kernels
    # between their start and done (synchronous ones, XLA:TPU's default on v5p, are exposed whole)
    gather = r["by_kind"]["all-gather"]
    assert gather["exposed_seconds"] < gather["seconds"]
    from jaxlm import config as config_lib

    m = config_lib.load_recipe("tiny").model
    tokens_per_device = 16 * 128 / 4
    # splash's one 128 x 128 block per row computes the whole square, of which the model counts the causal half
    causal_half = 6 * m.n_layers * 128 * m.n_heads * (m.head_dim or m.d_model // m.n_heads) * tokens_per_device
    # the fused backward recomputes the scores, 1 of its 5 matmuls: a third of the masked halves (the forward's 2
    # and the backward's 4 model matmuls, each half masked: 3 matmuls' worth)
    assert r["attention_recompute_flops"] == causal_half / 3
    assert r["matmul_flops"] == pytest.approx(r["model_flops"] + causal_half + r["attention_recompute_flops"], rel=1e-9)
    assert 0 < r["roofline_mfu"] <= 1


@pytest.mark.skipif(not (HAVE_LIBTPU or TPU_PYTHON.exists()),
                    reason="no libtpu: `make tpu-env` installs it (the TPU compiler, 1.8 GB)")
def test_tinys_train_step_compiles_for_two_v5p_slices_with_data_across_them():
    """Two v5p:2x2x1 slices joined over DCN (`--slices=2`, mesh.hybrid=slice): data across the slices, fsdp within
    each, one slice's program compiled, the gradients' reduction across slices sent over DCN (the megascale
    runtime's transfers, at the network's bandwidth) and the fsdp collectives over ICI."""
    result = subprocess.run([TPU_COMPILER, "-m", "jaxlm.plan", "--config=configs/tiny.py", "--target=v5p",
                             "--topology=v5p:2x2x1", "--slices=2", "--json"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert (report["num_devices"], report["slices"], report["topology"]) == (8, 2, "v5p:2x2x1")
    assert (report["mesh"]["data"], report["mesh"]["fsdp"]) == (2, 4) and report["compiled"]["num_devices"] == 8
    r = report["compiled"]["roofline"]
    gather = r["by_kind"]["all-gather"]  # fsdp's, within each slice
    assert gather["seconds"] == pytest.approx(gather["bytes"] / roofline.TPU_V5P.link_bytes_per_s, rel=1e-9)
    # across the slices: the gradients' all-reduce over data, at DCN's bandwidth (a ring over 2 slices sends each
    # chip's gradient shard once)
    assert r["network_seconds"] == pytest.approx(r["network_bytes"] / roofline.TPU_V5P.network_bytes_per_s, rel=1e-9)
    assert 0 < r["network_bytes"] <= r["by_kind"]["all-reduce"]["bytes"]
    state = sum(row["total_bytes"] for row in report["analytic"]["rows"] if row["name"] == "parameters")
    assert r["network_bytes"] >= state / 4 / 2  # at least the bf16 gradients of a quarter (fsdp=4) of the parameters
    assert r["matmul_flops"] > r["model_flops"] and r["roofline_mfu"] is not None


@pytest.mark.skipif(not (HAVE_LIBTPU or TPU_PYTHON.exists()),
                    reason="no libtpu: `make tpu-env` installs it (the TPU compiler, 1.8 GB)")
def test_the_sparse_core_option_makes_v6es_gradient_reduce_scatters_asynchronous():
    """tiny on four v6e chips (fsdp 4): under `run.libtpu_flags`' default XLA:TPU reduce-scatters the gradients
    synchronously (all-reduce-scatter fusions, exposed whole); with `xla_flags.LIBTPU_SPARSE_CORE_REDUCE_SCATTER`
    beside it the SparseCores run them beside the TensorCore's kernels, and the roofline reads them so."""
    scatters = {}
    for name, flags in (("default", xla_flags.LIBTPU_DEFAULT),
                        ("sparse cores", f"{xla_flags.LIBTPU_DEFAULT} {xla_flags.LIBTPU_SPARSE_CORE_REDUCE_SCATTER}")):
        result = subprocess.run([TPU_COMPILER, "-m", "jaxlm.plan", "--config=configs/tiny.py", "--target=v6e",
                                 "--topology=v6e:2x2", "--json", f"--config.run.libtpu_flags={flags}"], cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout)
        assert report["mesh"]["fsdp"] == 4
        scatters[name] = report["compiled"]["roofline"]["by_kind"]["reduce-scatter"]
    assert scatters["default"]["seconds"] > 0
    assert scatters["default"]["exposed_seconds"] == pytest.approx(scatters["default"]["seconds"], rel=1e-9)
    assert scatters["sparse cores"]["kernels"] > scatters["default"]["kernels"]  # offloaded one by one
    assert 0 <= scatters["sparse cores"]["exposed_seconds"] < 0.9 * scatters["sparse cores"]["seconds"]


def test_a_program_xla_tpu_refuses_for_its_size_is_one_line_that_says_what_to_change():
    """XLA:TPU checks the program's buffers against the chip's HBM while compiling and refuses one that does not
    fit (XLA:GPU compiles it and leaves the verdict to the plan): `jaxlm.plan` says so in one line, and --choose
    records it as a candidate that does not fit."""
    refusal = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                           "temporaries (96.63G) exceeds available HBM (95.74G).")
    error = plan._too_large(refusal, "tpu", roofline.TPU_V5P)
    assert isinstance(error, plan.ProgramTooLarge) and error.needed_bytes == 96.63 * GIB
    assert str(error).startswith("XLA refuses to compile the train step for v5p: its HLO temporaries need 96.63 GiB")
    assert "optim.micro_batches" in str(error) and "model.remat" in str(error)
    assert plan._too_large(RuntimeError("INTERNAL: something else"), "tpu", roofline.TPU_V5P) is None
    if not (HAVE_LIBTPU or TPU_PYTHON.exists()):
        return  # the compiler's own refusal needs libtpu (make tpu-env)
    result = subprocess.run([TPU_COMPILER, "-m", "jaxlm.plan", "--config=configs/tiny.py", "--target=v5p",
                             "--topology=v5p:1x1x1", "--config.data.global_batch_size=16384",
                             "--config.optim.micro_batches=1", "--config.data.seq_len=1024"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxlm: error: XLA refuses to compile the train step for v5p"), lines


NORM_FUSION_SCRIPT = """
import json, re
import jax
from jaxlm import config as config_lib, hlo, mesh as mesh_lib, roofline, train_setup, xla_flags
xla_flags.apply_libtpu(xla_flags.LIBTPU_DEFAULT)
roofline.quiet_libtpu()
jax.config.update("jax_enable_compilation_cache", False)
devices = roofline.tpu_devices(roofline.TPU_V5P, 4, "v5p:2x2x1")
with mesh_lib.planned_devices(devices):
    text = train_setup.build(config_lib.load_recipe("tiny"), devices, abstract=True).compile_train_step(None).as_text()
m = hlo.Module(text)
found = []  # a forward projection of a norm's output ([b, t, d] x [d, ...]): the operands of its matmul's fusion
for comp, insts in m.computations.items():
    for inst in insts:
        if comp in m.fused or inst["op"] != "fusion":
            continue
        for op, _ in roofline._fused_dots(m, m.callee(inst)):  # its matmuls (XLA:TPU's convolutions), nested too
            name = re.search(r'op_name="([^"]*)"', op["attrs"])
            if op["op"] == "convolution" and name and "transpose(" not in name.group(1) \\
                    and re.search(r"btd,d\\w+->bt\\w+\\)?/dot_general$", name.group(1)):
                found.append([name.group(1), [m.shapes.get(o.split()[-1].lstrip("%"), "").split("{")[0]
                                              for o in inst["operands"]]])
                break
print(json.dumps(found))
"""


@pytest.mark.skipif(not (HAVE_LIBTPU or TPU_PYTHON.exists()),
                    reason="no libtpu: `make tpu-env` installs it (the TPU compiler, 1.8 GB)")
def test_xla_tpu_scales_a_norms_input_inside_the_next_matmul_as_the_planner_counts():
    """The planner counts each norm's input and its rows' float32 statistic on TPUs, not its output
    (`memory.norm_outputs_kept`): XLA:TPU scales the input inside the matmul fusion of every projection that
    reads the norm (q, k, v, gate, up and the unembedding), so the normalized activation is never written. Read
    from tiny's train step compiled for four v5p chips: each such fusion takes the [rows, tokens] statistic and
    the [rows, tokens, d_model] input."""
    from jaxlm import memory

    assert not memory.norm_outputs_kept("tpu") and memory.norm_outputs_kept("gpu") and memory.norm_outputs_kept("cpu")
    result = subprocess.run([TPU_COMPILER, "-c", NORM_FUSION_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    rows, tokens, width = 16 // 4, 128, 128  # tiny: 16 sequences of 128 tokens over fsdp=4, d_model 128
    names = {re.sub(r".*[(/]", "", name.removesuffix(")/dot_general").removesuffix("/dot_general")) for name, _ in found}
    assert {"btd,dnh->btnh", "btd,dkh->btkh", "btd,df->btf", "btd,dv->btv"} <= names, names
    for name, operands in found:
        assert f"f32[{rows},{tokens}]" in operands, (name, operands)  # the statistic
        assert f"bf16[{rows},{tokens},{width}]" in operands, (name, operands)  # the norm's input
