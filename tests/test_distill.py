"""Distillation (`jaxlm.post_training.distill`): the loss and its gradient against a direct NumPy computation,
the chunked loss against the whole one, no gradient into the teacher, the tokenizer check, and a teacher read
from a real run onto another mesh giving the logits inference gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd

from helpers import llama_layout_model, random_batch, small_config
from jaxlm import axes, config, inference, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError
from jaxlm.post_training import distill
from jaxlm.post_training import teacher as teacher_lib

B, T, V = 2, 5, 11


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def numpy_kl(s, t, temperature, top_k=0):
    """KL(teacher || student) per position in float64; with top_k, over the teacher's top k and the rest."""
    ls, lt = _log_softmax(s / temperature), _log_softmax(t / temperature)
    pt, ps = np.exp(lt), np.exp(ls)
    if not top_k:
        return (pt * (lt - ls)).sum(-1)
    kept = t >= np.sort(t, -1)[..., -top_k][..., None]
    inside = np.where(kept, pt * (lt - ls), 0).sum(-1)
    rest_t, rest_s = np.where(kept, 0, pt).sum(-1), np.where(kept, 0, ps).sum(-1)
    return inside + np.where(rest_t > 0, rest_t * np.log(np.maximum(rest_t, 1e-300) / rest_s), 0)


def numpy_grad(s, t, targets, weights, temperature, alpha, top_k=0):
    """d(sum of w * (alpha T^2 KL + (1 - alpha) CE)) / d(student logits), derived by hand: the KL's is
    (p_student^T - q) / T with q the teacher's probabilities (on the top k; the rest's probability spread
    as the student spreads its own over the rest), the cross-entropy's softmax - one-hot."""
    ps, pt = np.exp(_log_softmax(s / temperature)), np.exp(_log_softmax(t / temperature))
    q = pt
    if top_k:
        kept = t >= np.sort(t, -1)[..., -top_k][..., None]
        rest_t, rest_s = np.where(kept, 0, pt).sum(-1, keepdims=True), np.where(kept, 0, ps).sum(-1, keepdims=True)
        q = np.where(kept, pt, rest_t * ps / rest_s)
    one_hot = np.eye(s.shape[-1])[targets]
    grad = alpha * temperature * (ps - q) + (1 - alpha) * (np.exp(_log_softmax(s)) - one_hot)
    return grad * weights[..., None]


