"""The decoder's forward pass: shapes, dtypes, causality, packed documents, sizes and FLOPs."""

import dataclasses

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import small_config
from jaxlm.models import attention
from jaxlm.models.transformer import Transformer, flops_per_token, param_count
from jaxlm.models.transforms import LoRA
from jaxlm.train_state import build_model, build_model_spec


@pytest.mark.parametrize("variant", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_logits_shape_and_dtype(variant, dtype):
    kw = dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True) if variant == "gpt2" else {}
    model = build_model(small_config(dtype=dtype, **kw))
    tokens = jnp.ones((3, 16), jnp.int32)
    logits = model(tokens)
    assert logits.shape == (3, 16, 96)
    assert logits.dtype == dtype
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize(
    "kw",
    [
        {},  # llama, scanned
        dict(scan_layers=False),
        dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True),  # gpt2
        dict(n_kv_heads=2, tie_embeddings=True),
    ],
)
def test_changing_a_future_token_changes_no_earlier_logit(kw):
    model = build_model(small_config(**kw))
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 4, 96)
    base = model(tokens)
    for t in (5, 11, 15):
        changed = tokens.at[:, t].set((tokens[:, t] + 7) % 96)
        out = model(changed)
        # one program on both inputs: the later token moves no bit of an earlier logit
        floats.identical(out[:, :t], base[:, :t], why=floats.SAME_PROGRAM)
        assert not np.allclose(out[:, t], base[:, t])  # the changed position itself does move


@pytest.mark.parametrize("kw", [{}, dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True)])
def test_packed_documents_do_not_see_each_other(kw):
    """Each document in a packed row gives the logits it gives alone (positions restart at 0)."""
    model = build_model(small_config(**kw))
    doc_a = jax.random.randint(jax.random.key(1), (1, 10), 4, 96)
    doc_b = jax.random.randint(jax.random.key(2), (1, 6), 4, 96)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    segments = jnp.array([[1] * 10 + [2] * 6])
    positions = jnp.array([list(range(10)) + list(range(6))])
    out = model(packed, positions, segments)
    np.testing.assert_allclose(out[:, :10], model(doc_a), atol=1e-5)
    np.testing.assert_allclose(out[:, 10:], model(doc_b), atol=1e-5)
    # Without segment ids, document b does see document a.
    assert not np.allclose(model(packed, positions)[:, 10:], model(doc_b), atol=1e-3)


def _uneven_documents(lengths_per_row, seq: int):
    """Rows of packed random documents of the given lengths, padding (segment 0) after them: (tokens,
    positions, segment ids), each [rows, seq], and each row's documents' (start, tokens [1, n])."""
    tokens, positions, segments, docs = [], [], [], []
    for r, lengths in enumerate(lengths_per_row):
        row_docs = [jax.random.randint(jax.random.key(10 * r + i), (1, n), 4, 96) for i, n in enumerate(lengths)]
        pad = seq - sum(lengths)
        tokens.append(jnp.concatenate([*row_docs, jnp.zeros((1, pad), jnp.int32)], axis=1))
        positions.append(jnp.array([sum((list(range(n)) for n in lengths), []) + [0] * pad]))
        segments.append(jnp.array([sum(([i + 1] * n for i, n in enumerate(lengths)), []) + [0] * pad]))
        starts = np.cumsum([0, *lengths[:-1]])
        docs.append(list(zip(starts.tolist(), row_docs)))
    return jnp.concatenate(tokens), jnp.concatenate(positions), jnp.concatenate(segments), docs


@pytest.mark.parametrize("strategy, layout", [pytest.param("allgather", "balanced", marks=pytest.mark.slow),
                                              pytest.param("ring", "balanced", marks=pytest.mark.slow),
                                              pytest.param("allgather", "contiguous", marks=pytest.mark.slow),
                                              pytest.param("ring", "contiguous", marks=pytest.mark.slow)])
