"""The auxiliary-output channel (`jaxlm.models.aux`): what a block returns beside its output reaches
the loss, its gradient and the step's metrics, whichever way the layers run.

The block here is a SwiGLU MLP registered for the test that also returns a dummy auxiliary loss, c times
the sum of squares of its up projection's kernel (gradient: 2 c W, known exactly), and a metric that
depends on the data, the mean of its input over the tokens.
"""

from __future__ import annotations

import json

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import random_batch, small_config, train_tiny
from jaxlm import steps, train_state
from jaxlm.models import mlps
from jaxlm.models.mlps.swiglu import GatedMLP
from jaxlm.models.transformer import Transformer

COEF = 0.01


class AuxMLP(GatedMLP):
    name = "swiglu_aux"
    aux_names = ("dummy_loss", "input_mean", "up_by_layer")

    @classmethod
    def aux_shapes(cls, cfg):
        return {**super().aux_shapes(cfg), "up_by_layer": (2,)}

    def __call__(self, x, dropout_key=None):
        kernel = self.w_up.kernel[...]
        square = jnp.sum(jnp.square(kernel.astype(jnp.float32)))
        out = {"dummy_loss": COEF * square, "input_mean": jnp.mean(x.astype(jnp.float32)),
               # kept per layer: the layer's own sum of squares, and 1 (each layer's value its own)
               "up_by_layer": jnp.stack([square, jnp.ones((), jnp.float32)])}
        return super().__call__(x, dropout_key), out


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(mlps.MLPS, AuxMLP.name, AuxMLP)


WAYS = {
    "scanned": dict(),
    "unrolled": dict(scan_layers=False),
    "scanned-remat": dict(remat="full"),
    "unrolled-remat": dict(scan_layers=False, remat="dots"),
    "pipelined": dict(n_layers=4, pipeline_stages=2, pipeline_microbatches=2),
    "pipelined-circular": dict(n_layers=4, pipeline_stages=2, pipeline_microbatches=2, pipeline_repeats=2),
}
# in the slow suite: the circular schedule's layer order, and remat in unrolled layers (each of the two alone here)
SLOW_WAYS = {"pipelined-circular", "unrolled-remat"}


def _loss_and_grads(cfg, with_aux: bool):
    model = Transformer(cfg, rngs=nnx.Rngs(params=0))
    spec = train_state.build_model_spec(cfg)
    params = nnx.to_pure_dict(nnx.state(model))
    batch = {k: jnp.asarray(v) for k, v in random_batch(4, cfg.max_seq_len, cfg.vocab_size, packed=False).items()}

    def loss(p):
        total, stats = steps.summed_loss(p, spec, batch, None, 0.0, with_aux=with_aux)
        tokens = stats[0] if with_aux else stats
        return total / tokens, stats

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return params, value, stats, grads


@pytest.mark.parametrize("way", [pytest.param(w, marks=pytest.mark.slow) if w in SLOW_WAYS else w for w in WAYS])
def test_an_auxiliary_loss_reaches_the_loss_and_its_gradient(way):
    cfg = small_config(mlp=AuxMLP.name, **WAYS[way])
    params, total, (tokens, out), grads = _loss_and_grads(cfg, with_aux=True)
    _, lm_loss, _, lm_grads = _loss_and_grads(cfg, with_aux=False)
    up = np.asarray(params["blocks"]["mlp"]["w_up"]["kernel"]) if cfg.scan_layers else np.stack(
        [np.asarray(params["blocks"][i]["mlp"]["w_up"]["kernel"]) for i in range(cfg.n_layers)])
    dummy = COEF * np.sum(np.square(up, dtype=np.float64))  # summed over the layers
    floats.close(np.float32(out["dummy_loss"] / tokens), np.float32(dummy))
    # a per-layer output: each layer's own value, in layer order (the pipeline's stages and repeats too)
    per_layer = np.asarray(out["up_by_layer"] / tokens)
    assert per_layer.shape == (cfg.n_layers, 2)
    floats.close(per_layer[:, 0], np.sum(np.square(up, dtype=np.float64), axis=(1, 2)).astype(np.float32))
    floats.close(per_layer[:, 1], np.ones(cfg.n_layers, np.float32))
    floats.close(np.float32(total - lm_loss), np.float32(dummy), ulps=64)  # a difference of two sums
    # The gradient: the language model's, plus 2 c W on every layer's up projection, nothing elsewhere.
    diff = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), grads, lm_grads)
    if cfg.scan_layers:
        got_up = diff["blocks"]["mlp"]["w_up"]["kernel"]
        diff["blocks"]["mlp"]["w_up"]["kernel"] = np.zeros_like(got_up)
    else:
        got_up = np.stack([diff["blocks"][i]["mlp"]["w_up"]["kernel"] for i in range(cfg.n_layers)])
        for i in range(cfg.n_layers):
            diff["blocks"][i]["mlp"]["w_up"]["kernel"] = np.zeros_like(got_up[i])
    floats.close(got_up, 2 * COEF * up, ulps=64)
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(lm_grads))
    assert max(float(np.abs(d).max()) for d in jax.tree.leaves(diff)) <= 1e-5 * largest


