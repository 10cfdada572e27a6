"""Supervised fine-tuning data (`jaxlm.data.sft`): chat rows rendered with a template and weighted
on the assistant's tokens alone, prompt/completion rows, the weights through packing (both the
in-memory and the prepared path), the start-of-run report, bad rows, the built-in chat set, and a
real training run whose held-out assistant loss goes down. Real tokenizers: a SentencePiece model
trained here and Hugging Face tokenizer.json ones made with transformers (test_hf_tokenizer's
helpers), checked against transformers' own apply_chat_template."""

import json
import pathlib

import floats
import numpy as np
import pytest
from command_forks import run_command
from test_hf_tokenizer import OFFLINE, make_llama3, make_qwen2

from jaxlm import config as config_lib
from jaxlm.data import builtin_chat, loader, pipeline, prepare, sft, sources
from jaxlm.data.tokenizer import SentencePieceTokenizer, Tokenizer
from jaxlm.errors import UserError
from tiny_run import ONE_DEVICE, ROOT

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Japan?"},
     {"role": "assistant", "content": "Tokyo, 東京 🗼"}],
    [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "Roses are red,\nviolets are blue.\n"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": " leading space"},
     {"role": "user", "content": "y"}],  # a user turn last: rendered, weighed 0
]
# ChatML with transformers' {% generation %} marks around what its assistant mask covers.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def sp() -> Tokenizer:
    """A SentencePiece tokenizer trained on the built-in chat set rendered both ways (no chat tokens)."""
    texts = []
    for name in ("simple", "chatml"):
        encoder = sft.Encoder("chat", sft.TEMPLATES[name])
        examples = (sft.check_row(c, "chat", "builtin") for c in builtin_chat.conversations(300))
        texts += list(sft.tokenizer_texts(examples, encoder))
    return SentencePieceTokenizer.train(texts, 400)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        make_qwen2(root / "qwen2")
        make_llama3(root / "llama3")
    return {"qwen2": root / "qwen2", "llama3": root / "llama3"}


def _tokenizer(kind: str, sp: Tokenizer, hf_dirs) -> Tokenizer:
    return sp if kind == "sp" else Tokenizer.load(hf_dirs[kind])


def _runs(ids: np.ndarray, weights: np.ndarray) -> list[list[int]]:
    """The maximal runs of consecutive weight-1 tokens."""
    runs, current = [], []
    for i, w in zip(ids.tolist(), weights.tolist()):
        if w:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


# (tokenizer, data.chat_template, what each assistant run decodes to, the id it ends with)
CASES = {
    "sp-simple": ("sp", "simple", lambda c: c, "eos"),
    "sp-chatml": ("sp", "chatml", lambda c: c + "<|im_end|>", None),  # no chat tokens: <|im_end|> is text
    "qwen2-own": ("qwen2", "", lambda c: c, "<|im_end|>"),  # a special token: decode drops it
    "qwen2-chatml": ("qwen2", "chatml", lambda c: c, "<|im_end|>"),
    "llama3-own": ("llama3", "", str.strip, "<|eot_id|>"),  # its template trims the content
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_are_one_exactly_on_each_assistant_turn_and_its_end_marker(case, sp, hf_dirs):
    kind, template, expected, end = CASES[case]
    tok = _tokenizer(kind, sp, hf_dirs)
    encoder = sft.Encoder.make(sft.Spec("chat", template), tok)
    for n, messages in enumerate(CONVERSATIONS):
        ids, weights = encoder(tok, sft.check_row({"messages": messages}, "chat", f"c:{n}"))
        assert ids.dtype == np.int32 and weights.dtype == np.uint8 and len(ids) == len(weights)
        # The ids are exactly the tokenization of the whole rendered conversation.
        assert ids.tolist() == sft.encode_rendered(tok, encoder.render(tok, messages))
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        runs = _runs(ids, weights)
        assert [tok.decode(run) for run in runs] == [expected(a) for a in answers]
        if end is not None:
            end_id = tok.eos_id if end == "eos" else Tokenizer.load(hf_dirs[kind]).encode([end], False, False)[0][0]
            assert all(run[-1] == end_id for run in runs)
        assert int(weights.sum()) == sum(len(run) for run in runs) and weights[0] == 0


@pytest.mark.parametrize("case", ["qwen2-own", "qwen2-chatml", "llama3-own"])
def test_rendering_and_ids_are_transformers_apply_chat_template(case, sp, hf_dirs, monkeypatch):
    import transformers

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    kind, template, _, _ = CASES[case]
    tok, theirs = Tokenizer.load(hf_dirs[kind]), transformers.AutoTokenizer.from_pretrained(hf_dirs[kind])
    encoder = sft.Encoder.make(sft.Spec("chat", template), tok)
    options = {"chat_template": sft.TEMPLATES[template]} if template else {}
    for messages in CONVERSATIONS:
        for generation_prompt in (False, True):
            text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **options)
            assert encoder.render(tok, messages, generation_prompt) == text
        expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"]
        assert encoder(tok, sft.check_row({"messages": messages}, "chat", "x"))[0].tolist() == expected
        assert encoder.prompt_ids(tok, messages) == theirs.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=True, **options)["input_ids"]


