"""The tokenizer interface: SentencePiece tokenizers (trained in-process, exact round trip) and
Hugging Face `tokenizer.json` ones.

`Tokenizer` is all the rest of jaxlm uses of a tokenizer: its special ids as attributes, encode,
decode, the bytes each id stands for, its identity and its file; `Tokenizer.load` opens a tokenizer
file (or the directory holding one) of either kind, told apart by content, and `find_in` finds the
one a run or prepared-data directory holds. `SentencePieceTokenizer` reads a `.model` file: a
loaded model keeps its own special ids (Llama's: unk 0, bos 1, eos 2, no pad), and a tokenizer
trained here has pad, unk, bos, eos = 0, 1, 2, 3. `HFTokenizer` reads a checkpoint's
`tokenizer.json` through the `tokenizers` library, with the special tokens and chat template of the
`tokenizer_config.json` beside it (both read as data; nothing from the checkpoint is executed).
"""

import abc
import functools
import hashlib
import io
import json
import os
import pathlib
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as spm_model

from jaxlm import cli
from jaxlm.data.sources import SourceSpec, iter_documents, unescape
from jaxlm.errors import UserError, report_error, run_command

MODEL_TYPES = ("bpe", "unigram", "char", "byte")
BYTE_VOCAB_SIZE = 260  # 4 specials + 256 byte pieces: the whole vocabulary of a 'byte' tokenizer.

# Lines sampled for training: enough for a good vocabulary, few enough that ~5 MB trains in seconds.
_MAX_TRAIN_LINES = {"bpe": 200_000, "unigram": 50_000, "char": 200_000}
# The pieces and ids of the specials of every tokenizer trained here (only of those: a loaded model has its own).
_TRAINED_SPECIALS = {"pad": ("<pad>", 0), "unk": ("<unk>", 1), "bos": ("<s>", 2), "eos": ("</s>", 3)}
_PieceType = spm_model.ModelProto.SentencePiece.Type
# The files `find_in` looks for in a directory, in this order: `HFTokenizer.file_name`, `SentencePieceTokenizer.file_name`.
FILE_NAMES = ("tokenizer.json", "tokenizer.model")


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see a partial file. The bytes
    reach the disk before the rename, so a machine losing power leaves the old file or the new one, never
    the new name on a file cut short."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp_path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


def _check_model_type(model_type: str) -> None:
    if model_type not in MODEL_TYPES:
        raise UserError(f"tokenizer model_type must be one of {', '.join(MODEL_TYPES)}; got {model_type!r}")


def _training_lines(texts: Iterable[str]) -> Iterator[str]:
    """SentencePiece trains on lines; newlines themselves are encoded through byte fallback."""
    for text in texts:
        for line in text.split("\n"):
            if line:
                yield line


def _pad_vocab(model: spm_model.ModelProto, vocab_size: int) -> None:
    """Append never-produced UNUSED pieces so that every model type has exactly `vocab_size` ids."""
    for i in range(len(model.pieces), vocab_size):
        model.pieces.add(piece=f"<unused{i}>", score=0.0, type=_PieceType.UNUSED)
    model.trainer_spec.vocab_size = vocab_size


def _byte_model_proto(vocab_size: int) -> bytes:
    """A byte-level model: every UTF-8 byte is one token, no training needed.

    Built by hand because a trained 'char' model cannot hold only bytes: it escapes spaces to
    U+2581, which must then be a piece of its own. Here whitespace is not escaped at all.
    """
    model = spm_model.ModelProto()
    for piece, _ in _TRAINED_SPECIALS.values():
        model.pieces.add(piece=piece, score=0.0, type=_PieceType.UNKNOWN if piece == "<unk>" else _PieceType.CONTROL)
    for byte in range(256):
        model.pieces.add(piece=f"<0x{byte:02X}>", score=0.0, type=_PieceType.BYTE)
    trainer_spec = model.trainer_spec
    trainer_spec.model_type = spm_model.TrainerSpec.CHAR
    trainer_spec.byte_fallback = True
    for name, (_, id_) in _TRAINED_SPECIALS.items():
        setattr(trainer_spec, f"{name}_id", id_)
    normalizer = model.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = False
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = False
    _pad_vocab(model, vocab_size)
    return model.SerializeToString()


