"""Sampling with a KV cache: cached greedy decoding equals repeated full forward passes (on a real
trained run and on other model variants and meshes), seeds, top-k/top-p, EOS, the CLI and its errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import llama_layout_model, small_config
from jaxlm import axes, config, generate, inference, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.data.tokenizer import Tokenizer
from jaxlm.errors import UserError
from jaxlm.generate import GREEDY, Generator, Sampling
from jaxlm.models import attention
from tiny_run import LIKES, NAMES, SEQ_LEN

NEW = 12


@pytest.fixture(scope="module")
def run_dir(facts_run):
    return facts_run  # one trained run shared by the evaluation and generation tests (tests/conftest.py)


@pytest.fixture(scope="module")
def generator(run_dir):
    return generate.load(run_dir, dtype="float32")


@pytest.fixture(scope="module")
def prompts(generator):
    """Three prompts of different lengths (1 + 2, 1 + 9 and 1 + 1 tokens or so)."""
    texts = ["alice likes", "heidi likes mangos. grace likes grapes. bob", "dave"]
    return generator.tokenizer.encode(texts, add_bos=True, add_eos=False)


def full_forward_greedy(model_cfg, graphdef, params, prompts, new_tokens) -> list[list[int]]:
    """The reference: each new token is the argmax of a full forward pass over the whole sequence so
    far (each row right-padded to the context: attention is causal, so padding after it changes nothing)."""
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    params = jax.tree.map(jnp.asarray, jax.device_get(params))
    seqs = [list(p) for p in prompts]
    for _ in range(new_tokens):
        inputs = np.zeros((len(seqs), model_cfg.max_seq_len), np.int32)
        for row, seq in enumerate(seqs):
            inputs[row, : len(seq)] = seq
        logits = np.asarray(forward(params, jnp.asarray(inputs)))
        for row, seq in enumerate(seqs):
            seq.append(int(np.argmax(logits[row, len(seq) - 1])))
    return [seq[len(p):] for seq, p in zip(seqs, prompts)]


def random_params(model_cfg, seed: int = 0):
    """Random parameters of the model's shapes, drawn by NumPy (initialising the model in JAX compiles
    for seconds): matrices ~ N(0, 0.1), vectors (norm scales, biases) ~ 1 + N(0, 0.1)."""
    shapes = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(train_state.build_model(model_cfg))))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (rng.normal(0, 0.1, s.shape) + (len(s.shape) == 1)).astype(s.dtype), shapes)


def test_cached_greedy_equals_repeated_full_forward_passes(generator, prompts):
    completions = generator.generate_ids(prompts, max_new_tokens=NEW, sampling=GREEDY, eos_id=None)
    expected = full_forward_greedy(generator.model_cfg, generator.graphdef, generator.params, prompts, NEW)
    assert [c.ids for c in completions] == expected
    assert all(c.finish_reason == "length" for c in completions)
    assert len({tuple(c.ids) for c in completions}) == 3


def test_cached_greedy_equals_full_passes_for_gpt2_unrolled_on_a_tensor_parallel_mesh():
    """The other variant (learned positions, LayerNorm, biases), unrolled layers, tied embeddings and
    grouped-query heads, on a (2, 2, 2) mesh (the trained run above: scanned Llama layers, FSDP over 8)."""
    model_cfg = small_config(n_kv_heads=4, tie_embeddings=True, scan_layers=False, norm="layernorm", mlp="gelu",
                             position="learned", use_bias=True)
    mesh_shape = axes.shape_of(data=2, fsdp=2, tensor=2)
    rules = mesh_lib.rules_from_config(config.base_config().mesh.rules)
    mesh = mesh_lib.make_mesh(mesh_shape)
    model_spec = train_state.build_model_spec(model_cfg)
    shardings = train_state.param_shardings(model_spec, mesh, rules)
    params = jax.device_put(random_params(model_cfg), shardings)
    gen = Generator(model_cfg, params, mesh, rules, shardings, graphdef=model_spec.graphdef)
    prompts = [[2, 17, 33, 40, 41, 5], [2, 60], [2, 7, 7, 7, 90, 91, 92, 93, 94, 95, 11]]
    completions = gen.generate_ids(prompts, max_new_tokens=8, eos_id=None)
    assert [c.ids for c in completions] == full_forward_greedy(model_cfg, model_spec.graphdef, params, prompts, 8)
    # The cache is sharded like the activations: rows over data x fsdp x expert, key/value heads over tensor.
    prefill, _ = gen.compiled()
    tokens, start, padding, cache_len, max_new = gen.prepare(prompts, 8)
    with jax.set_mesh(mesh):
        cache, _ = prefill(params, tokens, start, padding, jax.random.PRNGKey(0),
                           generate.SamplingArrays.of(GREEDY, None), cache_len, max_new)
    sizes = axes.sizes_of(mesh_shape)
    shards, tensor = sizes["data"] * sizes["fsdp"] * sizes["expert"], sizes["tensor"]
    rows = len(tokens)
    assert rows == -(-3 // shards) * shards  # the batch is padded to split evenly
    assert cache.k.sharding.spec == mesh_lib.logical_to_spec(attention.CACHE_AXES, rules)
    assert cache.k.sharding.spec == P(None, ("data", "fsdp", "expert"), None, "tensor", None)
    assert cache.k.shape == (2, rows, cache_len, model_cfg.n_kv_heads, 8)
    assert cache.k.sharding.shard_shape(cache.k.shape) == (2, rows // shards, cache_len, 4 // tensor, 8)


def test_cached_greedy_equals_full_passes_with_qwen3s_query_and_key_norms():
    """Qwen3's per-head norms of queries and keys (model.qk_norm) act on each chunk's keys before the cache
    holds them, as in a full pass: scanned layers, heads wider than d_model / n_heads, grouped-query heads over
    tensor on a data x fsdp x tensor = 2 x 2 x 2 mesh."""
    model_cfg = small_config(qk_norm=True, n_kv_heads=2, head_dim=16)
    mesh = mesh_lib.make_mesh(axes.shape_of(data=2, fsdp=2, tensor=2))
    rules = mesh_lib.rules_from_config(config.base_config().mesh.rules)
    model_spec = train_state.build_model_spec(model_cfg)
    shardings = train_state.param_shardings(model_spec, mesh, rules)
    params = jax.device_put(random_params(model_cfg, seed=3), shardings)
    assert params["blocks"]["attn"]["q_norm"]["scale"].shape == (model_cfg.n_layers, 16)
    gen = Generator(model_cfg, params, mesh, rules, shardings, graphdef=model_spec.graphdef)
    prompts = [[2, 17, 33, 40, 41, 5], [2, 60], [2, 7, 7, 7, 90, 91, 92, 93, 94, 95, 11]]
    completions = gen.generate_ids(prompts, max_new_tokens=8, eos_id=None)
    assert [c.ids for c in completions] == full_forward_greedy(model_cfg, model_spec.graphdef, params, prompts, 8)


def test_cached_greedy_equals_full_passes_with_yarn():
    """YaRN's scaled rotation (`layers.rope_attention_factor` times cos and sin) is applied to each chunk's
    keys before the cache holds them and to each new query, as in a full pass; it changes what is generated."""
    model_cfg = small_config(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=8, n_kv_heads=2, head_dim=16)
    mesh = mesh_lib.make_mesh(axes.shape_of(data=2, fsdp=2, tensor=2))
    rules = mesh_lib.rules_from_config(config.base_config().mesh.rules)
    model_spec = train_state.build_model_spec(model_cfg)
    shardings = train_state.param_shardings(model_spec, mesh, rules)
    params = random_params(model_cfg, seed=3)
    for name in ("wq", "wk"):  # peaked attention, which the rotation's scale and frequencies move
        params["blocks"]["attn"][name]["kernel"] = params["blocks"]["attn"][name]["kernel"] * 8
    params = jax.device_put(params, shardings)
    gen = Generator(model_cfg, params, mesh, rules, shardings, graphdef=model_spec.graphdef)
    prompts = [[2, 17, 33, 40, 41, 5], [2, 60], [2, 7, 7, 7, 90, 91, 92, 93, 94, 95, 11]]
    completions = [c.ids for c in gen.generate_ids(prompts, max_new_tokens=8, eos_id=None)]
    assert completions == full_forward_greedy(model_cfg, model_spec.graphdef, params, prompts, 8)
    plain = dataclasses.replace(model_cfg, rope_scaling="none")
    assert completions != full_forward_greedy(plain, train_state.build_model_spec(plain).graphdef, params, prompts, 8)


def test_sampling_is_reproducible_for_a_seed_and_differs_across_seeds(generator, prompts):
    hot = Sampling(temperature=1.5)

    def sample(seed):
        return [c.ids for c in generator.generate_ids(prompts, max_new_tokens=NEW, sampling=hot, seed=seed, eos_id=None)]

    first = sample(0)
    assert sample(0) == first
    assert sample(1) != first and sample(2) != first
    assert first != [c.ids for c in generator.generate_ids(prompts, max_new_tokens=NEW, eos_id=None)]  # not greedy


def test_top_k_1_and_a_tiny_top_p_equal_greedy(generator, prompts):
    greedy = [c.ids for c in generator.generate_ids(prompts, max_new_tokens=NEW, eos_id=None)]
    for seed in (0, 1):
        for sampling in (Sampling(temperature=1.0, top_k=1), Sampling(temperature=2.0, top_p=1e-6)):
            got = generator.generate_ids(prompts, max_new_tokens=NEW, sampling=sampling, seed=seed, eos_id=None)
            assert [c.ids for c in got] == greedy


def test_sample_logits_keeps_only_the_top_k_and_the_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.tile(np.log(probs), (4000, 1)), jnp.float32)  # 4000 rows, one draw each
    key = jax.random.PRNGKey(0)

    def draws(sampling):
        return np.asarray(generate.sample_logits(logits, key, sampling))

    def frequencies(sampling):
        return np.bincount(draws(sampling), minlength=4) / len(logits)

    np.testing.assert_allclose(frequencies(Sampling()), probs, atol=0.03)
    np.testing.assert_allclose(frequencies(Sampling(top_k=2)), [0.625, 0.375, 0, 0], atol=0.03)
    np.testing.assert_allclose(frequencies(Sampling(top_p=0.7)), [0.625, 0.375, 0, 0], atol=0.03)  # 0.5 < 0.7 <= 0.8
    np.testing.assert_allclose(frequencies(Sampling(top_p=0.85)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.03)
    np.testing.assert_array_equal(draws(Sampling(top_p=0.5)), 0)  # every draw the most likely token
    np.testing.assert_array_equal(draws(GREEDY), 0)
    # Temperature sharpens: at 0.5 the probabilities go as p^2.
    np.testing.assert_allclose(frequencies(Sampling(temperature=0.5)), probs**2 / np.sum(probs**2), atol=0.03)


def test_each_row_stops_at_its_own_eos(generator, prompts):
    free = [c.ids for c in generator.generate_ids(prompts, max_new_tokens=NEW, eos_id=None)]
    stop = free[0][3]  # pretend row 0's fourth new token is EOS
    completions = generator.generate_ids(prompts, max_new_tokens=NEW, eos_id=stop)
    for ids, completion in zip(free, completions):
        if stop in ids:
            assert completion.ids == ids[: ids.index(stop)] and completion.finish_reason == "eos"
        else:
            assert completion.ids == ids and completion.finish_reason == "length"
    assert completions[0].ids == free[0][:3]


def test_special_ids_come_from_the_tokenizer(generator, prompts, tmp_path):
    """With a tokenizer of Llama's layout (unk 0, bos 1, eos 2, no pad: pad is its EOS), prompts are
    left-padded with its pad, batch padding rows are its lone BOS, stopped rows hold its pad, a row
    stops at its EOS by default, and the completions are those of the run's own tokenizer (pad 0)."""
    (tmp_path / "llama.model").write_bytes(llama_layout_model())
    tok = Tokenizer.load(tmp_path / "llama.model")
    gen = Generator(generator.model_cfg, generator.params, generator.mesh, generator.rules,
                    generator.param_shardings, tok, generator.graphdef)
    assert (gen.pad_id, gen.eos_id) == (2, 2) and (generator.pad_id, generator.eos_id) == (0, 3)
    tokens, start, padding, cache_len, max_new = gen.prepare(prompts, NEW)
    assert padding.sum() > 0  # 3 prompts, a row per device
    for row in range(len(prompts)):
        assert (tokens[row, : start[row]] == tok.pad_id).all()
    assert (tokens[padding, -1] == tok.bos_id).all() and (tokens[padding, :-1] == tok.pad_id).all()
    prefill, decode = gen.compiled()
    with jax.set_mesh(gen.mesh):
        cache, state = prefill(gen.params, tokens, start, padding, jax.random.PRNGKey(0),
                               generate.SamplingArrays.of(GREEDY, gen.eos_id, gen.pad_id), cache_len, max_new)
        _, state = decode(gen.params, cache, state)
    assert (np.asarray(state.tokens)[padding, :2] == tok.pad_id).all()  # done from the start
    free = [c.ids for c in generator.generate_ids(prompts, max_new_tokens=NEW, eos_id=None)]
    expected = [ids[: ids.index(2)] if 2 in ids else ids for ids in free]
    assert [c.ids for c in gen.generate_ids(prompts, max_new_tokens=NEW)] == expected


