"""QLoRA: a 4-bit frozen base under LoRA adapters (`config.lora.quantize_base`, `jaxlm.quant`).

The codes are really packed two to a byte and the device holds them (uint8 + float32 scales);
dequantization stays within the documented bound per element on random and on trained weights; a
QLoRA model computes exactly what the same model computes with the dequantized kernels; the
planner counts the packed bytes; a QLoRA run started from a base run quantizes the source's float
kernels once, trains only its adapters (the packed base bit-unchanged), resumes exactly, evaluates,
and exports merged or as a PEFT adapter that transformers and peft run to jaxlm's logits."""

import dataclasses
import json
import math

import floats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from command_forks import run_command
from flax import nnx

from helpers import small_config
from jaxlm import axes, config, inference, init_from, lora, memory, quant, train_setup, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.models import quantized, transformer
from jaxlm.models.transforms import LoRA, Quantized

BLOCKS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
FORMATS = ("nf4", "int4")  # the 4-bit formats; tests/test_compress.py checks every format


def flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def params_of(cfg, seed=0):
    return jax.jit(lambda: nnx.to_pure_dict(nnx.state(train_state.build_model(cfg, seed))))()


def forward(cfg, params, tokens):
    graphdef = train_state.build_model_spec(cfg).graphdef
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))


def group_absmax(w, axis, g):
    """Each element's group absmax (w's shape)."""
    grouped = w.reshape(*w.shape[:axis], w.shape[axis] // g, g, *w.shape[axis + 1:])
    return np.repeat(np.abs(grouped).max(axis=axis + 1), g, axis=axis)


def roundtrip(w, spec, axis):
    return np.asarray(quant.dequantize(quant.quantize(jnp.asarray(w), spec, axis), spec, axis))


def reference_4bit(w, fmt, g):
    """Blockwise 4-bit quantization along axis 0 of w [n, ...] as bitsandbytes does it, in numpy: the axis
    padded with zeros to a whole number of groups of g, each group's absmax, each value normalized by it
    and coded to its nearest level of the table (NF4, or int4's -7..7 / 7), the padding dropped.
    -> (codes [n, ...], absmax [ceil(n / g), ...], the dequantized weight [n, ...])."""
    n = w.shape[0]
    padded = np.concatenate([w, np.zeros((-n % g, *w.shape[1:]), np.float32)])
    groups = padded.reshape(-1, g, *w.shape[1:])
    absmax = np.abs(groups).max(axis=1)
    table = np.asarray(quant.NF4 if fmt == "nf4" else quant.INT4, np.float32)
    normalized = groups / np.where(absmax > 0, absmax, 1)[:, None]
    codes = np.abs(normalized[..., None] - table).argmin(-1).astype(np.uint8)
    dequantized = (table[codes] * absmax[:, None]).reshape(padded.shape)[:n]
    return codes.reshape(padded.shape)[:n], absmax, dequantized


# ----------------------------------------------------------------------------- the format


def test_pack_and_unpack_are_inverse_two_codes_to_a_byte():
    np.testing.assert_array_equal(quant.pack(jnp.array([1, 2, 3, 15], jnp.uint8), 0), [0x21, 0xF3])
    codes = np.random.default_rng(0).integers(0, 16, (6, 8, 10)).astype(np.uint8)
    for axis in range(3):
        packed = quant.pack(jnp.asarray(codes), axis)
        assert packed.dtype == jnp.uint8 and packed.shape[axis] == codes.shape[axis] // 2
        np.testing.assert_array_equal(quant.unpack(packed, axis), codes)
    with pytest.raises(ValueError, match="odd"):
        quant.pack(jnp.zeros((3, 4), jnp.uint8), 0)


def test_the_code_tables():
    nf4 = np.asarray(quant.NF4)
    assert len(nf4) == 16 and np.all(np.diff(nf4) > 0) and (nf4[0], nf4[7], nf4[15]) == (-1.0, 0.0, 1.0)
    assert (nf4 < 0).sum() == 7 and (nf4 > 0).sum() == 8  # asymmetric: 8 positive values
    assert quant.NF4_MAX_GAP == pytest.approx(1 - 0.6961928009986877)  # the widest gap, -1 to -0.696
    int4 = np.asarray(quant.INT4) * 7
    np.testing.assert_allclose(int4[1:], np.arange(-7, 8), atol=1e-6)
    # every level is reproduced exactly (the levels times a scale of 1): the format's own values, encoded and
    # decoded through a division and a product by 1.0 and a max, exact on any processor
    for fmt, table in (("nf4", nf4), ("int4", np.asarray(quant.INT4)[1:])):
        w = np.concatenate([table, table[::-1]]).astype(np.float32)[:, None] * np.ones((1, 3), np.float32)
        floats.identical(roundtrip(w, quant.QuantSpec(fmt, 32), 0), w, why=floats.MOVED, err_msg=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, axis, group, used", [((256, 24), 0, 64, 64), ((12, 8, 40), 1, 64, 8),
                                                      ((6, 96), 1, 32, 32)])
