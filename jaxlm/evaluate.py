"""Evaluate a checkpoint: `python -m jaxlm.evaluate --run_dir=runs/tiny [--step=N] [--corpus=...] [--tasks=...]`.

Language modelling: the mean token loss, perplexity (exp of it) and bits per byte (total loss in
bits over the UTF-8 bytes of the text the targets stand for) on the run's validation split, on
text files (`--corpus=a.txt,docs/*.jsonl`) or on a prepared corpus directory. Documents are
packed into rows of `seq_len` tokens with segment ids, as in training, so a document longer than
that is scored in consecutive windows, each from a fresh context. A run trained on SFT data
(data.format=chat, sharegpt, alpaca or prompt_completion) is scored the same way on its own kind of
rows: the loss of the assistant's (the completion's) tokens alone, each example its first seq_len + 1
tokens, as its training's val_loss (`jaxlm.data.sft`).

Multiple choice, in the style of lm-eval-harness: each line of a JSONL file is
`{"context": str, "choices": [str, ...], "answer": int}`; each choice is scored by the summed
log-likelihood of its tokens after the context (split from it as the harness splits a request:
`jaxlm.scoring`). `acc` counts examples whose best-scoring choice is the answer; `acc_norm` divides each
score by the choice's length in UTF-8 bytes first. `--lm_eval_tasks=hellaswag,...` runs lm-evaluation-harness's
own tasks on the run (`jaxlm.lm_eval`; the optional extra `eval`).

Everything runs sharded over the devices here (batch over data x fsdp x expert, parameters by the run's
rules). Results are printed as a table and written as JSON (default `<run_dir>/eval-<step>.json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import commands, inference, lazy, scoring
from jaxlm import run_dir as run_dir_lib
from jaxlm.data import loader, mixture, prepare, sft, sources
from jaxlm.data.tokenizer import Tokenizer, write_bytes_atomically
from jaxlm.errors import UserError, report_error, run_command

pipeline = lazy.module("jaxlm.data.pipeline")  # (grain's, imported by the first evaluation)

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- perplexity


def perplexity(run: inference.LoadedRun, doc_tokens: Sequence[np.ndarray], *, seq_len: int | None = None,
               batch_size: int | None = None, scorer=None) -> dict[str, Any]:
    """Loss, perplexity and bits per byte of tokenized documents (each BOS, text, EOS)."""
    seq_len = seq_len or run.cfg.data.seq_len
    if seq_len > run.model_cfg.max_seq_len:
        raise UserError(f"--seq_len={seq_len} is longer than the model's context ({run.model_cfg.max_seq_len})")
    if seq_len % run.sequence_multiple:
        raise UserError(f"--seq_len={seq_len} does not split over this mesh's sequence axes (mesh.context, and "
                        f"twice it under model.context_layout='balanced'); use a multiple of {run.sequence_multiple}")
    batch_size = scoring.round_up(batch_size or run.cfg.data.global_batch_size, run.batch_shards)
    batches = pipeline.make_eval_batches(doc_tokens, seq_len=seq_len, batch_size=batch_size, max_batches=2**62)
    if not batches:
        raise UserError("the corpus has no tokens to predict (every document is shorter than 2 tokens)")
    scorer = scorer or scoring.make_scorer(run)
    byte_lengths = run.tokenizer.byte_lengths()
    total_loss, tokens, total_bytes = 0.0, 0, 0
    with jax.set_mesh(run.mesh):
        pending = []
        for batch in batches:
            real = batch["weights"] > 0
            pending.append(scorer(run.params, scoring.put_batch(run, batch)))  # dispatched; read below
            tokens += int(real.sum())
            total_bytes += int(byte_lengths[batch["targets"]][real].sum())
        for loss_sums, *_ in pending:
            total_loss += float(np.sum(np.asarray(jax.device_get(loss_sums), np.float64)))
    loss = total_loss / tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": total_loss / math.log(2) / total_bytes if total_bytes else None,
        "tokens": tokens,
        "bytes": total_bytes,
        "seq_len": seq_len,
    }


def corpus_documents(run: inference.LoadedRun, corpus: str, *, split: str = "val", max_tokens: int = 0,
                     format: str = "auto", text_field: str = "text", separator: str = "",
                     chat_template: str | None = None) -> tuple[Sequence[np.ndarray], str]:
    """Tokenized documents to evaluate on, and a description of where they came from.

    `corpus`: 'val' (the run's own validation split), a prepared directory (its `split`), or text
    files, directories and globs (every document). At most about `max_tokens` tokens (0 = all).
    SFT rows (`format` chat, sharegpt, alpaca or prompt_completion; `auto`: the run's data.format) come
    as weighted `FlatDocuments`, rendered with `chat_template` (None: the run's data.chat_template).
    """
    tok = run.tokenizer
    spec = loader.sft_spec(_data_section(run)) if format == "auto" else None
    if format in sft.FORMATS:
        spec = sft.Spec(format, run.cfg.data.chat_template)
    if spec and chat_template is not None:
        spec = sft.Spec(spec.format, chat_template)
    if spec:
        return _sft_documents(run, spec, corpus, split, max_tokens)
    if corpus == "val":
        parts = _corpora(run)
        docs, where = [], []
        for name, section in parts:  # a mixture's sources: an equal share of max_tokens each
            share = -(-max_tokens // len(parts))
            directory = _prepared_val_dir(run, section)
            if directory is not None:
                docs += _take_prepared(directory, "val", share)
                where.append(f"{name + ': ' if name else ''}{directory}")
                continue
            texts = (doc for doc in sources.iter_documents(loader.source_spec(section))
                     if sources.is_validation(doc, section.val_fraction, section.seed))
            own = _tokenize_up_to(tok, texts, share)
            if not own:
                what = f"source {name!r} of data.sources, {section.corpus!r}" if name else f"data.corpus={section.corpus!r}"
                raise UserError(f"the run's validation split is empty ({what}, data.val_fraction={section.val_fraction}); "
                                f"give --corpus=<files or prepared directory>")
            docs += own
            where.append(f"{name + ': ' if name else ''}{section.corpus}")
        return docs, f"validation split of {', '.join(where)}"
    directory = pathlib.Path(corpus)
    if prepare.is_prepared(directory):
        _check_same_tokenizer(run, directory)
        return _take_prepared(directory, split, max_tokens), f"{split} split of {directory}"
    source = sources.SourceSpec(corpus, format, text_field, separator)
    docs = _tokenize_up_to(tok, sources.iter_documents(source), max_tokens)
    if not docs:
        raise UserError(f"--corpus={corpus}: no documents (every file is empty); give non-empty text")
    return docs, corpus


def training_documents(run: inference.LoadedRun, max_tokens: int) -> Sequence[np.ndarray]:
    """About `max_tokens` tokens of the run's own training split (its prepared corpus's train split, or
    the documents of data.corpus that are not validation ones), tokenized: calibration data."""
    parts = _corpora(run)
    docs = []
    for _, section in parts:  # a mixture's sources: an equal share of max_tokens each
        share = -(-max_tokens // len(parts))
        directory = _prepared_val_dir(run, section)
        if directory is not None:
            docs += _take_prepared(directory, "train", share)
            continue
        texts = (doc for doc in sources.iter_documents(loader.source_spec(section))
                 if not sources.is_validation(doc, section.val_fraction, section.seed))
        docs += _tokenize_up_to(run.tokenizer, texts, share)
    return docs


def _data_section(run: inference.LoadedRun) -> loader.DataConfig:
    """The run's data section, typed."""
    return loader.DataConfig.from_config(run.cfg.data)


def _corpora(run: inference.LoadedRun) -> list[tuple[str, loader.DataConfig]]:
    """(name, data section) of each corpus the run trained on: its data.corpus ("", the section), or each
    source of its data mixture (the section with data.corpus that source's paths)."""
    d = _data_section(run)
    mix = mixture.parse_sources(d.sources)
    if len(mix) < 2:
        return [("", loader.source_config(d, mix[0]) if mix else d)]
    return [(s.name, loader.source_config(d, s)) for s in mix]


def _sft_documents(run: inference.LoadedRun, spec: sft.Spec, corpus: str, split: str,
                   max_tokens: int) -> tuple[pipeline.FlatDocuments, str]:
    """SFT examples with their weights: the run's validation split, a prepared directory's `split`, or
    every row of JSONL / Parquet files."""
    if corpus == "val":
        directory = _prepared_val_dir(run, _data_section(run))
        if directory is not None:
            return _take_prepared(directory, "val", max_tokens), f"validation split of {directory}"
        _, docs = loader.sft_documents(_data_section(run), run.tokenizer, spec, train=False)
        if not len(docs):
            raise UserError(f"the run's validation split is empty (data.corpus={run.cfg.data.corpus!r}, "
                            f"data.val_fraction={run.cfg.data.val_fraction}); give --corpus=<files or prepared directory>")
        return _first_tokens(docs, max_tokens), f"validation split of {run.cfg.data.corpus}"
    directory = pathlib.Path(corpus)
    if prepare.is_prepared(directory):
        _check_same_tokenizer(run, directory)
        return _take_prepared(directory, split, max_tokens), f"{split} split of {directory}"
    encoder = sft.Encoder.make(spec, run.tokenizer)
    examples = list(sft.iter_examples(sources.SourceSpec(corpus), spec.format))
    if not examples:
        raise UserError(f"--corpus={corpus}: no rows (every file is empty); give {spec.format} rows")
    docs = pipeline.FlatDocuments.from_arrays(*sft.encode_examples(encoder, run.tokenizer, examples))
    return _first_tokens(docs, max_tokens), corpus


def _first_tokens(docs: pipeline.FlatDocuments, max_tokens: int) -> pipeline.FlatDocuments:
    """The first documents of weighted `docs` up to about `max_tokens` targets (0 = all), the last cut to fit."""
    ids, weights, total = [], [], 0
    for i in range(len(docs)):
        if max_tokens and total >= max_tokens:
            break
        keep = max_tokens - total + 1 if max_tokens else len(docs[i])  # + 1: n tokens have n - 1 targets
        ids.append(np.asarray(docs[i][:keep], np.int32))
        weights.append(np.asarray(docs.weights(i)[:keep], np.uint8))
        total += max(len(ids[-1]) - 1, 0)
    return pipeline.FlatDocuments.from_arrays(ids, weights)


def _prepared_val_dir(run: inference.LoadedRun, section: loader.DataConfig) -> pathlib.Path | None:
    """The prepared corpus the run trained from (`section`'s: its data section, or a mixture's source's), when it
    is on disk here (its val split is tokenized)."""
    d = section
    given = pathlib.Path(d.corpus)
    if prepare.is_prepared(given):
        _check_same_tokenizer(run, given)
        return given
    if d.tokenize_on_the_fly:
        return None
    try:
        cached = loader.cached_prepared_dir(section, run.tokenizer.sha256)
    except (UserError, OSError):  # the corpus is not here: reading it raises the clear error later
        return None
    return cached if prepare.is_prepared(cached, complete=True) else None


def _check_same_tokenizer(run: inference.LoadedRun, directory: pathlib.Path) -> None:
    theirs = Tokenizer.load(prepare.tokenizer_file(directory))
    if theirs.sha256 != run.tokenizer.sha256:
        raise UserError(f"{directory} was prepared with another tokenizer than {run.run_dir}'s; prepare the corpus "
                        f"with {run.run_dir / run.tokenizer.file_name}, or give the raw files as --corpus")


def _take_prepared(directory: pathlib.Path, split: str, max_tokens: int) -> Sequence[np.ndarray]:
    if split not in prepare.SPLITS:
        raise UserError(f"--split={split}: use one of {', '.join(prepare.SPLITS)}")
    docs = prepare.open_prepared(directory, split)
    if docs.has_weights:  # SFT examples
        if not len(docs):
            raise UserError(f"{directory} has no {split} documents; give another --corpus or --split")
        return _first_tokens(docs, max_tokens)
    out, total = [], 0
    for i in range(len(docs)):
        if max_tokens and total >= max_tokens:
            break
        doc = np.asarray(docs[i], np.int32)
        if max_tokens:
            doc = doc[: max_tokens - total + 1]  # + 1: a document of n tokens has n - 1 targets
        out.append(doc)
        total += max(len(doc) - 1, 0)
    if not out:
        raise UserError(f"{directory} has no {split} documents; give another --corpus or --split")
    return out


def _tokenize_up_to(tok, texts, max_tokens: int, chunk: int = 256) -> list[np.ndarray]:
    """Tokenize documents (BOS, text, EOS) in chunks until `max_tokens` targets are collected (0 = all)."""
    out, total, buffer = [], 0, []

    def flush() -> bool:
        nonlocal total
        for doc in pipeline.tokenize_documents(tok, buffer):
            if max_tokens and total >= max_tokens:
                return True
            if max_tokens:
                doc = doc[: max_tokens - total + 1]
            out.append(doc)
            total += len(doc) - 1
        buffer.clear()
        return bool(max_tokens) and total >= max_tokens

    for text in texts:
        buffer.append(text)
        if len(buffer) == chunk and flush():
            return out
    flush()
    return out


# ----------------------------------------------------------------------------- multiple choice


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    answer: int


def read_examples(path: str | pathlib.Path) -> list[Example]:
    """Examples of a JSONL file, one `{"context": str, "choices": [str, ...], "answer": int}` per line."""
    path = pathlib.Path(path)
    shape = 'each line must be {"context": str, "choices": [str, ...], "answer": int}'
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--tasks: no file {path}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); {shape}") from None
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg}); {shape}") from None
        if not isinstance(item, dict):
            raise UserError(f"{where}: a JSON {type(item).__name__}, not an object; {shape}")
        missing = [k for k in ("context", "choices", "answer") if k not in item]
        if missing:
            raise UserError(f"{where}: no {', '.join(repr(k) for k in missing)}; {shape}")
        context, choices, answer = item["context"], item["choices"], item["answer"]
        if not isinstance(context, str):
            raise UserError(f"{where}: 'context' is a {type(context).__name__}, not a string; {shape}")
        if not (isinstance(choices, list) and len(choices) >= 2
                and all(isinstance(c, str) and c for c in choices)):
            raise UserError(f"{where}: 'choices' must be a list of at least 2 non-empty strings; {shape}")
        if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
            raise UserError(f"{where}: 'answer' must be the index of the right choice, an integer from 0 to "
                            f"{len(choices) - 1}; got {answer!r}")
        examples.append(Example(context, tuple(choices), answer))
    if not examples:
        raise UserError(f"{path} holds no examples; {shape}")
    return examples