def tiny_batch(seed=0):
    rng = np.random.default_rng(seed)
    student = rng.normal(0, 2, (B, T, V))
    teacher = rng.normal(0, 2, (B, T, V))
    targets = rng.integers(0, V, (B, T))
    weights = np.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], np.float64)
    return student, teacher, targets, weights


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("alpha", [1.0, 0.25, 0.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_loss_and_gradient_match_numpy(temperature, alpha, top_k):
    s, t, targets, w = tiny_batch()
    settings = distill.DistillConfig(temperature=temperature, alpha=alpha, top_k=top_k)

    def total(student, teacher):
        return distill.loss_sums(student, teacher, jnp.asarray(targets), jnp.asarray(w, jnp.float32), settings)

    loss, kl, ce = total(jnp.float32(s), jnp.float32(t))
    g_student, g_teacher = jax.grad(lambda a, b: total(a, b)[0], argnums=(0, 1))(jnp.float32(s), jnp.float32(t))

    np_kl = numpy_kl(s, t, temperature, top_k)
    np_ce = -np.take_along_axis(_log_softmax(s), targets[..., None], -1)[..., 0]
    np_loss = (w * (alpha * temperature**2 * np_kl + (1 - alpha) * np_ce)).sum()
    np.testing.assert_allclose(float(kl), (w * np_kl).sum(), rtol=2e-5)
    np.testing.assert_allclose(float(ce), (w * np_ce).sum(), rtol=2e-5)
    np.testing.assert_allclose(float(loss), np_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_student), numpy_grad(s, t, targets, w, temperature, alpha, top_k),
                               atol=2e-6)
    assert not np.any(np.asarray(g_teacher))  # the teacher's logits are a target: no gradient
    assert np_kl.min() > 0.01  # the distributions differ: a KL of 0 would not test much


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_kl_is_zero_when_the_student_is_the_teacher(temperature, top_k):
    s, t, targets, w = tiny_batch(1)
    settings = distill.DistillConfig(temperature=temperature, alpha=1.0, top_k=top_k)
    loss, kl, _ = distill.loss_sums(jnp.float32(t), jnp.float32(t), jnp.asarray(targets), jnp.float32(w), settings)
    assert abs(float(kl)) < 1e-5 and abs(float(loss)) < 1e-4
    grad = jax.grad(lambda a: distill.loss_sums(a, jnp.float32(t), jnp.asarray(targets), jnp.float32(w),
                                                settings)[0])(jnp.float32(t))
    assert np.abs(np.asarray(grad)).max() < 1e-6
    # and above zero for another student; the top-k KL never above the full one (it compares coarser outcomes)
    full = distill.token_kl(jnp.float32(s), jnp.float32(t), temperature)
    coarse = distill.token_kl(jnp.float32(s), jnp.float32(t), temperature, 3)
    assert float(full.min()) > 0 and float(coarse.min()) >= 0
    assert np.all(np.asarray(coarse) <= np.asarray(full) + 1e-6)


def test_top_k_of_a_whole_vocabulary_is_the_full_kl_and_ties_stay_finite():
    s, t, _, _ = tiny_batch(2)
    s, t = jnp.float32(s), jnp.float32(t)
    np.testing.assert_allclose(distill.token_kl(s, t, 1.5, V), distill.token_kl(s, t, 1.5), rtol=1e-5, atol=1e-7)
    flat = jnp.zeros_like(t)  # every logit tied at the k-th: all kept, the rest empty
    value, grad = jax.value_and_grad(lambda a: jnp.sum(distill.token_kl(a, flat, 1.0, 3)))(s)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    np.testing.assert_allclose(float(value), numpy_kl(np.asarray(s, np.float64), np.zeros((B, T, V)), 1.0).sum(),
                               rtol=1e-5)


@pytest.mark.parametrize("top_k", [0, 4])
def test_the_chunked_loss_equals_the_whole_one(top_k):
    """Logits made 4 positions at a time from hidden states: the same sums and gradients."""
    rng = np.random.default_rng(3)
    b, t, d, d_teacher, v = 2, 8, 6, 5, 13
    x, tx = jnp.float32(rng.normal(size=(b, t, d))), jnp.float32(rng.normal(size=(b, t, d_teacher)))
    w_s, w_t = jnp.float32(rng.normal(size=(d, v))), jnp.float32(rng.normal(size=(d_teacher, v)))
    targets, weights = jnp.asarray(rng.integers(0, v, (b, t))), jnp.float32(rng.integers(0, 2, (b, t)))
    settings = distill.DistillConfig(temperature=2.0, alpha=0.5, top_k=top_k)

    def whole(x, w_s):
        return distill.loss_sums(x @ w_s, tx @ w_t, targets, weights, settings, 1e-3)

    def chunked(x, w_s):
        return distill.chunked_loss_sums(lambda c: c @ w_s, x, lambda c: c @ w_t, tx, targets, weights, settings,
                                         1e-3, 4)

    np.testing.assert_allclose(jnp.stack(jax.jit(chunked)(x, w_s)), jnp.stack(jax.jit(whole)(x, w_s)), rtol=1e-5)
    got = jax.jit(jax.grad(lambda *args: chunked(*args)[0], argnums=(0, 1)))(x, w_s)
    want = jax.jit(jax.grad(lambda *args: whole(*args)[0], argnums=(0, 1)))(x, w_s)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # ~8 s; tests/test_distill_objective.py runs the teacher in the step
def test_summed_loss_on_two_models_runs_the_teacher_without_a_gradient():
    """A student and a wider teacher (same vocabulary): the loss equals `loss_sums` of their logits, the
    chunked path equals it, no gradient reaches the teacher's parameters, and a teacher that is the
    student gives a KL of 0."""
    student_cfg, teacher_cfg = small_config(), small_config(d_model=96, mlp_dim=160)
    student = train_state.build_model_spec(student_cfg)
    teacher = train_state.build_model_spec(teacher_cfg)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(train_state.build_model(student_cfg, seed=0), nnx.Param)))()
    t_params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(train_state.build_model(teacher_cfg, seed=1), nnx.Param)))()
    batch = {k: jnp.asarray(v) for k, v in random_batch(2, 16, 96).items()}
    settings = distill.DistillConfig(temperature=2.0, alpha=0.5)

    @jax.jit
    def loss(p, tp, chunk=0):
        return distill.summed_loss(p, student, tp, teacher, batch, None, settings, 0.0, chunk)

    total, (tokens, _, terms) = loss(params, t_params)
    logits = nnx.merge(student.graphdef, params)(batch["inputs"], batch["positions"], batch["segment_ids"])
    t_logits = nnx.merge(teacher.graphdef, t_params)(batch["inputs"], batch["positions"], batch["segment_ids"])
    expected = distill.loss_sums(logits, t_logits, batch["targets"], batch["weights"], settings)
    np.testing.assert_allclose([total, terms["distill/kl"], terms["distill/ce"]], expected, rtol=1e-5)
    assert float(tokens) == float(batch["weights"].sum()) and float(terms["distill/kl"]) > 0
    np.testing.assert_allclose(jax.jit(loss.__wrapped__, static_argnums=2)(params, t_params, 4)[0], total, rtol=1e-5)

    g_student, g_teacher = jax.jit(jax.grad(lambda p, tp: loss(p, tp)[0], argnums=(0, 1)))(params, t_params)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(g_teacher))
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(g_student)) > 0

    same = jax.jit(lambda p: distill.summed_loss(p, student, p, student, batch, None, settings))(params)
    assert abs(float(same[1][2]["distill/kl"])) < 1e-5


