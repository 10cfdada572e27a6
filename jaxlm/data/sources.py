"""Where documents come from: text files, JSONL, Parquet, the built-in corpus; and the train/val split.

A `SourceSpec` names the inputs (files, directories, globs) and how to read them. Every reader is a
generator of documents in a fixed order, and every bad input is a `UserError` naming the file (and
the line, where there is one) and what to do. `read_file_records` gives the rows of a JSONL or
Parquet file whole, for the SFT formats (`jaxlm.data.sft`); `builtin_chat` names the small chat
set shipped in the package (`jaxlm/data/builtin_chat.jsonl`, written by `builtin_chat.py`).
"""

import dataclasses
import glob
import gzip
import hashlib
import io
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence

from jaxlm.errors import UserError

FORMATS = ("auto", "text", "jsonl", "parquet", "hf", "arrow")
# The supervised fine-tuning formats (`jaxlm.data.sft`), kept here so that the command lines (`jaxlm.commands`)
# can name them without importing the tokenizer's module: the formats whose rows are conversations (rendered
# with a template), and every SFT format
CONVERSATIONS = ("chat", "sharegpt", "alpaca")
SFT_FORMATS = (*CONVERSATIONS, "prompt_completion")
_EXTENSIONS = {
    ".txt": "text", ".md": "text", ".text": "text", ".py": "text",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",  # an Arrow IPC file, as a Hugging Face `save_to_disk` folder holds its data
}
BUILTIN_CHAT = "builtin_chat"  # data.corpus: the chat set shipped in the package (jaxlm/data/builtin_chat.py)
BUILTIN_CHAT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_chat.jsonl")
# data.corpus: two-digit sums, SFT rows and GRPO prompts with answers (jaxlm/data/builtin_addition.py)
BUILTIN_ADDITION = "builtin_addition"
BUILTIN_ADDITION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_addition.jsonl")
BUILTIN_FILES = {BUILTIN_CHAT: BUILTIN_CHAT_FILE, BUILTIN_ADDITION: BUILTIN_ADDITION_FILE}


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """Which documents to read: `paths` is 'builtin' or files, directories and globs, comma-separated."""

    paths: str
    format: str = "auto"  # auto (by file extension) | text | jsonl | parquet | hf (a `save_to_disk` folder)
    text_field: str = "text"  # jsonl / parquet / hf: the field or column holding the text
    separator: str = ""  # text files: "" = one document per file, else split on this string (e.g. "\n\n")
    max_bytes: int = 0  # builtin only: stop after this many UTF-8 bytes (0 = the whole standard library)


def unescape(text: str) -> str:
    """Python escapes typed on a command line (`\\n\\n`) as the characters they stand for; text
    that holds the characters already is unchanged (`--config.data.separator='\\n\\n'` and a
    config file's "\n\n" mean the same)."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def resolve_files(source: SourceSpec) -> list[str]:
    """The input files, sorted within each pattern; directories are walked. UserError if none match."""
    if source.format not in FORMATS:
        raise UserError(f"data format {source.format!r} is unknown; use one of {', '.join(FORMATS)}")
    files: list[str] = []
    for pattern in (p.strip() for p in source.paths.split(",")):
        if not pattern:
            continue
        expanded = BUILTIN_FILES.get(pattern) or os.path.expanduser(pattern)
        if source.format == "hf" or (source.format == "auto" and is_hf_dataset(expanded)):
            matches = [expanded] if os.path.isdir(expanded) else []  # save_to_disk's folder is the input
        elif os.path.isdir(expanded):
            matches = sorted(_walk(expanded, source.format))
        else:
            matches = sorted(m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
        if not matches:
            raise UserError(f"no input files match {pattern!r}; check the path (globs like data/*.jsonl work)")
        files.extend(m for m in matches if m not in files)
    if not files:
        raise UserError("no input paths given; set config.data.corpus to files, a directory or a glob")
    return files


def is_hf_dataset(path: str) -> bool:
    """Whether `path` is a folder Hugging Face's `save_to_disk` wrote (a Dataset's, or a DatasetDict's)."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_dict.json")) or all(
        os.path.isfile(os.path.join(path, name)) for name in ("dataset_info.json", "state.json")))


def _walk(directory: str, fmt: str) -> Iterator[str]:
    """The inputs under a directory: its files (of a known extension, for format auto) and, for format auto,
    the `save_to_disk` folders in it, each one input (not walked into)."""
    for root, dirnames, names in os.walk(directory):
        if fmt == "auto":
            folders = [d for d in dirnames if is_hf_dataset(os.path.join(root, d))]
            dirnames[:] = [d for d in dirnames if d not in folders]
            yield from (os.path.join(root, d) for d in folders)
        yield from (os.path.join(root, name) for name in names if fmt != "auto" or _format_of(name, strict=False))