def test_dequantization_error_is_within_the_documented_bound_on_random_weights(fmt, shape, axis, group, used):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    w.reshape(-1)[:: 97] *= 20  # outliers, as trained weights have
    spec = quant.QuantSpec(fmt, group)
    leaves = quant.quantize(jnp.asarray(w), spec, axis)
    assert leaves["q"].dtype == jnp.uint8 and leaves["q"].shape[axis] == shape[axis] // 2
    assert leaves["scale"].dtype == jnp.float32 and leaves["scale"].shape[axis] == shape[axis] // used
    error = np.abs(roundtrip(w, spec, axis) - w)
    bound = quant.error_bound(spec) * group_absmax(w, axis, used)
    assert np.all(error <= bound * (1 + 1e-6) + 1e-9)
    assert (error / np.maximum(bound, 1e-12)).max() > 0.5  # and the bound is not loose
    if fmt == "int4":  # levels -7..7: code 0 is never written
        assert int(quant.unpack(leaves["q"], axis).min()) >= 1
    assert quant.error_bound(spec) == pytest.approx(0.1519, abs=1e-4) if fmt == "nf4" else 1 / 14


@pytest.mark.slow  # ~12 s; the bound itself is checked on random weights in the default suite (above)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_error_is_within_the_bound_on_trained_weights(facts_run, fmt):
    params = jax.device_get(inference.load_run(facts_run).params)
    spec, model_cfg = quant.QuantSpec(fmt, 64), inference.load_run(facts_run).model_cfg
    checked, relative = 0, []
    for site in quantized.sites(dataclasses.replace(model_cfg, quantized=Quantized(quant.QuantSpec(fmt), BLOCKS))):
        w = np.asarray(params[site.path[0]][site.path[1]][site.path[2]]["kernel"])  # [layers, ...]
        axis = site.axis + 1
        g = quant.group_size(64, w.shape[axis])
        deq = np.asarray(jax.vmap(lambda x, a=site.axis: quant.dequantize(quant.quantize(x, spec, a), spec, a))(w))
        error, absmax = np.abs(deq - w), group_absmax(w, axis, g)
        assert np.all(error <= quant.error_bound(spec) * absmax * (1 + 1e-6)), site.path
        relative.append(np.linalg.norm(deq - w) / np.linalg.norm(w))
        checked += 1
    assert checked == 7  # wq wk wv wo w_gate w_up w_down
    assert max(relative) < (0.12 if fmt == "nf4" else 0.16), relative


def test_double_quantization_adds_a_bounded_error_and_saves_037_bits_per_weight():
    rng = np.random.default_rng(2)
    w = jnp.asarray((rng.standard_normal((512, 600)) * 0.02).astype(np.float32))
    plain, double = quant.QuantSpec("nf4", 64), quant.QuantSpec("nf4", 64, double=True)
    a, b = quant.quantize(w, plain, 0), quant.quantize(w, double, 0)
    np.testing.assert_array_equal(a["q"], b["q"])  # the same codes, only the scales are coded
    assert b["scale"].dtype == jnp.int8 and b["scale"].shape == a["scale"].shape == (8, 600)
    assert b["scale_absmax"].shape == (math.ceil(8 * 600 / 256),) and b["scale_offset"].shape == (1,)
    scales = np.asarray(a["scale"]).reshape(-1)
    block = np.abs(scales - (scales.max() + scales.min()) / 2)
    block_absmax = np.array([block[i:i + 256].max() for i in range(0, block.size, 256)])
    np.testing.assert_allclose(b["scale_absmax"], block_absmax, rtol=1e-6)
    scale_error = np.abs(np.asarray(quant.dequantize_scales(b)).reshape(-1) - scales)
    assert np.all(scale_error <= np.repeat(block_absmax, 256)[: scales.size] / 254 * (1 + 1e-5))
    codes = np.asarray(jnp.take(jnp.asarray(quant.NF4), quant.unpack(a["q"], 0).astype(jnp.int32)))
    extra = np.abs(np.asarray(quant.dequantize(b, double, 0)) - np.asarray(quant.dequantize(a, plain, 0)))
    per_element = np.repeat(np.repeat(block_absmax, 256)[: scales.size].reshape(8, 600), 64, axis=0)
    assert np.all(extra <= np.abs(codes) * per_element / 254 * (1 + 1e-5) + 1e-9)
    assert 0 < extra.max() < 0.01 * np.abs(np.asarray(w)).max()
    saved = plain.bits_per_weight() - double.bits_per_weight()
    assert saved == pytest.approx(0.373, abs=1e-3)  # 32/64 - 8/64 - 32/(256*64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("double", [False, True])
