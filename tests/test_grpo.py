"""GRPO's parts (jaxlm.post_training): the advantages, the clipped objective and its gradient and the k3 KL
against direct NumPy computations; the rewards (built-ins, a user's module:function, the one-line errors);
rollouts from the KV-cache sampler (greedy equals `generate`, a key reproduces, the old log-probs equal a
full forward's, EOS stops rows); one real optax update raising the probability of what the reward prefers,
in full training and with LoRA adapters."""

import sys
import textwrap

import floats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import small_config
from jaxlm import axes, config, generate, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.errors import UserError
from jaxlm.models import transformer
from jaxlm.post_training import grpo, rewards

# ----------------------------------------------------------------------------- the math against NumPy


def np_advantages(r, g, scale=True, eps=1e-4):
    out = []
    for group in np.asarray(r, np.float64).reshape(-1, g):
        centered = group - group.mean()
        out.append(centered / (np.sqrt(np.mean((group - group.mean()) ** 2)) + eps) if scale else centered)
    return np.concatenate(out)


def test_group_advantages_match_numpy():
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0], np.float32)
    floats.close(np.asarray(grpo.group_advantages(r, 4)), np_advantages(r, 4).astype(np.float32))
    floats.close(np.asarray(grpo.group_advantages(r, 4, scale=False)), np_advantages(r, 4, False).astype(np.float32))
    # A group of equal rewards teaches nothing; the first group is +-1 (std 0.5) up to eps.
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, 4))[:8],
                               [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-3)


def tiny_batch(seed=0, b=3, t=5):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 0.5, (b, t)).astype(np.float32)
    # ratios on both sides of each clip bound: log-ratios -0.5 .. 0.5
    logp = (old + np.resize([0.5, -0.1, 0.3, -0.5, 0.05, -0.3, 0.25], (b, t))).astype(np.float32)
    ref = (old + rng.normal(0, 0.2, (b, t))).astype(np.float32)
    adv = np.repeat(np.array([1.5, -0.7, 0.4], np.float32)[:, None], t, axis=1)
    weights = np.ones((b, t), np.float32)
    weights[0, 3:] = 0
    weights[2, 1:] = 0
    return logp, {"old_logprobs": old, "ref_logprobs": ref, "advantages": adv, "weights": weights}


def np_objective(logp, batch, eps, eps_high, beta, how, max_new=0):
    """Loss and its gradient by logp, per the formulas, in float64."""
    logp, old, ref, a, w = (np.asarray(batch[k] if k != "logp" else logp, np.float64)
                            for k in ("logp", "old_logprobs", "ref_logprobs", "advantages", "weights"))
    ratio = np.exp(logp - old)
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - eps, 1 + eps_high) * a
    per = -np.minimum(unclipped, clipped)
    # d/dlogp: -ratio A where the unclipped term is the smaller (or equal), 0 where the clip binds
    grad = np.where(unclipped <= clipped, -ratio * a, 0.0)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    per, grad = per + beta * kl, grad + beta * (1 - np.exp(ref - logp))
    tokens = w.sum(1)
    if how == "token":
        loss, dloss = (per * w).sum() / w.sum(), grad * w / w.sum()
    elif how == "sequence":
        loss = ((per * w).sum(1) / tokens).mean()
        dloss = grad * w / tokens[:, None] / len(tokens)
    else:
        loss, dloss = (per * w).sum() / (len(tokens) * max_new), grad * w / (len(tokens) * max_new)
    is_clipped = ((ratio < 1 - eps) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))
    return loss, dloss, (kl * w).sum() / w.sum(), (is_clipped * w).sum() / w.sum()


@pytest.mark.parametrize("how,beta,eps_high", [("token", 0.0, 0.0), ("token", 0.1, 0.28), ("sequence", 0.05, 0.0),
                                               ("constant", 0.0, 0.0)])
def test_the_clipped_objective_and_its_gradient_match_numpy(how, beta, eps_high):
    logp, batch = tiny_batch()
    settings = grpo.GRPOConfig(epsilon=0.2, epsilon_high=eps_high, beta=beta, loss_aggregation=how, max_new_tokens=5)

    def loss(lp):
        total, (count, sums) = grpo.objective_sums(lp, {k: jnp.asarray(v) for k, v in batch.items()}, settings)
        return total / count, sums

    (value, sums), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    want, dwant, kl, clipped = np_objective(logp, batch, 0.2, eps_high or 0.2, beta, how, 5)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), dwant, rtol=1e-4, atol=1e-7)
    means = grpo.metric_means(sums)
    np.testing.assert_allclose(float(means["clipped_fraction"]), clipped, rtol=1e-6)
    assert 0 < clipped < 1  # the example clips some tokens and not others: both branches are tested
    if beta:
        np.testing.assert_allclose(float(means["kl"]), kl, rtol=1e-5)
    else:
        assert "kl" not in means


