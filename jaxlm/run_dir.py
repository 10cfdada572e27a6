"""A run directory: where it is, whether a resume may continue it, and the metric sinks in it.

`output_dir/name` holds config.json, metrics.jsonl, tensorboard/, the tokenizer (tokenizer.model, or
a Hugging Face tokenizer.json with its tokenizer_config.json), summary.json and checkpoints/<step>/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
import ml_collections

from jaxlm import distributed
from jaxlm import metrics as metrics_lib
from jaxlm import xla_flags as xla_flags_lib
from jaxlm.data.mixture import same_sources
from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import UserError
from jaxlm.paths import check_output_file, is_run, run_containing  # noqa: F401 -- check_output_file: for callers of run_dir
from jaxlm.run_lock import LOCK_NAME
from jaxlm.section import Section, check, check_choice, setting

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
    """The run: its directory, its length and logging, its seed, and where a fine-tune starts from."""

    section: ClassVar[str] = "run"
    name: str = setting("", 'run directory under output_dir; "" = the recipe\'s name. An existing run there is resumed')
    fresh: bool = setting(False, "true: move an existing run directory aside (kept, renamed) and start over")
    output_dir: str = setting("runs", "where run directories live (run.name under it)", path=("dir", "out"))
    seed: int = setting(0, "the parameters' initialization and dropout (the data order is data.seed)")
    steps: int = setting(1000, "optimizer steps")
    log_every: int = setting(10, "a console line and a metrics.jsonl entry every N steps")
    eval_every: int = setting(0, "0 = only at the end")
    eval_at_start: str = setting(
        "auto", "a held-out evaluation before the first step, the baseline a fine-tune is read against (step 0 in "
                "the metrics, `initial_val_loss` in summary.json): auto = for a run started from run.init_from | on | off")
    peak_flops: float = setting(0.0, "peak FLOP/s of one device for MFU; 0 = from the table of known devices")
    compile_cache_dir: str = setting(
        ".cache/jaxlm/xla",
        'XLA\'s persistent compilation cache: restarts skip compiling; "" = off', path=("dir", "out"))
    xla_flags: str = setting(
        "",
        '"--xla_name=value ..." added to XLA_FLAGS before JAX starts (checked first); "" = XLA\'s defaults')
    libtpu_flags: str = setting(
        xla_flags_lib.LIBTPU_DEFAULT,
        'XLA:TPU\'s own flags, "--xla_name=value ...", added to LIBTPU_INIT_ARGS before JAX starts (checked where '
        'libtpu is installed; inert elsewhere). The default turns off the collective matmul and makes FSDP\'s '
        'all-gathers asynchronous (faster FSDP steps, measured: benchmarks/BENCHMARKS.md); "" = XLA:TPU\'s defaults')
    init_from: str = setting(
        "",
        'Fine-tuning: a run directory (config.json, tokenizer file, checkpoints/) whose parameters a NEW run '
        'starts from (step 0, fresh optimizer and data; a resumed run ignores it). Its architecture (every '
        'model key but init_from.COMPUTE_MODEL_KEYS, and the RoPE scaling keys the recipe or command line sets) and '
        'tokenizer replace the recipe\'s. "" = random init')
    init_step: int = setting(-1, "run.init_from's checkpoint to read; -1 = the newest that loads (verified)")
    recipe: str = setting("", "the recipe's name, set when it is loaded (the run directory's default name)")

    def validate(self) -> None:
        check(self.steps > 0, self.key("steps"), self.steps, "a positive integer")
        check(self.log_every > 0, self.key("log_every"), self.log_every, "a positive integer")
        check(self.eval_every >= 0, self.key("eval_every"), self.eval_every, "0 (only at the end) or more")
        check_choice(self.key("eval_at_start"), self.eval_at_start, EVAL_AT_START)
        check(self.peak_flops >= 0, self.key("peak_flops"), self.peak_flops,
              "0 (known devices) or the FLOP/s of one device")
        check(self.init_step >= -1, self.key("init_step"), self.init_step,
              "-1 (the newest checkpoint that loads) or a step")
        check(self.init_step == -1 or bool(self.init_from), self.key("init_step"), self.init_step,
              "-1 while run.init_from is empty (set run.init_from to the run directory to read that step of)")


EVAL_AT_START = ("auto", "on", "off")


def eval_at_start(run: RunConfig | ml_collections.ConfigDict) -> bool:
    """Whether a new run evaluates before its first step (`run.eval_at_start`; auto: when it starts from
    another run's parameters, whose held-out loss is then the baseline its fine-tuning is read against)."""
    return run.eval_at_start == "on" or (run.eval_at_start == "auto" and bool(run.init_from))


def run_dir_path(cfg: ml_collections.ConfigDict) -> pathlib.Path:
    """`output_dir/name`; the name defaults to the recipe's, so re-running a command resumes its run."""
    return pathlib.Path(cfg.run.output_dir) / (cfg.run.name or cfg.run.recipe)


# What a run directory may hold before its config.json is written: its lock
OWN_FILES = (LOCK_NAME,)


# ----------------------------------------------------------------------------- what a command may write


def _locked_by_jaxlm(run_dir: pathlib.Path) -> bool:
    """Whether the directory holds a jaxlm run's lock (`run_lock.RunLock`: JSON with the holder's pid): a run
    that has not written its config.json yet, which the lock then reports (in use, or taken over)."""
    try:
        holder = json.loads((run_dir / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(holder, dict) and "pid" in holder and "host" in holder


def _config_cut_short(run_dir: pathlib.Path) -> bool:
    """Whether the directory is a jaxlm run whose config.json a killed process or a lost disk left not whole
    JSON: its checkpoints/ beside it (which carry the config; the resume writes config.json again)."""
    try:
        json.loads((run_dir / "config.json").read_text())
    except ValueError:
        return (run_dir / "checkpoints").is_dir()
    except OSError:
        return False
    return False


def check_run_dir(run_dir: pathlib.Path) -> None:
    """A run writes only into a run directory of its own kind: a new or empty directory, or one jaxlm
    wrote (which it resumes). Anything else, a Hugging Face model directory or a folder of the user's own
    files, is refused in one line before anything is written or moved."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} (run.output_dir/run.name) is a file, not a directory; choose another "
                        f"config.run.name or config.run.output_dir")
    if (any(p.name not in OWN_FILES for p in run_dir.iterdir()) and not is_run(run_dir) and not _locked_by_jaxlm(run_dir)
            and not _config_cut_short(run_dir)):
        raise UserError(f"{run_dir} (run.output_dir/run.name) holds files jaxlm did not write (no jaxlm config.json "
                        f"in it); a run writes only into its own directory: choose another config.run.name or "
                        f"config.run.output_dir")


def check_new_output(output: pathlib.Path, flag: str = "--output", *, is_a_run: bool = False) -> None:
    """A command's new output directory (hf import and export, compress, a PEFT adapter): refused in one
    line when it exists and is not empty, when it lies inside a run's checkpoints, or, for an output that
    is itself a run (`is_a_run`), anywhere inside another run, where resuming or cleaning that run would
    meet it."""
    output = pathlib.Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"{flag}={output} exists and is not empty; give a new directory")
    inside = run_containing(output.parent)
    if inside is not None and (is_a_run or "checkpoints" in output.absolute().relative_to(inside.absolute()).parts):
        raise UserError(f"{flag}={output} is inside the run directory {inside}; give a directory outside it")


def partial_path(output: pathlib.Path) -> pathlib.Path:
    """Where `new_output` writes `output` until it is complete: a hidden sibling, the same for every process."""
    return output.with_name(f".{output.name}.partial")


@contextlib.contextmanager
def new_output(output: pathlib.Path, flag: str = "--output", *, is_a_run: bool = False,
               collective: bool = True) -> Iterator[pathlib.Path]:
    """Write the new directory `output` whole or not at all: the body writes into `partial_path(output)`
    (what an earlier, interrupted attempt left there is cleared first), which process 0 renames to `output`
    once every process is done; a failure or an interrupt removes it. So an export, import or compression
    that stops halfway leaves nothing in the way of the same command run again. Checked first as
    `check_new_output` checks it. `collective=False`: only this process writes it (no barriers)."""
    output = pathlib.Path(output)
    check_new_output(output, flag, is_a_run=is_a_run)
    partial = partial_path(output)
    writer = not collective or jax.process_index() == 0
    if writer:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    if collective:
        distributed.barrier(f"new_output/{output.name}")
    try:
        yield partial
        if collective:
            distributed.barrier(f"new_output/{output.name}/done")
    except BaseException:
        if writer:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if writer:
        if output.is_dir():  # an empty directory given as the output (checked): replaced
            output.rmdir()
        os.replace(partial, output)


def set_aside(run_dir: pathlib.Path) -> pathlib.Path:
    """`run.fresh`: move an existing run directory out of the way (nothing is deleted)."""
    aside = run_dir.with_name(f"{run_dir.name}-replaced-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    run_dir.rename(aside)
    return aside


# Keys that may change between a run and its resumption; any other difference is refused.
RESUMABLE_CHANGES = (
    "run.steps", "run.log_every", "run.eval_every", "run.peak_flops", "run.output_dir", "run.name", "run.fresh",
    "run.recipe", "mesh.", "model.remat", "model.attention", "model.loss_chunk_len", "data.cache_dir", "checkpoint.",
    "optim.on_nonfinite", "optim.micro_batches", "metrics.", "profile.", "energy.", "run.compile_cache_dir", "run.xla_flags",
    "data.shards",  # the data stream's count is checked against the checkpoint's when its position is restored
    "data.tokenizer_path",  # the tokenizer itself (its sha256) is checked on resume, wherever its file now is
    "data.stages",  # a mixture's weights from a step on: a resumed run draws by its own from its first step
)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def config_differences(saved: dict, cfg: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict) -> list[str]:
    """'key: old -> new' for every difference that matters to a resumed run. A key the saved config
    lacks (it was written before the key existed, e.g. the lora section) had its value in `defaults`
    (`jaxlm.config.base_config()`)."""
    old = {**_flatten(json.loads(defaults.to_json())), **_flatten(saved)}
    new = _flatten(json.loads(cfg.to_json()))
    return [
        f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key) and not key.startswith(RESUMABLE_CHANGES)
        # model.dtype=auto resumes a run in the dtype it was trained in (jaxlm.train._compute_dtype)
        and not (key == "model.dtype" and "auto" in (old.get(key), new.get(key)))
        # a mixture's weights may change (its sources may not): they act from the resumed run's first step
        and not (key == "data.sources" and same_sources(old.get(key, ""), new.get(key, "")))
    ]


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """The records of an append-only log (metrics.jsonl). A line that is not a whole JSON object, as a
    process killed or a machine losing power mid-write leaves the last one, is dropped with a warning:
    never a traceback, and every whole record is kept."""
    return [record for _, record in _jsonl_lines(path)]


def _jsonl_lines(path: pathlib.Path) -> list[tuple[str, dict]]:
    """(line, record) for every whole record of `path` (`read_jsonl`)."""
    records, dropped = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append((line, record))
        else:
            dropped.append(number)
    if dropped:
        log.warning("%s: line(s) %s not a whole record (cut by an interrupted write?): left out", path,
                    ", ".join(map(str, dropped[:5])) + (" ..." if len(dropped) > 5 else ""))
    return records


def read_json(path: pathlib.Path) -> dict:
    """A run's JSON file (summary.json) as a dict; {} with a warning when it is not whole."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s could not be read (%s): left out", path, e)
        return {}
    return value if isinstance(value, dict) else {}


def make_run_dir(run_dir: pathlib.Path, cfg: ml_collections.ConfigDict, resume_step: int) -> None:
    """Create the run directory, or ready an existing one to continue after `resume_step`: the
    metrics of later steps (lost with the process that logged them) are dropped, so none repeat, and a
    last line cut by an interrupted write with them. config.json is replaced whole (`write_bytes_atomically`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(run_dir / "config.json", (cfg.to_json(indent=2) + "\n").encode())
    jsonl = run_dir / "metrics.jsonl"
    if jsonl.exists() and jax.process_index() == 0:
        kept = [line for line, record in _jsonl_lines(jsonl) if record["step"] <= resume_step]
        write_bytes_atomically(jsonl, "".join(line + "\n" for line in kept).encode())


class Sinks:
    """Where metrics go: metrics.jsonl and TensorBoard files in the run directory, and Weights & Biases
    when `metrics.wandb`; only process 0 writes."""

    def __init__(self, run_dir: pathlib.Path, cfg: ml_collections.ConfigDict, resume_step: int):
        self.sinks = []
        if jax.process_index() == 0:
            # Resumed: TensorBoard drops the earlier files' points from the first step trained again.
            purge = resume_step + 1 if resume_step else None
            tensorboard = metrics_lib.TensorBoardSink(run_dir / "tensorboard", purge_step=purge)
            if not resume_step:
                tensorboard.text(0, "config", "```\n" + cfg.to_json(indent=2) + "\n```")
            self.sinks = [metrics_lib.JsonlSink(run_dir / "metrics.jsonl"), tensorboard]
            m = cfg.metrics
            if m.wandb:
                self.sinks.append(metrics_lib.WandbSink(
                    run_dir, json.loads(cfg.to_json()), m.wandb_project, m.wandb_entity, run_dir.name))

    def write(self, step: int, values: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(step, values)

    def flush(self) -> None:
        """Everything written so far onto disk (before a checkpoint: the steps it covers are never lost)."""
        for sink in self.sinks:
            if hasattr(sink, "flush"):
                sink.flush()

    def histograms(self, step: int, stats: dict[str, dict[str, Any]]) -> None:
        """`param_histograms` statistics (host values) to the sinks that draw histograms."""
        for sink in self.sinks:
            if hasattr(sink, "histogram"):
                for tag, values in stats.items():
                    sink.histogram(step, f"params/{tag}", values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