def test_weights_equal_transformers_assistant_mask_of_a_generation_template(hf_dirs, monkeypatch):
    """transformers marks assistant tokens where a template says so ({% generation %}); jaxlm finds them
    by rendering prefixes, for any template. On a template that says, the two agree token for token."""
    import transformers

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    tok, theirs = Tokenizer.load(hf_dirs["qwen2"]), transformers.AutoTokenizer.from_pretrained(hf_dirs["qwen2"])
    encoder = sft.Encoder("chat", GENERATION_TEMPLATE)
    for messages in CONVERSATIONS:
        out = theirs.apply_chat_template(messages, chat_template=GENERATION_TEMPLATE, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        ids, weights = encoder(tok, sft.check_row({"messages": messages}, "chat", "x"))
        assert ids.tolist() == out["input_ids"] and weights.tolist() == out["assistant_masks"]


def test_prompt_completion_weighs_the_completion_and_eos(sp, hf_dirs):
    for tok in (sp, Tokenizer.load(hf_dirs["llama3"])):
        example = sft.check_row({"prompt": "Question: what is 7 * 6?\nAnswer:", "completion": " 42", "id": 3},
                                "prompt_completion", "p:1")
        assert example.fields == {"prompt": "Question: what is 7 * 6?\nAnswer:", "completion": " 42"}  # other fields go
        ids, weights = sft.Encoder("prompt_completion")(tok, example)
        body = tok.encode(["Question: what is 7 * 6?\nAnswer: 42"], add_bos=False, add_eos=False)[0]
        assert ids.tolist() == [tok.bos_id] * (tok.bos_id >= 0) + body + [tok.eos_id]
        prompt = tok.encode(["Question: what is 7 * 6?\nAnswer:"], add_bos=False, add_eos=False)[0]
        assert body[: len(prompt)] == prompt  # a clean boundary: exactly the completion's tokens and EOS weigh 1
        assert weights.tolist() == [0] * (len(ids) - len(body) + len(prompt) - 1) + [1] * (len(body) - len(prompt) + 1)
        assert tok.decode(ids[weights == 1]) == " 42" and ids[weights == 1][-1] == tok.eos_id


def test_a_token_merged_across_the_prompts_end_is_trained_on_and_the_ids_stay_the_whole_texts(hf_dirs):
    tok = Tokenizer.load(hf_dirs["qwen2"])
    text = "def function(x):\n    return x"
    cut = text.index("urn")  # " return" is one token of this vocabulary: the boundary falls inside it
    prompt_ids, completion_ids = (tok.encode([t], False, False)[0] for t in (text[:cut], text[cut:]))
    assert prompt_ids + completion_ids != tok.encode([text], False, False)[0]  # the pieces apart are not the whole
    ids, weights = sft.Encoder("prompt_completion")(tok, sft.check_row(
        {"prompt": text[:cut], "completion": text[cut:]}, "prompt_completion", "x"))
    assert ids.tolist() == tok.encode([text], False, True)[0]
    assert tok.decode(ids[weights == 1]) == " return x"  # the straddling token is in, nothing before it


def test_target_weights_are_the_weights_of_the_target_tokens():
    """The off-by-one: a chunk's target t is its token t + 1, and weighs what that token weighs."""
    docs = pipeline.FlatDocuments.from_arrays([np.arange(10, 15, dtype=np.int32), np.arange(20, 23, dtype=np.int32)],
                                              [np.array([0, 0, 1, 1, 0], np.uint8), np.array([0, 1, 1], np.uint8)])
    batch = pipeline.make_eval_batches(docs, seq_len=8, batch_size=1, max_batches=1)[0]
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "weights"} and list(batch)[-1] == "weights"
    np.testing.assert_array_equal(batch["inputs"][0], [10, 11, 12, 13, 20, 21, 0, 0])
    np.testing.assert_array_equal(batch["targets"][0], [11, 12, 13, 14, 21, 22, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 1, 1, 2, 2, 0, 0])
    # the documents' uint8 weights, moved into the batch as float32
    floats.identical(batch["weights"][0], np.array([0, 1, 1, 0, 1, 1, 0, 0], np.float32), why=floats.MOVED)