@pytest.mark.parametrize("context", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_packed_documents_do_not_see_each_other_with_the_sequence_split_over_context(context, strategy, layout):
    """Context parallelism (the sequence in the layout's chunks; keys and values all-gathered or passed round
    the ring): each document of uneven length, crossing the chunks' boundaries (at multiples of 32 / context,
    or 16 / context under the balanced layout), gives the logits it gives alone on one device, RoPE at the
    positions the batch carries (carried with their tokens). Any kernel takes the same path under context
    (`context_parallel.context_attention`)."""
    from jaxlm import axes
    from jaxlm import mesh as mesh_lib

    model = build_model(small_config(attention="blocked", context_attention=strategy, context_layout=layout))
    tokens, positions, segments, docs = _uneven_documents([[7, 13, 9], [3, 21, 5, 1]], 32)
    mesh = mesh_lib.make_mesh(axes.shape_of(context=context), devices=jax.devices()[:context])
    rules = mesh_lib.rules_from_config(mesh_lib.default_rules())
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        graphdef, state = nnx.split(model)
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

        @jax.jit
        def forward(state, tokens, positions, segments):
            return nnx.merge(graphdef, state)(tokens, positions, segments)

        out = forward(state, tokens, positions, segments)
        hlo = forward.lower(state, tokens, positions, segments).compile().as_text()
    assert ("all-gather(" if strategy == "allgather" else "collective-permute(") in hlo  # keys and values, over context
    for row, row_docs in enumerate(docs):
        for start, doc in row_docs:
            np.testing.assert_allclose(out[row:row + 1, start:start + doc.shape[1]], model(doc), atol=1e-5)


def test_scanned_and_unrolled_layers_compute_the_same_function():
    scanned = build_model(small_config(n_kv_heads=4))
    # built abstractly: every value comes from the scanned model's
    unrolled = nnx.eval_shape(lambda: build_model(small_config(n_kv_heads=4, scan_layers=False)))
    params = nnx.to_pure_dict(nnx.state(scanned))
    as_list = dict(params)
    as_list["blocks"] = {i: jax.tree.map(lambda x, i=i: x[i], params["blocks"]) for i in range(2)}
    nnx.update(unrolled, as_list)
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 96)
    forward = nnx.jit(lambda model, tokens: model(tokens))  # one compiled program each, not op by op
    np.testing.assert_allclose(forward(scanned, tokens), forward(unrolled, tokens), atol=1e-5)


def test_dropout_is_active_only_with_a_key():
    model = build_model(small_config(dropout=0.3))
    tokens = jnp.ones((2, 8), jnp.int32)
    without = build_model(small_config(dropout=0.0))  # the same parameters (dropout has none)
    # no key: the model without dropout (dropout is skipped, the same operations run)
    floats.identical(model(tokens), without(tokens), why=floats.SAME_PROGRAM)
    assert not np.allclose(model(tokens, dropout_key=jax.random.key(0)), model(tokens))
    assert not np.allclose(model(tokens, dropout_key=jax.random.key(0)), model(tokens, dropout_key=jax.random.key(1)))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(tie_embeddings=True, n_kv_heads=2),
        dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True),
        dict(scan_layers=False, use_bias=True),
        dict(qkv_bias=True, n_kv_heads=2),  # Qwen2: q/k/v biases alone
        dict(qk_norm=True, n_kv_heads=2, head_dim=16),  # Qwen3: q/k norms, heads wider than d_model / n_heads
        dict(qk_norm=True, scan_layers=False, use_bias=True),
        # LoRA adapters (a `lora` entry): per-module ranks, the unembedding's, unscanned, GELU's projections
        dict(lora=LoRA(4, 16.0, ("wq", "wk", "wv", "wo", "w_down", "unembed"), (("wq", 8),)), n_kv_heads=2),
        dict(lora=LoRA(2, 16.0, ("w_in", "w_out", "wo")), mlp="gelu", norm="layernorm", use_bias=True,
             scan_layers=False),
    ],
)
def test_param_count_from_config_equals_the_built_model(kw):
    cfg = small_config(**kw)
    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg)))  # the model's own arrays' shapes, none computed
    built = sum(x.size for x in jax.tree.leaves(state))
    assert param_count(cfg)["total"] == built
    adapters = sum(x.size for x in jax.tree.leaves(nnx.filter_state(state, nnx.LoRAParam)))
    assert param_count(cfg)["lora"] == adapters and (adapters > 0) == (cfg.lora is not None)


def test_flops_per_token_matches_a_hand_count():
    cfg = small_config(n_kv_heads=2)  # d=64, heads 8 x 8, kv 2 x 8, mlp 128, vocab 96, 2 layers
    attn = 64 * 64 + 2 * 64 * 16 + 64 * 64  # q, k+v, o
    mlp = 3 * 64 * 128
    per_token_forward_matmuls = 2 * (2 * (attn + mlp) + 64 * 96)
    causal_attention_forward = 2 * (2 * 2 * 32 * 64) / 2  # QK^T and AV, 2 layers, seq 32, half for causal
    assert flops_per_token(cfg, 32) == 3 * (per_token_forward_matmuls + causal_attention_forward)


def test_weight_decay_applies_to_matrices_only():
    model_spec = build_model_spec(small_config(norm="layernorm", use_bias=True, position="learned"))
    mask = model_spec.decay_mask
    assert mask["blocks"]["attn"]["wq"]["kernel"] and mask["blocks"]["mlp"]["w_up"]["kernel"] and mask["embed"]["embedding"]
    assert mask["pos_embed"] and mask["unembed"]["kernel"]
    assert not mask["blocks"]["attn"]["bq"] and not mask["blocks"]["attn_norm"]["scale"]
    assert not mask["blocks"]["attn_norm"]["bias"] and not mask["final_norm"]["scale"]