def choice_requests(tok, example: Example, max_len: int) -> list[tuple[np.ndarray, int]]:
    """(tokens, number of choice tokens at the end) per choice, split from the context as lm-evaluation-harness
    splits a request (`scoring.encode_pair`: the context's trailing whitespace moves to the choice, the
    whole text is encoded), BOS first where the tokenizer's convention puts it (`Tokenizer.adds_bos`); a
    sequence longer than the model's context keeps its end."""
    return [scoring.continuation_request(*scoring.encode_pair(tok, example.context, choice, tok.adds_bos), max_len)
            for choice in example.choices]


def multiple_choice(run: inference.LoadedRun, examples: Sequence[Example], *, batch_size: int | None = None,
                    scorer=None) -> dict[str, Any]:
    """acc and acc_norm over `examples`, with each choice's log-likelihood [examples][choices]."""
    max_len = run.model_cfg.max_seq_len
    requests = [choice_requests(run.tokenizer, example, max_len) for example in examples]
    scored = iter(scoring.score_continuations(run, [r for rs in requests for r in rs], batch_size=batch_size,
                                              scorer=scorer))
    loglik = [[next(scored)[0] for _ in example.choices] for example in examples]
    correct = correct_norm = 0
    for example, scores in zip(examples, loglik):
        norm = [s / len(choice.encode("utf-8")) for s, choice in zip(scores, example.choices)]
        correct += int(np.argmax(scores)) == example.answer
        correct_norm += int(np.argmax(norm)) == example.answer
    n = len(examples)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "examples": n, "loglikelihoods": loglik}