def _encoded(tok: Tokenizer, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    encoder = sft.Encoder("chat", sft.SIMPLE)
    examples = [sft.check_row(c, "chat", f"b:{i}") for i, c in enumerate(builtin_chat.conversations(n))]
    return sft.encode_examples(encoder, tok, examples)


def _check_segments(batch: dict[str, np.ndarray], by_inputs: dict[tuple, np.ndarray], seq_len: int) -> int:
    """Every packed segment's weights are its example's, shifted by one; padding weighs 0. Returns the
    most segments in one row."""
    most = 0
    for row in range(len(batch["inputs"])):
        seg = batch["segment_ids"][row]
        assert not batch["weights"][row][seg == 0].any()
        ids = np.unique(seg[seg > 0])
        most = max(most, len(ids))
        for s in ids:
            mask = seg == s
            weights = by_inputs[tuple(batch["inputs"][row][mask])]
            floats.identical(batch["weights"][row][mask], weights[1 : seq_len + 1].astype(np.float32),
                             why=floats.MOVED)  # the example's uint8 weights, moved into the batch as float32
            np.testing.assert_array_equal(batch["positions"][row][mask], np.arange(mask.sum()))
    return most


def test_packing_keeps_each_examples_weights_and_segments(sp):
    seq_len = 160
    ids, weights = _encoded(sp, 60)
    ids.append(np.concatenate([ids[0]] * 12))  # one example longer than seq_len: truncated, not continued
    weights.append(np.concatenate([weights[0]] * 12))
    docs = pipeline.FlatDocuments.from_arrays(ids, weights)
    by_inputs = {tuple(i[:-1][:seq_len]): w for i, w in zip(ids, weights)}
    batches = pipeline.make_eval_batches(docs, seq_len=seq_len, batch_size=4, max_batches=1000)
    assert max(_check_segments(b, by_inputs, seq_len) for b in batches) >= 3  # several examples share a row
    stats = sft.Stats.of(docs, seq_len)
    assert sum(int(b["weights"].sum()) for b in batches) == stats.trained  # every target of every example, once
    assert sum(int((b["segment_ids"] > 0).sum()) for b in batches) == stats.tokens - stats.examples
    assert (stats.examples, stats.truncated) == (61, 1)
    it = iter(pipeline.make_train_dataset(docs, seq_len=seq_len, batch_size=4, seed=3))
    for _ in range(6):
        _check_segments(next(it), by_inputs, seq_len)


def test_the_report_counts_examples_tokens_trained_targets_and_truncations():
    w = np.array([0, 0, 1, 1, 1, 1], np.uint8)  # 6 tokens, 4 trained targets
    tail = np.array([0, 0, 0, 0, 1, 1], np.uint8)  # trained only past the cut at seq_len=3
    docs = pipeline.FlatDocuments.from_arrays([np.arange(6), np.arange(6), np.arange(3)],
                                              [w, tail, np.array([0, 1, 1], np.uint8)])
    stats = sft.Stats.of(docs, seq_len=3)  # each example keeps its first 4 tokens
    assert stats == sft.Stats(examples=3, tokens=11, trained=2 + 0 + 2, truncated=2, emptied=1, seq_len=3)
    assert stats.describe("conversations") == ("3 conversations, 11 tokens, 4 trained on (36.4%), 2 truncated to "
                                               "seq_len=3 (1 with nothing left to train on)")
    val = pipeline.FlatDocuments.from_arrays([np.arange(3)], [np.array([0, 1, 1], np.uint8)])
    assert sft.report(sft.Spec("chat"), docs, val, 3).endswith("; 1 held out (2 tokens to score)")


def _config(tmp_path: pathlib.Path, **data) -> loader.DataConfig:
    """The data section of a validated config: builtin_chat with the simple template, `data` changed."""
    cfg = config_lib.base_config()
    cfg.data.update(corpus="builtin_chat", chat_template="simple", cache_dir=str(tmp_path / "cache"), seq_len=64,
                    global_batch_size=8, val_fraction=0.1, val_tokens=4096, tokenizer_vocab_size=400)
    cfg.data.update(**data)
    cfg.model.update(vocab_size=400, max_seq_len=64)
    config_lib.validate(cfg)
    return loader.DataConfig.from_config(cfg.data)


def test_in_memory_and_prepared_sft_data_give_the_same_batches_and_report(tmp_path, capsys):
    cfg = _config(tmp_path, tokenize_on_the_fly=True)
    fly = loader.load_data(cfg)
    assert fly.sft_report.startswith("SFT data: ") and "conversations" in fly.sft_report
    assert f"jaxlm: {fly.sft_report}" in capsys.readouterr().out
    # The prepare command (one worker: no process to spawn) writes the same examples with their weights.
    tok_path = tmp_path / "tok.model"
    fly.tokenizer.save(tok_path)
    out = tmp_path / "prepared"
    assert prepare.main(["--input=builtin_chat", "--format=chat", "--chat_template=simple", f"--tokenizer={tok_path}",
                         f"--output={out}", "--val_fraction=0.1", "--workers=1"]) == 0
    assert "trained on" in capsys.readouterr().out
    manifest = prepare.read_manifest(out)
    assert manifest["format_version"] == prepare.SFT_FORMAT_VERSION and manifest["sft"]["format"] == "chat"
    assert manifest["splits"]["train"]["weighted_tokens"] > 0
    prepared = loader.load_data(_config(tmp_path, corpus=str(out)))
    assert prepared.sft_report == fly.sft_report
    # The same tokens and 0/1 weights by two paths: moved, never computed.
    for a, b in zip([next(fly.train) for _ in range(3)], [next(prepared.train) for _ in range(3)]):
        assert a.keys() == b.keys()
        floats.identical(a, b, why=floats.MOVED)
    assert len(fly.eval_batches) == len(prepared.eval_batches) > 0
    for a, b in zip(fly.eval_batches, prepared.eval_batches):
        floats.identical(a["weights"], b["weights"], why=floats.MOVED)
        np.testing.assert_array_equal(a["targets"], b["targets"])
    fly.train.close()
    prepared.train.close()
    # The validation split is by row content: no held-out conversation is also a training one.
    examples = list(sft.iter_examples(sources.SourceSpec("builtin_chat"), "chat"))
    val = {e.key for e in examples if sources.is_validation(e.key, 0.1, 0)}
    assert 0 < len(val) and not val & {e.key for e in examples if not sources.is_validation(e.key, 0.1, 0)}


def test_prompt_completion_rows_through_the_loader_train_on_the_completions_alone(tmp_path, sp):
    rows = [{"prompt": f"Q: {a} + {a}?\nA:", "completion": f" {2 * a}"} for a in range(40)]
    path = _write_rows(tmp_path / "pc.jsonl", *rows)
    sp.save(tmp_path / "tok.model")
    data = loader.load_data(_config(tmp_path, corpus=path, format="prompt_completion", tokenize_on_the_fly=True,
                                    tokenizer_path=str(tmp_path / "tok.model"), val_fraction=0.25))
    held_out = [r for r in rows if sources.is_validation(sft.check_row(r, "prompt_completion", "").key, 0.25, 0)]
    assert data.sft_report.startswith(f"SFT data: {40 - len(held_out)} examples, ")
    completions = []
    for batch in data.eval_batches:
        for row in range(len(batch["inputs"])):
            seg = batch["segment_ids"][row]
            for s in np.unique(seg[seg > 0]):
                mask = (seg == s) & (batch["weights"][row] > 0)
                assert batch["targets"][row][mask][-1] == sp.eos_id  # each completion ends with EOS, trained on
                completions.append(sp.decode(batch["targets"][row][mask]))
    assert completions == [r["completion"] for r in held_out]
    data.train.close()


def test_a_text_prepared_directory_is_refused_as_sft_data(tmp_path, sp):
    (tmp_path / "a.txt").write_text("some text")
    sp.save(tmp_path / "tok.model")
    prepare.prepare(sources.SourceSpec(str(tmp_path / "a.txt")), sp, tmp_path / "p", val_fraction=0.0, progress=False)
    assert prepare.read_manifest(tmp_path / "p")["format_version"] == prepare.FORMAT_VERSION == 1  # text: as before
    with pytest.raises(UserError, match="holds prepared text, not SFT data"):
        loader.load_data(_config(tmp_path, corpus=str(tmp_path / "p"), format="chat"))


def _write_rows(path: pathlib.Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("row, template, words", [
    ({"text": "not a chat"}, "simple", ("no field 'messages'", "found: text")),
    ({"messages": "hi"}, "simple", ("'messages' must be a non-empty list",)),
    ({"messages": [{"role": "user"}]}, "simple", ("message 1 (user) has no 'content' string",)),
    ({"messages": [{"content": "x"}]}, "simple", ("message 1 has no 'role' string",)),
    ({"messages": [{"role": "user", "content": "hi"}]}, "simple", ("no assistant message",)),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}, "simple",
     ("message 2 (assistant) is empty",)),
    ({"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]}, "simple",
     ("chat template 'simple' refuses it", "not tool")),
    ("[1, 2]", "simple", ("a JSON list, not an object",)),
    ('{"messages": [', "simple", ("not valid JSON",)),
    (GOOD, "{{ messages.append(1) }}", ("refuses it",)),  # the sandbox: no changing the data
    (GOOD, "{{ ''.__class__.__mro__ }}", ("refuses it", "__class__")),  # nor reaching Python's internals
    (GOOD, "{% for m in messages %}{{ m.content }}{% if loop.last %}<end>{% endif %}{% endfor %}",
     ("does not render the conversation up to message 2 as the start of the whole",)),
    # ShareGPT and Alpaca rows, told by their fields
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{}"}]}, "simple",
     ("message 2 is from 'function_call', which is no ShareGPT role", "human, user, gpt")),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}, "simple",
     ("message 2 (gpt) has no 'value' string", "data.format=sharegpt")),
    ({"conversations": [{"value": "hi"}]}, "simple", ("message 1 has no 'from' string",)),
    ({"conversations": []}, "simple", ("'conversations' must be a non-empty list",)),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " "}]}, "simple",
     ("message 2 (assistant) is empty",)),
    ({"instruction": "Say hi"}, "simple", ("no field 'output' (found: instruction)", "data.format=alpaca")),
    ({"instruction": "Say hi", "output": ""}, "simple", ("the output is empty",)),
    ({"instruction": "Say hi", "input": 3, "output": "hi"}, "simple", ("'input' is a int, not a string",)),
    ({"instruction": "Say hi", "output": "hi", "history": [["a"]]}, "simple", ("'history' must be a list of",)),
    ({"prompt": "a", "completion": "b"}, "simple", ("no field 'messages'", "set data.format=prompt_completion")),
])
def test_a_bad_row_or_template_is_one_line_naming_the_file_and_line(tmp_path, sp, row, template, words):
    line = 3  # a bad row is the third; a bad template fails on the first
    if template not in sft.TEMPLATES:
        (tmp_path / "t.jinja").write_text(template)
        template, line = str(tmp_path / "t.jinja"), 1
    path = _write_rows(tmp_path / "chat.jsonl", GOOD, GOOD, row)
    encoder = sft.Encoder.make(sft.Spec("chat", template), sp)
    with pytest.raises(UserError) as e:
        for example in sft.iter_examples(sources.SourceSpec(path), "chat"):
            encoder(sp, example)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}:{line}: ") and all(w in message for w in words), message