def _remat_loss_and_grads(cfg):
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 96)
    model = build_model(cfg)
    graphdef, params = nnx.split(model)

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def without_remat():
    """The loss and gradients every remat policy is compared to, computed once."""
    return _remat_loss_and_grads(small_config())


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_remat_policies_change_memory_not_values(policy, without_remat):
    ref_loss, ref_grads = without_remat
    loss, grads = _remat_loss_and_grads(small_config(remat=policy))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)


@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_xla_attention_matches_the_reference(kv_heads, packed):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 16, 8, 16))
    k = jax.random.normal(keys[1], (2, 16, kv_heads, 16))
    v = jax.random.normal(keys[2], (2, 16, kv_heads, 16))
    seg = jnp.array([[1] * 7 + [2] * 9, [1] * 12 + [0] * 4]) if packed else None
    out = attention.attend(q, k, v, segment_ids=seg, implementation="xla")
    ref = attention.reference_attention(q, k, v, segment_ids=seg)
    valid = np.ones((2, 16), bool) if seg is None else np.asarray(seg) > 0  # padding rows are unused
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-5)


@pytest.mark.parametrize("kv_heads, block, packed", [
    (8, 16, True), (2, 16, True),  # a partial last block
    (8, 0, True), (2, 40, True),  # attention_block's (32 and a partial one); one block
    (2, 16, False),  # no segment ids: causal only
])
def test_blocked_attention_matches_the_reference_and_its_gradients(kv_heads, block, packed):
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (2, 40, 8, 16))
    k = jax.random.normal(keys[1], (2, 40, kv_heads, 16))
    v = jax.random.normal(keys[2], (2, 40, kv_heads, 16))
    seg = jnp.array([[1] * 7 + [2] * 20 + [3] * 13, [1] * 30 + [0] * 10]) if packed else None  # and padding
    valid = (np.ones((2, 40), bool) if seg is None else np.asarray(seg) > 0)[:, :, None, None]
    w = jax.random.normal(keys[3], q.shape) * valid  # padding's outputs are unused

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    def blocked(q, k, v):
        return attention.blocked_attention(q, k, v, seg, block)

    def ref(q, k, v):
        return attention.reference_attention(q, k, v, segment_ids=seg)

    out, expected = jax.jit(blocked)(q, k, v), jax.jit(ref)(q, k, v)
    np.testing.assert_allclose(np.asarray(out) * valid, np.asarray(expected) * valid, atol=1e-5)
    grads = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5)


@pytest.mark.parametrize("kv_heads, length", [
    pytest.param(8, 256, marks=pytest.mark.slow),  # two 128-blocks
    (2, 200),  # grouped-query heads; padded to 256 with a document of its own
    (2, 1024),  # two 512-blocks, the one above the diagonal skipped
])
def test_splash_attention_matches_the_reference_and_its_gradients(kv_heads, length):
    """JAX's Pallas TPU splash kernel, in Pallas' interpret mode on this CPU, with packed documents of uneven
    lengths and padding: its output and the gradients of q, k and v are XLA's reference's."""
    keys = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(keys[0], (2, length, 8, 16))
    k = jax.random.normal(keys[1], (2, length, kv_heads, 16))
    v = jax.random.normal(keys[2], (2, length, kv_heads, 16))
    first, second = length // 3, length // 2 + 5  # documents that cross blocks' edges
    seg = jnp.array([[1] * first + [2] * (second - first) + [3] * (length - second),
                     [1] * second + [0] * (length - second)])
    valid = (np.asarray(seg) > 0)[:, :, None, None]
    w = jax.random.normal(keys[3], q.shape) * valid  # padding's outputs are unused

    def splash(q, k, v):
        return attention.attend(q, k, v, segment_ids=seg, implementation="splash")

    def ref(q, k, v):
        return attention.reference_attention(q, k, v, segment_ids=seg)

    out, expected = jax.jit(splash)(q, k, v), jax.jit(ref)(q, k, v)
    np.testing.assert_allclose(np.asarray(out) * valid, np.asarray(expected) * valid, atol=2e-5)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(splash(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_blocked_attention_in_bfloat16_multiplies_bfloat16_in_both_passes():
    """Every matmul of the forward and of the custom backward takes bfloat16 operands (summed in float32):
    JAX's own gradient of a float32-result dot would take float32 ones, which XLA:CPU runs as float32 dots.
    And the values stay within bfloat16's rounding of the float32 reference."""
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(key, (2, 64, 4, 16), jnp.bfloat16) for key in keys)
    seg = jnp.array([[1] * 20 + [2] * 44, [1] * 64])

    def loss(q, k, v):
        return jnp.sum(attention.blocked_attention(q, k, v, seg, 16).astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    dots = []

    def collect(jpr):
        for eqn in jpr.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                collect(sub)

    collect(jaxpr.jaxpr)
    assert len(dots) == 4 * 2 + 4 * 5  # 4 blocks: 2 matmuls forward, 5 backward (scores recomputed)
    for eqn in dots:
        assert [x.aval.dtype for x in eqn.invars] == [jnp.bfloat16] * 2, eqn
        assert eqn.params["preferred_element_type"] == jnp.float32
    f32 = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    ref = jax.jit(attention.reference_attention)(*f32, segment_ids=seg)
    out = jax.jit(attention.blocked_attention, static_argnums=4)(q, k, v, seg, 16).astype(jnp.float32)
    np.testing.assert_allclose(out, ref, atol=0.03)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.reference_attention(q, k, v, segment_ids=seg) ** 2),
                                 argnums=(0, 1, 2)))(*f32)
    for g, r in zip(grads, ref_grads, strict=True):
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) <= 0.03 * float(jnp.max(jnp.abs(r)))


