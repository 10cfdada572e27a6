"""`python -m jaxlm.data.tokenizer`: train from a corpus file, encode and decode, clear errors."""

import json
import subprocess
import sys

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Grüße, 世界! 🙂", "def f(x):\n    return x + 1\n"] * 40


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxlm.data.tokenizer", *args], capture_output=True, text=True)


def test_train_encode_decode_round_trip(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS), encoding="utf-8")
    model = tmp_path / "tok.model"
    result = cli("train", f"--input={corpus}", "--text_field=body", "--vocab_size=400", f"--output={model}")
    assert result.returncode == 0, result.stderr
    assert "400 tokens" in result.stdout and model.is_file()
    text = "Grüße, 世界! 🙂 new words"
    ids = cli("encode", f"--model={model}", text).stdout.split()
    assert len(ids) > 3
    assert cli("decode", f"--model={model}", *ids).stdout.rstrip("\n") == text


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    missing = cli("train", f"--input={tmp_path}/none/*.txt", "--vocab_size=400", f"--output={tmp_path}/t.model")
    assert missing.returncode == 2 and "no input files match" in missing.stderr
    (tmp_path / "a.txt").write_text("hello world " * 50)
    small = cli("train", f"--input={tmp_path}/a.txt", "--vocab_size=100", f"--output={tmp_path}/t.model")
    assert small.returncode == 2 and "vocab_size > 260" in small.stderr
    not_model = cli("encode", f"--model={tmp_path}/a.txt", "hi")
    assert not_model.returncode == 2 and "not a SentencePiece model" in not_model.stderr
    for result in (missing, small, not_model):
        assert "Traceback" not in result.stderr