# ----------------------------------------------------------------------------- CLI


def format_table(results: dict[str, Any]) -> str:
    lines = []
    lm = results.get("corpus")
    if lm:
        bpb = "n/a" if lm["bits_per_byte"] is None else f"{lm['bits_per_byte']:.4f}"
        lines += ["| corpus | tokens | loss | perplexity | bits/byte |", "|---|---|---|---|---|",
                  f"| {lm['name']} | {lm['tokens']:,} | {lm['loss']:.4f} | {lm['perplexity']:.3f} | {bpb} |"]
    if results.get("tasks"):
        if lines:
            lines.append("")
        lines += ["| task | examples | acc | acc_norm |", "|---|---|---|---|"]
        lines += [f"| {name} | {r['examples']} | {r['acc']:.4f} | {r['acc_norm']:.4f} |"
                  for name, r in results["tasks"].items()]
    if results.get("lm_eval"):
        if lines:
            lines.append("")
        lines += ["| lm_eval task | metric | value | stderr |", "|---|---|---|---|"]
        for task, metrics in results["lm_eval"]["results"].items():
            for key, value in metrics.items():  # "acc,none", "acc_stderr,none": a metric and its filter
                metric, _, filter_name = key.partition(",")
                if not filter_name or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                stderr = metrics.get(f"{metric}_stderr,{filter_name}")
                stderr = f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "n/a"
                name = metric if filter_name == "none" else f"{metric} ({filter_name})"
                lines.append(f"| {task} | {name} | {value:.4f} | {stderr} |")
    return "\n".join(lines)


