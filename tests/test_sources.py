"""Reading corpora: text, JSONL and Parquet, globs and directories, and one clear line for bad input."""

import gzip
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxlm.data.sources import SourceSpec, iter_documents, load_documents, resolve_files, unescape
from jaxlm.errors import UserError

DOCS = ["first document\nwith two lines", "second 🙂 документ", "third\n\nhas a blank line"]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def test_text_files_one_document_per_file_or_split_on_a_separator(tmp_path):
    for i, doc in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(doc, encoding="utf-8")
    assert load_documents(SourceSpec(str(tmp_path / "*.txt"))) == DOCS
    assert load_documents(SourceSpec(str(tmp_path))) == DOCS  # a directory is walked, sorted
    joined = tmp_path / "all.md"
    joined.write_text("\n\n".join(["a b", "c d", "", "e"]), encoding="utf-8")
    assert load_documents(SourceSpec(str(joined), separator="\n\n")) == ["a b", "c d", "e"]
    # `--config.data.separator=\n\n` arrives as backslash-n; the config's data loader unescapes it.
    from jaxlm import config
    from jaxlm.data.loader import DataConfig, source_spec

    cfg = config.recipe("tiny", data__corpus=str(joined), data__separator=r"\n\n")
    assert load_documents(source_spec(DataConfig.from_config(cfg.data))) == ["a b", "c d", "e"]
    assert unescape("\n\n") == unescape(r"\n\n") == "\n\n" and unescape("é\t") == "é\t"


def test_jsonl_plain_and_gzipped_with_a_text_field(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS[:2])])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"content": DOCS[2]}) + "\n\n")
    assert load_documents(SourceSpec(str(tmp_path / "a.jsonl"))) == DOCS[:2]
    assert load_documents(SourceSpec(str(tmp_path / "b.jsonl.gz"), text_field="content")) == DOCS[2:]


def test_parquet_with_a_text_column(tmp_path):
    pq.write_table(pa.table({"body": DOCS + [None], "n": [1, 2, 3, 4]}), tmp_path / "d.parquet")
    assert load_documents(SourceSpec(str(tmp_path / "d.parquet"), text_field="body")) == DOCS


def test_comma_separated_globs_keep_their_order_and_skip_repeats(tmp_path):
    write_jsonl(tmp_path / "x.jsonl", [{"text": "x"}])
    (tmp_path / "y.txt").write_text("y")
    source = SourceSpec(f"{tmp_path}/y.txt,{tmp_path}/*.jsonl,{tmp_path}/y.txt")
    assert resolve_files(source) == [str(tmp_path / "y.txt"), str(tmp_path / "x.jsonl")]
    assert load_documents(source) == ["y", "x"]