# The same conversations as messages, ShareGPT and Alpaca rows (the last two: what Alpaca can hold).
SAME = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Japan?"},
     {"role": "assistant", "content": "Tokyo, 東京 🗼"}],
    [{"role": "user", "content": "Translate to French\ncat"}, {"role": "assistant", "content": " le chat\n"}],
]
SHAREGPT_NAMES = ({"user": "human", "assistant": "gpt", "system": "system"},
                  {"user": "user", "assistant": "chatgpt", "system": "system"})


def _sharegpt(messages: list[dict], names: dict[str, str]) -> dict:
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages], "id": 7}


def _alpaca(messages: list[dict]) -> dict:
    """The Alpaca row of a conversation: its system message, earlier turns as history, the last turn's user
    message as instruction (and input, after a newline), its answer as output."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [m["content"] for m in messages if m["role"] != "system"]
    instruction, _, given = turns[-2].partition("\n")
    row = {"instruction": instruction, "input": given, "output": turns[-1]}
    if system:
        row["system"] = system[0]
    if len(turns) > 2:
        row["history"] = [turns[i : i + 2] for i in range(0, len(turns) - 2, 2)]
    return row


@pytest.mark.parametrize("case", ["sp-simple", "qwen2-own", "llama3-own"])
def test_sharegpt_and_alpaca_rows_give_the_ids_and_weights_of_the_same_messages(case, sp, hf_dirs, tmp_path):
    kind, template, _, _ = CASES[case]
    tok = _tokenizer(kind, sp, hf_dirs)
    files = {
        "messages": _write_rows(tmp_path / "messages.jsonl", *({"messages": m} for m in SAME + CONVERSATIONS)),
        "sharegpt": _write_rows(tmp_path / "sharegpt.jsonl", *(_sharegpt(m, SHAREGPT_NAMES[i % 2])
                                                              for i, m in enumerate(SAME + CONVERSATIONS))),
        "alpaca": _write_rows(tmp_path / "alpaca.jsonl", *(_alpaca(m) for m in SAME)),
    }
    encoded = {}
    for form, path in files.items():
        for fmt in ("chat", "sharegpt" if form == "sharegpt" else "alpaca" if form == "alpaca" else "chat"):
            encoder = sft.Encoder.make(sft.Spec(fmt, template), tok)
            examples = list(sft.iter_examples(sources.SourceSpec(path), fmt))
            encoded[form, fmt] = [(e.key, *encoder(tok, e)) for e in examples]
    reference = encoded["messages", "chat"]
    assert len(reference) == len(SAME + CONVERSATIONS) and all(w.sum() > 0 for _, _, w in reference)
    for (form, fmt), got in encoded.items():
        expected = reference if form != "alpaca" else reference[: len(SAME)]
        assert len(got) == len(expected), (form, fmt)
        for (key, ids, weights), (ref_key, ref_ids, ref_weights) in zip(got, expected):
            assert key == ref_key  # the same validation split too
            np.testing.assert_array_equal(ids, ref_ids)
            np.testing.assert_array_equal(weights, ref_weights)


def test_sharegpt_and_alpaca_files_prepare_to_the_bytes_of_messages(tmp_path, sp):
    """Through `prepare` (and its validation split, by content): the same shards, whatever the rows' format;
    a named format refuses the others' rows."""
    rows = {"messages": [{"messages": m} for m in SAME * 8],
            "sharegpt": [_sharegpt(m, SHAREGPT_NAMES[i % 2]) for i, m in enumerate(SAME * 8)],
            "alpaca": [_alpaca(m) for m in SAME * 8]}
    shards = {}
    for form, fmt in (("messages", "chat"), ("sharegpt", "chat"), ("alpaca", "chat"), ("sharegpt", "sharegpt"),
                      ("alpaca", "alpaca")):
        path = _write_rows(tmp_path / f"{form}.jsonl", *rows[form])
        out = tmp_path / f"{form}-{fmt}"
        prepare.prepare(sources.SourceSpec(path), sp, out, val_fraction=0.3, progress=False,
                        sft_spec=sft.Spec(fmt, "simple"))
        shards[form, fmt] = {p.name: p.read_bytes() for p in sorted(out.glob("*.tokens"))}
    assert {"train-00000.tokens", "val-00000.tokens"} <= set(shards["messages", "chat"])
    assert all(got == shards["messages", "chat"] for got in shards.values())
    with pytest.raises(UserError, match=r"messages.jsonl:1: no field 'conversations' .*data.format=chat reads"):
        list(sft.iter_examples(sources.SourceSpec(str(tmp_path / "messages.jsonl")), "sharegpt"))
    with pytest.raises(UserError, match=r"sharegpt.jsonl:1: no field 'instruction' .*data.format=chat reads"):
        list(sft.iter_examples(sources.SourceSpec(str(tmp_path / "sharegpt.jsonl")), "alpaca"))


