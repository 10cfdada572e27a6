"""Standalone evaluation of a real, seconds-long training run: perplexity and bits per byte against an
independent computation, multiple-choice scoring on facts the model learned, the CLI and its errors."""

import json
import math
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from command_forks import run_command
from flax import nnx

from jaxlm import evaluate, inference
from jaxlm.data import pipeline, prepare, sources
from tiny_run import FRUITS, LIKES, NAMES, SEQ_LEN

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(facts_run):
    return facts_run  # one trained run shared by the evaluation and generation tests (tests/conftest.py)


@pytest.fixture(scope="module")
def run(run_dir):
    return inference.load_run(run_dir, dtype="float32")


def independent_logp(run, sequences) -> list[np.ndarray]:
    """log p of every next token of each sequence (at most seq_len + 1 tokens), each sequence run
    alone through a plain jitted forward pass on one device, log-softmax in float64."""
    graphdef = run.model_spec.graphdef
    forward = jax.jit(lambda params, inputs: nnx.merge(graphdef, params)(inputs))
    params = jax.tree.map(jnp.asarray, jax.device_get(run.params))
    rows = -(-len(sequences) // 32) * 32  # fixed shapes: one compilation for the whole module
    inputs = np.zeros((rows, SEQ_LEN), np.int32)
    for i, s in enumerate(sequences):
        inputs[i, : len(s) - 1] = s[:-1]  # right padding: causal attention, so no real logit sees it
    logp = log_softmax64(forward(params, jnp.asarray(inputs)))
    return [logp[i, np.arange(len(s) - 1), np.asarray(s[1:])] for i, s in enumerate(sequences)]


def independent_nll(run, sequences) -> list[float]:
    return [-float(np.sum(lp)) for lp in independent_logp(run, sequences)]


def windows(ids, seq_len: int = SEQ_LEN) -> list:
    """A document as evaluation scores it: windows of seq_len targets, each from a fresh context."""
    return [ids[start : start + seq_len + 1] for start in range(0, len(ids) - 1, seq_len)]


def log_softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def validation_texts(run_dir) -> list[str]:
    docs = (run_dir.parent / "facts.txt").read_text().split("\n\n")
    return [d for d in docs if sources.is_validation(d, 0.2, 0)]


def task_lines() -> list[dict]:
    """For each name: which of four fruits they like (the answer at a different index each time)."""
    lines = []
    for i, name in enumerate(NAMES):
        wrong = [f for f in FRUITS if f != LIKES[name]][i % 5 : i % 5 + 3]
        choices = [f" {f}." for f in wrong]
        choices.insert(i % 4, f" {LIKES[name]}.")
        lines.append({"context": f"{name} likes", "choices": choices, "answer": i % 4})
    return lines


def test_perplexity_on_the_validation_split_and_the_cli(run_dir, run, tmp_path, capsys):
    tasks = tmp_path / "likes.jsonl"
    tasks.write_text("".join(json.dumps(line) + "\n" for line in task_lines()))
    assert evaluate.main(["--run_dir", str(run_dir), "--dtype=float32", f"--tasks={tasks}"]) == 0
    out = capsys.readouterr().out
    assert "| corpus | tokens | loss | perplexity | bits/byte |" in out and "| likes | 8 |" in out
    results = json.loads((run_dir / "eval-120.json").read_text())  # the default output
    assert results["step"] == 120 and results["dtype"] == "float32" and results["devices"].startswith("8x")

    texts = validation_texts(run_dir)
    docs = pipeline.tokenize_documents(run.tokenizer, texts)
    nll = independent_nll(run, [w for d in docs for w in windows(d)])
    tokens = sum(len(d) - 1 for d in docs)
    lm = results["corpus"]
    assert lm["documents"] == len(docs) and lm["tokens"] == tokens
    assert lm["loss"] == pytest.approx(sum(nll) / tokens, rel=1e-5)
    assert lm["perplexity"] == pytest.approx(math.exp(sum(nll) / tokens), rel=1e-5)
    assert lm["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
    assert lm["bits_per_byte"] == pytest.approx(sum(nll) / math.log(2) / lm["bytes"], rel=1e-5)
    assert results["tasks"]["likes"]["examples"] == 8


def test_loss_in_the_run_dtype_matches_the_runs_own_validation_loss(run_dir):
    """bfloat16, the run's dtype: the same held-out batches as the training loop's evaluation."""
    bf16 = inference.load_run(run_dir)
    docs, _ = evaluate.corpus_documents(bf16, "val")
    result = evaluate.perplexity(bf16, docs)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val_loss"] for r in records if "val_loss" in r][-1]
    assert result["loss"] == pytest.approx(val_loss, rel=1e-3)


def test_bits_per_byte_on_a_known_text(run_dir, run, tmp_path):
    """A text of multi-byte characters and more than two windows of 64 tokens."""
    text = "alice likes apples. café, naïve, 日本語. " * 6 + "heidi likes mangos."
    path = tmp_path / "known.txt"
    path.write_text(text, encoding="utf-8")
    output = tmp_path / "known.json"
    assert evaluate.main(["--run_dir", str(run_dir), "--dtype=float32", f"--corpus={path}", f"--output={output}"]) == 0
    lm = json.loads(output.read_text())["corpus"]
    ids = pipeline.tokenize_documents(run.tokenizer, [text])[0]
    assert len(ids) > 2 * 64 + 1
    nll = sum(independent_nll(run, windows(ids)))
    assert lm["bytes"] == len(text.encode("utf-8")) and lm["tokens"] == len(ids) - 1
    assert lm["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(text.encode("utf-8")), rel=1e-5)
    assert lm["loss"] == pytest.approx(nll / (len(ids) - 1), rel=1e-5)


def test_a_prepared_corpus_and_a_token_limit(run_dir, run, tmp_path):
    """The val split of the corpus prepared with the run's tokenizer is the run's validation split."""
    source = sources.SourceSpec(str(run_dir.parent / "facts.txt"), separator="\n\n")
    prepare.prepare(source, run.tokenizer, tmp_path / "prepared", val_fraction=0.2, seed=0, workers=1, progress=False)
    prepared, name = evaluate.corpus_documents(run, str(tmp_path / "prepared"))
    raw, _ = evaluate.corpus_documents(run, "val")
    assert name.startswith("val split of")
    assert [d.tolist() for d in prepared] == [d.tolist() for d in raw]
    limited, _ = evaluate.corpus_documents(run, "val", max_tokens=100)
    assert sum(len(d) - 1 for d in limited) == 100
    assert evaluate.perplexity(run, limited)["tokens"] == 100


def test_multiple_choice_picks_the_facts_the_model_learned(run, tmp_path):
    path = tmp_path / "likes.jsonl"
    lines = task_lines()
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = evaluate.multiple_choice(run, evaluate.read_examples(path))
    assert result["examples"] == 8
    assert result["acc"] == 1.0 and result["acc_norm"] == 1.0
    # Each score is the log-likelihood of the choice's tokens after the context, computed independently.
    tok = run.tokenizer
    context = tok.encode([lines[0]["context"]], add_bos=True, add_eos=False)[0]
    choices = [tok.encode([choice], add_bos=False, add_eos=False)[0] for choice in lines[0]["choices"]]
    logps = independent_logp(run, [context + choice for choice in choices])
    for c, (choice, logp) in enumerate(zip(choices, logps)):
        # float32's rounding, at another length (the CPU's causal blocks sum each row over the keys up to
        # its block's end): about 1e-6 apart on a log-likelihood of -0.08
        assert result["loglikelihoods"][0][c] == pytest.approx(float(np.sum(logp[-len(choice):])), rel=1e-5, abs=1e-5)
    # lm-eval-harness's convention: a context's trailing space moves to the front of each choice.
    spaced = [evaluate.Example(f"{n} likes ", tuple(c.lstrip() for c in line["choices"]), line["answer"])
              for n, line in zip(NAMES, lines)]
    again = evaluate.multiple_choice(run, spaced)
    np.testing.assert_allclose(again["loglikelihoods"], result["loglikelihoods"], rtol=1e-6)
    # The scores decide: with every answer moved to a wrong choice, nothing is right.
    wrong = [evaluate.Example(e.context, e.choices, (e.answer + 1) % 4) for e in spaced]
    assert evaluate.multiple_choice(run, wrong)["acc"] == 0.0


def _no_checkpoints(run_dir, tmp_path) -> pathlib.Path:
    empty = tmp_path / "fresh"
    empty.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(run_dir / name, empty / name)
    return empty


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_checkpoints", "has no checkpoints (nothing complete in"),
        ("missing_dir", "nope' does not exist"),
        ("bad_step", "--step=7: "),
        ("not_json", "bad.jsonl:2: not JSON"),
        ("no_choices", "bad.jsonl:1: no 'choices'"),
        ("bad_answer", "bad.jsonl:1: 'answer' must be the index of the right choice, an integer from 0 to 1; got 2"),
        ("one_choice", "bad.jsonl:1: 'choices' must be a list of at least 2 non-empty strings"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(run_dir, tmp_path, capsys, case, expected):
    args = ["--run_dir", str(run_dir)]
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"context": "alice likes", "choices": [" apples.", " figs."], "answer": 0})
    if case == "no_checkpoints":
        args = ["--run_dir", str(_no_checkpoints(run_dir, tmp_path))]
    elif case == "missing_dir":
        args = ["--run_dir", str(tmp_path / "nope")]
    elif case == "bad_step":
        args.append("--step=7")
    else:
        bad.write_text({
            "not_json": good + "\n{context: 'x'}\n",
            "no_choices": json.dumps({"context": "x", "answer": 0}),
            "bad_answer": json.dumps({"context": "x", "choices": ["a", "b"], "answer": 2}),
            "one_choice": json.dumps({"context": "x", "choices": ["a"], "answer": 0}),
        }[case])
        args.append(f"--tasks={bad}")
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("jaxlm: error:")]
    assert len(lines) == 1 and expected in lines[0], err
    if case == "bad_step":
        assert "its checkpoints: 120" in lines[0]
    assert "Traceback" not in err


def test_the_module_runs_as_a_command(run_dir, tmp_path):
    result = run_command("evaluate", [f"--run_dir={_no_checkpoints(run_dir, tmp_path)}"], cwd=ROOT, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("jaxlm: error:") and "has no checkpoints" in result.stderr
    assert "Traceback" not in result.stderr