def test_a_width_the_group_does_not_divide_ends_with_a_zero_padded_group(fmt, double):
    """688 values in groups of 64: ten groups and a short one of 48, quantized as bitsandbytes quantizes the
    matrix padded with zeros to 704 values (the padding dropped, never stored): the codes are a numpy
    reference's, the short group's scale is its own 48 values' absmax, the error is within the bound."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((688, 24)) * 0.02).astype(np.float32)
    w[640:] *= 0.1  # the short group's own absmax, far below the others'
    spec = quant.QuantSpec(fmt, 64, double)
    assert quant.group_size(spec, 688) == 64 and quant.n_groups(spec, 688) == 11
    leaves = quant.quantize(jnp.asarray(w), spec, 0)
    assert leaves["q"].shape == (344, 24) and leaves["scale"].shape == (11, 24)  # 688 codes, 11 groups
    codes, absmax, expected = reference_4bit(w, fmt, 64)
    np.testing.assert_array_equal(quant.unpack(leaves["q"], 0), codes)
    scales = np.asarray(quant.dequantize_scales(leaves))
    deq = roundtrip(w, spec, 0)
    error = np.abs(deq - w)
    bound = quant.error_bound(spec) * np.repeat(absmax, 64, axis=0)[:688]
    if double:  # the scales within half an int8 step of their block's absmax; the weights within that more
        step = np.repeat(np.asarray(leaves["scale_absmax"]), 256)[:264].reshape(11, 24) / 127  # 264 scales: 2 blocks
        assert leaves["scale_absmax"].shape == (2,) and np.all(np.abs(scales - absmax) <= step / 2 * (1 + 1e-5))
        bound = bound + np.repeat(step, 64, axis=0)[:688] / 2
    else:
        floats.close(scales, absmax)  # the short group's: its own 48 values' absmax
        floats.close(deq, expected)
    assert np.all(error <= bound * (1 + 1e-6) + 1e-9)
    assert (error[640:] / bound[640:]).max() > 0.5  # the short group's bound is its own, and not loose
    # the same codes and scales as the whole 704 values with zeros, whose padding codes are the code of 0
    whole = quant.quantize(jnp.pad(jnp.asarray(w), ((0, 16), (0, 0))), spec, 0)
    np.testing.assert_array_equal(quant.unpack(whole["q"], 0)[:688], quant.unpack(leaves["q"], 0))
    assert np.all(roundtrip(np.zeros((16, 24), np.float32), spec, 0) == 0)
    floats.identical(whole["scale"], leaves["scale"], why=floats.MOVED)  # zeros change no absmax
    # storage: 4 bits + a scale per 688 / 11 values
    assert quant.QuantSpec(fmt, 64).bits_per_weight(688) == pytest.approx(4 + 32 * 11 / 688)
    # a 4-bit axis must still be even (two codes share a byte), whatever the group
    with pytest.raises(ValueError, match="its 687 values are odd"):
        quant.group_size(spec, 687)


# ----------------------------------------------------------------------------- the model


ALIGNED = dict(d_model=128, n_heads=2, n_kv_heads=2, head_dim=64, mlp_dim=256)  # every grouped axis a multiple of 64
WIDE = dict(d_model=64, n_heads=2, n_kv_heads=2, head_dim=32, mlp_dim=688)  # w_down: 688 inputs, 10 groups of 64 + 48


def qlora_config(fmt="nf4", double=False, group=64, **kw):
    blocks = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down") if kw.get("mlp") != "gelu" else (
        "wq", "wk", "wv", "wo", "w_in", "w_out")
    return small_config(lora=LoRA(4, 8.0, ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")),
                        quantized=Quantized(quant.QuantSpec(fmt, group, double), blocks), **kw)


@pytest.mark.parametrize("double, bytes_per_weight", [(False, 0.5625), (True, 0.5 + 1 / 64 + 4 / (64 * 256))])
def test_the_device_holds_the_base_in_4_bits(double, bytes_per_weight):
    """Bytes of the blocks' kernels per weight, measured on the built model's leaves: 0.5625 for NF4 in
    groups of 64 (4 bits + a float32 per 64), against 4 for float32; the unembedding stays float32."""
    cfg = qlora_config(double=double, **ALIGNED)
    params = params_of(cfg)
    plain = params_of(lora.without_lora(cfg))
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    packed = [v for p, v in flat(params).items() if any(f"['{n}']['kernel_" in p for n in names)]
    kernels = [v for p, v in flat(plain).items() if any(f"['{n}']['kernel']" in p for n in names)]
    weights = sum(v.size for v in kernels)
    assert weights == 2 * (4 * 128 * 128 + 3 * 128 * 256)  # q k v o, gate up down; 2 layers
    assert all(v.dtype == np.float32 for v in kernels) and sum(v.nbytes for v in kernels) / weights == 4
    measured = sum(v.nbytes for v in packed) / weights
    n_tensors = 2 * 7  # each layer's kernel has its own 4-byte offset (its scales are whole blocks of 256 here)
    assert measured == pytest.approx(bytes_per_weight + (4 * n_tensors / weights if double else 0), rel=1e-12)
    assert {v.dtype for v in packed} == ({np.dtype("uint8"), np.dtype("float32")} | (
        {np.dtype("int8")} if double else set()))
    assert params["unembed"]["kernel"].dtype == np.float32 and "kernel" in params["unembed"]
    # parameters are counted by the weights they stand for
    assert transformer.param_count(cfg) == transformer.param_count(dataclasses.replace(cfg, quantized=None))
    assert quant.count(params) == transformer.param_count(cfg)["total"]


@pytest.mark.slow  # 10 s each: the default suite's budget (make test-slow runs both)
@pytest.mark.parametrize("kw", [{}, dict(scan_layers=False, mlp="gelu", norm="layernorm", use_bias=True),
                                dict(qk_norm=True, n_kv_heads=2)])  # Qwen3's q/k norms stay float, frozen
def test_a_qlora_model_computes_with_the_dequantized_base_and_merges(kw):
    mlp = ("w_in", "w_out") if kw.get("mlp") == "gelu" else ("w_gate", "w_up", "w_down")
    cfg = qlora_config("int4", double=True, group=32, **kw)
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=("wq", "wo") + mlp))
    fresh = params = params_of(cfg)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree_util.tree_unflatten(jax.tree.structure(params), [  # adapters that change the model
        v + 0.05 * jax.random.normal(k, v.shape) if "lora_b" in jax.tree_util.keystr(p) else v
        for (p, v), k in zip(leaves, keys)])
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 4, 96)
    adapted = forward(cfg, params, tokens)
    # the QLoRA model = the LoRA model whose kernels are the dequantized ones
    unquantized = dataclasses.replace(cfg, quantized=None)
    np.testing.assert_allclose(forward(unquantized, quantized.dequantize_params(params, cfg), tokens), adapted,
                               rtol=1e-5, atol=1e-5)
    # merged: float kernels, the model without LoRA and without quantization
    merged = lora.merge(params, cfg)
    base_cfg = lora.without_lora(cfg)
    assert base_cfg.quantized is None and jax.tree.structure(merged) == jax.tree.structure(params_of(base_cfg))
    assert all(v.dtype == np.float32 for v in flat(merged).values())
    np.testing.assert_allclose(forward(base_cfg, merged, tokens), adapted, rtol=1e-5, atol=1e-5)
    assert not np.allclose(forward(base_cfg, lora.base_weights(params, cfg), tokens), adapted, atol=1e-3)
    # a fresh QLoRA model is the quantized random init of the same seed (two programs: the init quantized in
    # its own jit or in another; the float leaves within ulps, the integer codes equal)
    again = jax.jit(lambda p: quantized.quantize_params(p, cfg))(params_of(base_cfg))
    floats.close(flat(lora.base_params(fresh)), flat(again))


def test_quantized_leaves_shard_and_never_train():
    cfg = qlora_config(double=True)
    spec = train_state.build_model_spec(cfg)
    wq = spec.logical_names["blocks"]["attn"]["wq"]
    assert wq["kernel_q"] == ("layers", "embed", "heads", "head_dim")
    assert wq["kernel_scale"] == ("layers", None, "heads", "head_dim")  # the grouped axis unsharded
    assert wq["kernel_scale_absmax"] == wq["kernel_scale_offset"] == ("layers", None)
    trains = flat(spec.trainable)
    assert {p for p, t in trains.items() if t} == {p for p in trains if "lora_" in p}
    # a selection that names the base's paths still leaves the 4-bit leaves frozen
    trains = flat(train_state.build_model_spec(cfg, "blocks/").trainable)
    assert not any(t for p, t in trains.items() if "kernel_" in p) and any(trains.values())
    # created on 8 devices, fsdp=8: the packed embed axis (64 / 2 = 32) splits 4 per device
    rules = mesh_lib.rules_from_config(mesh_lib.default_rules())
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=8))
    abstract, *_ = train_state.abstract_state(cfg, optax.identity(), mesh, rules)
    q, scale = abstract.params["blocks"]["attn"]["wq"]["kernel_q"], abstract.params["blocks"]["attn"]["wq"]["kernel_scale"]
    assert q.shape == (2, 32, 8, 8) and tuple(q.sharding.spec)[:2] == ("stage", "fsdp")
    assert q.sharding.shard_shape(q.shape) == (2, 4, 8, 8)
    assert scale.shape == (2, 1, 8, 8) and tuple(scale.sharding.spec)[:2] == ("stage", None)
    down = abstract.params["blocks"]["mlp"]["w_down"]["kernel_q"]  # [layers, mlp / 2, embed]
    assert down.shape == (2, 64, 64) and down.sharding.shard_shape(down.shape) == (2, 64, 8)
    # a packed axis that does not split: one line naming the leaf
    with pytest.raises(UserError, match=r"blocks\.attn\.wk\.kernel_q: its 'embed' dimension \(4: packed integer "
                                        r"codes\) does not split over mesh fsdp=8"):
        train_state.abstract_state(qlora_config(d_model=8, n_heads=2, head_dim=4, mlp_dim=16), optax.identity(), mesh,
                                   rules)


@pytest.mark.slow
def test_a_sharded_train_step_trains_the_adapters_over_the_packed_base():
    """fsdp=8: the 4-bit base is sharded, dequantized in the step, and stays bit-equal; the adapters move."""
    from test_lora import _train

    cfg = qlora_config(double=True)
    model_spec, before, state, losses = _train(cfg, 8, mesh_shape=axes.shape_of(fsdp=8))
    q = state.params["blocks"]["mlp"]["w_up"]["kernel_q"]  # [layers, embed / 2, mlp]
    assert q.dtype == jnp.uint8 and q.sharding.shard_shape(q.shape) == (2, 4, 128)
    after = flat(jax.device_get(state.params))
    for path, value in after.items():
        if "lora_b" in path:
            assert not np.array_equal(value, before[path]), path
        elif "lora_" not in path:  # the packed base: passed through every step, never updated
            floats.identical(value, before[path], why=floats.MOVED, err_msg=path)
    assert losses[-1] < losses[0] - 0.2 and losses == sorted(losses, reverse=True), losses
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    assert set(flat(adam.mu)) == {p for p in after if "lora_" in p}  # no optimizer state for the base


@pytest.mark.slow  # ~11 s; the quantization of a short group is checked in the default suite above
def test_qlora_trains_over_a_width_the_group_does_not_divide():
    """An MLP width of 688 in groups of 64, trained on 8 devices (fsdp 8): w_down's packed codes are sharded
    like its float kernel (the 688 inputs too, over tensor), its 11 groups' scales whole along them; the
    model computes with the dequantized base, which is a reference NF4 quantization of the padded float
    init; the adapters train. (fsdp 8, as the sharded test above: on a mesh with data or tensor > 1, XLA:CPU's
    threads can deadlock in this step, at any width, running an all-reduce beside the layers' loop.)"""
    from test_lora import _train

    cfg = qlora_config("nf4", **WIDE)
    rules = mesh_lib.rules_from_config(mesh_lib.default_rules())
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=4, tensor=2))
    abstract, *_ = train_state.abstract_state(cfg, optax.identity(), mesh, rules)
    q = abstract.params["blocks"]["mlp"]["w_down"]["kernel_q"]  # [layers, mlp / 2, embed]
    assert tuple(q.sharding.spec) == ("stage", "tensor", "fsdp") and q.sharding.shard_shape(q.shape) == (2, 172, 16)
    float_init = params_of(lora.without_lora(cfg))  # the random init a fresh QLoRA model quantizes
    _, before, state, losses = _train(cfg, 8, mesh_shape=axes.shape_of(fsdp=8))
    down = state.params["blocks"]["mlp"]["w_down"]
    q, scale = down["kernel_q"], down["kernel_scale"]
    assert q.shape == (2, 344, 64) and scale.shape == (2, 11, 64) and q.sharding.shard_shape(q.shape) == (2, 344, 8)
    assert tuple(scale.sharding.spec)[:2] == ("stage", None)  # the grouped axis unsharded
    params = jax.device_get(state.params)
    w = np.asarray(float_init["blocks"]["mlp"]["w_down"]["kernel"])
    deq = np.asarray(quantized.dequantize_params(params, cfg)["blocks"]["mlp"]["w_down"]["kernel"])
    for layer in range(2):
        codes, absmax, expected = reference_4bit(w[layer], "nf4", 64)
        np.testing.assert_array_equal(quant.unpack(params["blocks"]["mlp"]["w_down"]["kernel_q"][layer], 0), codes)
        floats.close(deq[layer], expected, err_msg=f"layer {layer}")
        bound = quant.error_bound(cfg.stored_quant) * np.repeat(absmax, 64, axis=0)[:688]
        assert np.all(np.abs(deq[layer] - w[layer]) <= bound * (1 + 1e-6) + 1e-9)
    # the step computes with exactly that base: the same model with the dequantized kernels
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 4, 96)
    np.testing.assert_allclose(forward(dataclasses.replace(cfg, quantized=None), quantized.dequantize_params(params, cfg),
                                       tokens), forward(cfg, params, tokens), rtol=1e-5, atol=1e-5)
    for path, value in flat(params).items():  # the packed base never moves, the adapters do
        if "lora_b" in path:
            assert not np.array_equal(value, before[path]), path
        elif "lora_" not in path:
            floats.identical(value, before[path], why=floats.MOVED, err_msg=path)
    assert losses[-1] < losses[0] - 0.2 and losses == sorted(losses, reverse=True), losses
    # counted by the weights it stands for, and planned at the bytes it holds
    assert quant.count(params) == transformer.param_count(cfg)["total"]