def test_a_data_dependent_output_is_the_same_mean_whichever_way_the_layers_run():
    """A mean over the tokens each block saw: the pipeline's micro-batches average to the whole batch's.
    (Stacked layers draw other initial weights than a list of them: each is compared with its own kind.)"""
    base = dict(n_layers=4)
    values = {way: _loss_and_grads(small_config(mlp=AuxMLP.name, **{**base, **kw}), with_aux=True)[2]
              for way, kw in WAYS.items() if way not in SLOW_WAYS}
    means = {way: float(out["input_mean"] / tokens) for way, (tokens, out) in values.items()}
    assert means["scanned"] != 0.0 and means["unrolled"] != 0.0
    for way, value in means.items():
        same_weights = "unrolled" if way.startswith("unrolled") else "scanned"
        floats.close(np.float32(value), np.float32(means[same_weights]), ulps=64, err_msg=way)


@pytest.mark.parametrize("overrides", [
    # all in the slow suite (the default suite's budget): tests/test_moe.py trains an MoE through the step and
    # reads its auxiliary metrics; these run `python -m jaxlm.train`'s loop and read the files back
    pytest.param((("optim.micro_batches", "1"),), marks=pytest.mark.slow),
    # the micro-batch loop (in the slow suite: data-replicas runs a micro-batch loop too, each replica's)
    pytest.param((("optim.micro_batches", "2"),), marks=pytest.mark.slow),
    # each data replica's own loop (slow too: tests/test_train_step.py checks the replicas' step in the default suite)
    pytest.param((("optim.micro_batches", "2"), ("mesh.data", "2"), ("mesh.fsdp", "4")), marks=pytest.mark.slow),
], ids=["one-micro-batch", "micro-batches", "data-replicas"])
def test_a_run_logs_the_auxiliary_outputs_and_trains_on_the_loss_with_them(tmp_path, overrides):
    def first_steps(name, *more):
        train_tiny(tmp_path, name, ("run.steps", "2"), ("run.log_every", "1"), ("run.eval_every", "0"), *overrides,
                   *more)
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [m for m in lines if "loss" in m]

    with_aux, plain = first_steps("aux", ("model.mlp", AuxMLP.name)), first_steps("plain")
    assert [m["step"] for m in with_aux] == [1, 2] and "aux/dummy_loss" not in plain[0]
    for m in with_aux:
        assert m["aux/dummy_loss"] > 0 and np.isfinite(m["aux/input_mean"])
        # a per-layer output: one float per layer and element, each layer's value 1 in its second
        assert [m[f"aux/up_by_layer/layer_{i:02d}/1"] for i in range(4)] == pytest.approx([1.0] * 4, rel=1e-6)
        assert all(m[f"aux/up_by_layer/layer_{i:02d}/0"] > 0 for i in range(4))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "aux" / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    read = events.Scalars("aux/up_by_layer/layer_03/0")  # each per-layer element a TensorBoard scalar
    assert [e.step for e in read] == [1, 2]
    floats.close(np.float32([e.value for e in read]), np.float32([m["aux/up_by_layer/layer_03/0"] for m in with_aux]))
    # Step 1's loss is computed from the same initial weights (the MLP is SwiGLU's, drawn alike): the
    # language model's loss plus the auxiliary loss
    floats.close(np.float32(with_aux[0]["loss"] - plain[0]["loss"]), np.float32(with_aux[0]["aux/dummy_loss"]),
                 ulps=64)