def test_attention_block_sizes():
    assert [attention.attention_block(t) for t in (16, 32, 33, 64, 65, 128, 256, 512, 1024, 4096)] == [
        16, 32, 32, 32, 64, 64, 64, 64, 128, 512]


def test_attention_selection_is_explicit():
    from jaxlm.errors import UserError

    assert attention.select_implementation("auto", "cpu") == "blocked"
    assert attention.select_implementation("blocked", "gpu") == "blocked"
    assert attention.select_implementation("auto", "gpu", dtype=jnp.bfloat16, head_dim=128) == "cudnn"
    assert attention.select_implementation("xla", "gpu") == "xla"
    # cuDNN cannot run float32 or odd head sizes: 'auto' falls back to XLA, an explicit 'cudnn' is an error.
    assert attention.select_implementation("auto", "gpu", dtype=jnp.float32, head_dim=64) == "xla"
    assert attention.select_implementation("auto", "gpu", dtype=jnp.bfloat16, head_dim=36) == "xla"
    with pytest.raises(UserError, match="not a GPU"):
        attention.select_implementation("cudnn", "cpu")
    with pytest.raises(UserError, match="bfloat16 or float16"):
        attention.select_implementation("cudnn", "gpu", dtype=jnp.float32)
    # Pallas only when asked for (not measured against cuDNN yet); off a GPU interpreted, and said so.
    assert attention.select_implementation("pallas", "gpu") == "pallas"
    assert attention.select_implementation("pallas", "cpu") == "pallas"
    with pytest.raises(UserError, match="multiple of 16"):
        attention.attend(*(jnp.zeros((1, 24, 2, 8)),) * 3, implementation="pallas")
    # On a TPU 'auto' is splash attention; elsewhere splash only when asked for, interpreted.
    assert attention.select_implementation("auto", "tpu") == "splash"
    assert attention.select_implementation("splash", "cpu") == "splash"


def test_projections_of_one_input_are_joined_everywhere_but_on_tpus():
    """`ModelConfig.joint_projections`, resolved by platform: q, k, v (and gate, up) as one matmul on CPUs and
    GPUs; each its own on TPUs, whose compiled program lays the joined outputs out at a cost
    (benchmarks/BENCHMARKS.md), and the model then has no joints for a step to join once per step."""
    from jaxlm import config
    from jaxlm.models import layers
    from jaxlm.models.transformer import ModelConfig

    m = config.recipe("tiny").model
    m.n_kv_heads = m.n_heads // 2  # grouped-query heads: q, k and v can be joined
    m.matmul = "xla"  # plain matmuls (auto on a CPU accumulates in its own: `layers.accumulating_einsum`)
    joined = {platform: ModelConfig.from_config(m, platform, log_choice=False).joint_projections
              for platform in ("cpu", "gpu", "tpu")}
    assert joined == {"cpu": True, "gpu": True, "tpu": False}
    for platform, kinds in (("cpu", {"qkv", "gate_up"}), ("tpu", set())):
        cfg = dataclasses.replace(ModelConfig.from_config(m, platform, log_choice=False), attention="xla")
        assert {joint.kind for joint in layers.joints(build_model(cfg))} == kinds, platform


