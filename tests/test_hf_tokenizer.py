"""Hugging Face tokenizer.json tokenizers (`HFTokenizer`) against transformers itself, on tokenizers
made here (nothing is downloaded): a GPT-2-style byte-level BPE trained with `tokenizers`, a Llama 2
one converted by transformers from a SentencePiece model jaxlm trained (and the same in the original
Llama 2 file's layout), and Llama 3 / Qwen2-style byte-level ones saved by transformers with a chat
template. Then a run trained with a tokenizer.json, loaded back for inference."""

import json
import pathlib
import pickle
import shutil
import unicodedata

import numpy as np
import pytest

from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer, find_in
from jaxlm.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキスト、中文字符，한국어 텍스트",
    "emoji 😀🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin tone 👍🏽 keycap 1️⃣ rainbow 🏳️‍🌈",
    "combining marks: e\u0301 a\u0308 n\u0303 Z\u0335\u0321 and precomposed é ñ",
    "RTL: שלום עולם · مرحبا بالعالم \u200fmark\u202eoverride\u202c",
    "tabs\tand  multiple   spaces\n\n\nnewlines\r\nand CRLF ",
    "    def f(x):\n\treturn {'a': [1, 2], \"b\": x ** 2}  # code\n",
    " one leading space",
    "   three leading and trailing   ",
    "\u00a0nbsp\u2003em\u3000ideographic, zero\u200bwidth, math 𝔸𝔹ℂ ∑∫ ≠ ≤, NUL \x00 bell \x07",
    "",
]
SPECIAL_TEXT = "before<|endoftext|>after <s> </s>"  # special tokens' text inside a document
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                  "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
KINDS = ("gpt2", "llama2", "llama2_original", "llama3", "qwen2")


def expected_text(kind: str, text: str) -> str:
    """What decode(encode(text)) gives: the text itself but for the documented exceptions."""
    if kind == "qwen2":  # an NFC normalizer
        return unicodedata.normalize("NFC", text)
    if kind.startswith("llama2"):
        text = text.replace("\u2581", " ")  # a literal '▁' is a space to SentencePiece
        if kind == "llama2" and text.startswith(" "):  # Metaspace 'first' adds no prefix space; decode strips one
            return text[1:]
    return text


def expected_bytes(kind: str, text: str) -> int:
    """The sum of byte_lengths over encode(text): its UTF-8 length, plus the prefix space a Llama 2 adds."""
    size = len(expected_text(kind, text).encode("utf-8"))
    if kind.startswith("llama2"):  # the added '▁' (for 'llama2', the leading space decode strips where none was added)
        return size + (1 if text else 0)
    return size


def _training_texts() -> list[str]:
    files = sorted((ROOT / "jaxlm").rglob("*.py"))[:40]
    return [f.read_text() for f in files] + TEXTS * 3


def _byte_level(split: str | None, specials: list[str], nfc: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split is None:  # GPT-2: the byte-level pre-tokenizer's own regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # Llama 3, Qwen2: their regex, then bytes
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_texts(), trainer)
    return tok


def make_gpt2(directory: pathlib.Path) -> None:
    """tokenizer.json, and the special tokens in special_tokens_map.json in the old dict form."""
    tok = _byte_level(None, ["<|endoftext|>"])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": False}))
    token = {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": True,
             "rstrip": False, "single_word": False}
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": token, "eos_token": token, "unk_token": token}))


def make_llama2(directory: pathlib.Path, sp_dir: pathlib.Path) -> None:
    """jaxlm's SentencePiece model (pad, unk, bos, eos = 0..3, byte fallback), converted by transformers."""
    import transformers

    sp_dir.mkdir()
    SentencePieceTokenizer.train(_training_texts(), 700).save(sp_dir / "tokenizer.model")
    tok = transformers.LlamaTokenizer.from_pretrained(sp_dir, pad_token="<pad>", add_bos_token=True)
    tok.save_pretrained(directory)