def run_evaluation(args: argparse.Namespace) -> dict[str, Any]:
    task_files = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    examples = {pathlib.Path(t).stem: read_examples(t) for t in task_files}  # bad files fail before loading
    harness_tasks, manager = [t.strip() for t in (args.lm_eval_tasks or "").split(",") if t.strip()], None
    if harness_tasks:  # the harness and every task name checked before the checkpoint loads
        from jaxlm import lm_eval  # local import: the harness (an optional extra) loads only for --lm_eval_tasks

        manager = lm_eval.task_manager(harness_tasks, args.lm_eval_include_path)
    else:
        given = [f"--{k}" for k in ("lm_eval_include_path", "lm_eval_num_fewshot", "lm_eval_limit")
                 if getattr(args, k) is not None]
        if given:
            raise UserError(f"{given[0]} is a setting of --lm_eval_tasks; give the harness's tasks too "
                            f"(--lm_eval_tasks=hellaswag,...)")
    run = inference.load_run(args.run_dir, step=args.step, dtype=args.dtype)
    scorer = scoring.make_scorer(run)
    results: dict[str, Any] = {"run_dir": str(run.run_dir), "step": run.step,
                               "devices": f"{len(run.mesh.devices.flat)}x {run.mesh.devices.flat[0].device_kind}",
                               "dtype": jnp.dtype(run.model_cfg.dtype).name}
    if args.corpus != "none":
        docs, name = corpus_documents(run, args.corpus, split=args.split, max_tokens=args.max_tokens,
                                      format=args.format, text_field=args.text_field, separator=args.separator,
                                      chat_template=args.chat_template)
        results["corpus"] = {"name": name, "documents": len(docs),
                             **perplexity(run, docs, seq_len=args.seq_len, batch_size=args.batch_size, scorer=scorer)}
    results["tasks"] = {}
    for name, task_examples in examples.items():
        results["tasks"][name] = multiple_choice(run, task_examples, batch_size=args.batch_size, scorer=scorer)
    if harness_tasks:
        results["lm_eval"] = lm_eval.run_tasks(run, harness_tasks, manager, num_fewshot=args.lm_eval_num_fewshot,
                                               limit=args.lm_eval_limit, batch_size=args.batch_size, scorer=scorer)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """The command: `_main`, its errors, interrupts and environment failures as one line and an exit code."""
    return run_command(lambda: _main(argv), resume="run the same command again to evaluate")


