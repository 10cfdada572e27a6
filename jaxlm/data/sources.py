"""Text corpora as lists of documents, and a deterministic train/validation split."""

import hashlib
import os
import sysconfig
from collections.abc import Sequence

from jaxlm.errors import UserError

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
    digest = hashlib.sha256(f"{seed}\0{text}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_train_val(docs: Sequence[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Split documents by a hash of their text, so the split survives reordering and appending.

    Identical documents always land on the same side, so validation text never leaks into
    training. With two or more distinct documents and `val_fraction > 0`, each side gets at
    least one. Order within each side follows `docs`.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    scores = [_unit_hash(doc, seed) for doc in docs]
    is_val = [score < val_fraction for score in scores]
    if val_fraction > 0 and len(set(scores)) >= 2:
        lowest, highest = min(scores), max(scores)
        if not any(is_val):
            is_val = [score == lowest for score in scores]
        elif all(is_val):
            is_val = [score != highest for score in scores]
    train = [doc for doc, v in zip(docs, is_val) if not v]
    val = [doc for doc, v in zip(docs, is_val) if v]
    return train, val


def corpus_fingerprint(docs: Sequence[str]) -> str:
    """A short content hash of a corpus: the cache key of tokenizers and tokenized data trained on it."""
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]