def test_transformer_builds_without_a_mesh_and_from_a_recipe():
    from jaxlm import config
    from jaxlm.models.transformer import ModelConfig

    cfg = config.recipe("tiny", model__n_layers=2, model__variant="gpt2")
    mc = ModelConfig.from_config(cfg.model)
    assert (mc.norm, mc.mlp, mc.position, mc.use_bias) == ("layernorm", "gelu", "learned", True)
    assert isinstance(Transformer(mc, rngs=nnx.Rngs(0)), Transformer)
    mc = ModelConfig.from_config(config.recipe("tiny", model__mlp="gelu").model)  # an ablation of one component
    assert (mc.norm, mc.mlp, mc.position) == ("rmsnorm", "gelu", "rope")


def _segments_mask(seqlens, offsets, length):
    """[B, 1, T, T] bool: what attention within (seqlens, offsets) segments, causal in each, allows."""
    pos = jnp.arange(length)
    starts, lengths = offsets[:, :-1, None], seqlens[:, :, None]
    inside = (lengths > 0) & (pos >= starts) & (pos < starts + lengths)  # [B, M, T]
    same = jnp.einsum("bmq,bmk->bqk", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
    return (same & (pos[:, None] >= pos[None, :]))[:, None]


@pytest.mark.parametrize("max_segments", [4, 3])
def test_packed_segments_cover_each_document_causally(max_segments):
    """cuDNN's packed layout from segment ids (padding runs are segments too): the same mask as the
    document mask and the causal mask together, and `fits` is False once a row has too many runs."""
    seg = jnp.array([[1] * 5 + [2] * 3 + [3] * 6 + [0] * 2, [1] * 16, [1, 1, 2, 2, 3, 3] + [0] * 10])
    seqlens, offsets, fits = attention.packed_segments(seg, max_segments)
    assert bool(attention.packed_fits(seg, max_segments)) == bool(fits)  # the check alone, without the layout
    if max_segments == 4:
        assert bool(fits)
        np.testing.assert_array_equal(offsets, [[0, 5, 8, 14, -1], [0, -1, -1, -1, -1], [0, 2, 4, 6, -1]])
        np.testing.assert_array_equal(seqlens, [[5, 3, 6, 2], [16, -1, -1, -1], [2, 2, 2, 10]])
        causal = jnp.tril(jnp.ones((16, 16), bool))[None, None]
        want = causal & attention.document_mask(seg)
        np.testing.assert_array_equal(_segments_mask(seqlens, offsets, 16), want)
    else:  # rows 0 and 2 have 4 runs each
        assert not bool(fits)
        np.testing.assert_array_equal(offsets[1], [0, -1, -1, -1])


@pytest.mark.parametrize("scan_layers", [True, False])
def test_every_weight_matmul_goes_through_a_projection_whose_contraction_can_be_replaced(scan_layers):
    from jaxlm.models import layers

    cfg = small_config(scan_layers=scan_layers, n_layers=2)
    model = build_model(cfg)
    found = {"/".join(map(str, path)): proj for path, proj in layers.projections(model)}
    per_block = {"attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/w_gate", "mlp/w_up", "mlp/w_down"}
    blocks = [""] if scan_layers else ["0/", "1/"]
    assert set(found) == {f"blocks/{b}{name}" for b in blocks for name in per_block} | {"unembed"}
    wq, wo = found[f"blocks/{blocks[0]}attn/wq"], found[f"blocks/{blocks[0]}attn/wo"]
    assert wq.in_axes == (0,) and wo.in_axes == (0, 1)  # [D, N, H] contracts D; [N, H, D] contracts N, H
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    before = model(tokens)
    # A contraction that zeroes the residual branches (attention's and the MLP's output projections):
    # every block becomes the identity, so the logits are the unembedded, normed embeddings.
    for path, proj in found.items():
        if path.endswith(("attn/wo", "mlp/w_down")):
            proj.einsum_op = lambda eq, x, w: jnp.einsum(eq, x, w) * 0
    skipped = model.logits(model.final_norm(model.embed(tokens)))
    np.testing.assert_allclose(model(tokens), skipped, rtol=1e-6, atol=1e-6)
    assert not np.allclose(before, skipped, atol=1e-3)


def test_rope_scaling_changes_only_the_long_wavelengths():
    """Llama 3.1's scaling: wavelengths below original_max_len / high_freq_factor are kept, those
    above original_max_len / low_freq_factor divided by the factor, those between blended; linear
    divides them all. (Equality with transformers' RoPE: tests/test_hf.py.)"""
    from jaxlm.models.layers import rope_frequencies

    plain = np.asarray(rope_frequencies(64, 500000.0))
    scaled = np.asarray(rope_frequencies(64, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192))
    wavelen = 2 * np.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192
    assert short.any() and long.any() and (~short & ~long).any()
    floats.identical(scaled[short], plain[short], why=floats.MOVED)  # kept: the unscaled frequencies, selected
    np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-6)
    between = ~short & ~long
    assert np.all((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8))
    np.testing.assert_allclose(np.asarray(rope_frequencies(64, 1e4, "linear", 4.0)),
                               np.asarray(rope_frequencies(64, 1e4)) / 4, rtol=1e-6)


