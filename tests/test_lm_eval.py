"""lm-evaluation-harness on a jaxlm run (`jaxlm.lm_eval`), with the harness's own machinery on local tasks
(tests/data/lm_eval_tasks: YAML over JSONL, no download): the adapter's log-likelihoods are jaxlm's own
scorer's, its generations jaxlm's greedy ones, `python -m jaxlm.evaluate --lm_eval_tasks` gives the
accuracy `--tasks` gives, and (slow) the harness's `hf` model on the run's Hugging Face export gives the same
numbers request by request. Without the harness, the flag and the command are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxlm import evaluate, generate, inference
from tiny_run import LIKES, ROOT

TASKS = ROOT / "tests" / "data" / "lm_eval_tasks"
GREEDY_UNTIL_STOP = {"until": ["."], "max_gen_toks": 12, "do_sample": False}


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{name}.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run(facts_run):
    return inference.load_run(facts_run, dtype="float32")


@pytest.fixture(scope="module")
def harness_lm(run):
    pytest.importorskip("lm_eval")
    from jaxlm import lm_eval

    return lm_eval.JaxLM(run=run)


def instances(request_type: str, arguments: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type, {}, args, i) for i, args in enumerate(arguments)]


def test_requests_are_padded_to_a_few_lengths():
    """Multiples of 32 up to 128, then four lengths per doubling (under 25% padding), never past the context."""
    from jaxlm.scoring import bucket_length

    lengths = sorted({bucket_length(n, 2048) for n in range(1, 2049)})
    assert lengths == [32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536,
                       1792, 2048]
    assert all(n <= bucket_length(n, 2048) < 1.25 * n + 32 for n in range(1, 2049))
    assert bucket_length(100, 64) == 64
    # on a mesh whose sequence splits 64 ways (context 32, balanced): a multiple of 64 past the context's end
    assert bucket_length(100, 2048, 64) == 128 and bucket_length(100, 96, 64) == 128


def test_rows_on_a_context_mesh_are_a_multiple_of_its_split():
    """`LoadedRun.sequence_multiple`: the devices a row's sequence splits over (context, x tensor under sequence
    parallelism), twice the context under the balanced layout; 1 without a context axis."""
    from jaxlm import axes
    from jaxlm import mesh as mesh_lib
    from jaxlm.inference import sequence_multiple

    def multiple(layout="balanced", act_seq="context", **sizes):
        rules = mesh_lib.rules_from_config({**mesh_lib.default_rules(), "act_seq": act_seq})
        return sequence_multiple(mesh_lib.make_mesh(axes.shape_of(**sizes)), rules, layout)

    assert multiple(fsdp=8) == 1
    assert multiple(fsdp=1, context=8) == 16
    assert multiple("contiguous", fsdp=1, context=8) == 8
    assert multiple(fsdp=2, context=2, tensor=2, act_seq="context,tensor") == 4
    assert multiple("contiguous", fsdp=2, context=2, tensor=2, act_seq="context,tensor") == 4
    assert multiple(fsdp=1, context=2, tensor=4, act_seq="context,tensor") == 8


def test_the_adapters_loglikelihoods_are_jaxlms_own_scorers(run, harness_lm):
    """The harness's requests (context, " choice") answered by the adapter: the log-likelihoods
    `jaxlm.evaluate.multiple_choice` gives the same strings, and the greedy flag true exactly where the
    choice is the fact the model learned."""
    examples = [evaluate.Example(r["context"], tuple(f" {c}" for c in r["choices"]), r["answer"])
                for r in rows("facts_choice")]
    own = evaluate.multiple_choice(run, examples, scorer=harness_lm.scorer)
    answered = harness_lm.loglikelihood(instances("loglikelihood", [(e.context, c) for e in examples for c in e.choices]))
    got = np.array([logprob for logprob, _ in answered]).reshape(len(examples), 4)
    np.testing.assert_allclose(got, np.array(own["loglikelihoods"]), rtol=1e-6, atol=1e-6)
    learned = [c == f" {LIKES[e.context.split()[-2]]}." for e in examples for c in e.choices]
    assert [greedy for _, greedy in answered] == learned
    assert own["acc"] == 0.75  # rows 3, 7, 11, 15, 19 are labelled with a fruit the model did not learn


def test_generate_until_is_jaxlms_greedy_generation_cut_at_the_stop_string(run, harness_lm):
    contexts = [r["context"] for r in rows("facts_generate")]
    answered = harness_lm.generate_until(instances("generate_until", [(c, GREEDY_UNTIL_STOP) for c in contexts]))
    greedy = harness_lm.generator.generate(contexts, max_new_tokens=12, sampling=generate.GREEDY)  # no early stop
    assert answered == [c.text.split(".")[0] for c in greedy]
    assert answered == [f" {LIKES[c.split()[-2]]}" for c in contexts]
    # a stop string that never comes: the whole greedy text, up to EOS or max_gen_toks
    whole = harness_lm.generate_until(instances("generate_until", [(contexts[0], {"until": ["zzz"], "max_gen_toks": 12})]))
    assert whole == [greedy[0].text]


def test_the_evaluate_command_runs_harness_tasks_as_its_own_tasks(facts_run, tmp_path, capsys):
    """`python -m jaxlm.evaluate --lm_eval_tasks=... --lm_eval_include_path=...` (in this process): the
    harness's multiple-choice task over facts_choice.jsonl has the accuracy `--tasks` gives on the same rows."""
    pytest.importorskip("lm_eval")
    own = tmp_path / "facts_choice.jsonl"  # jaxlm's format, the harness's target delimiter in front of each choice
    own.write_text("".join(json.dumps({**r, "choices": [f" {c}" for c in r["choices"]]}) + "\n"
                           for r in rows("facts_choice")))
    out = tmp_path / "eval.json"
    assert evaluate.main([f"--run_dir={facts_run}", "--corpus=none", "--dtype=float32", f"--tasks={own}",
                          "--lm_eval_tasks=jaxlm_facts_choice", f"--lm_eval_include_path={TASKS}",
                          f"--output={out}"]) == 0
    results = json.loads(out.read_text())
    harness = results["lm_eval"]["results"]["jaxlm_facts_choice"]
    assert harness["acc,none"] == results["tasks"]["facts_choice"]["acc"] == 0.75
    assert harness["acc_norm,none"] == results["tasks"]["facts_choice"]["acc_norm"]
    assert results["lm_eval"]["n-samples"]["jaxlm_facts_choice"]["effective"] == 20
    assert "| jaxlm_facts_choice | acc | 0.7500 |" in capsys.readouterr().out