def test_the_settings_are_checked_in_one_line():
    for bad, key in [(dict(temperature=0.0), "temperature"), (dict(alpha=1.5), "alpha"), (dict(top_k=-1), "top_k"),
                     (dict(teacher_param_dtype="int8"), "teacher_param_dtype")]:
        with pytest.raises(UserError) as e:
            distill.DistillConfig(**bad).validate()
        assert str(e.value).startswith(f"config.distill.{key}=") and "\n" not in str(e.value)
    distill.DistillConfig(temperature=2.0, alpha=0.0, top_k=20).validate()


@pytest.fixture
def other_tokenizer(tmp_path):
    path = tmp_path / "llama" / "tokenizer.model"
    path.parent.mkdir()
    path.write_bytes(llama_layout_model())
    return Tokenizer.load(path), path


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(facts_run, other_tokenizer):
    student_tok, student_path = other_tokenizer
    teacher_tok = Tokenizer.load(facts_run)
    with pytest.raises(UserError) as e:
        distill.check_same_tokenizer(student_tok, teacher_tok, str(student_path), str(facts_run / "tokenizer.model"))
    message = str(e.value)
    assert "\n" not in message
    for text in (str(student_path), str(facts_run / "tokenizer.model"), student_tok.sha256[:16], teacher_tok.sha256[:16],
                 f"{student_tok.vocab_size} tokens", f"{teacher_tok.vocab_size} tokens"):
        assert text in message, (text, message)
    distill.check_same_tokenizer(teacher_tok, Tokenizer.load(facts_run), "a", "b")  # the same tokenizer passes

    # load_teacher refuses before reading any parameter, and a model of another width in its own line
    rules = mesh_lib.rules_from_config(config.base_config().mesh.rules)
    mesh = mesh_lib.make_mesh(axes.shape_of(fsdp=8))
    settings = distill.DistillConfig(teacher=str(facts_run))
    with pytest.raises(UserError, match="the teacher's tokenizer is not the student's"):
        teacher_lib.load_teacher(settings, mesh, rules, student_tok, 300, str(student_path))
    with pytest.raises(UserError, match=r"logits over 300 ids .* and the student over 512; .*vocab_size=300$"):
        teacher_lib.load_teacher(settings, mesh, rules, teacher_tok, 512)


