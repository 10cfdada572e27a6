"""Compressing a trained model (`python -m jaxlm.compress`, `jaxlm.quant`, `jaxlm.compress.prune`).

The formats: every format quantizes and dequantizes within its documented bound on random weights,
on outliers and on all-zero groups, the codes really are packed (int4 two to a byte, int3 eight to
three bytes) and unpack exactly; fake quantization computes the stored format's weight and passes the
gradient straight through. Pruning: N:M masks keep exactly N of every M, unstructured ones the exact
count. A compressed run directory evaluates to the loss its report states, exports to weights
transformers computes identically with, and fine-tunes from `run.init_from` with its pruned weights
exactly zero; QAT trains, then compresses into the integer format computing what it trained;
gradual pruning reaches its sparsity on schedule. GPTQ's own tests are in tests/test_gptq.py.
"""

import json
import math

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from command_forks import run_command
from flax import nnx

from jaxlm import inference, pruning_masks, quant
from jaxlm.compress import cli, prune
from jaxlm.errors import UserError

FORMATS = [("nf4", True), ("int8", True), ("int8", False), ("int4", True), ("int4", False), ("int3", True),
           ("int3", False)]


def roundtrip(w, spec, axis):
    return np.asarray(quant.dequantize(quant.quantize(jnp.asarray(w), spec, axis), spec, axis))


def group_range(w, axis, g, symmetric):
    """Each element's group absmax (symmetric) or range with 0 (asymmetric), w's shape."""
    grouped = w.reshape(*w.shape[:axis], w.shape[axis] // g, g, *w.shape[axis + 1:])
    if symmetric:
        r = np.abs(grouped).max(axis=axis + 1)
    else:
        r = np.maximum(grouped.max(axis=axis + 1), 0) - np.minimum(grouped.min(axis=axis + 1), 0)
    return np.repeat(r, g, axis=axis)


# ----------------------------------------------------------------------------- the formats


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_codes_pack_into_bytes_and_unpack_exactly(bits):
    codes = np.random.default_rng(bits).integers(0, 2 ** bits, (16, 24, 8)).astype(np.uint8)
    for axis in range(3):
        packed = quant.pack(jnp.asarray(codes), axis, bits)
        assert packed.dtype == jnp.uint8 and packed.shape[axis] == codes.shape[axis] * bits // 8
        np.testing.assert_array_equal(quant.unpack(packed, axis, bits), codes)
    # int3: eight codes as one little-endian 24-bit number, code k in bits 3k..3k+2
    packed = np.asarray(quant.pack(jnp.arange(8, dtype=jnp.uint8), 0, 3))
    assert int(packed[0]) | int(packed[1]) << 8 | int(packed[2]) << 16 == sum(k << (3 * k) for k in range(8))
    with pytest.raises(ValueError, match="not a multiple of 8"):
        quant.pack(jnp.zeros((12,), jnp.uint8), 0, 3)


@pytest.mark.parametrize("fmt, symmetric", FORMATS)
@pytest.mark.parametrize("shape, axis, group, used", [((256, 24), 0, 64, 64), ((12, 8, 40), 1, 128, 8),
                                                      ((6, 96), 1, 0, 96)])
def test_dequantization_is_within_the_bound_with_outliers_and_zero_groups(fmt, symmetric, shape, axis, group, used):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    w.reshape(-1)[:: 97] *= 30  # outliers, as trained weights have
    zero = [slice(0, 1)] * len(shape)
    zero[axis] = slice(0, used)  # one group of one row
    w[tuple(zero)] = 0  # an all-zero group (a pruned row)
    if not symmetric:
        w += 0.01  # a group that is not centred on 0
    spec = quant.QuantSpec(fmt, group, symmetric=symmetric)
    leaves = quant.quantize(jnp.asarray(w), spec, axis)
    assert set(leaves) == set(spec.keys)
    assert leaves["q"].dtype == jnp.uint8 and leaves["q"].shape[axis] == shape[axis] * spec.bits // 8
    assert leaves["scale"].shape[axis] == shape[axis] // used
    back = roundtrip(w, spec, axis)
    error = np.abs(back - w)
    bound = quant.error_bound(spec) * group_range(w, axis, used, symmetric)
    assert np.all(error <= bound * (1 + 1e-5) + 1e-9)
    assert (error / np.maximum(bound, 1e-12)).max() > 0.4  # and the bound is not loose
    assert np.all(back[tuple(zero)] == 0) if symmetric else True  # an all-zero group stays exactly zero
    assert np.all(back[w == 0] == 0) or not symmetric  # zero is a level of every symmetric format
    expected = {"nf4": 0.1519, "int8": 1 / 254, "int4": 1 / 14, "int3": 1 / 6}[fmt] if symmetric else \
        1 / (2 * (2 ** spec.bits - 1))
    assert quant.error_bound(spec) == pytest.approx(expected, abs=1e-4)


def test_asymmetric_formats_keep_zero_exact_and_use_every_level():
    w = jnp.asarray(np.linspace(-0.1, 0.7, 64, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32))
    spec = quant.QuantSpec("int3", 0, symmetric=False)
    leaves = quant.quantize(jnp.where(jnp.abs(w) < 0.006, 0.0, w), spec, 0)
    codes = np.asarray(quant.unpack(leaves["q"], 0, 3))
    assert set(codes[:, 0].tolist()) == set(range(8))  # 2^3 levels, all used
    back = np.asarray(quant.dequantize(leaves, spec, 0))
    assert np.all(back[np.abs(np.asarray(w)) < 0.006] == 0)


def test_storage_bits_per_weight():
    assert quant.QuantSpec("int4", 128).bits_per_weight() == 4 + 32 / 128
    assert quant.QuantSpec("int3", 128, symmetric=False).bits_per_weight() == 3 + 40 / 128
    assert quant.QuantSpec("int8", 0).bits_per_weight(4096) == 8 + 32 / 4096
    with pytest.raises(ValueError, match="odd"):
        quant.group_size(quant.QuantSpec("int4", 3), 9)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.group_size(quant.QuantSpec("int3", 4), 12)


def test_fake_quantization_is_the_stored_weight_forward_and_the_identity_backward():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((64, 5)).astype(np.float32))
    spec = quant.QuantSpec("int4", 32, symmetric=False)
    floats.close(quant.fake_quantize(w, spec, 0), roundtrip(w, spec, 0))  # another program: w + (decoded - w)
    grad = jax.grad(lambda w: jnp.sum(quant.fake_quantize(w, spec, 0) * jnp.arange(5.0)))(w)
    # the identity backward: the cotangent passes through as it came
    floats.identical(grad, jnp.broadcast_to(jnp.arange(5.0), w.shape), why=floats.MOVED)