class Tokenizer(abc.ABC):
    """What jaxlm uses of a tokenizer. Each implementation reads its special ids from its own model.

    `bos_id` and `eos_id` begin and end a document, `unk_id` stands for what the vocabulary cannot
    spell; each is -1 when the model has none. `pad_id` is never -1: it is the model's pad or, when
    the model has none (Llama), its eos (as Hugging Face generation does), else 0. It only needs to
    be a valid id: what it fills (left-padded prompts, a row after EOS) is masked from attention and
    never scored. The packing padding of training batches is id 0 with segment 0 and weight 0.
    Instances pickle (grain workers tokenize with them).
    """

    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int
    chat_template: str | None = None  # a Jinja template of chat messages, where the tokenizer has one
    file_name: str  # what a run or prepared-data directory calls this kind's file (`find_in`)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer in file `path`, or in the directory `path` (`find_in`), whichever kind it is:
        told apart by content, not by name (a JSON object is a Hugging Face tokenizer.json, anything
        else a SentencePiece model)."""
        path = pathlib.Path(path)
        if path.is_dir():
            found = find_in(path)
            if found is None:
                raise UserError(f"{path} holds no tokenizer ({' or '.join(FILE_NAMES)})")
            path = found
        if not path.exists():
            raise UserError(f"tokenizer model not found: {path}")
        return (HFTokenizer if _is_json(path) else SentencePieceTokenizer).load(path)

    @property
    def adds_bos(self) -> bool:
        """Whether a text begins with BOS by this tokenizer's own convention: what transformers'
        `tokenizer(text)` does with the Hugging Face copy of it (`jaxlm.hf export` writes a SentencePiece
        model's as `add_bos_token`). A SentencePiece model: BOS wherever it has one, as training adds it."""
        return self.bos_id >= 0

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def sha256(self) -> str:
        """Hex digest of the tokenizer's file: its identity, recorded with data and checkpoints."""

    @abc.abstractmethod
    def encode(
        self, texts: Sequence[str], add_bos: bool = True, add_eos: bool = True, num_threads: int = -1
    ) -> list[list[int]]:
        """The ids of each text, with BOS before and EOS after where asked (and the model has them)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special ids dropped."""

    @abc.abstractmethod
    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for, int32 [vocab_size] (0 for special ids)."""

    @abc.abstractmethod
    def token_text(self, token_id: int) -> str:
        """The text of one id as the vocabulary spells it ("<s>", "<|im_end|>"); "" for -1. What a chat
        template's bos_token and eos_token are (`jaxlm.data.sft`)."""

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> None:
        """Write the file `load` reads back."""


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model with its own special ids (`sp.pad_id()` etc., pad as `Tokenizer` says).

    One trained here (`train`) round-trips any Unicode text exactly: byte fallback makes every
    string encodable (no UNK), and identity normalization with no whitespace folding keeps code and
    text byte-exact. One known exception: a literal U+2581 ('▁', SentencePiece's space marker) in the
    input decodes as a space.
    """

    file_name = "tokenizer.model"

    def __init__(self, model_proto: bytes):
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        sp = self._sp
        self._dropped = np.array(
            [sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) for i in range(sp.get_piece_size())]
        )
        self.unk_id, self.bos_id, self.eos_id = sp.unk_id(), sp.bos_id(), sp.eos_id()  # -1: none
        self.pad_id = next(i for i in (sp.pad_id(), self.eos_id, 0) if i >= 0)  # see Tokenizer

    @classmethod
    def train(
        cls, texts: Sequence[str], vocab_size: int, model_type: str = "bpe", num_threads: int = 2
    ) -> "SentencePieceTokenizer":
        """Train on `texts` in memory; the result has exactly `vocab_size` ids for every model type."""
        _check_model_type(model_type)
        if model_type == "byte":
            if vocab_size < BYTE_VOCAB_SIZE:
                raise UserError(f"a byte tokenizer needs vocab_size >= {BYTE_VOCAB_SIZE}; got {vocab_size}")
            return cls(_byte_model_proto(vocab_size))
        if vocab_size <= BYTE_VOCAB_SIZE:
            raise UserError(
                f"a {model_type} tokenizer needs vocab_size > {BYTE_VOCAB_SIZE} (4 specials + 256 byte pieces"
                f" + its own pieces); got {vocab_size}"
            )
        buffer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_training_lines(texts),
                model_writer=buffer,
                model_type=model_type,
                vocab_size=vocab_size,
                character_coverage=1.0 if model_type == "char" else 0.9995,
                byte_fallback=True,
                **{f"{name}_id": id_ for name, (_, id_) in _TRAINED_SPECIALS.items()},
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                split_digits=True,
                allow_whitespace_only_pieces=True,
                input_sentence_size=_MAX_TRAIN_LINES[model_type],
                shuffle_input_sentence=True,
                num_threads=num_threads,
                minloglevel=2,
            )
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[-1].split("] ")[-1]
            raise UserError(f"cannot train a {model_type} tokenizer with vocab_size={vocab_size}: {reason}") from e
        model = spm_model.ModelProto.FromString(buffer.getvalue())
        if len(model.pieces) == vocab_size:  # bpe and unigram: keep the trainer's bytes as they are
            return cls(buffer.getvalue())
        _pad_vocab(model, vocab_size)  # char: the vocabulary is the corpus's characters, often fewer
        return cls(model.SerializeToString())

    def __getstate__(self) -> bytes:  # pickles as its model proto (grain workers tokenize with it)
        return self._proto

    def __setstate__(self, proto: bytes) -> None:
        self.__init__(proto)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        try:
            with open(path, "rb") as f:
                proto = f.read()
        except FileNotFoundError:
            raise UserError(f"tokenizer model not found: {path}") from None
        try:
            return cls(proto)
        except RuntimeError:
            raise UserError(f"not a SentencePiece model: {path}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the serialized model proto, the tokenizer's whole definition."""
        write_bytes_atomically(path, self._proto)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def sha256(self) -> str:
        """Hex digest of the model proto: the tokenizer's identity, recorded with data and checkpoints."""
        return hashlib.sha256(self._proto).hexdigest()

    def encode(
        self, texts: Sequence[str], add_bos: bool = True, add_eos: bool = True, num_threads: int = -1
    ) -> list[list[int]]:
        """Encode a batch: `num_threads=1` (or a single text) in this thread, one text at a time; else in
        parallel (`num_threads=-1`: all cores). SentencePiece's list form starts a thread pool on every call,
        even of one thread, which costs more than encoding a document (benchmarks/BENCHMARKS.md, "Data
        throughput"): the on-the-fly pipeline and the chat and prompt encoders call this once per text."""
        add_bos, add_eos = add_bos and self.bos_id >= 0, add_eos and self.eos_id >= 0  # sentencepiece raises
        texts = list(texts)
        if num_threads == 1 or len(texts) == 1:
            return [self._sp.encode(text, out_type=int, add_bos=add_bos, add_eos=add_eos) for text in texts]
        return self._sp.encode(texts, out_type=int, add_bos=add_bos, add_eos=add_eos, num_threads=num_threads)

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for, int32 [vocab_size]: a byte-fallback piece is 1,
        special and unused ids 0, a text piece its length with SentencePiece's space marker as one
        byte. The sum over a document's ids is the document's size in bytes (bits per byte)."""
        sp = self._sp
        lengths = np.zeros(sp.get_piece_size(), np.int32)
        for i in range(len(lengths)):
            if sp.is_byte(i):
                lengths[i] = 1
            elif not self._dropped[i]:
                lengths[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return lengths

    def token_text(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id) if token_id >= 0 else ""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special and unused ids dropped."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self._dropped)]
        if bad:
            raise UserError(f"token id {bad[0]} is outside this tokenizer's vocabulary (0..{len(self._dropped) - 1})")
        return self._sp.decode([i for i in ids if not self._dropped[i]])


def find_in(directory: str | os.PathLike) -> pathlib.Path | None:
    """The tokenizer file a run directory, a prepared-data directory or a Hugging Face checkpoint
    holds: its tokenizer.json (of a checkpoint with both, the one transformers uses), else its
    tokenizer.model; None when it has neither."""
    for name in FILE_NAMES:
        path = pathlib.Path(directory) / name
        if path.is_file():
            return path
    return None


def _is_json(path: pathlib.Path) -> bool:
    """Whether the file holds a JSON object (a tokenizer.json) rather than a SentencePiece model: after
    whitespace it begins with `{` and then `"` or `}`, which no serialized model proto does."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False  # SentencePieceTokenizer.load reports it
    head = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    return head[:1] == b"{" and head[1:].lstrip(b" \t\r\n")[:1] in (b'"', b"}", b"")


# ----------------------------------------------------------------------------- Hugging Face tokenizer.json

HF_CONFIG_FILE = "tokenizer_config.json"
_HF_SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_HF_CHAT_TEMPLATE = "chat_template.jinja"  # where transformers 5 writes the chat template
_MAX_TOKENIZER_JSON_BYTES = 200 * 10**6  # Llama 3's is 9 MB; the largest are tens of MB
_MAX_CONFIG_BYTES = 10 * 10**6  # tokenizer_config.json, special_tokens_map.json, chat_template.jinja
_SPECIAL_NAMES = ("bos", "eos", "pad", "unk")
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback piece
_UNBOUNDED_LENGTH = 10**18  # transformers writes model_max_length=1e30 for "no limit"


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode inverted: the printable character a byte-level vocabulary spells
    each byte with -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


def read_limited(path: pathlib.Path, max_bytes: int, what: str) -> bytes:
    """A file's bytes, refused past `max_bytes` (checkpoint files are data from elsewhere)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise UserError(f"tokenizer model not found: {path}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if len(data) > max_bytes:
        raise UserError(f"{path} is larger than {max_bytes / 1e6:g} MB, the most jaxlm reads as a {what}; "
                        f"is it the right file?")
    return data


def _parse_json(data: bytes, path: str | os.PathLike, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise UserError(f"{path} is not {what}: it is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not {what}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None


def _hf_config(directory: pathlib.Path) -> bytes:
    """The tokenizer_config.json in `directory` ("{}" where there is none), as its bytes when nothing
    beside it adds to it; else the config with special_tokens_map.json's token names (for those the
    config leaves unset) and chat_template.jinja (which wins, as in transformers) merged in, as
    transformers would write it, so that what `HFTokenizer.save` writes reads back the same."""
    path = directory / HF_CONFIG_FILE
    raw = read_limited(path, _MAX_CONFIG_BYTES, HF_CONFIG_FILE) if path.is_file() else b"{}\n"
    config = _parse_json(raw, path, "a tokenizer_config.json")
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a tokenizer_config.json: it holds a JSON {type(config).__name__}, not an object")
    merged = dict(config)
    special_path = directory / _HF_SPECIAL_TOKENS_MAP
    if special_path.is_file():
        data = read_limited(special_path, _MAX_CONFIG_BYTES, _HF_SPECIAL_TOKENS_MAP)
        special = _parse_json(data, special_path, "a special_tokens_map.json")
        if not isinstance(special, dict):
            raise UserError(f"{special_path} is not a special_tokens_map.json: it holds a JSON "
                            f"{type(special).__name__}, not an object")
        for key in (f"{name}_token" for name in _SPECIAL_NAMES):
            if merged.get(key) is None and special.get(key) is not None:
                merged[key] = special[key]
    template_path = directory / _HF_CHAT_TEMPLATE
    if template_path.is_file():
        try:
            merged["chat_template"] = read_limited(template_path, _MAX_CONFIG_BYTES, _HF_CHAT_TEMPLATE).decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{template_path} is not a chat template: it is not UTF-8 text") from None
    if merged == config:
        return raw
    return (json.dumps(merged, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _token_content(config: dict[str, Any], key: str, where: str) -> str | None:
    """A special token's text: tokenizer_config.json gives a string or {"content": ..., ...}."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value or None
    raise UserError(f"{where}: {key} must be a string or an object with a \"content\" string; got {value!r:.80}")


def _steps(component: Any) -> list[dict[str, Any]]:
    """The steps of a tokenizer.json section (a normalizer, pre-tokenizer or decoder), Sequences flattened."""
    if not isinstance(component, dict):
        return []
    if component.get("type") == "Sequence":
        inner = next((v for k, v in component.items() if k != "type" and isinstance(v, list)), [])
        return [step for part in inner for step in _steps(part)]
    return [component]


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (the `tokenizers` library) with the special tokens, chat
    template and length limit (`model_max_length`, None for none) of the `tokenizer_config.json` beside it.

    Special ids come from the config's bos_token, eos_token, pad_token and unk_token (a string or
    {"content": ...}), then from special_tokens_map.json for those the config leaves unset; -1 where
    none is named (a bare tokenizer.json has none); pad as `Tokenizer` says. `chat_template` is
    chat_template.jinja's where there is one, else the config's (its "default" where it lists named
    templates), else None. The files are read as data, with a size limit: nothing is executed or
    imported (`auto_map` is ignored).

    BOS and EOS follow `encode`'s flags alone, never the tokenizer.json's post-processor, so
    add_bos/add_eos mean what they mean for SentencePiece: `encode([t], False, False)` is
    transformers' `tokenizer(t, add_special_tokens=False)`, and `encode([t], hf_add_bos, hf_add_eos)`
    its `tokenizer(t)`. `hf_add_bos`/`hf_add_eos` are the checkpoint's own convention: the config's
    add_bos_token/add_eos_token where it states them, else what the post-processor adds (Llama: BOS;
    GPT-2, Qwen2: nothing).

    Byte-level BPE (GPT-2, Llama 3, Qwen2) and SentencePiece-style tokenizers with byte fallback
    (Llama 2, Mistral: `▁` for a space, `<0xXX>` pieces) decode what they encode byte-exactly for any
    Unicode text, except where transformers does not either (known exceptions, tested):
    - a special token's text in the input ("<s>", "<|endoftext|>") is encoded as that token, and
      `decode` drops it;
    - a normalizer changes the text before it is split: NFC (Qwen2) gives back the NFC form, a
      combining accent composed ("e\u0301" -> "\u00e9");
    - SentencePiece-style ones decode a literal U+2581 ('▁') as a space, and those that add a prefix
      space strip one leading space in `decode`. Transformers' Llama conversion (a Metaspace
      pre-tokenizer, prepend_scheme "first") adds none before a text that begins with a space, so
      such a text loses its first space; the original Llama 2 file (a Prepend("▁") normalizer)
      always adds one and round-trips. Either way a continuation decoded alone (generated ids) loses
      its leading space, as with Llama's SentencePiece model, and `byte_lengths` counts the added
      space: a document's sum is its UTF-8 length plus one wherever one was added.
    """

    file_name = "tokenizer.json"

    def __init__(self, tokenizer_json: bytes, config_json: bytes = b"{}\n", source: str = "tokenizer.json"):
        """`tokenizer_json`: a tokenizer.json's bytes; `config_json`: its tokenizer_config.json's (as
        `_hf_config` gives them); `source`: the tokenizer.json's path, for errors."""
        import tokenizers  # local import: start-up time (SentencePiece users need not load it)

        self._json, self._config_json = tokenizer_json, config_json
        spec = _parse_json(tokenizer_json, source, "a Hugging Face tokenizer.json")
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise UserError(f"{source} is JSON but not a Hugging Face tokenizer.json (no \"model\" section); give the "
                            f"tokenizer.json of a checkpoint")
        try:
            self._tok = tokenizers.Tokenizer.from_str(tokenizer_json.decode("utf-8-sig"))
        except Exception as e:  # tokenizers raises a bare Exception
            reason = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise UserError(f"{source} is not a tokenizer that tokenizers {tokenizers.__version__} reads: "
                            f"{reason}") from None
        self._tok.no_truncation()  # a document is never cut or padded here, whatever the file says
        self._tok.no_padding()
        self._decoder_steps = _steps(spec.get("decoder"))

        where = str(pathlib.Path(source).parent / HF_CONFIG_FILE)
        config = _parse_json(config_json, where, "a tokenizer_config.json")
        if not isinstance(config, dict):
            raise UserError(f"{where} is not a tokenizer_config.json: it holds a JSON {type(config).__name__}, "
                            f"not an object")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Ids are 0..n-1 in every tokenizer we know; where a file leaves gaps, the embedding needs the highest id + 1.
        self._vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        ids = {}
        for name in _SPECIAL_NAMES:
            content = _token_content(config, f"{name}_token", where)
            ids[name] = -1 if content is None else self._tok.token_to_id(content)
            if ids[name] is None:
                raise UserError(f"{where} names {name}_token {content!r}, which {source} does not have; give the "
                                f"checkpoint's own tokenizer files")
        self.bos_id, self.eos_id, self.unk_id = ids["bos"], ids["eos"], ids["unk"]
        self.pad_id = next(i for i in (ids["pad"], self.eos_id, 0) if i >= 0)  # see Tokenizer
        self._dropped = np.zeros(self._vocab_size, bool)
        self._dropped[[i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]] = True
        self._dropped[[i for i in ids.values() if i >= 0]] = True

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise UserError(f"{where}: chat_template must be a string or a list of named templates; got {template!r:.80}")
        self.chat_template = template
        length = config.get("model_max_length")
        ok = isinstance(length, (int, float)) and not isinstance(length, bool) and 0 < length < _UNBOUNDED_LENGTH
        self.model_max_length: int | None = int(length) if ok else None  # None: no limit stated

        probe, bare = (self._tok.encode("a", add_special_tokens=flag).ids for flag in (True, False))
        at = next((k for k in range(len(probe) - len(bare) + 1) if probe[k:k + len(bare)] == bare), 0)
        adds_bos = self.bos_id >= 0 and self.bos_id in probe[:at]
        adds_eos = self.eos_id >= 0 and self.eos_id in probe[at + len(bare):]
        self.hf_add_bos = self.bos_id >= 0 and bool(config.get("add_bos_token", adds_bos))
        self.hf_add_eos = self.eos_id >= 0 and bool(config.get("add_eos_token", adds_eos))
        self._byte_lengths: np.ndarray | None = None

    def __getstate__(self) -> tuple[bytes, bytes]:  # pickles as its two files (grain workers tokenize with it)
        return self._json, self._config_json

    def __setstate__(self, state: tuple[bytes, bytes]) -> None:
        self.__init__(*state)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HFTokenizer":
        """A tokenizer.json (or the directory holding one), with the tokenizer_config.json,
        special_tokens_map.json and chat_template.jinja beside it where present."""
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / cls.file_name
        tokenizer_json = read_limited(path, _MAX_TOKENIZER_JSON_BYTES, "tokenizer.json")
        return cls(tokenizer_json, _hf_config(path.parent), str(path))

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer.json at `path` and its tokenizer_config.json beside it (give it a
        directory of its own: `load` also reads a special_tokens_map.json or chat_template.jinja there)."""
        path = pathlib.Path(path)
        write_bytes_atomically(path.parent / HF_CONFIG_FILE, self._config_json)
        write_bytes_atomically(path, self._json)

    @property
    def adds_bos(self) -> bool:
        return self.hf_add_bos

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def sha256(self) -> str:
        """Hex digest of the tokenizer.json's bytes, a NUL, and the tokenizer_config.json's: its identity."""
        return hashlib.sha256(self._json + b"\0" + self._config_json).hexdigest()

    def encode(
        self, texts: Sequence[str], add_bos: bool = True, add_eos: bool = True, num_threads: int = -1
    ) -> list[list[int]]:
        """Encode a batch: `num_threads=1` in this thread, else in parallel on tokenizers' own thread pool
        (all cores, or RAYON_NUM_THREADS)."""
        texts = list(texts)
        if num_threads == 1 or len(texts) == 1:
            encoded = [self._tok.encode(text, add_special_tokens=False).ids for text in texts]
        else:
            batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: no offsets (0.21+)
            encoded = [e.ids for e in batch(texts, add_special_tokens=False)]
        bos = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        eos = [self.eos_id] if add_eos and self.eos_id >= 0 else []
        return [bos + ids + eos for ids in encoded] if bos or eos else encoded

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for, int32 [vocab_size]: a byte-level token (GPT-2's
        alphabet) one per character, a byte-fallback piece 1, a SentencePiece-style token its text
        with `▁` as one byte, special ids 0. The sum over a document's ids is its size in bytes (but
        see the class's note on an added prefix space)."""
        if self._byte_lengths is None:
            kinds = {step.get("type") for step in self._decoder_steps}
            alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else {}
            spaces = {step["pattern"]["String"] for step in self._decoder_steps
                      if step.get("type") == "Replace" and step.get("content") == " "
                      and isinstance(step.get("pattern"), dict) and isinstance(step["pattern"].get("String"), str)}
            spaces |= {step.get("replacement", "\u2581") for step in self._decoder_steps if step.get("type") == "Metaspace"}

            def length(token: str) -> int:
                if "ByteFallback" in kinds and _BYTE_PIECE.fullmatch(token):
                    return 1
                for space in spaces:
                    token = token.replace(space, " ")
                return sum(1 if c in alphabet else len(c.encode("utf-8")) for c in token)

            lengths = np.zeros(self._vocab_size, np.int32)
            tokens = self._tok.get_vocab(with_added_tokens=False)
            tokens.update({t.content: i for i, t in self._tok.get_added_tokens_decoder().items()})  # theirs win
            for token, i in tokens.items():
                if not self._dropped[i]:
                    lengths[i] = length(token)
            self._byte_lengths = lengths
        return self._byte_lengths.copy()

    def token_text(self, token_id: int) -> str:
        return (self._tok.id_to_token(token_id) or "") if token_id >= 0 else ""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special ids dropped."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside this tokenizer's vocabulary (0..{self._vocab_size - 1})")
        return self._tok.decode([i for i in ids if not self._dropped[i]], skip_special_tokens=False)