def test_config_keys_are_checked_in_one_line():
    with pytest.raises(UserError, match=r"config\.lora\.quantize_base='nf4' needs config\.lora\.rank > 0"):
        config.recipe("tiny", lora__quantize_base="nf4")
    with pytest.raises(UserError, match=r"config\.lora\.quantize_base='fp4' is not allowed: '' \(off\) or one of "
                                        r"nf4, int8, int4, int3"):
        config.recipe("tiny", lora__rank=4, lora__quantize_base="fp4")
    with pytest.raises(UserError, match=r"config\.lora\.quant_group=63 is not allowed: an even number"):
        config.recipe("tiny", lora__rank=4, lora__quantize_base="nf4", lora__quant_group=63)
    # a group that does not divide a width ends with a short group (tiny: d_model 128 = 2 x 48 + 32)
    cfg = config.recipe("tiny", lora__rank=4, lora__quantize_base="nf4", lora__quant_group=48)
    assert transformer.ModelConfig.from_config(cfg.model, "cpu", lora=cfg.lora).stored_quant.group == 48
    # an odd width cannot be packed two codes to a byte, whatever the group (w_down, grouped along mlp)
    with pytest.raises(UserError, match=r"config\.lora\.quant_group=64: projection w_down is grouped along its "
                                        r"'mlp' axis and its 687 values are odd \(two 4-bit codes share a byte\) "
                                        r"\(nf4\); choose a format that takes this width \(int8 takes any\)"):
        config.recipe("tiny", model__mlp_dim=687, lora__rank=4, lora__quantize_base="nf4")
    cfg = config.recipe("tiny", lora__rank=4, lora__quantize_base="int4", lora__quant_group=512, lora__double_quant=True)
    m = transformer.ModelConfig.from_config(cfg.model, "cpu", lora=cfg.lora)
    assert m.stored_quant == quant.QuantSpec("int4", 512, True)  # 512 > every grouped axis: one group per row