def test_a_teacher_read_from_a_run_onto_the_students_mesh_gives_the_logits_inference_gives(facts_run):
    """The facts run (trained on one device) as a teacher on a data x fsdp x tensor = 2 x 2 x 2 mesh by the
    default rules: its forward pass as the step runs it equals the logits of `inference.load_run`'s model on
    the mesh load_run picks."""
    rules = mesh_lib.rules_from_config(config.base_config().mesh.rules)
    mesh = mesh_lib.make_mesh(axes.shape_of(data=2, fsdp=2, tensor=2))
    tokenizer = Tokenizer.load(facts_run)
    teacher = teacher_lib.load_teacher(distill.DistillConfig(teacher=str(facts_run)), mesh, rules, tokenizer, 300,
                                   dtype="float32")
    embed = teacher.params["embed"]["embedding"]
    assert embed.sharding.mesh == mesh and embed.sharding.spec == mesh_lib.logical_to_spec(("vocab", "embed"), rules)

    ids = tokenizer.encode(["alice likes apples. bob likes", "carol likes"] * 4, add_eos=False)
    tokens = np.zeros((8, 16), np.int32)
    segments = np.zeros((8, 16), np.int32)
    for i, row in enumerate(ids):
        tokens[i, :len(row)], segments[i, :len(row)] = row[:16], 1
    batch = {"inputs": tokens, "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (8, 16)),
             "segment_ids": segments}

    def logits_on(mesh, rules, forward, params):
        with jax.set_mesh(mesh):
            @jax.jit
            def run(params, batch):
                with spmd.logical_axis_rules(rules):
                    return forward(params, batch)
            return np.asarray(run(params, batch))

    got = logits_on(mesh, rules, lambda p, b: distill.teacher_forward(p, teacher.model_spec, b), teacher.params)
    reference = inference.load_run(facts_run, dtype="float32")
    assert reference.step == teacher.step and reference.mesh.shape != mesh.shape
    want = logits_on(reference.mesh, reference.rules,
                     lambda p, b: nnx.merge(reference.model_spec.graphdef, p)(
                         b["inputs"], b["positions"], b["segment_ids"]), reference.params)
    real = segments.astype(bool)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert np.abs(want[real]).max() > 1  # a trained model's logits, not zeros

    # as the train step will take it: the teacher's params a frozen input of the jitted step, with their
    # shardings; a student that is the teacher has a KL of 0 and a gradient of 0
    targets = np.roll(tokens, -1, axis=1)
    weights = (segments * np.roll(segments, -1, axis=1)).astype(np.float32)
    weights[:, -1] = 0
    full = {**batch, "targets": targets, "weights": weights}
    loss = distill.make_trainable_loss(teacher.model_spec, distill.DistillConfig(temperature=2.0))

    def grads(student, teacher_params, batch):
        with spmd.logical_axis_rules(rules):
            return jax.value_and_grad(loss, has_aux=True)(student, {}, teacher.model_spec, batch, None, 0.0, 0,
                                                          teacher_params)

    shardings = (teacher.param_shardings, teacher.param_shardings, mesh_lib.batch_sharding(mesh, rules))
    with jax.set_mesh(mesh):
        (total, (tokens_sum, _, terms)), g = jax.jit(grads, in_shardings=shardings)(teacher.params, teacher.params, full)
    assert float(tokens_sum) == weights.sum() > 0
    assert abs(float(terms["distill/kl"])) < 1e-4 and abs(float(total)) < 1e-3
    assert float(terms["distill/ce"]) / weights.sum() < 3.0  # the facts run's next-token loss: it learned the facts
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g)) < 1e-4