def test_fake_quantization_of_a_short_last_group_sharded_along_its_groups():
    """QAT on a width the group does not divide (688 in groups of 64: ten whole, one of 48), the grouped
    axis split over 8 devices (86 rows each, so groups straddle shards): the forward weight is the one
    the stored format holds (the last group zero-padded, as `quantize` pads it), on the sharded array as
    on the whole one, and the gradient passes through."""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    w = np.random.default_rng(5).standard_normal((688, 16)).astype(np.float32)
    spec = quant.QuantSpec("int4", 64, symmetric=False)
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("fsdp",), axis_types=(AxisType.Auto,))  # as `mesh.make_mesh`
    sharded = jax.device_put(w, NamedSharding(mesh, PartitionSpec("fsdp", None)))
    fake = jax.jit(lambda w: quant.fake_quantize(w, spec, 0))
    out = fake(sharded)
    floats.close(out, roundtrip(jnp.asarray(w), spec, 0))
    padded = np.concatenate([w, np.zeros((704 - 688, 16), np.float32)])  # the last group as the stored format pads it
    floats.close(out, np.asarray(roundtrip(jnp.asarray(padded), spec, 0))[:688])
    assert quant.group_params(jnp.asarray(w), spec, 0)["scale"].shape == (11, 16)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(quant.fake_quantize(w, spec, 0) * jnp.arange(16.0))))(sharded)
    floats.identical(grad, jnp.broadcast_to(jnp.arange(16.0), w.shape), why=floats.MOVED)


# ----------------------------------------------------------------------------- pruning masks


def test_nm_masks_keep_exactly_n_of_every_m_the_largest():
    score = jnp.asarray(np.random.default_rng(4).random((64, 7)).astype(np.float32))
    mask = np.asarray(prune.nm_mask(score, 2, 4))
    groups = mask.reshape(16, 4, 7)
    assert np.all(groups.sum(axis=1) == 2)
    s = np.asarray(score).reshape(16, 4, 7)
    assert np.all(np.where(groups, s, np.inf).min(axis=1) >= np.where(groups, -np.inf, s).max(axis=1))