@pytest.mark.parametrize("double", [False, True])
def test_the_planner_counts_the_packed_base(double):
    cfg = config.recipe("tiny", lora__rank=8, lora__targets="all", lora__quantize_base="nf4",
                        lora__double_quant=double)
    m = transformer.ModelConfig.from_config(cfg.model, "cpu", lora=cfg.lora)
    built = jax.eval_shape(lambda: params_of(m))
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(built))
    for devices in (1, 8):
        est = memory.estimate(cfg, devices, platform="cpu")
        assert est.row("parameters").total_bytes == nbytes
        assert "nf4 (group 64" in est.row("parameters").note
    assert est.param_count == quant.count(built) == transformer.param_count(m)["total"]
    plain = memory.estimate(config.recipe("tiny", lora__rank=8, lora__targets="all"), 1, platform="cpu")
    assert plain.param_count == est.param_count
    kernels = transformer.matmul_params(m) - m.d_model * m.vocab_size  # the blocks' (not the unembedding)
    per_weight = 4 - (plain.row("parameters").total_bytes - est.row("parameters").total_bytes) / kernels
    # 0.5625 at group 64; wo's head_dim (32) makes groups of 32 there (0.625), 8% of the kernels
    assert (0.5157 < per_weight < 0.52) if double else (0.5625 < per_weight < 0.57), per_weight


