"""Context parallelism's pieces on 8 CPU devices: the balanced (zig-zag) layout and its reordering, and the
all-gather and ring strategies of attention against the plain reference, forward and backward, on packed
documents of uneven lengths (`jaxlm.models.context_parallel`). Training through them: test_parallelism.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import spmd

from jaxlm import axes
from jaxlm import mesh as mesh_lib
from jaxlm.models import attention, context_parallel


@pytest.mark.parametrize("context", [2, 4, 8])
def test_the_balanced_layout_gives_every_device_the_same_causal_work(context):
    """Counted from each device's share of the causal mask at 512 tokens: balanced equal within 5% (it is
    exact), contiguous not (the last device does 2c - 1 times the first's work)."""
    balanced = context_parallel.causal_work(512, context, "balanced")
    contiguous = context_parallel.causal_work(512, context, "contiguous")
    assert balanced.sum() == contiguous.sum() == 512 * 513 // 2
    assert balanced.max() <= 1.05 * balanced.min()
    assert contiguous.max() > 1.05 * contiguous.min()
    assert (balanced == balanced[0]).all()


def test_the_balanced_order_takes_chunks_i_and_2c_minus_1_minus_i():
    order = context_parallel.layout_order(16, 4, "balanced").reshape(4, 4)
    np.testing.assert_array_equal(order, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
    np.testing.assert_array_equal(context_parallel.layout_order(16, 4, "contiguous"), np.arange(16))


def _mesh(**sizes):
    return mesh_lib.make_mesh(axes.shape_of(**sizes))


RULES = mesh_lib.rules_from_config(mesh_lib.default_rules())
MESHES = {"context8": dict(fsdp=1, context=8), "context4-data2": dict(fsdp=1, data=2, context=4),
          "context2-fsdp2-tensor2": dict(fsdp=2, context=2, tensor=2)}


@pytest.mark.parametrize("name", list(MESHES))
def test_reordering_into_the_balanced_layout_and_back(name):
    sizes = MESHES[name]
    x = jnp.arange(4 * 32 * 3).reshape(4, 32, 3)
    with jax.set_mesh(_mesh(**sizes)), spmd.logical_axis_rules(RULES):
        there = jax.jit(lambda x: context_parallel.to_layout(x, "balanced"))(x)
        back = jax.jit(lambda x: context_parallel.from_layout(x, "balanced"))(there)
    order = context_parallel.layout_order(32, sizes["context"], "balanced")
    np.testing.assert_array_equal(np.asarray(there), np.asarray(x)[:, order])
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def _packed(batch, seq, seed):
    """Segment ids of documents of uneven lengths (2 to seq/3), some rows ending in padding (0)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        at, doc, end = 0, 0, seq - 3 * (row % 2)
        while at < end:
            n = min(int(rng.integers(2, seq // 3)), end - at)
            doc += 1
            ids[row, at:at + n] = doc
            at += n
    return ids


@functools.cache
def _inputs(seq=64, batch=4, n=4, kv=2, h=8):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, n, h), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq, kv, h), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq, kv, h), jnp.float32)
    d_out = jax.random.normal(keys[3], (batch, seq, n, h), jnp.float32)
    return q, k, v, jnp.asarray(_packed(batch, seq, 0)), d_out


def _loss_and_grads(fn, q, k, v, seg, d_out):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, seg) * d_out)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


# The default suite runs each strategy under one layout, the two layouts alternating; `make test-slow` every pair
_SPLIT_BY_DEFAULT = {("allgather", "contiguous"), ("ring", "balanced"), ("ring-tiles-of-2", "contiguous"),
                     ("ring-flash-blocks", "contiguous"), ("ring-flash-diagonal-tiles-of-4", "balanced")}


@pytest.mark.parametrize("strategy, layout", [
    pair if pair in _SPLIT_BY_DEFAULT else pytest.param(*pair, marks=pytest.mark.slow)
    for pair in ((s, layout) for s in (*context_parallel.STRATEGIES, "ring-tiles-of-2", "ring-flash-blocks",
                                       "ring-flash-diagonal-tiles-of-4") for layout in context_parallel.LAYOUTS)])
@pytest.mark.parametrize("name", [n if n == "context8" else pytest.param(n, marks=pytest.mark.slow) for n in MESHES])
def test_attention_across_the_split_sequence_equals_the_reference(strategy, layout, name, monkeypatch):
    """Each strategy under each layout: the output and the gradients of q, k and v (grouped-query heads, packed
    documents crossing the chunks' boundaries, padding) equal plain attention over the whole sequence to
    float32's rounding. The inputs go in and come out in the sequence's order, reordered around the call as
    the model does. `ring-tiles-of-2`: the ring's blocks of scores 2 x 2 (several per step, those above the
    diagonal skipped), where the others' are each step's whole square. `ring-flash-blocks`: the ring GPUs run with
    cuDNN's kernel per block (`model.attention='cudnn'`), its blocks here by `XlaBlocks`, which emulates the
    kernel's masks and gives NaN wherever the kernel's results are unspecified; `ring-flash-diagonal-tiles-of-4`:
    the same with the diagonal step in tiles of 4 (those below the diagonal padded calls, those above skipped)."""
    implementation = "xla"
    if strategy == "ring-tiles-of-2":
        monkeypatch.setattr(context_parallel, "RING_TILE", 2)
        strategy = "ring"
    if strategy == "ring-flash-diagonal-tiles-of-4":
        monkeypatch.setattr(context_parallel, "RING_DIAGONAL", 4)
        strategy = "ring-flash-blocks"
    if strategy == "ring-flash-blocks":
        monkeypatch.setitem(context_parallel.RING_BLOCKS, "cudnn", context_parallel.XlaBlocks())
        strategy, implementation = "ring", "cudnn"
    q, k, v, seg, d_out = _inputs()
    want = _loss_and_grads(lambda q, k, v, s: attention.reference_attention(q, k, v, segment_ids=s), q, k, v, seg, d_out)

    def split(q, k, v, s):
        there = functools.partial(context_parallel.to_layout, layout=layout)
        out = attention.attend(there(q), there(k), there(v), segment_ids=there(s), context_strategy=strategy,
                               context_layout=layout, implementation=implementation)
        return context_parallel.from_layout(out, layout)

    with jax.set_mesh(_mesh(**MESHES[name])), spmd.logical_axis_rules(RULES):
        got = jax.jit(functools.partial(_loss_and_grads, split))(q, k, v, seg, d_out)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_an_off_diagonal_block_shares_at_most_the_document_across_its_boundary():
    """Keys all before the queries: the allowed pairs are the queries' prefix and the keys' suffix in the document
    running from the keys' last token to the queries' first (padding, id 0, included); none when that document
    differs, or the block is masked whole (`live` false). Lengths at least 1, the kernel's lower bound."""
    seg_q = jnp.asarray([[3, 3, 4, 5], [2, 2, 2, 2], [0, 0, 0, 0]])
    seg_k = jnp.asarray([[1, 2, 3, 3], [1, 1, 1, 1], [5, 6, 0, 0]])
    q_len, kv_len, ok = context_parallel._shared_document(seg_q, seg_k, jnp.asarray(True))
    np.testing.assert_array_equal(q_len, [2, 1, 4])
    np.testing.assert_array_equal(kv_len, [2, 1, 2])
    np.testing.assert_array_equal(ok, [True, False, True])
    _, _, ok = context_parallel._shared_document(seg_q, seg_k, jnp.asarray(False))
    np.testing.assert_array_equal(ok, [False, False, False])


def test_the_planner_counts_the_ring_by_the_kernel_of_its_blocks():
    """cuDNN's blocks where model.attention is cuDNN (GPUs), XLA's tiles otherwise."""
    assert attention.context_kernel("ring", "cudnn") is attention.CONTEXT_KERNELS[("ring", "cudnn")]
    assert isinstance(attention.context_kernel("ring", "cudnn"), attention.CudnnRingKernel)
    for implementation in ("xla", "blocked", "pallas"):
        assert attention.context_kernel("ring", implementation).name == "ring (XLA einsums)"
    assert set(context_parallel.RING_BLOCKS) == {"cudnn"}


@pytest.mark.parametrize("layout", ["balanced", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_the_flash_ring_in_bfloat16_stays_close_to_the_reference(layout, monkeypatch):
    """The dtypes GPUs run the cuDNN ring in: bfloat16 q, k, v and cotangent through the blocks (emulated), the
    steps combined in float32; output and gradients within bfloat16's rounding of float32 attention."""
    monkeypatch.setitem(context_parallel.RING_BLOCKS, "cudnn", context_parallel.XlaBlocks())
    q, k, v, seg, d_out = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in _inputs())
    want = _loss_and_grads(lambda q, k, v, s: attention.reference_attention(q, k, v, segment_ids=s),
                           *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in (q, k, v, seg, d_out)))

    def split(q, k, v, s):
        there = functools.partial(context_parallel.to_layout, layout=layout)
        out = attention.attend(there(q), there(k), there(v), segment_ids=there(s), context_strategy="ring",
                               context_layout=layout, implementation="cudnn")
        return context_parallel.from_layout(out, layout)

    with jax.set_mesh(_mesh(**MESHES["context8"])), spmd.logical_axis_rules(RULES):
        got = jax.jit(functools.partial(_loss_and_grads, split))(q, k, v, seg, d_out)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.bfloat16 or g.ndim == 0
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0.05, atol=0.05 * float(np.abs(w).max()))