def test_unstructured_masks_prune_the_exact_count_per_matrix_per_output_and_globally():
    rng = np.random.default_rng(5)
    score = jnp.asarray(rng.random((40, 6)).astype(np.float32))
    mask = np.asarray(prune.unstructured_mask(score, 0.3))
    assert (~mask).sum() == math.floor(0.3 * 240)
    assert np.asarray(score)[~mask].max() < np.asarray(score)[mask].min()
    per_output = np.asarray(prune.unstructured_mask(score, 0.5, per_output=True))
    assert np.all((~per_output).sum(axis=0) == 20)
    a, b = jnp.asarray(rng.random((10, 10))), jnp.asarray(rng.random((30,)) * 0.5)
    t = prune.global_threshold([a, b], 0.5)
    assert int(jnp.sum(a < t) + jnp.sum(b < t)) == 65
    # gradual pruning's schedule: 0 at the start, the target at the end, cubic between
    assert float(pruning_masks.sparsity_at(10, 0.8, 10, 20)) == 0
    assert float(pruning_masks.sparsity_at(20, 0.8, 10, 20)) == pytest.approx(0.8)
    assert float(pruning_masks.sparsity_at(15, 0.8, 10, 20)) == pytest.approx(0.8 * (1 - 0.5 ** 3))


# ----------------------------------------------------------------------------- a compressed run directory


def _logits(run, tokens):
    return np.asarray(jax.jit(lambda p, t: nnx.merge(run.model_spec.graphdef, p)(t))(run.params, tokens))


def _kernel_bytes(params, names=("attn", "mlp")):
    return sum(x.nbytes for k in names for x in jax.tree.leaves(params["blocks"][k]) if x.ndim > 1)


@pytest.fixture(scope="module")
def int4_run(facts_run, tmp_path_factory):
    from test_evaluate import task_lines

    root = tmp_path_factory.mktemp("compressed")
    tasks = root / "likes.jsonl"
    tasks.write_text("".join(json.dumps(line) + "\n" for line in task_lines()))
    report = cli.compress_run(facts_run, root / "int4", [("compress.quantize", "int4"), ("compress.group", "32"),
                                                         ("compress.targets", "blocks,embed")],
                              gen_tokens=4, tasks=[str(tasks)])
    return root / "int4", report