def test_the_planner_counts_a_short_last_group():
    """mlp_dim 688 in groups of 64: the planner's bytes are the built model's (w_down's 11 scales per
    column, its 344 bytes of codes), the parameter count that of the unquantized model."""
    cfg = config.recipe("tiny", model__mlp_dim=688, lora__rank=8, lora__quantize_base="nf4")
    m = transformer.ModelConfig.from_config(cfg.model, "cpu", lora=cfg.lora)
    built = jax.eval_shape(lambda: params_of(m))
    down = built["blocks"]["mlp"]["w_down"]
    assert down["kernel_q"].shape == (4, 344, 128) and down["kernel_scale"].shape == (4, 11, 128)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(built))
    for devices in (1, 8):
        est = memory.estimate(cfg, devices, platform="cpu")
        assert est.row("parameters").total_bytes == nbytes
    plain = memory.estimate(config.recipe("tiny", model__mlp_dim=688, lora__rank=8), 1, platform="cpu")
    assert est.param_count == quant.count(built) == transformer.param_count(m)["total"] == plain.param_count


# ----------------------------------------------------------------------------- a QLoRA run, end to end


def _run_args(directory, source, name, *extra, steps=6):
    from tiny_run import finetune_args

    return finetune_args(directory, source, name, *extra, steps=steps, optim__peak_lr=1e-2, checkpoint__every_steps=3,
                         lora__rank=4, lora__targets="all", lora__alpha=8.0, lora__quantize_base="nf4",
                         lora__double_quant="true")