def test_without_the_harness_the_flag_and_the_command_are_one_line(tmp_path):
    """An `lm_eval` that fails to import (a package of that name raising ImportError, first on the path):
    `--lm_eval_tasks` and `python -m jaxlm.lm_eval` each stop with one line saying what to install."""
    fake = tmp_path / "path" / "lm_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'lm_eval'\", name='lm_eval')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT)]), JAX_PLATFORMS="cpu")
    for argv in (["jaxlm.evaluate", f"--run_dir={tmp_path}", "--lm_eval_tasks=hellaswag"],
                 ["jaxlm.lm_eval", "--model", "jaxlm", "--tasks", "hellaswag"]):
        done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert lines[0] == ("jaxlm: error: lm-evaluation-harness is not installed; install jaxlm's extra: pip install "
                            "'jaxlm[eval]' (in a checkout: pip install -e '.[eval]')"), lines


@pytest.mark.parametrize("argv, words", [
    pytest.param(["--lm_eval_tasks=no_such_task", f"--lm_eval_include_path={TASKS}"],
                 "no lm-evaluation-harness task 'no_such_task'",
                 marks=pytest.mark.slow),  # the harness's own thousands of tasks indexed: seconds
    (["--lm_eval_limit=3"], "--lm_eval_limit is a setting of --lm_eval_tasks"),
])
def test_bad_harness_settings_are_one_line(facts_run, tmp_path, capsys, argv, words):
    pytest.importorskip("lm_eval")
    code = evaluate.main([f"--run_dir={facts_run}", "--corpus=none", *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxlm:")]
    assert code == 2 and len(err) == 1 and words in err[0], err


def test_requests_past_the_models_context_are_one_line(harness_lm):
    from jaxlm.errors import UserError

    context = harness_lm.max_length  # 64 tokens
    with pytest.raises(UserError, match=f"a continuation is .* tokens, longer than the model's context \\({context}\\)"):
        harness_lm.loglikelihood(instances("loglikelihood", [("alice likes", " apples." * context)]))
    with pytest.raises(UserError, match=f"generates up to {context} tokens, which leaves no room for its prompt"):
        harness_lm.generate_until(instances("generate_until", [("alice likes", {"max_gen_toks": context})]))


# ----------------------------------------------------------------------------- the hf model on the export

# (context, continuation): words split at the border, trailing spaces, punctuation, an empty context, a BOS-led text
PAIRS = [("hello", "world"), ("The quick brown", " fox jumps."), ("x = 1", "23 + y"), ("alice likes ", "apples."),
         ("def f(x):\n    return", " x ** 2\n"), ("Caf", "\u00e9 au lait"), ("", "alone"), ("<|begin_of_text|>Hi", " there")]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama2", "llama3", "qwen2"])
def test_requests_are_tokenized_as_the_harness_hf_model_tokenizes_them(kind, tmp_path, monkeypatch):
    """Imported Hugging Face tokenizers of each convention (GPT-2: a BOS named but never added; Llama 2 and 3:
    BOS added; Qwen2: none): the harness's hf model (its own `_encode_pair`, `tok_encode`, `tok_batch_encode`
    over transformers' tokenizer) and jaxlm (`scoring`, over `HFTokenizer`) split and encode alike."""
    pytest.importorskip("lm_eval")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import test_hf_tokenizer as made
    from lm_eval.models.huggingface import HFLM

    from jaxlm import scoring
    from jaxlm.data.tokenizer import Tokenizer

    for key, value in made.OFFLINE.items():
        monkeypatch.setenv(key, value)
    directory = tmp_path / kind
    if kind == "llama2":
        made.make_llama2(directory, tmp_path / "sp")
    else:
        getattr(made, f"make_{kind}")(directory)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(hf_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=64))
    harness = HFLM(pretrained=model, tokenizer=hf_tokenizer)
    tok = Tokenizer.load(directory)
    assert tok.adds_bos == (kind in ("llama2", "llama3"))
    for context, continuation in PAIRS:
        if context:  # (the harness's own rule for an empty context sits inside its loglikelihood)
            assert scoring.encode_pair(tok, context, continuation, tok.adds_bos) == tuple(
                harness._encode_pair(context, continuation)), (context, continuation)
        text = context + continuation  # a rolling document, a generation prompt
        assert scoring.encode(tok, text, tok.adds_bos) == harness.tok_encode(text)
        assert scoring.encode(tok, text, tok.adds_bos) == harness.tok_batch_encode([text])[0][0].tolist()
    assert scoring.prefix_id(tok) == harness.prefix_token_id


@pytest.mark.slow
def test_the_harness_gives_the_hf_models_numbers_on_the_runs_export(run, facts_run, tmp_path, monkeypatch):
    """Every local task run by the harness with `--model jaxlm` and with `--model hf` on `jaxlm.hf export`'s
    copy: the same accuracy, exact match and generated text, log-likelihoods within 1e-4 request by request,
    the same perplexities."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.tasks import TaskManager

    from jaxlm import hf
    from jaxlm import lm_eval as adapter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    exported = hf.export_run(facts_run, tmp_path / "facts-hf", dtype="float32")
    tasks = ["jaxlm_facts_choice", "jaxlm_facts_generate", "jaxlm_facts_perplexity"]
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    common = dict(tasks=tasks, task_manager=manager, log_samples=True, torch_random_seed=None)
    ours = lm_eval.simple_evaluate(model=adapter.JaxLM(run=run), **common)
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={exported},dtype=float32", device="cpu",
                                     batch_size=8, **common)
    for task in tasks:
        for key, value in theirs["results"][task].items():
            if isinstance(value, float) and "perplexity" not in key and "bits_per_byte" not in key:
                assert ours["results"][task][key] == value, (task, key)
    assert ours["results"]["jaxlm_facts_choice"]["acc,none"] == 0.75
    assert ours["results"]["jaxlm_facts_generate"]["exact_match,strip"] == 10 / 12
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["jaxlm_facts_perplexity"][key] == pytest.approx(
            theirs["results"]["jaxlm_facts_perplexity"][key], rel=1e-5)
    for task in tasks:
        for a, b in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert a["doc_id"] == b["doc_id"]
            if task == "jaxlm_facts_generate":
                assert a["resps"] == b["resps"]
                continue
            got, want = ([r[0] if isinstance(r[0], float) else r[0][0] for r in s["resps"]] for s in (a, b))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