def test_remat_saves_memory_with_unrolled_layers_too():
    """Unrolled, XLA could merge the recomputation with the forward (CSE) and keep every activation:
    remat prevents it there (`transformer._remat`), so full remat compiles to less temporary memory."""

    def temp_bytes(cfg):
        tokens = jnp.zeros((8, 32), jnp.int32)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))  # compiled for shapes, never run
        grad = jax.jit(jax.value_and_grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes(small_config(n_layers=4, scan_layers=False))
    assert temp_bytes(small_config(n_layers=4, scan_layers=False, remat="full")) < 0.97 * plain


def _dot_generals(jaxpr) -> int:
    """dot_general equations in a jaxpr, inner jaxprs (remat, custom VJPs, scans) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _dot_generals(sub)
    return count


FUSABLE_CASES = [
    (dict(n_kv_heads=2), True, True),  # grouped-query heads: q, k and v in one matmul; no remat: gate and up too
    (dict(n_kv_heads=2, remat="dots"), True, False),  # the MLP's hidden activation recomputed: gate, up apart
    (dict(n_kv_heads=2, remat="dots_mlp"), True, True),  # ... and kept
    (dict(n_kv_heads=2, remat="full"), True, False),
    (dict(n_kv_heads=8), False, True),  # every head its own key and value: three
    (dict(n_kv_heads=2, lora=LoRA(4, 16.0, ("wq",))), False, True),  # an adapter on q: three
    (dict(n_kv_heads=2, lora=LoRA(4, 16.0, ("w_up",))), True, False),  # an adapter on up: two
    (dict(n_kv_heads=2, joint_projections=False), False, False),  # as on TPUs: each projection its own matmul
]
# the values compared in the default suite where the joint matmuls differ in kind (both joined; q, k, v joined
# beside an adapter; remat's recomputation of a joined layer); every case under `make test-slow`
FUSABLE_VALUES_BY_DEFAULT = (0, 3, 6)


def _joint_and_separate(kw, monkeypatch, *, values: bool):
    """((dot_generals, (loss, grads) or None) with the joint matmuls, the same with each projection its own)."""
    from jaxlm.models import layers

    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 96)
    graphdef, params = nnx.split(build_model(small_config(scan_layers=False, **kw)))  # each layer in the jaxpr

    def run():  # a new function each time: JAX caches traces by function
        def loss(p):
            return jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)

        return (_dot_generals(jax.make_jaxpr(loss)(params).jaxpr),
                jax.jit(jax.value_and_grad(loss))(params) if values else None)

    joint = run()
    monkeypatch.setattr(layers.Projection, "fusable", property(lambda self: False))
    return joint, run()


@pytest.mark.parametrize("kw, qkv, gate_up", FUSABLE_CASES)
def test_fusable_projections_of_one_input_are_one_matmul_exactly_where_they_should_be(kw, qkv, gate_up,
                                                                                     monkeypatch):
    """`layers.project_qkv` and `layers.project_gate_up` are taken exactly where they should be (counted in
    the jaxpr: two fewer dot_generals per layer for q, k and v, one fewer for gate and up)."""
    (dots, _), (three_dots, _) = _joint_and_separate(kw, monkeypatch, values=False)
    layers_ = small_config().n_layers
    assert three_dots - dots == 2 * layers_ * qkv + layers_ * gate_up


@pytest.mark.parametrize("kw, qkv, gate_up", [
    case if i in FUSABLE_VALUES_BY_DEFAULT else pytest.param(*case, marks=pytest.mark.slow)
    for i, case in enumerate(FUSABLE_CASES)])
def test_fusable_projections_of_one_input_are_one_matmul_with_the_same_values_and_gradients(kw, qkv, gate_up,
                                                                                            monkeypatch):
    """A joint matmul computes what the separate ones do: the loss and every gradient."""
    (_, (value, grads)), (_, (three_value, three_grads)) = _joint_and_separate(kw, monkeypatch, values=True)
    np.testing.assert_allclose(value, three_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, three_grads)


def test_dots_mlp_keeps_the_mlp_hidden_activation_as_well_as_what_dots_keeps():
    """remat=dots_mlp saves each layer's SwiGLU product by name (`layers.MLP_HIDDEN`) beside what `dots` saves,
    and nothing else: [B, T, F] more per layer. The backward pass then does not recompute the product (one
    logistic function fewer per layer in the gradient's jaxpr than under `dots`)."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxlm.models import layers

    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 96)

    def residuals_and_logistics(policy):
        cfg = small_config(n_kv_heads=2, remat=policy, scan_layers=False)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))  # traced for shapes, never run

        def loss(p):
            return jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)

        def count(jaxpr) -> int:
            n = sum(e.primitive.name == "logistic" for e in jaxpr.eqns)
            return n + sum(count(sub) for e in jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(e.params))

        return cfg, saved_residuals(loss, params), count(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)

    cfg, kept, kept_logistics = residuals_and_logistics("dots_mlp")
    _, dots, dots_logistics = residuals_and_logistics("dots")
    named = f"named '{layers.MLP_HIDDEN}'"
    hidden = [aval.shape for aval, why in kept if named in str(why)]
    assert hidden == [(2, 16, cfg.mlp_dim)] * cfg.n_layers
    assert not any(named in str(why) for _, why in dots)
    assert sum(a.size for a, _ in kept) == sum(a.size for a, _ in dots) + cfg.n_layers * 2 * 16 * cfg.mlp_dim
    # per layer: the forward's and the one in silu's derivative; `dots` recomputes the product once more
    assert kept_logistics == 2 * cfg.n_layers and dots_logistics == 3 * cfg.n_layers