def _train(args):
    from tiny_run import ONE_DEVICE, ROOT

    result = run_command("train", args, cwd=ROOT, env=ONE_DEVICE, timeout=600)
    return result.returncode, result.stdout, result.stderr


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
def test_a_qlora_run_from_a_base_run_trains_its_adapters_resumes_exactly_and_evaluates(facts_run, tmp_path):
    from jaxlm import evaluate

    # In-process on 8 devices: the source's float kernels quantized into the packed base, adapters fresh.
    cfg = init_from.config_from_cli(_run_args(tmp_path, facts_run, "inproc", "--config.mesh.fsdp=-1"))
    setup = train_setup.build(cfg, abstract=True)
    state, origin = init_from.load_state(setup)
    src = inference.load_run(facts_run)
    expected = flat(quantized.quantize_params(jax.device_get(src.params), setup.model_cfg))
    mine = flat(jax.device_get(state.params))
    base = {p for p in mine if "lora_" not in p}
    assert base == set(expected) and any("kernel_q" in p for p in base) and not any("['kernel']" in p and "blocks" in p
                                                                                    for p in base)
    # Two programs (quantized sharded in one jit here, op by op on the host there): the float leaves within
    # ulps, the integer codes equal.
    floats.close({p: mine[p] for p in base}, {p: expected[p] for p in base})
    wq = state.params["blocks"]["attn"]["wq"]["kernel_q"]
    assert wq.dtype == jnp.uint8 and wq.sharding.spec[1] == "fsdp"  # born sharded
    assert "M parameters" in init_from.describe(origin, state.params)
    assert f"({transformer.param_count(setup.model_cfg)['total'] / 1e6:.2f}M parameters)" in init_from.describe(
        origin, state.params)
    del state

    # The CLI: 6 steps uninterrupted; 3 steps, then resumed to 6 (a constant learning rate: the same
    # schedule): the same run, bit for bit.
    code, out, err = _train(_run_args(tmp_path, facts_run, "whole"))
    assert code == 0, err[-3000:]
    losses = _losses(tmp_path / "whole")
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    code, out, err = _train(_run_args(tmp_path, facts_run, "parts", steps=3))
    assert code == 0, err[-3000:]
    code, out, err = _train(_run_args(tmp_path, facts_run, "parts"))
    assert code == 0 and "resuming from step 3" in out + err, err[-3000:]
    floats.identical(_losses(tmp_path / "parts"), losses, why=floats.SAME_PROGRAM)  # a resume: the same run
    whole, parts = inference.load_run(tmp_path / "whole"), inference.load_run(tmp_path / "parts")
    assert whole.step == parts.step == 6 and whole.model_cfg.stored_quant == quant.QuantSpec("nf4", 64, True)
    trained, resumed = flat(jax.device_get(whole.params)), flat(jax.device_get(parts.params))
    floats.identical(resumed, trained, why=floats.SAME_PROGRAM)
    for path, value in trained.items():
        if "lora_" in path:
            assert "lora_a" in path or value.any(), path  # B moved from zero
    # the packed base: unchanged from its quantization at the start (that of the CLI's init, another program
    # than `expected`'s: the float leaves within ulps, the integer codes equal)
    frozen = [p for p in trained if "lora_" not in p]
    floats.close({p: trained[p] for p in frozen}, {p: expected[p] for p in frozen})
    q = whole.params["blocks"]["mlp"]["w_up"]["kernel_q"]
    assert q.dtype == jnp.uint8 and q.shape == (2, 32, 128)  # the facts run's 2 layers, d_model 64 packed, mlp 128

    # Evaluation loads the quantized model with its adapters: the facts stay learned (a model that knew
    # nothing would score ln(300) = 5.7), and the adapters count (the base alone, B at zero, scores otherwise).
    docs, _ = evaluate.corpus_documents(whole, str(tmp_path / "other.txt"), separator="\n\n", max_tokens=4000)
    tuned = evaluate.perplexity(whole, docs)["loss"]
    without = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 0 if "lora_b" in jax.tree_util.keystr(p) else x, whole.params)
    base_only = evaluate.perplexity(dataclasses.replace(whole, params=without), docs)["loss"]
    assert tuned < 1.0 and base_only < 1.0 and abs(tuned - base_only) > 1e-3, (tuned, base_only)