def test_k3_kl_matches_numpy_is_non_negative_and_zero_at_the_reference():
    logp, batch = tiny_batch(1)
    d = batch["ref_logprobs"].astype(np.float64) - logp
    np.testing.assert_allclose(np.asarray(grpo.k3_kl(logp, batch["ref_logprobs"])), np.exp(d) - d - 1, rtol=1e-4,
                               atol=1e-7)
    assert np.all(np.asarray(grpo.k3_kl(logp, batch["ref_logprobs"])) >= 0)
    assert np.all(np.asarray(grpo.k3_kl(logp, logp)) == 0)


def test_sums_add_over_micro_batches():
    """Two halves' (sum, count) add to the whole batch's, for each aggregation."""
    logp, batch = tiny_batch(2, b=4)
    batch["advantages"] = batch["advantages"][np.arange(4) % 3]
    for how in grpo.AGGREGATIONS:
        settings = grpo.GRPOConfig(loss_aggregation=how, beta=0.1, max_new_tokens=5)
        whole = grpo.objective_sums(logp, batch, settings)
        halves = [grpo.objective_sums(logp[s], {k: v[s] for k, v in batch.items()}, settings)
                  for s in (slice(0, 2), slice(2, 4))]
        summed = jax.tree.map(lambda a, b: a + b, *halves)
        floats.close(jax.tree.map(np.asarray, summed), jax.tree.map(np.asarray, whole))


# ----------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("completion,answer,expected", [
    (" 46", "46", 1.0),
    ("12+34=46", "46", 1.0),
    ("12+34= 46.\nmore text", "46", 1.0),
    ("so x = 3 and y = 1,234", "1234", 1.0),
    ("Natalia sold 72 clips.\n#### 72", "She sold ... #### 72", 1.0),
    ("#### 72.0", "72", 1.0),
    ("#### $1,000", "1000", 1.0),
    ("12+34=47", "46", 0.0),
    ("46 = 47", "46", 0.0),  # the last "=" decides
    ("= paris", "Paris", 0.0),  # texts compare exactly
    ("the answer is  paris", "the answer is paris", 1.0),
    ("", "0", 0.0),
])
def test_exact_match_reads_the_final_answer(completion, answer, expected):
    assert rewards.exact_match("prompt", completion, answer) == expected