def test_the_model_completes_the_facts_it_learned(generator):
    completions = generator.generate([f"{name} likes" for name in NAMES], max_new_tokens=NEW, sampling=GREEDY)
    assert [c.text.split(".")[0] for c in completions] == [f" {LIKES[name]}" for name in NAMES]


def test_prompts_must_fit_the_context(generator):
    with pytest.raises(UserError, match=f"a prompt is {SEQ_LEN} tokens but the model's context is {SEQ_LEN} tokens"):
        generator.generate_ids([[2] + [5] * (SEQ_LEN - 1)], max_new_tokens=4)
    # A prompt that fits, but not with all its new tokens: generation stops at the context's end.
    assert generator.max_new_tokens_for([5, SEQ_LEN - 3], 10) == 3
    assert generator.max_new_tokens_for([5, SEQ_LEN - 20], 10) == 10


def test_cli_prints_completions_equal_to_full_passes_in_the_runs_bfloat16(run_dir, capsys):
    args = ["--run_dir", str(run_dir), "--prompt=alice likes", "--prompt=bob likes", "--temperature=0",
            "--max_new_tokens=10", "--ignore_eos", "--json"]
    assert generate.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["alice likes", "bob likes"]
    assert lines[0]["completion"].startswith(" apples") and lines[1]["completion"].startswith(" bananas")
    # The run's own compute dtype, bfloat16 (its cache holds bf16 bit patterns): still the same tokens.
    run = inference.load_run(run_dir)
    assert run.model_cfg.dtype == jnp.bfloat16
    prompts = run.tokenizer.encode(["alice likes", "bob likes"], add_bos=True, add_eos=False)
    expected = full_forward_greedy(run.model_cfg, run.model_spec.graphdef, run.params, prompts, 10)
    assert [line["completion"] for line in lines] == [run.tokenizer.decode(ids) for ids in expected]
    assert all(line["tokens"] == 10 and line["finish_reason"] == "length" for line in lines)


def test_parameters_can_be_loaded_in_bfloat16(run_dir):
    run = inference.load_run(run_dir, param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(run.params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([f"--prompt={'alice likes apples. ' * 40}"], "but the model's context is 64 tokens (model.max_seq_len)"),
        (["--prompt=alice", "--step=3"], "--step=3: "),
        (["--prompt=alice", "--top_p=0"], "--top_p=0.0 is not allowed: a probability in (0, 1]"),
        ([], "give at least one --prompt=TEXT"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(run_dir, capsys, extra, expected):
    assert generate.main(["--run_dir", str(run_dir), *extra]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("jaxlm: error:")]
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err