def make_llama2_original(directory: pathlib.Path, converted: pathlib.Path) -> None:
    """The same vocabulary in the layout of Meta's Llama 2 tokenizer.json: a Prepend('▁') + Replace
    normalizer instead of a Metaspace pre-tokenizer."""
    spec = json.loads((converted / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = json.loads((converted / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True, add_eos_token=False,
                  legacy=True)  # the file as it is (transformers' LlamaTokenizer would rebuild it)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def make_llama3(directory: pathlib.Path) -> None:
    """Byte-level with Llama 3's split, a post-processor that adds <|begin_of_text|>, a chat template."""
    import transformers
    from tokenizers import processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _byte_level(LLAMA3_SPLIT, specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                eos_token="<|end_of_text|>", chat_template=LLAMA3_TEMPLATE,
                                                model_max_length=131072)
    fast.save_pretrained(directory)


def make_qwen2(directory: pathlib.Path, eos: str = "<|im_end|>") -> None:
    """Byte-level with NFC and Qwen2's split, no BOS, pad <|endoftext|>, eos <|im_end|> (an instruct
    model's; a base model's is <|endoftext|>), a chat template."""
    import transformers

    tok = _byte_level(QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], nfc=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos,
                                                pad_token="<|endoftext|>", chat_template=QWEN2_TEMPLATE)
    fast.save_pretrained(directory)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The directory of each kind of tokenizer (tokenizer.json, tokenizer_config.json, ...)."""
    root = tmp_path_factory.mktemp("hf_tokenizers")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        make_gpt2(root / "gpt2")
        make_llama2(root / "llama2", root / "sp")
        make_llama2_original(root / "llama2_original", root / "llama2")
        make_llama3(root / "llama3")
        make_qwen2(root / "qwen2")
    return {kind: root / kind for kind in KINDS}


@pytest.fixture(scope="module")
def hf():
    """transformers' own tokenizer of each directory, loaded once."""
    import transformers

    loaded = {}

    def get(directory: pathlib.Path):
        if directory not in loaded:
            loaded[directory] = transformers.AutoTokenizer.from_pretrained(directory)
        return loaded[directory]

    return get


def test_the_tokenizers_made_here_have_the_layouts_they_stand_for(made):
    spec = {kind: json.loads((made[kind] / "tokenizer.json").read_text()) for kind in KINDS}
    assert spec["llama2"]["pre_tokenizer"]["type"] == "Metaspace" and spec["llama2"]["model"]["byte_fallback"]
    assert "<s>" in json.dumps(spec["llama2"]["post_processor"])  # the converter's post-processor adds BOS
    assert spec["llama2_original"]["normalizer"]["normalizers"][0]["type"] == "Prepend"
    assert "<|begin_of_text|>" in json.dumps(spec["llama3"]["post_processor"])
    assert spec["qwen2"]["normalizer"]["type"] == "NFC"
    assert (made["llama3"] / "chat_template.jinja").is_file()  # transformers 5 writes the template beside
    assert (made["gpt2"] / "special_tokens_map.json").is_file()


@pytest.mark.parametrize("kind", KINDS)
def test_encode_gives_what_transformers_gives(made, hf, kind):
    tok, theirs = HFTokenizer.load(made[kind] / "tokenizer.json"), hf(made[kind])
    texts = [*TEXTS, SPECIAL_TEXT, "\u2581literal marks\u2581"]
    bare = tok.encode(texts, add_bos=False, add_eos=False)
    assert bare == [theirs(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert tok.encode(texts, add_bos=tok.hf_add_bos, add_eos=tok.hf_add_eos) == [theirs(t)["input_ids"] for t in texts]
    bos, eos = [tok.bos_id] if tok.bos_id >= 0 else [], [tok.eos_id] if tok.eos_id >= 0 else []
    assert tok.encode(texts) == [bos + ids + eos for ids in bare]  # the flags alone, never the post-processor
    assert tok.encode(texts, num_threads=1) == tok.encode(texts, num_threads=-1) == tok.encode(texts)
    assert [tok.encode([t], add_bos=False, add_eos=False)[0] for t in texts] == bare
    assert tok.hf_add_bos == (kind.startswith("llama")) and not tok.hf_add_eos


@pytest.mark.parametrize("kind", KINDS)
def test_special_ids_vocabulary_and_chat_template_are_transformers(made, hf, kind):
    tok, theirs = HFTokenizer.load(made[kind]), hf(made[kind])
    for name in ("bos", "eos", "unk"):
        theirs_id = getattr(theirs, f"{name}_token_id")
        assert getattr(tok, f"{name}_id") == (-1 if theirs_id is None else theirs_id), name
    assert tok.pad_id == next(i for i in (theirs.pad_token_id, tok.eos_id, 0) if i is not None and i >= 0)
    assert tok.vocab_size == len(theirs)
    assert tok.chat_template == theirs.chat_template
    expected = {"gpt2": (0, 0, 0, 0), "llama2": (2, 3, 1, 0), "llama2_original": (2, 3, 1, 0),
                "llama3": (0, 1, -1, 1), "qwen2": (-1, 2, -1, 0)}[kind]
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == expected  # as the files name them
    assert tok.model_max_length == {"gpt2": 1024, "llama3": 131072}.get(kind)
    if kind == "llama3":
        assert tok.chat_template == LLAMA3_TEMPLATE


@pytest.mark.parametrize("kind", KINDS)
def test_decode_round_trips_unicode_byte_exactly_but_for_the_documented_exceptions(made, hf, kind):
    tok, theirs = HFTokenizer.load(made[kind]), hf(made[kind])
    for text in TEXTS:
        ids = tok.encode([text], add_bos=False, add_eos=False)[0]
        assert tok.decode(ids) == expected_text(kind, text) == theirs.decode(ids, skip_special_tokens=True)
        if kind in ("gpt2", "llama3", "llama2_original"):
            assert tok.decode(ids) == text
        full = tok.encode([text])[0]  # BOS and EOS are dropped
        assert tok.decode(full) == expected_text(kind, text)
    # The exceptions, exactly.
    if kind == "qwen2":
        assert tok.decode(tok.encode(["e\u0301"], False, False)[0]) == "\u00e9"
    if kind.startswith("llama2"):
        ids = tok.encode(["a\u2581b"], False, False)[0]
        assert tok.decode(ids) == "a b"
        assert tok.decode(tok.encode([" x"], False, False)[0]) == (" x" if kind == "llama2_original" else "x")
        ids = tok.encode(["hello world"], False, False)[0]  # a continuation decoded alone loses its space
        k = next(k for k in range(1, len(ids)) if tok._tok.id_to_token(ids[k]).startswith("\u2581"))
        assert tok.decode(ids[:k]) == "hello" and tok.decode(ids[k:]) == "world"
    ids = tok.encode([SPECIAL_TEXT], False, False)[0]
    assert tok.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    if kind == "gpt2":
        assert tok.eos_id in ids and tok.decode(ids) == "beforeafter <s> </s>"
    if kind.startswith("llama2"):
        assert tok.bos_id in ids and tok.eos_id in ids


@pytest.mark.parametrize("kind", KINDS)
def test_byte_lengths_sum_to_each_documents_utf8_size(made, kind):
    tok = HFTokenizer.load(made[kind])
    lengths = tok.byte_lengths()
    assert lengths.dtype == np.int32 and lengths.shape == (tok.vocab_size,)
    specials = [i for i in (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) if i >= 0]
    assert not lengths[specials].any()
    files = [f.read_text() for f in sorted((ROOT / "jaxlm" / "data").glob("*.py"))]
    special_texts = [t.content for t in tok._tok.get_added_tokens_decoder().values() if t.special]
    corpus = [*TEXTS, *(text for text in files if not any(s in text for s in special_texts))]  # see SPECIAL_TEXT
    assert len(corpus) > len(TEXTS) + 2
    for text in corpus:
        ids = tok.encode([text])[0]  # with BOS and EOS: they count 0
        assert int(lengths[ids].sum()) == expected_bytes(kind, text), text[:40]
    if kind.startswith("llama2"):  # byte-fallback pieces are one byte, '▁' one
        assert lengths[tok._tok.token_to_id("<0xE6>")] == 1 and lengths[tok._tok.token_to_id("\u2581")] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_pickle_save_load_and_dispatch_keep_the_tokenizer(made, tmp_path, kind):
    tok = HFTokenizer.load(made[kind] / "tokenizer.json")
    text = TEXTS[2] + TEXTS[6]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.sha256 == tok.sha256 and clone.encode([text]) == tok.encode([text])
    assert (clone.bos_id, clone.eos_id, clone.pad_id, clone.chat_template) == (tok.bos_id, tok.eos_id, tok.pad_id,
                                                                                  tok.chat_template)
    for path in (made[kind], made[kind] / "tokenizer.json"):  # a directory or the file
        loaded = Tokenizer.load(path)
        assert isinstance(loaded, HFTokenizer) and loaded.sha256 == tok.sha256
    run_dir = tmp_path / "run"
    tok.save(run_dir / tok.file_name)
    assert sorted(p.name for p in run_dir.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert find_in(run_dir) == run_dir / "tokenizer.json"
    again = Tokenizer.load(run_dir)
    assert again.sha256 == tok.sha256 and again.encode([text]) == tok.encode([text])
    assert again.chat_template == tok.chat_template and again.pad_id == tok.pad_id
    assert (run_dir / "tokenizer.json").read_bytes() == (made[kind] / "tokenizer.json").read_bytes()
    if kind == "llama2":  # the identity is the two files: another config is another tokenizer
        other = tmp_path / "other"
        shutil.copytree(made[kind], other)
        config = json.loads((other / "tokenizer_config.json").read_text())
        (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
        assert Tokenizer.load(other).sha256 != tok.sha256


def test_load_tells_the_kinds_apart_by_content_and_finds_them_in_directories(made, tmp_path):
    sp_model = made["llama2"].parent / "sp" / "tokenizer.model"
    disguised = tmp_path / "a.json"  # names do not matter, content does
    shutil.copy(sp_model, disguised)
    assert isinstance(Tokenizer.load(disguised), SentencePieceTokenizer)
    renamed = tmp_path / "b.model"
    shutil.copy(made["qwen2"] / "tokenizer.json", renamed)
    assert isinstance(Tokenizer.load(renamed), HFTokenizer)
    assert isinstance(Tokenizer.load(sp_model.parent), SentencePieceTokenizer)
    both = tmp_path / "both"  # a checkpoint with both files: tokenizer.json, as transformers
    shutil.copytree(made["llama2"], both)
    shutil.copy(sp_model, both / "tokenizer.model")
    assert find_in(both) == both / "tokenizer.json" and isinstance(Tokenizer.load(both), HFTokenizer)
    assert find_in(tmp_path / "nothing") is None and find_in(sp_model.parent) == sp_model


def test_a_sentencepiece_model_and_its_conversion_encode_alike(made):
    """The converted Llama 2 file is the same tokenizer as jaxlm's SentencePiece model, as far as the
    dummy prefix allows: SentencePiece here adds none, the converted file a '▁' before each text."""
    sp = Tokenizer.load(made["llama2"].parent / "sp")
    tok = Tokenizer.load(made["llama2"])
    assert (sp.vocab_size, sp.pad_id, sp.unk_id, sp.bos_id, sp.eos_id) == (tok.vocab_size, tok.pad_id, tok.unk_id,
                                                                          tok.bos_id, tok.eos_id)
    for text in (" leading space", "  two\tthree\n"):  # a leading space: no prefix is added
        assert sp.encode([text]) == tok.encode([text])


def test_tokenizer_config_variants_are_read_as_transformers_reads_them(made, hf, tmp_path):
    directory = tmp_path / "variants"
    shutil.copytree(made["qwen2"], directory)
    template = (directory / "chat_template.jinja").read_text()
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(chat_template=[{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": template}],
                  bos_token={"content": "<|im_start|>", "lstrip": False, "special": True},
                  auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]}, model_max_length=1e30)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.load(directory)
    assert tok.chat_template == template and tok.model_max_length is None  # 1e30: no limit
    assert tok.bos_id == 1 and tok.pad_id == 0 and tok.eos_id == 2
    # chat_template.jinja wins over the config's, as in transformers; its text is part of the identity.
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    with_file = HFTokenizer.load(directory)
    assert with_file.chat_template == "{{ messages }}" and with_file.sha256 != tok.sha256
    # special_tokens_map.json fills only what the config leaves unset.
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>",
                                                                   "unk_token": "<|endoftext|>"}))
    mapped = HFTokenizer.load(directory)
    assert mapped.bos_id == 1 and mapped.unk_id == 0
    saved = tmp_path / "saved" / "tokenizer.json"
    mapped.save(saved)  # the merged config is written, and reads back the same
    assert HFTokenizer.load(saved).sha256 == mapped.sha256 and HFTokenizer.load(saved).unk_id == 0
    # A bare tokenizer.json: no special tokens named, pad 0.
    bare = tmp_path / "bare.json"
    shutil.copy(made["gpt2"] / "tokenizer.json", bare)
    alone = HFTokenizer.load(bare)
    assert (alone.bos_id, alone.eos_id, alone.unk_id, alone.pad_id, alone.chat_template) == (-1, -1, -1, 0, None)
    assert alone.encode(["hi"]) == alone.encode(["hi"], add_bos=False, add_eos=False)
    alone.save(tmp_path / "bare_saved" / "tokenizer.json")
    assert Tokenizer.load(tmp_path / "bare_saved").sha256 == alone.sha256


def _write(path: pathlib.Path, content: str | bytes) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def test_bad_tokenizer_files_are_one_line_each(made, tmp_path, monkeypatch):
    good = (made["gpt2"] / "tokenizer.json").read_text()

    def error(path) -> str:
        with pytest.raises(UserError) as e:
            Tokenizer.load(path)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "tokenizer model not found" in error(tmp_path / "missing.json")
    assert "holds no tokenizer (tokenizer.json or tokenizer.model)" in error(_write(tmp_path / "empty" / "x", "")
                                                                             .parent)
    assert "invalid JSON at line 1" in error(_write(tmp_path / "trunc" / "tokenizer.json", good[:200]))
    assert "not UTF-8" in error(_write(tmp_path / "latin" / "tokenizer.json", b'{"model": "\xff"}'))
    assert "not a Hugging Face tokenizer.json (no \"model\" section)" in error(
        _write(tmp_path / "config" / "tokenizer.json", '{"model_type": "llama", "vocab_size": 32000}'))
    assert "is not a tokenizer that tokenizers" in error(
        _write(tmp_path / "unknown" / "tokenizer.json", '{"model": {"type": "NoSuchModel"}}'))
    assert "not a SentencePiece model" in error(_write(tmp_path / "junk.model", "not a model"))

    def beside(name: str, config: str) -> pathlib.Path:
        directory = tmp_path / name
        _write(directory / "tokenizer.json", good)
        _write(directory / "tokenizer_config.json", config)
        return directory

    assert "tokenizer_config.json is not a tokenizer_config.json: invalid JSON" in error(beside("c1", "{oops"))
    assert "it holds a JSON list, not an object" in error(beside("c2", "[1, 2]"))
    assert "names bos_token '<s>', which" in error(beside("c3", '{"bos_token": "<s>"}'))
    assert "eos_token must be a string or an object" in error(beside("c4", '{"eos_token": 7}'))
    assert "chat_template must be a string" in error(beside("c5", '{"chat_template": 3}'))
    with pytest.raises(UserError, match=r"token id 70000 is outside this tokenizer's vocabulary \(0\.\.699\)"):
        HFTokenizer.load(made["qwen2"]).decode([1, 70000])
    monkeypatch.setattr(tokenizer_lib, "_MAX_TOKENIZER_JSON_BYTES", 1000)
    assert "is larger than 0.001 MB, the most jaxlm reads as a tokenizer.json" in error(made["gpt2"])
    monkeypatch.setattr(tokenizer_lib, "_MAX_TOKENIZER_JSON_BYTES", 10**9)
    monkeypatch.setattr(tokenizer_lib, "_MAX_CONFIG_BYTES", 10)
    assert "is larger than 1e-05 MB, the most jaxlm reads as a tokenizer_config.json" in error(made["gpt2"])


def test_the_tokenizer_command_encodes_and_decodes_with_a_tokenizer_json(made, capsys):
    tok = HFTokenizer.load(made["llama3"])
    assert tokenizer_lib.main(["encode", f"--model={made['llama3'] / 'tokenizer.json'}", "héllo 😀"]) == 0
    ids = [int(i) for i in capsys.readouterr().out.split()]
    assert ids == tok.encode(["héllo 😀"], add_bos=False, add_eos=False)[0]
    assert tokenizer_lib.main(["decode", f"--model={made['llama3']}", *map(str, ids)]) == 0
    assert capsys.readouterr().out == "héllo 😀\n"


@pytest.mark.slow
def test_a_run_trained_with_a_tokenizer_json_is_loaded_with_it(made, tmp_path):
    """Train a few steps with data.tokenizer_path=<tokenizer.json> (prepared corpus, so the prepared
    cache holds it too), then load the run for inference: its tokenizer is the same HF tokenizer."""
    from jaxlm import explore, inference, train
    from jaxlm.data import loader
    from tiny_run import write_corpus

    write_corpus(tmp_path / "facts.txt", documents=120)
    path = made["llama3"] / "tokenizer.json"
    tok = HFTokenizer.load(path)
    cfg = explore.make_config(
        "tiny", model__vocab_size=tok.vocab_size, model__d_model=32, model__n_layers=1, model__n_heads=2,
        model__n_kv_heads=1, model__mlp_dim=64, data__seq_len=32, data__global_batch_size=8,
        data__corpus=str(tmp_path / "facts.txt"), data__separator="\n\n", data__val_fraction=0.2,
        data__val_tokens=128, data__tokenizer_path=str(path), data__cache_dir=str(tmp_path / "cache"),
        optim__warmup_steps=1, run__steps=2, run__eval_every=2, run__log_every=1,
        run__output_dir=str(tmp_path / "runs"), run__name="hf", run__compile_cache_dir="")
    summary = train.run(cfg)
    assert summary["steps"] == 2
    run_dir = tmp_path / "runs" / "hf"
    assert find_in(run_dir) == run_dir / "tokenizer.json" and not (run_dir / "tokenizer.model").exists()
    prepared = loader.cached_prepared_dir(loader.DataConfig.from_config(cfg.data), tok.sha256)
    assert find_in(prepared) == prepared / "tokenizer.json" and Tokenizer.load(prepared).sha256 == tok.sha256
    loaded = inference.load_run(run_dir)
    assert isinstance(loaded.tokenizer, HFTokenizer) and loaded.tokenizer.sha256 == tok.sha256
    assert loaded.tokenizer.chat_template == LLAMA3_TEMPLATE and loaded.step == 2