@pytest.mark.parametrize("completion,expected", [
    ("12+34=46", 1.0), ("work...\n#### 72", 1.0), ("= -3.5.", 1.0), ("#### 1,000 ", 1.0),
    ("46", 0.0), ("=46 and more", 0.0), ("= x", 0.0), ("", 0.0),
])
def test_format_checks_for_a_marked_number_at_the_end(completion, expected):
    assert rewards.format_check("p", completion, "") == expected


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def brevity(prompt, completion, answer):
            return 1.0 / (1 + len(completion))

        def two_args(prompt, completion):
            return 0.0

        def raises(prompt, completion, answer):
            raise KeyError("boom")

        def text(prompt, completion, answer):
            return "1"

        def nothing(prompt, completion, answer):
            pass

        def nan(prompt, completion, answer):
            return float("nan")

        def yes(prompt, completion, answer):
            return True

        not_a_function = 3
    """))
    (tmp_path / "broken_rewards.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def test_rewards_resolve_built_ins_and_a_users_function_and_weigh_them(user_module):
    resolved = rewards.resolve("exact_match, my_rewards:brevity", "2,0.5")
    assert [(r.name, r.weight) for r in resolved] == [("exact_match", 2.0), ("my_rewards:brevity", 0.5)]
    total, per = rewards.score(resolved, ["p", "p"], ["1+1=2", "=3"], ["2", "2"])
    np.testing.assert_allclose(per["exact_match"], [1, 0])
    np.testing.assert_allclose(per["my_rewards:brevity"], [1 / 6, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(total, [2 + 0.5 / 6, 0.5 / 3], rtol=1e-6)
    # the same function from its file
    from_file = rewards.resolve([f"{user_module / 'my_rewards.py'}:brevity"])
    np.testing.assert_allclose(rewards.score(from_file, ["p"], ["abc"], [""])[0], [0.25])


@pytest.mark.parametrize("spec,message", [
    ("exactmatch", "reward 'exactmatch' is not a built-in (exact_match, format) nor module:function"),
    ("no_such_module_xyz:f", "reward 'no_such_module_xyz:f': module 'no_such_module_xyz' does not import "
                             "(ModuleNotFoundError"),
    ("broken_rewards:f", "reward 'broken_rewards:f': module 'broken_rewards' does not import (ModuleNotFoundError: "
                         "No module named 'no_such_module_here')"),
    ("my_rewards:missing", "reward 'my_rewards:missing': my_rewards has no 'missing'"),
    ("my_rewards:not_a_function", "reward 'my_rewards:not_a_function': my_rewards.not_a_function is a int, not a function"),
    ("my_rewards:two_args", "reward 'my_rewards:two_args': takes (prompt, completion); a reward takes (prompt, "
                            "completion, answer)"),
    ("nowhere/x.py:f", "reward 'nowhere/x.py:f': no file nowhere/x.py"),
])
def test_a_reward_that_does_not_load_is_one_line(user_module, spec, message):
    with pytest.raises(UserError) as e:
        rewards.resolve(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,message", [
    ("raises", "reward 'my_rewards:raises' raised KeyError: 'boom' on completion #0; fix the function"),
    ("text", "reward 'my_rewards:text' returned str '1' for completion #0; return a number"),
    ("nothing", "reward 'my_rewards:nothing' returned NoneType None for completion #0; return a number"),
    ("nan", "reward 'my_rewards:nan' returned nan for completion #0; return a finite number"),
    ("yes", "reward 'my_rewards:yes' returned bool True for completion #0; return a number"),
])
def test_a_reward_that_fails_on_a_completion_is_one_line(user_module, name, message):
    resolved = rewards.resolve(f"my_rewards:{name}")
    with pytest.raises(UserError) as e:
        rewards.score(resolved, ["p"], ["c"], ["a"])
    assert str(e.value) == message


def test_bad_reward_lists_are_one_line():
    for names, weights, message in [("", "", "no reward named"), ("format,format", "", "names one twice"),
                                    ("format", "1,2", "give 1 finite numbers"), ("format", "x", "comma-separated")]:
        with pytest.raises(UserError, match=message):
            rewards.resolve(names, weights)


def test_settings_are_checked():
    grpo.GRPOConfig().validate()
    with pytest.raises(UserError, match=r"config.grpo.group_size=1 is not allowed"):
        grpo.GRPOConfig(group_size=1).validate()
    with pytest.raises(UserError, match=r"config.grpo.loss_aggregation='mean' is not allowed"):
        grpo.GRPOConfig(loss_aggregation="mean").validate()


# ----------------------------------------------------------------------------- rollouts on a tiny model

PROMPTS = [[2, 17, 33, 40], [2, 60], [2, 7, 7, 90, 91]]
NEW = 8


def random_params(model_cfg, seed=0, scale=0.1):
    """Random parameters drawn by NumPy (as tests/test_generate.py's): LoRA's B zero, as the adapters start."""
    state = nnx.state(nnx.eval_shape(lambda: train_state.build_model(model_cfg)))
    shapes = nnx.to_pure_dict(state)
    rng = np.random.default_rng(seed)
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    leaves = []
    for path, s in flat:
        if any(getattr(k, "key", None) == "lora_b" for k in path):
            leaves.append(np.zeros(s.shape, s.dtype))
        else:
            leaves.append((rng.normal(0, scale, s.shape) + (len(s.shape) == 1)).astype(s.dtype))
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


@pytest.fixture(scope="module")
def tiny():
    """A tiny model's Generator on a data=2 mesh (rows split over two devices)."""
    model_cfg = small_config()
    mesh = mesh_lib.make_mesh(axes.shape_of(data=2), devices=jax.devices()[:2])
    rules = mesh_lib.rules_from_config(config.base_config().mesh.rules)
    spec = train_state.build_model_spec(model_cfg)
    shardings = train_state.param_shardings(spec, mesh, rules)
    params = jax.device_put(random_params(model_cfg), shardings)
    return generate.Generator(model_cfg, params, mesh, rules, shardings, graphdef=spec.graphdef), spec


def sampler(gen, sampling=generate.GREEDY, stop_ids=None, group_size=2):
    return grpo.Sampler.from_generator(gen, stop_ids=stop_ids, group_size=group_size, max_new_tokens=NEW,
                                       max_prompt_len=8, sampling=sampling)


def test_greedy_rollouts_equal_generates_greedy_output(tiny):
    gen, _ = tiny
    rollouts = sampler(gen)(gen.params, PROMPTS, jax.random.PRNGKey(0))
    expected = [c.ids for c in gen.generate_ids(PROMPTS, max_new_tokens=NEW, eos_id=None)]
    assert rollouts.completion_ids() == [ids for ids in expected for _ in range(2)]
    assert rollouts.finish_reasons() == ["length"] * 6 and np.asarray(rollouts.lengths).tolist() == [NEW] * 6
    # the training layout: row 1 (prompt 0) is its prompt, then its completion, then padding
    inputs, weights = np.asarray(rollouts.inputs), np.asarray(rollouts.weights)
    assert inputs.shape == (6, 8 + NEW)
    assert inputs[1].tolist() == PROMPTS[0] + expected[0] + [0] * 4
    assert np.asarray(rollouts.targets)[1].tolist() == PROMPTS[0][1:] + expected[0] + [0] * 5
    assert weights[1].tolist() == [0] * 3 + [1] * NEW + [0] * 5
    assert np.asarray(rollouts.segment_ids)[5].tolist() == [1] * (5 + NEW) + [0] * 3


def test_sampled_rollouts_are_reproducible_from_a_key(tiny):
    gen, _ = tiny
    hot = sampler(gen, generate.Sampling(temperature=1.5, top_p=0.95), group_size=4)
    first = hot(gen.params, PROMPTS, jax.random.PRNGKey(7)).completion_ids()
    assert hot(gen.params, PROMPTS, jax.random.PRNGKey(7)).completion_ids() == first
    assert hot(gen.params, PROMPTS, jax.random.PRNGKey(8)).completion_ids() != first
    assert len({tuple(ids) for ids in first[:4]}) > 1  # a group's completions differ


def full_forward_logprobs(gen, rollouts, temperature):
    """Each row's prompt and completion alone through a plain forward pass; log-softmax at the next tokens."""
    forward = jax.jit(lambda p, x: nnx.merge(gen.graphdef, p)(x))
    params = jax.tree.map(jnp.asarray, jax.device_get(gen.params))
    inputs, segments = np.asarray(rollouts.inputs), np.asarray(rollouts.segment_ids)
    out = np.zeros(inputs.shape, np.float64)
    for row in range(rollouts.rows):
        n = int(segments[row].sum())
        padded = np.zeros((1, gen.model_cfg.max_seq_len), np.int32)
        padded[0, :n] = inputs[row, :n]
        logits = np.asarray(forward(params, jnp.asarray(padded)), np.float64)[0, : n - 1] / temperature
        logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        out[row, : n - 1] = logp[np.arange(n - 1), inputs[row, 1:n]]
    return out


def test_old_logprobs_equal_a_full_forwards_log_softmax_at_the_sampled_tokens(tiny):
    gen, _ = tiny
    rollouts = sampler(gen, generate.Sampling(temperature=0.7))(gen.params, PROMPTS, jax.random.PRNGKey(3))
    expected = full_forward_logprobs(gen, rollouts, 0.7) * np.asarray(rollouts.weights)
    np.testing.assert_allclose(np.asarray(rollouts.old_logprobs), expected, atol=2e-5)
    assert np.all(expected[np.asarray(rollouts.weights) > 0] < 0)


def test_eos_stops_rows_and_ends_their_completion_mask(tiny):
    gen, _ = tiny
    free = sampler(gen)(gen.params, PROMPTS, jax.random.PRNGKey(0)).completion_ids()
    stop = next(t for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i])  # pretend it is EOS
    cut = free[0].index(stop)
    rollouts = sampler(gen, stop_ids=stop)(gen.params, PROMPTS, jax.random.PRNGKey(0))
    ids, lengths, weights = rollouts.completion_ids(), np.asarray(rollouts.lengths), np.asarray(rollouts.weights)
    completions = np.asarray(rollouts.completions)
    for row, (full, got) in enumerate(zip(free, ids)):
        if stop in full:
            end = full.index(stop)
            assert got == full[:end] and rollouts.finish_reasons()[row] == "eos" and lengths[row] == end + 1
            assert completions[row, end] == stop and np.all(completions[row, end + 1:] == 0)
        else:
            assert got == full and rollouts.finish_reasons()[row] == "length" and lengths[row] == NEW
        assert weights[row].sum() == lengths[row]  # the stop token is a completion token: it is learned
    assert ids[0] == free[0][:cut] and len(ids[0]) >= 2