@pytest.mark.slow  # ~15 s: trains through the CLI; the PEFT path itself is in tests/test_hf.py's LoRA test
def test_a_qlora_run_exports_merged_and_as_a_peft_adapter_that_transformers_and_peft_run(tmp_path, monkeypatch,
                                                                                         caplog):
    """QLoRA (int4, double quantization) on every projection of an imported Llama, trained a few steps:
    merged, transformers computes jaxlm's logits; as PEFT, the adapter alone names the original model
    and says in one line that it belongs to the dequantized base (on the original it computes another
    model), and with `with_base` peft on the dequantized base written beside it computes jaxlm's logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from test_hf import close, jaxlm_logits, make_model, reference_logits, save, train_cli

    from jaxlm import hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    original = make_model("llama")  # d_model 64, head_dim 8, mlp 160: groups of 32 (wo: one of 8 per row)
    hf_dir = save(original, tmp_path / "hf")
    imported = hf.import_checkpoint(hf_dir, tmp_path / "imported")
    tuned = train_cli(tmp_path, f"--config.run.init_from={imported}", "--config.run.name=qlora", "--config.lora.rank=4",
                      "--config.lora.targets=all", "--config.lora.quantize_base=int4", "--config.lora.quant_group=32",
                      "--config.lora.double_quant=true", "--config.optim.peak_lr=0.01")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    run = inference.load_run(tmp_path / "qlora", dtype="float32")
    assert run.params["blocks"]["attn"]["wq"]["kernel_q"].dtype == jnp.uint8
    want = jaxlm_logits(run)
    base = reference_logits(original)
    assert np.abs(want - base).max() / np.abs(base).max() > 1e-3  # quantized and adapted: another model

    merged = hf.export_run(run.run_dir, tmp_path / "merged", dtype="float32")
    close(reference_logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval()), want)

    caplog.set_level("WARNING", logger="jaxlm.hf")
    out = hf.export_run(run.run_dir, tmp_path / "adapter", dtype="float32", adapters="peft")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf_dir.resolve())
    assert [r.getMessage() for r in caplog.records] == [
        f"this QLoRA adapter was trained over the int4-dequantized weights of {hf_dir.resolve()}, and on the original "
        f"weights computes another model: --with_base writes that dequantized base into {out / 'base'} and points the "
        f"adapter at it"]
    on_original = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), out).eval()
    assert np.abs(reference_logits(on_original) - want).max() / np.abs(want).max() > 1e-3  # what the line warns of

    caplog.clear()
    with_base = hf.export_run(run.run_dir, tmp_path / "with-base", dtype="float32", adapters="peft", with_base=True)
    assert json.loads((with_base / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        with_base.resolve() / "base")
    assert [r.getMessage() for r in caplog.records] == [
        f"this QLoRA adapter belongs to the int4-dequantized base in {with_base / 'base'} (the weights the run trained "
        f"over), not to {hf_dir.resolve()} itself"]
    exported_base = transformers.AutoModelForCausalLM.from_pretrained(with_base / "base").eval()
    # the exported base is the dequantized one: within int4's bound of the original weights
    w = exported_base.model.layers[0].mlp.down_proj.weight.detach().numpy()  # [d, f], grouped along f
    w0 = original.model.layers[0].mlp.down_proj.weight.detach().numpy()
    absmax = np.repeat(np.abs(w0.reshape(64, 5, 32)).max(axis=2), 32, axis=1)
    # (double quantization adds at most a scale block's largest |scale - offset| / 254 <= the largest scale / 254)
    assert 0 < np.abs(w - w0).max() and np.all(np.abs(w - w0) <= absmax / 14 + absmax.max() / 254 + 1e-7)
    adapted = peft.PeftModel.from_pretrained(exported_base, with_base).eval()
    close(reference_logits(adapted), want)
