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


@pytest.mark.parametrize("strategy", [*context_parallel.STRATEGIES, "ring-tiles-of-2"])
@pytest.mark.parametrize("layout", context_parallel.LAYOUTS)
@pytest.mark.parametrize("name", [n if n == "context8" else pytest.param(n, marks=pytest.mark.slow) for n in MESHES])
def test_attention_across_the_split_sequence_equals_the_reference(strategy, layout, name, monkeypatch):
    """Each strategy under each layout: the output and the gradients of q, k and v (grouped-query heads, packed
    documents crossing the chunks' boundaries, padding) equal plain attention over the whole sequence to
    float32's rounding. The inputs go in and come out in the sequence's order, reordered around the call as
    the model does. `ring-tiles-of-2`: the ring's blocks of scores 2 x 2 (several per step, those above the
    diagonal skipped), where the others' are each step's whole square."""
    if strategy == "ring-tiles-of-2":
        monkeypatch.setattr(context_parallel, "RING_TILE", 2)
        strategy = "ring"
    q, k, v, seg, d_out = _inputs()
    want = _loss_and_grads(lambda q, k, v, s: attention.reference_attention(q, k, v, segment_ids=s), q, k, v, seg, d_out)

    def split(q, k, v, s):
        there = functools.partial(context_parallel.to_layout, layout=layout)
        out = attention.attend(there(q), there(k), there(v), segment_ids=there(s), context_strategy=strategy,
                               context_layout=layout)
        return context_parallel.from_layout(out, layout)

    with jax.set_mesh(_mesh(**MESHES[name])), spmd.logical_axis_rules(RULES):
        got = jax.jit(functools.partial(_loss_and_grads, split))(q, k, v, seg, d_out)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