def test_a_prompt_longer_than_max_prompt_len_is_one_line(tiny):
    gen, _ = tiny
    with pytest.raises(UserError, match="a prompt is 9 tokens, longer than max_prompt_len=8"):
        sampler(gen)(gen.params, [[2] * 9], jax.random.PRNGKey(0))
    with pytest.raises(UserError, match="passes the model's context of 32 tokens"):
        grpo.Sampler.from_generator(gen, group_size=2, max_new_tokens=30, max_prompt_len=8)


# ----------------------------------------------------------------------------- one update


PREFERRED = np.arange(48)  # the reward: 1 when a completion's first token is one of these, else 0


def first_token_mass(gen, params, prompts):
    """The model's probability of a PREFERRED first new token, per prompt."""
    forward = jax.jit(lambda p, x: nnx.merge(gen.graphdef, p)(x))
    params = jax.tree.map(jnp.asarray, jax.device_get(params))
    out = []
    for prompt in prompts:
        logits = np.asarray(forward(params, jnp.asarray([prompt], jnp.int32)), np.float64)[0, -1]
        probs = np.exp(logits - logits.max())
        out.append(probs[PREFERRED].sum() / probs.sum())
    return np.array(out)


def grpo_step(gen, spec, params, settings, lr):
    """Rollouts, rewards, advantages, one optax step on the GRPO loss; the new parameters."""
    sample = grpo.Sampler.from_generator(gen, stop_ids=None, **grpo.Sampler.settings_kwargs(settings))
    rollouts = sample(params, PROMPTS, grpo.Sampler.key(0, 0))
    first = np.array([ids[0] for ids in rollouts.completion_ids()])
    reward = np.isin(first, PREFERRED).astype(np.float32)
    assert 0 < reward.mean() < 1  # the groups disagree: there is something to learn
    batch = rollouts.batch()
    rows, seq_len = batch["inputs"].shape
    batch["advantages"] = grpo.expand_advantages(grpo.group_advantages(reward, settings.group_size), rows, seq_len)
    if settings.beta:
        batch["ref_logprobs"] = grpo.reference_logprobs(gen.graphdef, grpo.without_adapters(params), batch,
                                                        settings.temperature)
    tx = optax.adam(lr)
    opt_state = tx.init(spec.split(params)[0])
    new, _, out = grpo.update(spec, tx, settings, gen.rules)(params, opt_state, batch)
    assert np.isfinite(float(out["loss"])) and float(out["clipped_fraction"]) == 0  # the first step: ratio 1
    return new, out


