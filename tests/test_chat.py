"""Chat in generation: `jaxlm.generate --chat` (flags, --messages, a JSONL prompts file) and
`--interactive`, and the Python route (`explore.chat`, `explore.sample` on ids), on a real chat run
(the facts run fine-tuned on the built-in chat set with the simple template) and on a model whose
Hugging Face tokenizer has special chat tokens. Greedy answers are compared as token ids: each route
must prompt the model with exactly the ids the run's template renders, special tokens included."""

import io
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from command_forks import run_command

from jaxlm import explore, generate, inference
from jaxlm.data import sft
from jaxlm.data.tokenizer import SentencePieceTokenizer, Tokenizer
from tiny_run import ONE_DEVICE, ROOT, train_chat_run

FIRST, SECOND = "What is 2 plus 3?", "And 4 plus 4?"
NEW = 32
GREEDY = ["--temperature=0", f"--max_new_tokens={NEW}", "--dtype=float32", "--json"]


@pytest.fixture(scope="module")
def chat_run(facts_run, tmp_path_factory):
    return train_chat_run(tmp_path_factory.mktemp("chat"), facts_run)


@pytest.fixture(scope="module")
def loaded(chat_run):
    return inference.load_run(chat_run, dtype="float32")


def _cli(capsys, run_dir, *args: str) -> list[dict]:
    assert generate.main(["--run_dir", str(run_dir), *args, *GREEDY]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_chat_answers_are_the_greedy_tokens_of_the_templates_ids(chat_run, loaded, capsys):
    """--prompt with --system, and --messages with a past assistant turn: the ids printed are those of
    greedy sampling on the simple template's rendering of each conversation (BOS, and the EOS that ends a
    past answer, as their ids)."""
    history = [_user(FIRST), {"role": "assistant", "content": "5."}, _user(SECOND)]
    lines = _cli(capsys, chat_run, "--system=Be brief.", f"--prompt={FIRST}", f"--messages={json.dumps(history)}")
    conversations = [[{"role": "system", "content": "Be brief."}, _user(FIRST)],
                     [{"role": "system", "content": "Be brief."}, *history]]
    assert [line["messages"] for line in lines] == conversations
    tok = loaded.tokenizer
    template = sft.Encoder("chat", sft.TEMPLATES["simple"])  # what the run was fine-tuned with
    prompts = [template.prompt_ids(tok, c) for c in conversations]
    assert all(p[0] == tok.bos_id for p in prompts) and tok.eos_id in prompts[1]  # specials as ids
    assert tok.encode([tok.decode(prompts[1])], add_bos=True, add_eos=False)[0] != prompts[1]  # text would lose them
    expected = generate.Generator.from_run(loaded).generate_ids(prompts, max_new_tokens=NEW)
    assert [line["ids"] for line in lines] == [c.ids for c in expected]
    assert [line["completion"] for line in lines] == [tok.decode(c.ids) for c in expected]


def test_a_jsonl_prompts_file_gives_what_the_flags_give(chat_run, capsys, tmp_path):
    history = [_user(FIRST), {"role": "assistant", "content": "5."}, _user(SECOND)]
    by_flags = _cli(capsys, chat_run, "--chat", f"--prompt={FIRST}", f"--messages={json.dumps(history)}")
    rows = [json.dumps([_user(FIRST)]), "", json.dumps({"messages": history, "id": 7})]
    (tmp_path / "chats.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "chats.txt").write_text("\n".join(rows) + "\n")
    assert _cli(capsys, chat_run, f"--prompts_file={tmp_path / 'chats.jsonl'}") == by_flags  # told by the extension
    assert _cli(capsys, chat_run, "--chat", f"--prompts_file={tmp_path / 'chats.txt'}") == by_flags


def _interactive(chat_run, *extra: str) -> subprocess.Popen:
    """The interactive command as a real subprocess, for a test that signals it while it reads."""
    return subprocess.Popen([sys.executable, "-m", "jaxlm.generate", f"--run_dir={chat_run}", "--interactive",
                             *GREEDY, *extra], cwd=ROOT, env=ONE_DEVICE, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_interactive_answers_the_second_turn_as_a_one_shot_chat_with_the_history(chat_run, capsys):
    """Two lines of standard input, then its end: two answers, exit 0. The second equals `--chat` with the
    whole history (greedy), and it was computed on the cache of the first turn: all of the first prompt
    and answer (and the EOS that ended it) were reused, only the new message ran."""
    done = run_command("generate", [f"--run_dir={chat_run}", "--interactive", *GREEDY], cwd=ROOT, env=ONE_DEVICE,
                       input=f"{FIRST}\n{SECOND}\n", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    turns = [json.loads(line) for line in done.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    first, second = turns
    assert first["finish_reason"] == "eos"
    assert second["reused_tokens"] == first["prompt_tokens"] + first["tokens"] + 1
    history = [_user(FIRST), {"role": "assistant", "content": first["completion"]}, _user(SECOND)]
    one_shot = _cli(capsys, chat_run, f"--messages={json.dumps(history)}")
    assert one_shot[0]["ids"] == second["ids"] and one_shot[0]["completion"] == second["completion"]
    assert one_shot[0]["ids"] != first["ids"]


def test_interactive_reset_and_exit_and_a_message_past_the_context(chat_run, loaded, capsys, monkeypatch):
    """/reset starts over: the next answer is a one-shot chat's, computed on the cache from the common start
    of the two conversations on (the slots after it rewritten); /exit ends before the lines after it; a
    message longer than the context is one error line and the chat goes on."""
    lines = [FIRST, "x" * 300, "/reset", SECOND, "/exit", FIRST]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    assert generate.main(["--run_dir", str(chat_run), "--interactive", *GREEDY]) == 0
    captured = capsys.readouterr()
    turns = [json.loads(line) for line in captured.out.splitlines()]
    errors = [line for line in captured.err.splitlines() if line.startswith("jaxlm: error:")]
    assert len(errors) == 1 and "but the model's context is 256 tokens" in errors[0], captured.err
    one_shot = _cli(capsys, chat_run, "--chat", f"--prompt={FIRST}", f"--prompt={SECOND}")
    assert [t["ids"] for t in turns] == [line["ids"] for line in one_shot]
    template, tok = loaded.chat_template(), loaded.tokenizer
    shared = generate.common_start(*(template.prompt_ids(tok, [_user(q)]) for q in (FIRST, SECOND)))
    assert 0 < turns[1]["reused_tokens"] == shared < turns[1]["prompt_tokens"]


@pytest.mark.slow  # a second interactive subprocess (3 s with a warm compilation cache, 30 s cold): make check
def test_ctrl_c_ends_an_interactive_chat_with_130(chat_run):
    process = _interactive(chat_run)
    process.stdin.write(f"{FIRST}\n")
    process.stdin.flush()
    assert json.loads(process.stdout.readline())["turn"] == 1  # waiting for the next line now
    os.kill(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "jaxlm: interrupted" in err and "Traceback" not in err, err


# ----------------------------------------------------------------------------- a template with special tokens


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A Qwen2-style tokenizer (<|im_start|>, <|im_end|> special; its own ChatML template) and a random
    tiny model on one device whose config fine-tunes on chat with the tokenizer's template."""
    from test_hf_tokenizer import OFFLINE, make_qwen2

    directory = tmp_path_factory.mktemp("qwen2")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        make_qwen2(directory)
    tok = Tokenizer.load(directory)
    setup = explore.build("tiny", devices=1, model__vocab_size=700, model__n_layers=2, data__tokenizer_path=str(directory),
                          data__corpus="builtin_chat", data__format="chat", data__chat_template="", data__seq_len=64)
    return setup, tok


def test_the_python_route_prompts_with_the_special_token_ids(chatml):
    """explore.chat and explore.sample on ids give the model the template's ids, <|im_start|> and
    <|im_end|> included: the answers are greedy sampling on those ids. Decoded to text and encoded again
    (what the notebook did) the prompt loses them, and the model answers otherwise."""
    setup, tok = chatml
    conversation = [{"role": "system", "content": "Be brief."}, _user(FIRST)]
    ids = explore.chat_prompt_ids(setup, conversation, tok)
    assert ids == sft.Encoder("chat", tok.chat_template).prompt_ids(tok, conversation)
    start, end = (tok._tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(start) == 3 and ids.count(end) == 2
    gen = explore.generator(setup, tok)
    direct = tok.decode(gen.generate_ids([ids], max_new_tokens=8, eos_id=None)[0].ids)
    options = dict(temperature=0, max_new_tokens=8)
    assert explore.chat(setup, conversation, tok, **options) == direct
    assert explore.sample(setup, ids, tok, **options) == direct
    assert explore.sample(setup, [ids, ids], tok, **options) == [direct, direct]
    decoded = tok.decode(ids)
    assert start not in tok.encode([decoded], add_bos=True, add_eos=False)[0]
    assert explore.sample(setup, decoded, tok, **options) != direct


def test_a_chat_answer_stops_at_the_templates_end_of_turn_as_at_eos(tmp_path):
    """A base model's tokenizer (EOS <|endoftext|>) with ChatML: an answer ends at <|im_end|>, the marker
    SFT taught it to emit (`sft.Encoder.stop_ids`); an instruct tokenizer's EOS is that marker already; a
    template whose end of turn is text (not a special token) adds nothing."""
    from test_hf_tokenizer import OFFLINE, make_qwen2

    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        make_qwen2(tmp_path / "base", eos="<|endoftext|>")
        make_qwen2(tmp_path / "instruct")
    base, instruct = Tokenizer.load(tmp_path / "base"), Tokenizer.load(tmp_path / "instruct")
    im_end, text_end = (base._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert base.eos_id == text_end and instruct.eos_id == im_end
    assert sft.Encoder("chat", base.chat_template).stop_ids(base) == (text_end, im_end)
    assert sft.Encoder("chat", instruct.chat_template).stop_ids(instruct) == (im_end,)
    spm = SentencePieceTokenizer.train([], 300, "byte")
    template, _ = sft.template_text("chatml", spm)
    assert sft.Encoder("chat", template).stop_ids(spm) == (spm.eos_id,)  # its "<|im_end|>" is plain text there
    # the sampler stops a row at any of them, and the completion ends before it
    done = generate._next_tokens(jnp.array([[0.0, 5.0, 0.0], [9.0, 0.0, 0.0]]), jax.random.key(0), 0,
                                 jnp.array([False, False]), generate.SamplingArrays.of(generate.GREEDY, (7, 1)))[1]
    assert done.tolist() == [True, False]
    got = generate.completion([1, 2], np.array([5, 9, im_end, 4]), (text_end, im_end))
    assert (got.ids, got.finish_reason) == ([5, 9], "eos")
