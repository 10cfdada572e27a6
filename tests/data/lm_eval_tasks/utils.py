"""The local tasks' data: each task's JSONL file beside this one, as the test split (no download)."""

import json
import pathlib

import datasets

HERE = pathlib.Path(__file__).resolve().parent


def _split(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def facts_choice(**metadata) -> datasets.DatasetDict:
    return _split("facts_choice")


def facts_generate(**metadata) -> datasets.DatasetDict:
    return _split("facts_generate")


def facts_text(**metadata) -> datasets.DatasetDict:
    return _split("facts_text")