def test_one_grpo_update_raises_the_probability_the_reward_prefers(tiny):
    gen, spec = tiny
    settings = grpo.GRPOConfig(group_size=8, max_new_tokens=4, max_prompt_len=8, temperature=1.0)
    before = first_token_mass(gen, gen.params, PROMPTS)
    new, _ = grpo_step(gen, spec, gen.params, settings, lr=1e-2)
    after = first_token_mass(gen, new, PROMPTS)
    assert np.all(after > before + 0.02), (before, after)


@pytest.mark.slow  # ~8 s; the full-training update stays in the default suite
def test_one_grpo_update_of_lora_adapters_with_a_kl_penalty_to_the_base():
    """LoRA: only the adapters change, the reference is the base (adapters off), and the KL is 0 on the first
    step (the adapters start as the identity: B = 0) and the preferred tokens' probability rises."""
    model_cfg = transformer.with_lora(small_config(), {"rank": 4, "alpha": 8.0, "targets": "wq,wv,w_up,w_down",
                                                       "ranks": "", "dropout": 0.0})
    mesh = mesh_lib.make_mesh(axes.shape_of(), devices=jax.devices()[:1])
    rules = mesh_lib.rules_from_config(config.base_config().mesh.rules)
    spec = train_state.build_model_spec(model_cfg)
    shardings = train_state.param_shardings(spec, mesh, rules)
    params = jax.device_put(random_params(model_cfg), shardings)
    gen = generate.Generator(model_cfg, params, mesh, rules, shardings, graphdef=spec.graphdef)
    settings = grpo.GRPOConfig(group_size=16, max_new_tokens=1, max_prompt_len=8, beta=0.04)
    before = first_token_mass(gen, params, PROMPTS)
    new, out = grpo_step(gen, spec, params, settings, lr=1e-1)
    assert float(out["kl"]) == 0.0
    after = first_token_mass(gen, new, PROMPTS)
    assert np.all(after > before + 0.02), (before, after)
    trained, base = spec.split(new)
    floats.identical(base, spec.split(params)[1], why=floats.MOVED)  # the base is untouched
    lora_b = [np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(trained)[0]
              if getattr(p[-1], "key", None) == "lora_b"]
    assert lora_b and all(np.any(b != 0) for b in lora_b)
