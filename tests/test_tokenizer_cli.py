"""`python -m jaxlm.data.tokenizer`: train from a corpus file, encode and decode, clear errors."""

import json
import os

from command_forks import run_command

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Grüße, 世界! 🙂", "def f(x):\n    return x + 1\n"] * 40


def cli(*args):
    return run_command("data.tokenizer", args, cwd=os.getcwd(), env=dict(os.environ))


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

# Bad input to this command: tests/test_bad_inputs.py (the catalogue).