def test_a_failed_cached_preparation_leaves_no_directory_in_the_cache(tmp_path, sp):
    sp.save(tmp_path / "tok.model")
    good = _sharegpt(SAME[0], SHAREGPT_NAMES[0])
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "observation", "value": "42"}]}
    path = _write_rows(tmp_path / "chats.jsonl", *[good] * 20, bad)
    cfg = _config(tmp_path, corpus=path, format="chat", tokenizer_path=str(tmp_path / "tok.model"))
    with pytest.raises(UserError, match=r"chats.jsonl:21: message 2 is from 'observation'"):
        loader.load_data(cfg)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".lock"]


def test_bad_templates_formats_and_prompt_completion_rows_are_one_line(tmp_path, sp):
    with pytest.raises(UserError, match="this tokenizer has no chat template; set data.chat_template to chatml, simple"):
        sft.Encoder.make(sft.Spec("chat", ""), sp)
    with pytest.raises(UserError, match="neither a built-in template"):
        sft.Encoder.make(sft.Spec("chat", str(tmp_path / "missing.jinja")), sp)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    encoder = sft.Encoder.make(sft.Spec("chat", str(tmp_path / "bad.jinja")), sp)
    with pytest.raises(UserError, match=r"bad.jinja: not a valid Jinja template \(line 1"):
        encoder(sp, sft.check_row(GOOD, "chat", "x"))
    path = _write_rows(tmp_path / "pc.jsonl", {"prompt": "a", "completion": "b"}, {"prompt": "a"})
    with pytest.raises(UserError, match=r"pc.jsonl:2: no field 'completion'"):
        list(sft.iter_examples(sources.SourceSpec(path), "prompt_completion"))
    with pytest.raises(UserError, match=r"pc.jsonl:1: the completion is empty"):
        sft.check_row({"prompt": "a", "completion": ""}, "prompt_completion", f"{path}:1")
    (tmp_path / "chat.txt").write_text("hello")
    with pytest.raises(UserError, match="chat.txt: SFT data must be JSONL"):
        list(sft.iter_examples(sources.SourceSpec(str(tmp_path / "chat.txt")), "chat"))
    with pytest.raises(UserError, match="config.data.corpus='builtin' is not allowed"):
        _config(tmp_path, corpus="builtin", format="chat")
    with pytest.raises(UserError, match="data.chat_template"):
        _config(tmp_path, chat_template="llama")