def input_files(path: str) -> list[str]:
    """The files an input stands for: itself, or every file of a `save_to_disk` folder, sorted (what a
    cache key and a manifest identify it by)."""
    if not os.path.isdir(path):
        return [path]
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)


def _format_of(path: str, strict: bool = True) -> str | None:
    if is_hf_dataset(path):
        return "hf"
    name = path[:-3] if path.endswith(".gz") else path
    fmt = _EXTENSIONS.get(os.path.splitext(name)[1].lower())
    if fmt is None and strict:
        raise UserError(
            f"cannot tell the format of {path} from its extension ({', '.join(sorted(_EXTENSIONS))}, optionally "
            f".gz); rename it, or give the format where the command takes one (config.data.format, evaluate "
            f"--format); python -m jaxlm.compress reads those extensions only"
        )
    return fmt


def _open_text(path: str) -> io.TextIOBase:
    opener = gzip.open if path.endswith(".gz") else open
    return opener(path, "rt", encoding="utf-8", newline="")


def read_file_documents(path: str, source: SourceSpec) -> Iterator[str]:
    """The documents of one file, in order. Empty documents are skipped."""
    fmt = source.format if source.format != "auto" else _format_of(path)
    try:
        if fmt == "text":
            yield from _read_text(path, source.separator)
        elif fmt == "jsonl":
            yield from _read_jsonl(path, source.text_field)
        elif fmt == "parquet":
            yield from _read_parquet(path, source.text_field)
        elif fmt == "hf":
            yield from _read_hf(path, source.text_field)
        elif fmt == "arrow":
            yield from _read_arrow(path, source.text_field)
        else:
            raise UserError(f"data format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    except FileNotFoundError:
        raise UserError(f"input file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
    except (EOFError, gzip.BadGzipFile, OSError) as e:
        raise UserError(f"{path}: cannot be read ({e}); the file may be truncated or corrupt") from None


def read_file_records(path: str) -> Iterator[tuple[str, object]]:
    """(where, row) for every row of a JSONL or Parquet file (told by its extension), in order: where
    is 'path:line' (JSONL; blank lines skipped) or 'path: row N' (Parquet, from 1)."""
    fmt = _format_of(path)
    if fmt not in ("jsonl", "parquet"):
        raise UserError(f"{path}: SFT data must be JSONL (.jsonl, .json, .jsonl.gz) or Parquet, not {fmt}")
    try:
        if fmt == "jsonl":
            with _open_text(path) as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield f"{path}:{line_no}", json.loads(line)
                        except json.JSONDecodeError as e:
                            raise UserError(f"{path}:{line_no}: not valid JSON ({e.msg}); fix or remove the line") from None
        else:
            import pyarrow.parquet as pq  # local import: heavy (pyarrow), only for Parquet inputs

            try:
                table = pq.read_table(path)
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError for corrupt files
                raise UserError(f"{path}: not a readable Parquet file ({e}); the file may be truncated or corrupt") from None
            for row_no, row in enumerate(table.to_pylist(), 1):
                yield f"{path}: row {row_no}", row
    except FileNotFoundError:
        raise UserError(f"input file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
    except (EOFError, gzip.BadGzipFile, OSError) as e:
        raise UserError(f"{path}: cannot be read ({e}); the file may be truncated or corrupt") from None


# The fields of supervised fine-tuning rows (jaxlm.data.sft): a text reader that meets them names the format to set.
_SFT_FIELDS = {"messages": "chat", "conversations": "chat", "instruction": "chat", "prompt": "prompt_completion"}


def _fix_for(found: Sequence[str]) -> str:
    """What to set when a row or table lacks the text field: data.format for SFT rows (messages,
    ShareGPT's conversations, Alpaca's instruction, prompt/completion), else data.text_field."""
    fmt = next((_SFT_FIELDS[name] for name in found if name in _SFT_FIELDS), None)
    if fmt:
        return (f"these are fine-tuning rows: set config.data.format={fmt} (prepare, evaluate: --format {fmt}), "
                f"or config.data.text_field to a field holding text")
    return "set config.data.text_field"


def _read_text(path: str, separator: str) -> Iterator[str]:
    with _open_text(path) as f:
        text = f.read()
    for doc in (text.split(separator) if separator else [text]):
        if doc.strip():
            yield doc


def _read_jsonl(path: str, field: str) -> Iterator[str]:
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{line_no}: not valid JSON ({e.msg}); fix or remove the line") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else [type(record).__name__]
                raise UserError(f"{path}:{line_no}: no field {field!r} (found: {', '.join(keys)}); {_fix_for(keys)}")
            text = record[field]
            if not isinstance(text, str):
                raise UserError(f"{path}:{line_no}: field {field!r} is a {type(text).__name__}, not text")
            if text.strip():
                yield text


def _read_parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # local import: heavy (pyarrow), only for Parquet inputs

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for corrupt files
        raise UserError(f"{path}: not a readable Parquet file ({e}); the file may be truncated or corrupt") from None
    names = parquet.schema_arrow.names
    if field not in names:
        raise UserError(f"{path}: no column {field!r} (found: {', '.join(names)}); {_fix_for(names)}")
    for batch in parquet.iter_batches(columns=[field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None and text.strip():
                yield text


def _read_arrow(path: str, field: str) -> Iterator[str]:
    """An Arrow IPC file: the streaming format (a `save_to_disk` folder's `data-*.arrow`) or the file format."""
    import pyarrow as pa  # local import: heavy (pyarrow), only for Arrow inputs

    with pa.memory_map(path) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise UserError(f"{path}: not an Arrow IPC file ({e}); the file may be truncated or corrupt") from None
        names = reader.schema.names
        if field not in names:
            raise UserError(f"{path}: no column {field!r} (found: {', '.join(names)}); {_fix_for(names)}")
        batches = reader if isinstance(reader, pa.ipc.RecordBatchStreamReader) else (
            reader.get_batch(i) for i in range(reader.num_record_batches))
        try:
            for batch in batches:
                for text in batch.column(names.index(field)).to_pylist():
                    if text is not None and text.strip():
                        yield text
        except pa.ArrowInvalid as e:
            raise UserError(f"{path}: cannot be read ({e}); the file may be truncated or corrupt") from None


def _read_hf(path: str, field: str) -> Iterator[str]:
    """A local Hugging Face dataset (`save_to_disk`); of a DatasetDict, its 'train' split."""
    try:
        import datasets  # local import: optional dependency (pip install datasets)
    except ImportError:
        raise UserError("format 'hf' needs the Hugging Face datasets package: pip install datasets") from None
    try:
        dataset = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise UserError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise UserError(f"{path}: a DatasetDict without a 'train' split (found: {', '.join(dataset)})")
        dataset = dataset["train"]
    if field not in dataset.column_names:
        raise UserError(
            f"{path}: no column {field!r} (found: {', '.join(dataset.column_names)}); {_fix_for(dataset.column_names)}"
        )
    for text in dataset.select_columns([field]).to_iterable_dataset():
        if text[field] and text[field].strip():
            yield text[field]


def iter_documents(source: SourceSpec) -> Iterator[str]:
    """Every document of the source, files in order."""
    if source.paths == "builtin":
        yield from builtin_corpus(source.max_bytes or 10**12)
        return
    for path in resolve_files(source):
        yield from read_file_documents(path, source)


def load_documents(source: SourceSpec) -> list[str]:
    docs = list(iter_documents(source))
    if not docs:
        raise UserError(f"the corpus {source.paths!r} holds no documents (every file is empty); give non-empty text")
    return docs

# Tests and IDE/2to3 fixtures are repetitive or unusual Python: keep the default corpus to real library code.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def builtin_corpus(max_bytes: int) -> list[str]:
    """The Python standard library's own sources, one document per `.py` file.

    Read from the running interpreter at run time so that a first run needs no download and no
    data path; the walk is sorted, so the same interpreter always gives the same corpus.
    Collects whole files until at least `max_bytes` UTF-8 bytes are gathered.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    total_bytes = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    text = f.read().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text:
                continue
            docs.append(text)
            total_bytes += len(text.encode("utf-8"))
            if total_bytes >= max_bytes:
                return docs
    if not docs:
        raise UserError(f"the built-in corpus is empty: no readable .py files under {root}; give a data path instead")
    return docs


def _unit_hash(text: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by the text and the seed, independent of position."""
    digest = hashlib.sha256(f"{seed}\0{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_validation(doc: str, val_fraction: float, seed: int) -> bool:
    """Whether a document belongs to the validation split: a hash of its text, not its position."""
    return _unit_hash(doc, seed) < val_fraction


def corpus_fingerprint(docs: Sequence[str]) -> str:
    """A short content hash of a corpus: the cache key of tokenizers and tokenized data trained on it."""
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]