@pytest.mark.parametrize("policy", ["dots", "dots_no_batch"])
def test_the_dots_policies_keep_the_rotated_q_and_k_instead_of_recomputing_the_rotation(policy):
    """Under remat's `dots` policies the attention's inputs are saved by name (`layers.ATTENTION_INPUTS`) after
    the rotary embedding, and the unrotated projections are not kept besides them: the same bytes saved as
    keeping the projections, and the backward pass holds no sine or cosine of the positions."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxlm.models import layers, transformer

    cfg = small_config(n_kv_heads=2, remat=policy, scan_layers=False)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 96)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))  # traced for shapes, never run

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)

    residuals = saved_residuals(loss, params)
    named = [aval for aval, why in residuals if layers.ATTENTION_INPUTS in str(why)]
    b, t, n, k, h = 2, 16, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    assert sorted(a.shape for a in named) == sorted([(b, t, n, h), (b, t, k, h), (b, t, k, h)] * cfg.n_layers)
    saved = sum(a.size for a, _ in residuals)
    # the policy without the name saves the unrotated projections instead: as many elements
    plain = {"dots": jax.checkpoint_policies.dots_saveable,
             "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]
    old = jax.checkpoint_policies.save_from_both_policies(plain, transformer._fused_attention_saveable)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(transformer.REMAT_POLICIES, policy, old)
        graphdef_old, params_old = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
        old_residuals = saved_residuals(lambda p: jnp.mean(nnx.merge(graphdef_old, p)(tokens) ** 2), params_old)
    assert saved == sum(a.size for a, _ in old_residuals)

    # The rotation's concatenations of q and k's halves (`layers.apply_rope`): once in the forward pass,
    # once in its transpose (the split's), and, under the old policy, a third time to recompute it
    def rotations(f, *args) -> int:
        def count(jaxpr) -> int:
            n = sum(e.primitive.name == "concatenate" and e.outvars[0].aval.shape[:2] == (b, t)
                    and e.outvars[0].aval.shape[-1] == h for e in jaxpr.eqns)  # [B, T, heads, H]
            return n + sum(count(sub) for e in jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(e.params))
        return count(jax.make_jaxpr(f)(*args).jaxpr)

    forward = rotations(loss, params)
    assert forward == 2 * cfg.n_layers
    assert rotations(jax.grad(loss), params) == 2 * forward
    with pytest.MonkeyPatch.context() as m:
        m.setitem(transformer.REMAT_POLICIES, policy, old)
        graphdef_old, params_old = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
        assert rotations(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef_old, p)(tokens) ** 2)), params_old) == 3 * forward


def test_weight_grad_einsum_gives_the_kernel_gradient_in_float32_as_the_grad_arrays():
    """`layers.weight_grad_einsum`: the forward is `jnp.einsum`; the kernel's gradient, made in float32 by
    the matmul, comes back as the `grad` argument's (whose value is never read); the kernel's own is zero."""
    from jaxlm.models import layers

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(8, 3, 4)), jnp.bfloat16)
    g = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.bfloat16)
    eq = "btd,dnh->btnh"
    y, vjp = jax.vjp(lambda x, k, a: layers.weight_grad_einsum(eq, x, k, a), x, kernel, jnp.full((8, 3, 4), 7.0))
    floats.identical(y, jnp.einsum(eq, x, kernel), why=floats.SAME_PROGRAM)  # the forward is that einsum
    dx, dkernel, dgrad = vjp(g)
    _, ref_vjp = jax.vjp(lambda x, k: jnp.einsum(eq, x, k), x, kernel)
    floats.close(dx, ref_vjp(g)[0])  # the custom backward's einsum against autodiff's transpose: two programs
    assert dgrad.dtype == jnp.float32 and not np.any(dkernel)
    ref = jnp.einsum("btd,btnh->dnh", x.astype(jnp.float32), g.astype(jnp.float32))
    np.testing.assert_allclose(dgrad, ref, rtol=1e-5, atol=1e-5)
    # the bfloat16 kernel gradient autodiff gives is that, rounded (autodiff's transpose against an einsum: two
    # programs)
    floats.close(ref_vjp(g)[1], jnp.einsum("btd,btnh->dnh", x, g))
    assert ref_vjp(g)[1].dtype == jnp.bfloat16


def test_compute_layout_joins_what_the_model_runs_as_one_matmul_and_splits_it_back():
    """`ModelSpec`: the plain projections' trainable kernels get `ComputeKernel`s; q, k, v (grouped-query heads)
    and gate, up (hidden activation kept) are joined in the compute layout as the model joins them, named
    for sharding, and `param_layout` gives the parameters back exactly. Kernels stacked for a layer scan get
    none (only the unembedding does)."""
    cfg = small_config(n_kv_heads=4, scan_layers=False, remat="dots_mlp", tie_embeddings=False, dtype=jnp.bfloat16)
    spec = build_model_spec(cfg)
    assert not build_model_spec(dataclasses.replace(cfg, scan_layers=True)).joints
    assert build_model_spec(dataclasses.replace(cfg, scan_layers=True)).grad_kernels == {("unembed", "kernel")}
    blocks = [("blocks", i) for i in range(cfg.n_layers)]
    assert [j.kind for j in spec.joints] == ["qkv", "gate_up"] * cfg.n_layers
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    expected = {(*b, group, n, "kernel") for b in blocks for group, ns in (("attn", names[:4]), ("mlp", names[4:]))
                for n in ns}
    assert spec.grad_kernels == expected | {("unembed", "kernel")}
    params = nnx.to_pure_dict(nnx.state(build_model(cfg), nnx.Param))
    trainable, _ = spec.split(params)
    layout = spec.compute_layout(trainable, cast=False)
    block = layout["blocks"][0]
    assert block["attn"]["wq"]["kernel"].shape == (64, 4, 4, 8)  # [D, K, N/K + 2, H]
    assert block["attn"]["wk"]["kernel"] is None and block["mlp"]["w_up"]["kernel"] is None
    assert block["mlp"]["w_gate"]["kernel"].shape == (64, 128, 2)
    floats.identical(block["mlp"]["w_gate"]["kernel"][..., 1], trainable["blocks"][0]["mlp"]["w_up"]["kernel"],
                     why=floats.MOVED)
    mask = spec.kernel_mask(layout)
    assert mask["blocks"][0]["attn"]["wq"]["kernel"] and mask["blocks"][1]["attn"]["wo"]["kernel"]
    assert mask["unembed"]["kernel"] and not mask["blocks"][0]["attn_norm"]["scale"] and not mask["embed"]["embedding"]
    layer_names = spec.compute_names()["blocks"][0]
    assert layer_names["attn"]["wq"]["kernel"] == ("embed", "kv_heads", None, "head_dim")
    assert layer_names["mlp"]["w_gate"]["kernel"] == ("embed", "mlp", None)
    floats.identical(spec.param_layout(layout), trainable, why=floats.MOVED)
    # the step's: cast to the compute dtype, then joined
    assert spec.compute_layout(trainable)["unembed"]["kernel"].dtype == jnp.bfloat16
    assert spec.compute_layout(trainable)["blocks"][1]["attn"]["wq"]["kernel"].dtype == jnp.bfloat16


def test_no_compute_kernels_where_the_weight_is_not_a_plain_trained_kernel():
    """LoRA (the base frozen, the adapters not plain kernels), a part of a joint group frozen (the group is
    left to the model's own join, per micro-batch), the accumulating matmul: none or fewer `ComputeKernel`s."""
    cfg = small_config(n_kv_heads=4, remat="dots_mlp", tie_embeddings=False, scan_layers=False, n_layers=1)
    assert not build_model_spec(dataclasses.replace(cfg, lora=LoRA(4, 16.0, ("wq", "wv")))).grad_kernels
    assert not build_model_spec(dataclasses.replace(cfg, matmul="accumulate")).grad_kernels
    only_q = build_model_spec(cfg, trainable="wq|w_gate|w_down")
    assert only_q.joints == () and only_q.grad_kernels == {("blocks", 0, "mlp", "w_down", "kernel")}
