"""SentencePiece tokenizers: trained in-process on the corpus, cached by content, exact round trip."""

import hashlib
import io
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as spm_model

from jaxlm.data.sources import corpus_fingerprint
from jaxlm.errors import UserError

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
MODEL_TYPES = ("bpe", "unigram", "char", "byte")
BYTE_VOCAB_SIZE = 260  # 4 specials + 256 byte pieces: the whole vocabulary of a 'byte' tokenizer.

# Bump when the training options below change, so cached tokenizers are retrained.
_FORMAT_VERSION = 1
# Lines sampled for training: enough for a good vocabulary, few enough that ~5 MB trains in seconds.
_MAX_TRAIN_LINES = {"bpe": 200_000, "unigram": 50_000, "char": 200_000}
_SPECIALS = (("<pad>", PAD_ID), ("<unk>", UNK_ID), ("<s>", BOS_ID), ("</s>", EOS_ID))
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
    for piece, _ in _SPECIALS:
        model.pieces.add(piece=piece, score=0.0, type=_PieceType.UNKNOWN if piece == "<unk>" else _PieceType.CONTROL)
    for byte in range(256):
        model.pieces.add(piece=f"<0x{byte:02X}>", score=0.0, type=_PieceType.BYTE)
    spec = model.trainer_spec
    spec.model_type = spm_model.TrainerSpec.CHAR
    spec.byte_fallback = True
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    normalizer = model.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = False
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = False
    _pad_vocab(model, vocab_size)
    return model.SerializeToString()


class Tokenizer:
    """A SentencePiece model with fixed special ids and exact round trip of any Unicode text.

    Byte fallback makes every string encodable (no UNK), and identity normalization with no
    whitespace folding keeps code and text byte-exact. One known exception for trained models:
    a literal U+2581 ('▁', SentencePiece's space marker) in the input decodes as a space.
    """

    def __init__(self, model_proto: bytes):
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        sp = self._sp
        self._dropped = np.array(
            [sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) for i in range(sp.get_piece_size())]
        )
        for piece, expected in _SPECIALS:
            if sp.piece_to_id(piece) != expected:
                raise UserError(f"tokenizer model has {piece} at id {sp.piece_to_id(piece)}, jaxlm needs id {expected}")

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int, model_type: str = "bpe", num_threads: int = 2) -> "Tokenizer":
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
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
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
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
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


def get_or_train(
    cache_dir: str | os.PathLike, docs: Sequence[str], vocab_size: int, model_type: str = "bpe"
) -> Tokenizer:
    """Load the tokenizer trained on exactly these documents and options, training it once if missing."""
    _check_model_type(model_type)
    key_text = f"v{_FORMAT_VERSION}|{corpus_fingerprint(docs)}|{vocab_size}|{model_type}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"tokenizer-{key}.model")
    if os.path.exists(path):
        return Tokenizer.load(path)
    tokenizer = Tokenizer.train(docs, vocab_size, model_type)
    tokenizer.save(path)
    return tokenizer


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
    """`python -m jaxlm.data.tokenizer train|encode|decode ...`"""
    import argparse
    import sys

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
            spec = SourceSpec(args.input, args.format, args.text_field, unescape(args.separator), max_bytes=args.max_bytes)
            docs = _take_bytes(iter_documents(spec), args.max_bytes)
            if not docs:
                raise UserError(f"the corpus {args.input!r} holds no documents; give non-empty text")
            tok = Tokenizer.train(docs, args.vocab_size, args.model_type)
            tok.save(args.output)
            print(f"wrote {args.output}: {args.model_type}, {tok.vocab_size} tokens, sha256 {tok.sha256[:16]}, "
                  f"trained on {len(docs)} documents")
        elif args.command == "encode":
            print(" ".join(map(str, Tokenizer.load(args.model).encode([args.text], add_bos=False, add_eos=False)[0])))
        else:
            print(Tokenizer.load(args.model).decode(args.ids))
    except UserError as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