def _take_bytes(docs: Iterable[str], max_bytes: int) -> list[str]:
    """Documents from the start of `docs` until `max_bytes` UTF-8 bytes are collected."""
    taken, total = [], 0
    for doc in docs:
        taken.append(doc)
        total += len(doc.encode("utf-8"))
        if total >= max_bytes:
            break
    return taken


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `_main`, its errors, interrupts and environment failures as one line and an exit code."""
    return run_command(lambda: _main(argv), resume="run the same command again")


def make_parser() -> cli.Parser:
    """The command line of `python -m jaxlm.data.tokenizer` (tests/test_cli_numbers.py tries every numeric flag of it)."""
    parser = cli.Parser(prog="python -m jaxlm.data.tokenizer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a tokenizer on a corpus and write its .model file")
    train.add_argument("--input", required=True, help="'builtin', or files, directories, globs (comma-separated)")
    train.add_argument("--format", default="auto", help="auto | text | jsonl | parquet")
    train.add_argument("--text_field", default="text", help="the JSONL field / Parquet column with the text")
    train.add_argument("--separator", default="", help="text files: split documents on this string")
    train.add_number("--vocab_size", kind=int, required=True)  # its range is the tokenizer's own check
    train.add_argument("--model_type", default="bpe", choices=MODEL_TYPES)
    train.add_number("--max_bytes", kind=int, minimum=1, limit=2**62, default=100_000_000,
                     help="train on the first N bytes of the corpus")
    train.add_path("--output", kind="file", io="out", required=True, help="path of the .model file to write")
    encode = commands.add_parser("encode", help="print the ids of a text")
    encode.add_path("--model", kind="any", io="in", required=True)
    encode.add_argument("text")
    decode = commands.add_parser("decode", help="print the text of space-separated ids")
    decode.add_path("--model", kind="any", io="in", required=True)
    decode.add_argument("ids", nargs="+", type=cli.number(int))
    return parser


def _main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxlm.data.tokenizer train|encode|decode ...`"""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            source = SourceSpec(args.input, args.format, args.text_field, unescape(args.separator), max_bytes=args.max_bytes)
            docs = _take_bytes(iter_documents(source), args.max_bytes)
            if not docs:
                raise UserError(f"the corpus {args.input!r} holds no documents; give non-empty text")
            tok = SentencePieceTokenizer.train(docs, args.vocab_size, args.model_type)
            tok.save(args.output)
            print(f"wrote {args.output}: {args.model_type}, {tok.vocab_size} tokens, sha256 {tok.sha256[:16]}, "
                  f"trained on {len(docs)} documents")
        elif args.command == "encode":
            print(" ".join(map(str, Tokenizer.load(args.model).encode([args.text], add_bos=False, add_eos=False)[0])))
        else:
            print(Tokenizer.load(args.model).decode(args.ids))
    except UserError as e:
        return report_error(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