make_parser = commands.evaluate_parser  # the command line, declared in jaxlm.commands (light to import)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    args.separator = sources.unescape(args.separator)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.output:  # refused before the work: a file of another kind, or one inside a run's checkpoints
            run_dir_lib.check_output_file(pathlib.Path(args.output))
        results = run_evaluation(args)
    except UserError as e:
        return report_error(e)
    # The results first, so a run that cannot be written to (read-only) still gives them; the file after
    print(f"jaxlm: {results['run_dir']} step {results['step']} on {results['devices']} ({results['dtype']})")
    print(format_table(results))
    output = pathlib.Path(args.output) if args.output else pathlib.Path(args.run_dir) / f"eval-{results['step']}.json"
    if jax.process_index() == 0:
        try:
            run_dir_lib.check_output_file(output, "--output" if args.output else "the results file")
            write_bytes_atomically(output, (json.dumps(results, indent=2) + "\n").encode())  # whole or not at all
        except (OSError, UserError) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            if args.output:  # asked for: an error (the results are above)
                return report_error(f"cannot write the results to {output}: {why}; give another --output")
            print(f"jaxlm: warning: the results were not written to the run directory ({why}); give "
                  f"--output=FILE to keep them", file=sys.stderr)
            return 0
    print(f"jaxlm: results written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