@pytest.mark.slow  # the default suite's 10-minute budget; make test-slow runs it (with its int4 run)
def test_a_quantized_run_directory_evaluates_and_holds_its_kernels_in_4_bits(facts_run, int4_run):
    from jaxlm import evaluate

    out, report = int4_run
    run = inference.load_run(out)
    source = inference.load_run(facts_run)
    wq = run.params["blocks"]["attn"]["wq"]
    assert wq["kernel_q"].dtype == jnp.uint8 and wq["kernel_q"].shape == (2, 32, 4, 16) and "kernel" not in wq
    # on the device: 4 bits + a float32 scale per 32 weights (wo's head_dim of 16: one per 16), against
    # float32's 32 bits (a quarter of bfloat16's 16 bits is 4)
    ratio = _kernel_bytes(run.params) / _kernel_bytes(source.params)
    assert 4.5 / 32 < ratio < 5.2 / 32, ratio
    assert report["after"]["device_bytes"] == sum(x.nbytes for x in jax.tree.leaves(run.params))
    assert report["before"]["parameters"] == report["after"]["parameters"]
    # the report's loss is the one evaluate gives the directory, and near the source's
    docs, _ = evaluate.corpus_documents(run, "val", max_tokens=200_000)
    assert evaluate.perplexity(run, docs)["loss"] == pytest.approx(report["after"]["corpus"]["loss"], rel=1e-6)
    assert report["before"]["corpus"]["loss"] == pytest.approx(evaluate.perplexity(source, docs)["loss"], rel=1e-6)
    assert abs(report["after"]["corpus"]["loss"] - report["before"]["corpus"]["loss"]) < 0.05
    # the facts survive 4 bits: every multiple-choice answer still right; speed measured both sides
    assert report["before"]["tasks"]["likes"]["acc"] == report["after"]["tasks"]["likes"]["acc"] == 1.0
    assert report["before"]["generation"]["tokens_per_second"] > 0 < report["after"]["generation"]["tokens_per_second"]
    assert report["disk_bytes"]["checkpoint"] < report["disk_bytes"]["source_checkpoint"]
    saved = json.loads((out / "compress_report.json").read_text())
    floats.identical(saved["after"]["corpus"]["loss"], report["after"]["corpus"]["loss"], why=floats.MOVED)
    assert "| loss (val) |" in (out / "compress_report.md").read_text()
    # the model computes with exactly the round-to-nearest weights of the source's kernels
    spec = run.model_cfg.stored_quant
    w = jax.vmap(lambda k: quant.dequantize(quant.quantize(k, spec, 0), spec, 0))(
        source.params["blocks"]["mlp"]["w_up"]["kernel"])
    stored = {k[len("kernel_"):]: v for k, v in run.params["blocks"]["mlp"]["w_up"].items()}
    floats.close(jax.vmap(lambda x: quant.dequantize(x, spec, 0))(stored), w)  # the CLI's program against this one
    # the embedding, named in the targets: 4-bit codes grouped along its width, round to nearest; a lookup
    # dequantizes the rows it gathers, which are the table's rows
    embed = run.params["embed"]
    assert set(embed) == {"embedding_q", "embedding_scale"} and embed["embedding_q"].shape == (300, 32)
    table = quant.dequantize({k[len("embedding_"):]: v for k, v in embed.items()}, spec, 1)
    table_source = source.params["embed"]["embedding"]
    floats.close(table, quant.dequantize(quant.quantize(table_source, spec, 1), spec, 1))
    assert 0 < float(jnp.max(jnp.abs(table - table_source))) <= quant.error_bound(spec) * float(
        jnp.max(jnp.abs(table_source)))
    model = nnx.merge(run.model_spec.graphdef, run.params)
    ids = jnp.array([[3, 0, 299, 17]])
    floats.close(model.embed(ids), jnp.take(table.astype(model.embed.dtype), ids, axis=0))  # gather, then decode
    assert report["targets"] == ["embed", "w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]


@pytest.mark.slow  # the default suite's 10-minute budget; make test-slow runs it
def test_a_compressed_run_exports_the_weights_it_computes_with(int4_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from jaxlm import hf

    out, _ = int4_run
    exported = hf.export_run(out, tmp_path / "hf", dtype="float32")
    run = inference.load_run(out, dtype="float32")
    tokens = np.array([[1, 5, 9, 20, 33, 7, 2, 11]], np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.detach().numpy()
    np.testing.assert_allclose(theirs, _logits(run, tokens), atol=1e-4, rtol=0)


def _train(args):
    from tiny_run import ONE_DEVICE, ROOT

    return run_command("train", args, cwd=ROOT, env=ONE_DEVICE, timeout=600)


@pytest.mark.slow  # 12 s: the default suite's budget (make test-slow runs it)
def test_a_pruned_run_fine_tunes_with_its_pruned_weights_exactly_zero(facts_run, tmp_path):
    from tiny_run import finetune_args

    pruned = tmp_path / "pruned"
    report = cli.compress_run(facts_run, pruned, [("compress.sparsity", "0.5"), ("compress.pattern", "2:4")],
                              gen_tokens=0, corpus="none")
    assert report["after"]["sparsity"] == 0.5 and report["after"]["pruned"] == report["after"]["weights"] // 2
    before = inference.load_run(pruned)
    mask = np.asarray(before.params["blocks"]["mlp"]["w_down"]["kernel_mask"])  # [layers, mlp, embed]
    assert mask.dtype == bool and np.all(mask.reshape(2, 32, 4, 64).sum(axis=2) == 2)  # 2 of every 4 inputs
    result = _train(finetune_args(tmp_path, pruned, "tuned", steps=4))
    assert result.returncode == 0, result.stderr[-3000:]
    tuned = inference.load_run(tmp_path / "tuned")
    assert tuned.cfg.compress.sparsity == 0.5 and tuned.cfg.compress.pattern == "2:4"  # the structure passes on
    for name, module in (("mlp", "w_down"), ("attn", "wq")):
        old, new = before.params["blocks"][name][module], tuned.params["blocks"][name][module]
        np.testing.assert_array_equal(new["kernel_mask"], old["kernel_mask"])
        kernel = np.asarray(new["kernel"])
        assert np.all(kernel[~np.asarray(old["kernel_mask"])] == 0)  # pruned: exactly zero after training
        assert not np.array_equal(kernel, np.asarray(old["kernel"]))  # the rest trained
    # stopped at step 4 and run on to 6: it resumes from its own checkpoint (masks, kernels, moments), and
    # the pruned weights stay zero through the resumed steps
    result = _train(finetune_args(tmp_path, pruned, "tuned", steps=6))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from step 4" in result.stdout + result.stderr
    resumed = inference.load_run(tmp_path / "tuned")
    assert resumed.step == 6
    records = [json.loads(line) for line in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each step trained once
    for name, module in (("mlp", "w_down"), ("attn", "wq")):
        mask = np.asarray(before.params["blocks"][name][module]["kernel_mask"])
        new = resumed.params["blocks"][name][module]
        np.testing.assert_array_equal(new["kernel_mask"], mask)
        kernel = np.asarray(new["kernel"])
        assert np.all(kernel[~mask] == 0)
        assert not np.array_equal(kernel, np.asarray(tuned.params["blocks"][name][module]["kernel"]))


@pytest.mark.slow
def test_quantization_aware_training_compresses_into_the_model_it_trained(facts_run, tmp_path):
    from tiny_run import finetune_args

    result = _train(finetune_args(tmp_path, facts_run, "qat", "--config.compress.quantize=int4",
                                  "--config.compress.group=16", "--config.compress.qat=true",
                                  "--config.compress.targets=blocks,embed", steps=4))
    assert result.returncode == 0, result.stderr[-3000:]
    qat = inference.load_run(tmp_path / "qat", dtype="float32")
    assert qat.params["blocks"]["attn"]["wq"]["kernel"].dtype == jnp.float32  # trains float kernels
    report = cli.compress_run(tmp_path / "qat", tmp_path / "int4", gen_tokens=0, corpus="none")
    assert report["compress"]["qat"] is False and report["compress"]["method"] == "rtn"
    real = inference.load_run(tmp_path / "int4", dtype="float32")
    assert real.params["blocks"]["attn"]["wq"]["kernel_q"].dtype == jnp.uint8
    assert real.params["embed"]["embedding_q"].dtype == jnp.uint8  # the embedding trained fake-quantized too
    tokens = np.array([[1, 5, 9, 20, 33, 7]], np.int32)
    np.testing.assert_allclose(_logits(real, tokens), _logits(qat, tokens), atol=1e-5, rtol=0)
    # and the fake quantization mattered: the float kernels alone compute another function
    plain = qat.cfg.copy_and_resolve_references()
    plain.compress.qat, plain.compress.quantize = False, ""
    float_run = cli._variant(qat, plain, inference.model_config(plain, "cpu", "float32"), qat.params)
    assert np.abs(_logits(float_run, tokens) - _logits(qat, tokens)).max() > 1e-3


@pytest.mark.slow
def test_gradual_pruning_reaches_its_sparsity_on_schedule(facts_run, tmp_path):
    from tiny_run import finetune_args

    result = _train(finetune_args(tmp_path, facts_run, "gradual", "--config.compress.sparsity=0.5",
                                  "--config.compress.prune_start=0", "--config.compress.prune_end=4",
                                  "--config.compress.prune_every=2", steps=6))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "gradual" / "metrics.jsonl").read_text().splitlines()]
    sparsity = [r["sparsity"] for r in records if "sparsity" in r]
    # pruned at steps 0, 2, 4: 0 (t=0), 0.5 (1 - 0.5^3) = 0.4375, then 0.5; the metric after each step
    assert sparsity == pytest.approx([0, 0, 0.4375, 0.4375, 0.5, 0.5], abs=2e-3), sparsity
    run = inference.load_run(tmp_path / "gradual")
    for layer in range(2):
        mask = np.asarray(run.params["blocks"]["mlp"]["w_up"]["kernel_mask"][layer])
        kernel = np.asarray(run.params["blocks"]["mlp"]["w_up"]["kernel"][layer])
        assert (~mask).sum() == mask.size // 2 and np.all(kernel[~mask] == 0)


@pytest.mark.slow  # the default suite's 10-minute budget; make test-slow runs it; test_bad_inputs.py's compress cases stay
def test_bad_settings_stop_in_one_line(facts_run, tmp_path):
    cases = [
        ([("compress.quantize", "int5")], "compress.quantize='int5' is not allowed"),
        ([("compress.quantize", "int4"), ("compress.group", "47")], "a group of 47 values is odd"),
        ([("compress.sparsity", "1.0")], "a fraction in [0, 1)"),
        ([("compress.sparsity", "0.3"), ("compress.pattern", "2:4")], "0.5 with compress.pattern=2:4"),
        ([("compress.sparsity", "0.5"), ("compress.targets", "blocks,embed")], "can be quantized, not pruned"),
        ([("compress.quantize", "int4"), ("compress.targets", "w_nope")], "'w_nope' matches no weight"),
        ([], "nothing to compress"),
        ([("model.d_model", "32")], "compress.* keys only"),
    ]
    for overrides, words in cases:
        with pytest.raises(UserError) as e:
            cli.compress_run(facts_run, tmp_path / "out", overrides, gen_tokens=0, corpus="none")
        assert words in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the default suite's 10-minute budget; make test-slow runs it
def test_an_imported_run_needs_a_calibration_corpus(facts_run, tmp_path):
    from jaxlm import hf

    imported = hf.import_checkpoint(hf.export_run(facts_run, tmp_path / "hf"), tmp_path / "imported")
    for overrides, method in (([("compress.quantize", "int4"), ("compress.method", "gptq")], "GPTQ"),
                              ([("compress.sparsity", "0.5"), ("compress.criterion", "wanda")], "Wanda")):
        with pytest.raises(UserError, match=f"was imported and has no training corpus of its own to calibrate {method} "
                                            "on; give --config.compress.calib_corpus="):
            cli.compress_run(imported, tmp_path / "out", overrides, gen_tokens=0, corpus="none")
    assert not (tmp_path / "out").exists()
    # round to nearest needs no calibration: the imported run compresses
    report = cli.compress_run(imported, tmp_path / "rtn", [("compress.quantize", "int8"), ("compress.group", "0")],
                              gen_tokens=0, corpus="none")
    assert report["after"]["device_bytes"] < report["before"]["device_bytes"]


@pytest.mark.slow  # the layer-output comparison with round to nearest: tests/test_gptq.py
def test_gptq_loses_less_than_round_to_nearest_on_the_trained_model(facts_run, tmp_path):
    """3 bits in groups of 16 on 8 devices, calibrated layer by layer on the run's own training split:
    GPTQ's validation loss rises by less than round to nearest's (measured 0.0010 against 0.0050)."""
    common = [("compress.quantize", "int3"), ("compress.group", "16")]
    gptq = cli.compress_run(facts_run, tmp_path / "gptq", [*common, ("compress.method", "gptq"),
                                                           ("compress.calib_samples", "64")], gen_tokens=0)
    rtn = cli.compress_run(facts_run, tmp_path / "rtn", common, gen_tokens=0)
    assert gptq["calibration"] == {"sequences": 64, "seq_len": 64}
    base = gptq["before"]["corpus"]["loss"]
    floats.identical(rtn["before"]["corpus"]["loss"], base, why=floats.SAME_PROGRAM)  # the source, evaluated again
    assert 0 < gptq["after"]["corpus"]["loss"] - base < 0.6 * (rtn["after"]["corpus"]["loss"] - base), (gptq, rtn)


def test_a_compressed_model_counts_the_weights_it_stands_for():
    from helpers import small_config
    from jaxlm import train_state
    from jaxlm.models import transformer
    from jaxlm.models.transforms import Pruned, Quantized

    for fields in (dict(pruned=Pruned(("wq", "w_up"))),
                   dict(quantized=Quantized(quant.QuantSpec("int3", 16), ("wq", "wo"))),
                   dict(quantized=Quantized(quant.QuantSpec("int8", 0), ("w_down",)), pruned=Pruned(("w_down",))),
                   dict(quantized=Quantized(quant.QuantSpec("int4", 16), ("embed", "wv"))),
                   dict(quantized=Quantized(quant.QuantSpec("int4", 16), ("embed",)), tie_embeddings=True),
                   dict(quantized=Quantized(quant.QuantSpec("int4", 16), ("wq", "wk")), qk_norm=True)):
        cfg = small_config(**fields)
        params = jax.eval_shape(lambda c=cfg: nnx.to_pure_dict(nnx.state(train_state.build_model(c))))
        bits = cfg.stored_quant.bits if cfg.stored_quant else 4
        assert quant.count(params, bits) == transformer.param_count(cfg)["total"], fields


@pytest.mark.slow  # ~10 s (GPTQ); the default suite keeps the 10-minute budget
def test_round_to_nearest_and_gptq_with_short_last_groups():
    """compress.group=32 on w_down's 688 inputs (21 groups of 32 and one of 16) and on wo's head_dim of 48 (a
    group of 32 and one of 16 in each head): round to nearest stores what `quant.quantize` stores for each
    layer's kernel along its grouped axis, a reference int4 quantization of the zero-padded matrix; GPTQ on
    the padded matrix view equals it where the inputs are uncorrelated, and loses less where they are not."""
    from test_qlora import reference_4bit

    from helpers import small_config
    from jaxlm import config, train_state
    from jaxlm.compress import methods
    from jaxlm.models import quantized, transformer

    cfg = small_config(d_model=64, n_heads=2, n_kv_heads=2, head_dim=48, mlp_dim=688)
    co = config.recipe("tiny", compress__quantize="int4", compress__group=32).compress
    out_cfg = transformer.with_compress(cfg, co)
    spec = out_cfg.stored_quant
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(train_state.build_model(cfg, 0))))()
    out, _ = methods.compress_params(params, cfg, out_cfg, co)
    dequantized = quantized.dequantize_params(out, out_cfg)
    for path, axis, n_groups in ((("blocks", "mlp", "w_down"), 0, 22), (("blocks", "attn", "wo"), 1, 2)):
        kernel = np.asarray(params[path[0]][path[1]][path[2]]["kernel"])  # [layers, ...]
        stored = out[path[0]][path[1]][path[2]]
        assert "kernel" not in stored and stored["kernel_scale"].shape[axis + 1] == n_groups, path
        assert stored["kernel_q"].shape[axis + 1] == kernel.shape[axis + 1] // 2  # the codes of its own values
        own = jax.vmap(lambda w, a=axis: quant.quantize(w, spec, a))(jnp.asarray(kernel))
        np.testing.assert_array_equal(stored["kernel_q"], own["q"], err_msg=str(path))
        floats.close(stored["kernel_scale"], own["scale"], err_msg=str(path))
        deq = np.asarray(dequantized[path[0]][path[1]][path[2]]["kernel"])
        for layer in range(2):  # the grouped axis first, as the reference wants it
            w = np.moveaxis(kernel[layer], axis, 0)
            codes, _, expected = reference_4bit(w, "int4", 32)
            np.testing.assert_array_equal(np.moveaxis(np.asarray(quant.unpack(stored["kernel_q"][layer], axis)), axis, 0),
                                          codes, err_msg=str(path))
            floats.close(np.moveaxis(deq[layer], axis, 0), expected, err_msg=str(path))

    targets = {t.name: t for t in methods.targets(out_cfg)}
    rng = np.random.default_rng(0)
    for name, path in (("w_down", ("blocks", "mlp", "w_down")), ("wo", ("blocks", "attn", "wo"))):
        target, kernel = targets[name], params[path[0]][path[1]][path[2]]["kernel"][0]
        n_in = math.prod(kernel.shape[:target.n_in])
        settings = dict(quantize=spec, damp=0.01, block=128, sparsity=0.0, nm=None, criterion="magnitude",
                        scope="layer")
        rtn_weight, rtn = methods._compress_matrix(kernel, None, target, methods.Settings(
            method="rtn", act_order=False, **settings), None)
        for act_order in (False, True):
            gptq = methods.Settings(method="gptq", act_order=act_order, **settings)
            diagonal = np.diag(rng.uniform(0.5, 5.0, n_in)).astype(np.float32)
            _, leaves = methods._compress_matrix(kernel, jnp.asarray(diagonal), target, gptq, None)
            np.testing.assert_array_equal(leaves["kernel_q"], rtn["kernel_q"], err_msg=f"{name} {act_order}")
            floats.close(leaves["kernel_scale"], rtn["kernel_scale"], err_msg=f"{name} {act_order}")
            x = (rng.standard_normal((1024, n_in)) @ rng.standard_normal((n_in, n_in)) / np.sqrt(n_in)).astype(
                np.float32)
            weight, leaves = methods._compress_matrix(kernel, jnp.asarray(x.T @ x), target, gptq, None)
            assert leaves["kernel_scale"].shape == rtn["kernel_scale"].shape
            m = np.asarray(kernel, np.float64).reshape(n_in, -1)
            errors = [np.linalg.norm(x @ (m - np.asarray(wq, np.float64))) for wq in (weight, rtn_weight)]
            assert errors[0] < 0.9 * errors[1], (name, act_order, errors)
