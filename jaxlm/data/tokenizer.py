"""The tokenizer interface, and SentencePiece tokenizers trained in-process with exact round trip.

`Tokenizer` is all the rest of jaxlm uses of a tokenizer: its special ids as attributes, encode,
decode, the bytes each id stands for, its identity and its file; `Tokenizer.load` opens a tokenizer
file. SentencePiece is the one implementation for now (a Hugging Face tokenizer.json one is next):
a loaded model keeps its own special ids (Llama's: unk 0, bos 1, eos 2, no pad), and a tokenizer
trained here has pad, unk, bos, eos = 0, 1, 2, 3.
"""

import abc
import hashlib
import io
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as spm_model

from jaxlm.errors import UserError, report_error, run_command

MODEL_TYPES = ("bpe", "unigram", "char", "byte")
BYTE_VOCAB_SIZE = 260  # 4 specials + 256 byte pieces: the whole vocabulary of a 'byte' tokenizer.

# Lines sampled for training: enough for a good vocabulary, few enough that ~5 MB trains in seconds.
_MAX_TRAIN_LINES = {"bpe": 200_000, "unigram": 50_000, "char": 200_000}
# The pieces and ids of the specials of every tokenizer trained here (only of those: a loaded model has its own).
_TRAINED_SPECIALS = {"pad": ("<pad>", 0), "unk": ("<unk>", 1), "bos": ("<s>", 2), "eos": ("</s>", 3)}
_PieceType = spm_model.ModelProto.SentencePiece.Type


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see a partial file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp_path, "xb") as f:
        f.write(data)
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

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer in file `path`: a SentencePiece .model (the one format for now)."""
        return SentencePieceTokenizer.load(path)

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
    def save(self, path: str | os.PathLike) -> None:
        """Write the file `load` reads back."""


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model with its own special ids (`sp.pad_id()` etc., pad as `Tokenizer` says).

    One trained here (`train`) round-trips any Unicode text exactly: byte fallback makes every
    string encodable (no UNK), and identity normalization with no whitespace folding keeps code and
    text byte-exact. One known exception: a literal U+2581 ('▁', SentencePiece's space marker) in the
    input decodes as a space.
    """

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
        """Encode a batch in parallel (`num_threads=-1`: all cores)."""
        add_bos, add_eos = add_bos and self.bos_id >= 0, add_eos and self.eos_id >= 0  # sentencepiece raises
        return self._sp.encode(list(texts), out_type=int, add_bos=add_bos, add_eos=add_eos, num_threads=num_threads)

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

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special and unused ids dropped."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self._dropped)]
        if bad:
            raise UserError(f"token id {bad[0]} is outside this tokenizer's vocabulary (0..{len(self._dropped) - 1})")
        return self._sp.decode([i for i in ids if not self._dropped[i]])


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


def _main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxlm.data.tokenizer train|encode|decode ...`"""
    import argparse

    from jaxlm.data.sources import SourceSpec, iter_documents, unescape

    parser = argparse.ArgumentParser(prog="python -m jaxlm.data.tokenizer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a tokenizer on a corpus and write its .model file")
    train.add_argument("--input", required=True, help="'builtin', or files, directories, globs (comma-separated)")
    train.add_argument("--format", default="auto", help="auto | text | jsonl | parquet")
    train.add_argument("--text_field", default="text", help="the JSONL field / Parquet column with the text")
    train.add_argument("--separator", default="", help="text files: split documents on this string")
    train.add_argument("--vocab_size", type=int, required=True)
    train.add_argument("--model_type", default="bpe", choices=MODEL_TYPES)
    train.add_argument("--max_bytes", type=int, default=100_000_000, help="train on the first N bytes of the corpus")
    train.add_argument("--output", required=True, help="path of the .model file to write")
    encode = commands.add_parser("encode", help="print the ids of a text")
    encode.add_argument("--model", required=True)
    encode.add_argument("text")
    decode = commands.add_parser("decode", help="print the text of space-separated ids")
    decode.add_argument("--model", required=True)
    decode.add_argument("ids", nargs="+", type=int)
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