def test_a_local_hugging_face_dataset(tmp_path, monkeypatch):
    import datasets  # in the dev extra (optional for users): run, never skipped
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets.Dataset.from_dict({"text": DOCS, "n": [1, 2, 3]}).save_to_disk(str(tmp_path / "one"))
    assert load_documents(SourceSpec(str(tmp_path / "one"), format="hf")) == DOCS
    split = datasets.Dataset.from_dict({"body": DOCS[:1]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dict"))
    assert load_documents(SourceSpec(str(tmp_path / "dict"), format="hf", text_field="body")) == DOCS[:1]
    with pytest.raises(UserError, match="no column 'text'"):
        load_documents(SourceSpec(str(tmp_path / "dict"), format="hf"))
    with pytest.raises(UserError, match="not a dataset saved with save_to_disk"):
        load_documents(SourceSpec(str(tmp_path), format="hf"))


def test_a_save_to_disk_folder_and_its_arrow_files_are_told_without_a_format(tmp_path, monkeypatch):
    """Format auto: a `save_to_disk` folder (given, or met walking a directory) is one input read as a dataset,
    and its Arrow file read alone gives the same documents; the trainer prepares the folder (its files are the
    cache key and the manifest's sources) and mixes it with a JSONL file."""
    import datasets  # in the dev extra (optional for users): run, never skipped

    from jaxlm.data import loader

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "corpus" / "hf"
    datasets.Dataset.from_dict({"text": DOCS * 20, "n": list(range(60))}).save_to_disk(str(folder))
    write_jsonl(tmp_path / "corpus" / "more.jsonl", [{"text": d} for d in reversed(DOCS)])
    assert load_documents(SourceSpec(str(folder))) == DOCS * 20
    assert resolve_files(SourceSpec(str(tmp_path / "corpus"))) == [str(folder), str(tmp_path / "corpus" / "more.jsonl")]
    arrow = resolve_files(SourceSpec(str(folder / "*.arrow")))
    assert len(arrow) == 1 and load_documents(SourceSpec(arrow[0])) == DOCS * 20
    (tmp_path / "cut.arrow").write_bytes((folder / pathlib.Path(arrow[0]).name).read_bytes()[:200])
    with pytest.raises(UserError, match=r"cut.arrow: .*truncated or corrupt"):
        load_documents(SourceSpec(str(tmp_path / "cut.arrow")))
    d = loader.DataConfig(sources=f"hf={folder}:1,lines={tmp_path / 'corpus' / 'more.jsonl'}:1", tokenizer_type="byte",
                          tokenizer_vocab_size=260, val_fraction=0.0, seq_len=16, global_batch_size=4,
                          cache_dir=str(tmp_path / "cache"))
    data = loader.load_data(d)
    assert [(f.name, f.documents) for f in data.mixture.sources] == [("hf", 60), ("lines", 3)]


def test_builtin_corpus_is_a_source():
    docs = list(iter_documents(SourceSpec("builtin", max_bytes=100_000)))
    assert docs and sum(len(d.encode()) for d in docs) >= 100_000


@pytest.mark.parametrize(
    "setup, spec_kw, message",
    [
        (lambda p: None, dict(paths="{p}/missing/*.jsonl"), "no input files match '{p}/missing/*.jsonl'"),
        (lambda p: (p / "e.txt").write_text("  \n"), dict(paths="{p}/e.txt"), "holds no documents"),
        (lambda p: (p / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n'), dict(paths="{p}/bad.jsonl"),
         "{p}/bad.jsonl:2: not valid JSON"),
        (lambda p: write_jsonl(p / "f.jsonl", [{"text": "a"}, {"body": "b"}]), dict(paths="{p}/f.jsonl"),
         "{p}/f.jsonl:2: no field 'text' (found: body); set config.data.text_field"),
        # fine-tuning rows read as text: the line names the data.format that reads them
        (lambda p: write_jsonl(p / "m.jsonl", [{"messages": []}]), dict(paths="{p}/m.jsonl"),
         "{p}/m.jsonl:1: no field 'text' (found: messages); these are fine-tuning rows: set config.data.format=chat"),
        (lambda p: write_jsonl(p / "s.jsonl", [{"conversations": [], "id": 1}]), dict(paths="{p}/s.jsonl"),
         "(found: conversations, id); these are fine-tuning rows: set config.data.format=chat"),
        (lambda p: write_jsonl(p / "a.jsonl", [{"instruction": "i", "output": "o"}]),
         dict(paths="{p}/a.jsonl", format="jsonl"), "set config.data.format=chat"),
        (lambda p: pq.write_table(pa.table({"prompt": ["a"], "completion": ["b"]}), p / "pc.parquet"),
         dict(paths="{p}/pc.parquet"), "no column 'text' (found: prompt, completion); these are fine-tuning rows: "
         "set config.data.format=prompt_completion"),
        (lambda p: write_jsonl(p / "n.jsonl", [{"text": 3}]), dict(paths="{p}/n.jsonl"), "field 'text' is a int"),
        (lambda p: pq.write_table(pa.table({"body": ["a"]}), p / "c.parquet"), dict(paths="{p}/c.parquet"),
         "no column 'text' (found: body)"),
        (lambda p: (p / "t.parquet").write_bytes(b"PAR1 not really"), dict(paths="{p}/t.parquet"),
         "not a readable Parquet file"),
        (lambda p: (p / "z.jsonl.gz").write_bytes(gzip.compress(b'{"text": "abc"}\n' * 100)[:40]),
         dict(paths="{p}/z.jsonl.gz"), "may be truncated or corrupt"),
        (lambda p: (p / "l.bin").write_bytes(b"\xff\xfe"), dict(paths="{p}/l.bin", format="text"), "not UTF-8 text"),
        (lambda p: (p / "u.csv").write_text("a"), dict(paths="{p}/u.csv"), "cannot tell the format"),
        (lambda p: None, dict(paths="{p}", format="xml"), "data format 'xml' is unknown"),
    ],
)
def test_bad_input_is_one_line_naming_the_file(tmp_path, setup, spec_kw, message):
    setup(tmp_path)
    source = SourceSpec(**{k: v.format(p=tmp_path) if isinstance(v, str) else v for k, v in spec_kw.items()})
    with pytest.raises(UserError) as error:
        load_documents(source)
    assert message.format(p=tmp_path) in str(error.value)
    assert "\n" not in str(error.value)