def test_a_new_tokenizer_without_a_named_template_is_one_line(tmp_path):
    with pytest.raises(UserError, match="a tokenizer trained here has no chat template; set data.chat_template"):
        loader.load_data(_config(tmp_path, chat_template="", tokenize_on_the_fly=True))


def test_the_builtin_chat_set_is_what_its_script_writes():
    text = pathlib.Path(sources.BUILTIN_CHAT_FILE).read_text(encoding="utf-8")
    assert text == builtin_chat.text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) == builtin_chat.NUM_CONVERSATIONS == 600
    examples = list(sft.iter_examples(sources.SourceSpec("builtin_chat"), "chat"))
    assert len(examples) == 600 and len({e.key for e in examples}) > 400  # few repeats
    assert sum(len(e.fields["messages"]) > 3 for e in examples) > 50  # some have two turns


@pytest.mark.slow
def test_a_tiny_model_learns_the_chat_format_and_evaluate_scores_chat_files_as_training_does(tmp_path):
    """The CLI trains a tiny model on the built-in chat set; its val_loss (held-out assistant tokens)
    falls, and `jaxlm.evaluate` gives the same loss on the run's validation split and on a JSONL
    file of those conversations."""
    flags = dict(
        model__vocab_size=400, model__d_model=64, model__n_layers=2, model__n_heads=4, model__n_kv_heads=2,
        model__mlp_dim=128, data__seq_len=128, data__global_batch_size=16, data__corpus="builtin_chat",
        data__chat_template="simple", data__val_fraction=0.1, data__val_tokens=100_000,
        data__cache_dir=tmp_path / "cache", data__tokenize_on_the_fly="true", optim__warmup_steps=5,
        optim__peak_lr=3e-3, run__steps=60, run__eval_every=10, run__log_every=60, run__output_dir=tmp_path,
        run__name="chat", run__compile_cache_dir="",
    )
    args = ["--config=configs/tiny.py", *(f"--config.{k.replace('__', '.')}={v}" for k, v in flags.items())]
    result = run_command("train", args, cwd=ROOT, env=ONE_DEVICE, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "jaxlm: SFT data: " in result.stdout and "trained on" in result.stdout
    run = tmp_path / "chat"
    val = [json.loads(line)["val_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
           if "val_loss" in json.loads(line)]
    assert len(val) == 6 and val[-1] < val[0] - 0.5, val
    held_out = [line for line in pathlib.Path(sources.BUILTIN_CHAT_FILE).read_text().splitlines()
                if sources.is_validation(sft.check_row(json.loads(line), "chat", "").key, 0.1, 0)]
    (tmp_path / "held_out.jsonl").write_text("\n".join(held_out) + "\n")
    losses = []
    for corpus in ("val", tmp_path / "held_out.jsonl"):
        out = tmp_path / f"eval-{len(losses)}.json"
        result = run_command("evaluate", [f"--run_dir={run}", f"--corpus={corpus}", f"--output={out}"], cwd=ROOT,
                             env=ONE_DEVICE, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(json.loads(out.read_text())["corpus"]["loss"])
    assert losses[0] == pytest.approx(val[-1], rel=1e-4) and losses[1] == pytest.approx(val[-1], rel=1e-4)
