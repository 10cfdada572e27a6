"""Ablations and hyperparameter searches: `python -m jaxlm.experiment experiments/<name>.py`.

An experiment is a base recipe, named variants (config overrides) and seeds, declared in a file:

    # experiments/lr_warmup.py
    from jaxlm.experiment import Experiment, IntUniform, LogUniform, grid

    EXPERIMENT = Experiment(
        recipe="tiny",
        base={"run.steps": 150, "run.eval_every": 25},              # every run
        variants=grid({"optim.peak_lr": [1e-3, 3e-3, 1e-2], "optim.warmup_steps": [0, 50]}),
        seeds=[0, 1],                                               # run.seed: initialization
        search_space={"optim.peak_lr": LogUniform(3e-4, 3e-2), "optim.warmup_steps": IntUniform(0, 60)},
        columns=["active_params"],                                  # more per-run columns (below)
    )

Every run is one `python -m jaxlm.train` process (the CLI, unchanged) with its own run directory
`<output_dir>/<experiment>/<variant>-s<seed>`. Running the command again skips finished runs
(summary.json at the configured step count) and continues interrupted ones from their last
checkpoint, so a sweep survives being killed. At the end (and with `--collect` alone) every run's
metrics.jsonl is read into `results.csv` (one row per run: final and best train loss, validation
loss and bits per byte), `results.md` (per variant, mean ± standard deviation over seeds),
`curves.csv` (every run's loss, tokens and seconds of training per step), `loss.png` (the curves of all
variants) and `loss_vs_time.png` (the same against seconds of training: compare it only between runs
that had the machine to the same degree, e.g. `--parallel 1` on a quiet one). `columns` adds
columns to results.csv and results.md, each a key of the runs' summary.json (`params`,
`active_params`, `compile_s`, ...) or a training metric they logged (`grad_norm`, `aux/<name>`, ...),
that one as its mean over the last tenth of the logged steps (one step is noisy).

    --parallel N          N runs at once (on a machine with GPUs, each gets its share of them)
    --print_commands      one `python -m jaxlm.train ...` line per unfinished run, for a cluster;
                          then `--collect` gathers what the jobs wrote
    --search grid|random|optuna [--trials N]
                          search `search_space` instead of running `variants`: the grid of its
                          points, N random draws (fixed by `search_seed`, so a search resumes),
                          or Optuna's TPE sampler (optuna: pip install -e ".[search]")
    --early_stop          stop a run whose validation loss is worse than the median of the other
                          runs' at the same step (with optuna: its MedianPruner); always on with
                          optuna unless --no_early_stop
    --set KEY=VALUE       an extra override for every run (e.g. --set run.steps=20 for a smoke test)
    --seeds 0,1,2         other seeds than the declaration's

Searches run in `<output_dir>/<experiment>/search-<mode>/`, one seed per trial unless --seeds
says otherwise; optuna's study lives there too (optuna.journal), so it resumes.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import itertools
import json
import logging
import math
import os
import pathlib
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxlm import commands, init_from
from jaxlm import config as config_lib
from jaxlm import run_dir as run_dir_lib
from jaxlm import train as train_lib
from jaxlm.console import duration
from jaxlm.data import loader
from jaxlm.data.tokenizer import write_bytes_atomically
from jaxlm.errors import UserError, report_error, run_user_file
from jaxlm.table import Table

# Per-run columns of results.csv besides the identifiers; lower is better for all of them.
METRICS = ("final_loss", "best_loss", "final_val_loss", "best_val_loss",
           "final_val_bits_per_byte", "best_val_bits_per_byte")
# Every column of results.csv that `run_row` writes whatever the experiment asks (`Experiment.columns` adds more)
ROW_KEYS = ("run", "variant", "seed", "status", "steps", *METRICS, "best_val_step", "tokens_per_s", "train_s",
            "energy_wh", "energy_measured", "wh_per_loss_drop", "overrides")
FINAL_SHARE = 0.1  # an extra column's logged metric: its mean over this share of the last logged steps
STOPPED = "stopped.json"  # written into a run directory that early stopping ended
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+-]*$")
POLL_S = 0.5

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- search spaces


@dataclasses.dataclass(frozen=True)
class Choice:
    values: tuple

    def __init__(self, values: Iterable[Any]):
        object.__setattr__(self, "values", tuple(values))
        if not self.values:
            raise UserError("Choice() needs at least one value")

    def grid(self) -> list[Any]:
        return list(self.values)

    def sample(self, rng: np.random.Generator) -> Any:
        return self.values[int(rng.integers(len(self.values)))]


@dataclasses.dataclass(frozen=True)
class Uniform:
    low: float
    high: float
    points: int = 3  # for --search grid

    def grid(self) -> list[float]:
        return [float(v) for v in np.linspace(self.low, self.high, self.points)]

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))


@dataclasses.dataclass(frozen=True)
class LogUniform(Uniform):
    def grid(self) -> list[float]:
        return [float(f"{v:.6g}") for v in np.geomspace(self.low, self.high, self.points)]

    def sample(self, rng: np.random.Generator) -> float:
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


@dataclasses.dataclass(frozen=True)
class IntUniform:
    low: int
    high: int  # included
    points: int = 3

    def grid(self) -> list[int]:
        return sorted({int(round(v)) for v in np.linspace(self.low, self.high, self.points)})

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))


Space = Choice | Uniform | LogUniform | IntUniform


def _space(value: Any) -> Space:
    return value if isinstance(value, (Choice, Uniform, IntUniform)) else Choice(value)


def format_value(value: Any) -> str:
    """A value as a short name part: 0.001 -> 1e-03 style only where shorter, ints and strings as is."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def variant_name(overrides: dict[str, Any]) -> str:
    """`peak_lr=0.003-warmup_steps=50`: the last part of each key (the whole key where that repeats)."""
    short = [k.rsplit(".", 1)[-1] for k in overrides]
    keys = [s if short.count(s) == 1 else k for s, k in zip(short, overrides)]
    return "-".join(f"{k}={format_value(v)}" for k, v in zip(keys, overrides.values())) or "base"


def grid(axes: dict[str, Sequence[Any] | Space]) -> dict[str, dict[str, Any]]:
    """Variants for every combination: {"peak_lr=0.001-warmup_steps=0": {...}, ...}."""
    keys = list(axes)
    values = [_space(axes[k]).grid() for k in keys]
    out = {}
    for combo in itertools.product(*values):
        overrides = dict(zip(keys, combo))
        out[variant_name(overrides)] = overrides
    return out


# ----------------------------------------------------------------------------- the declaration


@dataclasses.dataclass
class Experiment:
    """A base recipe plus named variants (dotted-key overrides) and seeds; see the module docstring."""

    recipe: str  # a recipe name (configs/<name>.py) or a path
    variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=lambda: {"base": {}})
    base: dict[str, Any] = dataclasses.field(default_factory=dict)  # overrides for every run
    seeds: Sequence[int] = (0,)  # run.seed of each variant's runs (initialization; the data order is data.seed)
    metric: str = "final_val_loss"  # ranks variants in results.md; what searches minimize
    search_space: dict[str, Any] = dataclasses.field(default_factory=dict)  # key -> Space or list of values
    search_seed: int = 0  # random search draws and optuna's sampler
    # more per-run columns: summary.json keys, or logged training metrics (their mean over the last tenth)
    columns: Sequence[str] = ()
    name: str = ""  # default: the file's name
    description: str = ""  # default: the file's docstring

    def check(self) -> None:
        where = f"experiment {self.name or '?'}"
        if not self.variants:
            raise UserError(f"{where}: no variants; give at least one, e.g. variants={{'base': {{}}}}")
        for name in self.variants:
            if not NAME_RE.match(name):
                raise UserError(f"{where}: variant name {name!r}: use letters, digits and _ . = + - only")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UserError(f"{where}: seeds={list(self.seeds)}: give one or more distinct integers")
        if self.metric not in METRICS:
            raise UserError(f"{where}: metric={self.metric!r}: use one of {', '.join(METRICS)}")
        if isinstance(self.columns, str):
            raise UserError(f"{where}: columns={self.columns!r}: give a list of keys, e.g. columns=[{self.columns!r}]")
        for key in self.columns:
            if not isinstance(key, str) or not key or key in ROW_KEYS or list(self.columns).count(key) > 1:
                raise UserError(f"{where}: columns: {key!r}: give distinct summary.json keys or logged metric names "
                                f"that are not already columns ({', '.join(ROW_KEYS)})")


def load_experiment(path: str | os.PathLike) -> Experiment:
    """The `EXPERIMENT` of a Python file; its name defaults to the file's, its description to the docstring."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"no experiment file {str(path)!r}; give a .py file that defines EXPERIMENT = Experiment(...)")
    module = run_user_file(path, f"jaxlm_experiment_{path.stem}")
    exp = getattr(module, "EXPERIMENT", None)
    if not isinstance(exp, Experiment):
        raise UserError(f"{path} defines no EXPERIMENT = jaxlm.experiment.Experiment(...)")
    exp = dataclasses.replace(exp, name=exp.name or path.stem,
                              description=exp.description or (module.__doc__ or "").strip())
    exp.check()
    return exp


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Run:
    """One training run of a sweep: a variant with a seed, as `python -m jaxlm.train` flags."""

    name: str  # <variant>-s<seed>, the run directory's name
    variant: str
    seed: int
    overrides: dict[str, Any]  # the variant's own (the base is common to all)
    flags: list[str]  # --config=... --config.k=v ...
    run_dir: pathlib.Path
    steps: int  # run.steps of the resolved config

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", "jaxlm.train", *self.flags]


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def make_runs(exp: Experiment, variants: dict[str, dict[str, Any]], seeds: Sequence[int], root: pathlib.Path,
              extra: Sequence[tuple[str, Any]] = ()) -> list[Run]:
    """Every variant x seed as a Run, its config resolved and validated (a bad key fails here, in one line)."""
    runs = []
    for variant, overrides in variants.items():
        for seed in seeds:
            name = f"{variant}-s{seed}"
            pairs = [*exp.base.items(), *extra, *overrides.items(),
                     ("run.output_dir", str(root)), ("run.name", name), ("run.seed", seed)]
            flags = [f"--config={exp.recipe}"] + [f"--config.{k}={_flag_value(v)}" for k, v in pairs]
            try:
                cfg = init_from.config_from_cli(flags)
                config_lib.validate(cfg)
            except UserError as e:
                raise UserError(f"experiment {exp.name}, variant {variant}: {e}") from None
            runs.append(Run(name=name, variant=variant, seed=int(seed), overrides=dict(overrides), flags=flags,
                            run_dir=root / name, steps=cfg.run.steps))
    return runs


def run_status(run: Run) -> str:
    """done (summary.json at run.steps), stopped (early stopping), partial (started) or pending."""
    if (run.run_dir / STOPPED).is_file():
        return "stopped"
    summary = run.run_dir / "summary.json"
    if summary.is_file() and run_dir_lib.read_json(summary).get("steps", 0) >= run.steps:  # ({} when not whole)
        return "done"
    if (run.run_dir / "metrics.jsonl").is_file() or (run.run_dir / "checkpoints").is_dir():
        return "partial"
    return "pending"


# ----------------------------------------------------------------------------- executing


class MetricsTail:
    """New evaluation records of a run's metrics.jsonl while it is being written."""

    def __init__(self, path: pathlib.Path):
        self.path, self.offset, self.last_step = path, 0, 0

    def new_evals(self) -> list[tuple[int, float]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # rewritten by a resume
            self.offset = 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        out = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line) if line.strip() else {}
            except ValueError:  # not a whole record (read from mid-line after a resume rewrote the file)
                continue
            if isinstance(record, dict) and "val_loss" in record and record.get("step", 0) > self.last_step:
                self.last_step = record["step"]
                out.append((record["step"], record["val_loss"]))
        return out


Stopper = Callable[[Run, int, float], bool]  # (run, step, val_loss) -> stop it now?


def gpu_groups(parallel: int) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each of `parallel` slots when this machine has at least that many
    GPUs (each run gets its own share), else None (every run sees every device)."""
    if parallel <= 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
    else:
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        ids = [str(i) for i, line in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]
    if len(ids) < parallel:
        return None
    per = len(ids) // parallel
    return [",".join(ids[i * per:(i + 1) * per]) for i in range(parallel)]


@dataclasses.dataclass
class _Job:
    run: Run
    proc: subprocess.Popen
    log: Any
    slot: int
    started: float
    tail: MetricsTail
    stop: dict | None = None


def execute(runs: Iterable[Run], *, parallel: int = 1, stopper: Stopper | None = None,
            on_finish: Callable[[Run, str], None] | None = None, echo: Callable[[str], None] = print,
            total: int | None = None) -> dict[str, str]:
    """Train each run in its own `python -m jaxlm.train` process, `parallel` at a time (0: one after
    the other in this process, without early stopping). `runs` is read lazily, when a slot frees
    (a search asks for its next trial then). Returns run name -> done | stopped | failed (...).
    Output goes to `<sweep>/logs/<run>.log`."""
    if parallel == 0:
        return _execute_in_process(runs, on_finish, echo, total)
    groups = gpu_groups(parallel)
    prepared: set[tuple[str, ...]] = set()
    pending: Iterator[Run] = iter(runs)
    jobs: list[_Job] = []
    outcomes: dict[str, str] = {}
    exhausted, count = False, 0
    try:
        while jobs or not exhausted:
            while not exhausted and len(jobs) < parallel:
                run = next(pending, None)
                if run is None:
                    exhausted = True
                    break
                count += 1
                if parallel > 1:  # runs side by side would each prepare the same data cache at once
                    prepare_data([run], echo, prepared)
                resuming = run_status(run) == "partial"
                slot = min(set(range(parallel)) - {j.slot for j in jobs})
                jobs.append(_start(run, slot, groups))
                of = f"/{total}" if total else ""
                echo(f"jaxlm.experiment: [{count}{of}] {run.name}: started" + (" (resuming)" if resuming else "")
                     + f"; log {_log_path(run)}")
            time.sleep(POLL_S)
            for job in list(jobs):
                if stopper is not None and job.stop is None:
                    for step, val_loss in job.tail.new_evals():
                        if stopper(job.run, step, val_loss):
                            job.stop = {"step": step, "val_loss": val_loss, "reason": "early stopping"}
                            job.proc.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint and exits
                            break
                code = job.proc.poll()
                if code is None:
                    continue
                jobs.remove(job)
                job.log.close()
                outcome = _finish(job, code)
                outcomes[job.run.name] = outcome
                echo(f"jaxlm.experiment: {job.run.name}: {outcome} after {duration(time.time() - job.started)}"
                     + _result_text(job.run))
                if on_finish:
                    on_finish(job.run, outcome)
    except BaseException:
        for job in jobs:  # Ctrl-C or an error here: stop the children; they save and can be resumed
            job.proc.send_signal(signal.SIGTERM)
        for job in jobs:
            try:
                job.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                job.proc.kill()
        raise
    return outcomes


def prepare_data(runs: Sequence[Run], echo: Callable[[str], None] = print, seen: set | None = None) -> None:
    """Train the tokenizer and tokenize the corpus of each distinct data config (not in `seen`)
    once, before runs start side by side (each would otherwise prepare the same cache at the same
    time). In a CPU-only child process, so this process never claims an accelerator."""
    seen = set() if seen is None else seen
    for run in runs:
        data_flags = [f for f in run.flags if f.startswith(("--config=", "--config.data.", "--config.model.vocab_size"))]
        if tuple(data_flags) in seen:
            continue
        seen.add(tuple(data_flags))
        echo(f"jaxlm.experiment: preparing the data of {run.name} (once, cached in data.cache_dir)")
        code = "import sys; from jaxlm.experiment import _prepare_one; _prepare_one(sys.argv[1:])"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        result = subprocess.run([sys.executable, "-c", code, *run.flags], env=env, capture_output=True, text=True)
        if result.returncode:
            lines = (result.stderr or result.stdout).strip().splitlines()
            raise UserError(f"preparing the data of {run.name} failed: {lines[-1] if lines else result.returncode}")


def _prepare_one(flags: Sequence[str]) -> None:
    data = loader.DataConfig.from_config(init_from.config_from_cli(flags).data)
    if data.tokenize_on_the_fly:
        if not data.tokenizer_path:
            loader.load_tokenizer(data, loader.inputs_key(data))
    else:
        loader.prepared_dir(data)


def _log_path(run: Run) -> pathlib.Path:
    return run.run_dir.parent / "logs" / f"{run.name}.log"


def _start(run: Run, slot: int, groups: list[str] | None) -> _Job:
    log_path = _log_path(run)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "a", encoding="utf-8")
    log.write(f"\n# {datetime.datetime.now():%Y-%m-%d %H:%M:%S} {shlex.join(run.command())}\n")
    log.flush()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if groups:
        env["CUDA_VISIBLE_DEVICES"] = groups[slot]
    proc = subprocess.Popen(run.command(sys.executable), stdout=log, stderr=subprocess.STDOUT, env=env)
    return _Job(run=run, proc=proc, log=log, slot=slot, started=time.time(), tail=MetricsTail(run.run_dir / "metrics.jsonl"))


def _finish(job: _Job, code: int) -> str:
    if job.stop is not None and code in (0, 75):
        if code == 75:  # stopped before its last step: remember why, so a resume skips it
            write_bytes_atomically(job.run.run_dir / STOPPED, (json.dumps(job.stop) + "\n").encode())
            return f"stopped at step {job.stop['step']} (val_loss {job.stop['val_loss']:.4f})"
    if code == 0:
        return "done"
    return f"failed (exit {code}; see {_log_path(job.run)}: {_last_line(_log_path(job.run))})"


def _last_line(path: pathlib.Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _result_text(run: Run) -> str:
    row = run_row(run)
    value = row.get("final_val_loss") if row.get("final_val_loss") is not None else row.get("final_loss")
    key = "val_loss" if row.get("final_val_loss") is not None else "loss"
    return "" if value is None else f", {key} {value:.4f}"


def _execute_in_process(runs, on_finish, echo, total) -> dict[str, str]:
    outcomes = {}
    for count, run in enumerate(runs, 1):
        of = f"/{total}" if total else ""
        echo(f"jaxlm.experiment: [{count}{of}] {run.name}: started in this process")
        started = time.time()
        cfg = init_from.config_from_cli(run.flags)
        train_lib.enable_compilation_cache(cfg.run.compile_cache_dir)
        try:
            train_lib.run(cfg)
            outcome = "done"
        except (UserError, train_lib.NonFiniteError) as e:
            outcome = f"failed ({e})"
        outcomes[run.name] = outcome
        echo(f"jaxlm.experiment: {run.name}: {outcome} after {duration(time.time() - started)}" + _result_text(run))
        if on_finish:
            on_finish(run, outcome)
    return outcomes


# ----------------------------------------------------------------------------- early stopping


class MedianStopper:
    """Stop a run at an evaluation whose val_loss is worse than the median of the other runs'
    val_loss at the same step, once at least `min_runs` others have reached it."""

    def __init__(self, runs: Sequence[Run], min_runs: int = 2):
        self.runs, self.min_runs = list(runs), min_runs

    def __call__(self, run: Run, step: int, val_loss: float) -> bool:
        others = []
        for other in self.runs:
            if other.name != run.name:
                others += [r["val_loss"] for r in read_metrics(other.run_dir)[1] if r["step"] == step]
        return len(others) >= self.min_runs and val_loss > statistics.median(others)


# ----------------------------------------------------------------------------- collecting


def read_metrics(run_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a run's metrics.jsonl; empty when absent."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return [], []
    records = run_dir_lib.read_jsonl(path)  # a line cut by an interrupted write: left out, with a warning
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def run_row(run: Run, columns: Sequence[str] = ()) -> dict[str, Any]:
    """A run's final and best metrics, read from its own files (metrics.jsonl, summary.json), and the
    `columns` asked for (`column_value`)."""
    train, evals = read_metrics(run.run_dir)
    row: dict[str, Any] = {"run": run.name, "variant": run.variant, "seed": run.seed, "status": run_status(run),
                           "steps": train[-1]["step"] if train else 0}
    for key, records in (("loss", train), ("val_loss", evals), ("val_bits_per_byte", evals)):
        values = [r[key] for r in records if key in r]
        row[f"final_{key}"] = values[-1] if values else None
        row[f"best_{key}"] = min(values) if values else None
    row["best_val_step"] = min(evals, key=lambda r: r["val_loss"])["step"] if evals else None
    summary_path = run.run_dir / "summary.json"
    summary = run_dir_lib.read_json(summary_path) if summary_path.is_file() else {}
    row["tokens_per_s"], row["train_s"] = summary.get("tokens_per_s"), summary.get("train_s")
    # energy (jaxlm.energy), and per unit of loss it bought: from the first logged step's loss to the final
    # validation loss (the training loss where nothing was evaluated); estimates have energy_measured = 0
    row["energy_wh"] = summary["energy_j"] / 3600 if "energy_j" in summary else None
    row["energy_measured"] = summary.get("energy_measured")
    last = row["final_val_loss"] if row["final_val_loss"] is not None else row["final_loss"]
    drop = train[0]["loss"] - last if train and last is not None else None
    row["wh_per_loss_drop"] = row["energy_wh"] / drop if row["energy_wh"] is not None and drop and drop > 0 else None
    row["overrides"] = json.dumps(run.overrides, sort_keys=True)
    for key in columns:
        row[key] = column_value(key, summary, train)
    return row


def column_value(key: str, summary: dict[str, Any], train: Sequence[dict[str, Any]]) -> Any:
    """An extra column's value for a run: its summary.json's `key` where it has one (a run that has
    not finished has none), else the mean of the training metric `key` over the last tenth
    (`FINAL_SHARE`) of the steps that logged it, at least the last one; None where neither is."""
    if key in summary:
        return summary[key]
    values = [r[key] for r in train if isinstance(r.get(key), (int, float))]
    if not values:
        return None
    return statistics.fmean(values[-max(1, int(len(values) * FINAL_SHARE)):])


CURVE_X = {"step": "step", "tokens_seen": "tokens", "wall_s": "seconds of training (wall clock)"}  # x -> axis label


def curve_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Every logged step of every run: run, variant, seed, step, loss and (where evaluated) val_loss, and
    the tokens trained on and the seconds of training to that step (`tokens_seen`, `wall_s`: the training
    loop's own clock, compilation included, evaluations not) where the step's training record has them."""
    out = []
    for run in runs:
        train, evals = read_metrics(run.run_dir)
        val = {r["step"]: r["val_loss"] for r in evals}
        steps = sorted({r["step"] for r in train} | set(val))
        by_step = {r["step"]: r for r in train}
        out += [{"run": run.name, "variant": run.variant, "seed": run.seed, "step": s,
                 "loss": by_step.get(s, {}).get("loss"), "val_loss": val.get(s),
                 "tokens_seen": by_step.get(s, {}).get("tokens_seen"), "wall_s": by_step.get(s, {}).get("wall_s")}
                for s in steps]
    return out


@dataclasses.dataclass
class VariantSummary:
    variant: str
    overrides: str
    runs: int  # finished runs that the statistics cover
    stats: dict[str, tuple[float | None, float | None]]  # metric -> (mean, sample std over seeds; None for one)
    integral: set[str] = dataclasses.field(default_factory=set)  # the extra columns whose values are all integers


def summarize(rows: Sequence[dict[str, Any]], metric: str, columns: Sequence[str] = ()) -> list[VariantSummary]:
    """Per variant (finished runs only): mean and standard deviation of each metric and extra column
    over seeds, best `metric` first."""
    order = list(dict.fromkeys(r["variant"] for r in rows))
    out = []
    for variant in order:
        done = [r for r in rows if r["variant"] == variant and r["status"] == "done"]
        stats, integral = {}, set()
        for key in (*METRICS, "tokens_per_s", "energy_wh", "wh_per_loss_drop", *columns):
            values = [r[key] for r in done if isinstance(r.get(key), (int, float))]
            stats[key] = (statistics.fmean(values) if values else None,
                          statistics.stdev(values) if len(values) > 1 else None)
            if key in columns and values and all(isinstance(v, int) for v in values):
                integral.add(key)
        overrides = next(r["overrides"] for r in rows if r["variant"] == variant)
        out.append(VariantSummary(variant=variant, overrides=overrides, runs=len(done), stats=stats, integral=integral))
    return sorted(out, key=lambda v: (v.stats[metric][0] is None, v.stats[metric][0] or 0.0))


def mean_std(stat: tuple[float | None, float | None], digits: int = 4) -> str:
    mean, std = stat
    if mean is None:
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def _column_text(stat: tuple[float | None, float | None], integral: bool) -> str:
    """An extra column's cell: integers (parameter counts) with thousands separators, the spread where there
    is one; other values as `mean_std`."""
    mean, std = stat
    if mean is None or not integral:
        return mean_std(stat)
    return f"{mean:,.0f}" + (f" ± {std:,.0f}" if std else "")


COLUMNS = (("final_val_loss", "final val loss"), ("best_val_loss", "best val loss"),
           ("final_loss", "final train loss"), ("final_val_bits_per_byte", "val bits/byte"))


def _overrides_text(overrides: str) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in json.loads(overrides).items()) or "(base)"


def variant_table(rows: Sequence[dict[str, Any]], metric: str = "final_val_loss", columns: Sequence[str] = ()):
    """The per-variant table (mean ± std over seeds) as a `Table` (Markdown in a notebook); the extra
    `columns` last, headed by their keys."""
    summaries = summarize(rows, metric, columns)
    table_rows = []
    for i, v in enumerate(summaries):
        name = f"**{v.variant}**" if i == 0 and v.stats[metric][0] is not None else v.variant
        rate = v.stats["tokens_per_s"][0]
        wh, per_drop = v.stats["energy_wh"][0], v.stats["wh_per_loss_drop"][0]
        metered = [r for r in rows if r["variant"] == v.variant and r.get("energy_wh") is not None]
        est = "" if all(r.get("energy_measured") for r in metered) else " (est.)"
        table_rows.append([name, _overrides_text(v.overrides), v.runs, *(mean_std(v.stats[k]) for k, _ in COLUMNS),
                           "–" if rate is None else f"{rate:,.0f}", "–" if wh is None else f"{wh:.3g}{est}",
                           "–" if per_drop is None else f"{per_drop:.3g}{est}",
                           *(_column_text(v.stats[k], k in v.integral) for k in columns)])
    return Table(["variant", "overrides", "runs", *(label for _, label in COLUMNS), "tokens/s", "energy (Wh)",
                  "Wh per nat of loss", *columns], table_rows)


def docstring_markdown(doc: str) -> str:
    """A docstring as Markdown: its indented command blocks dropped, prose paragraphs joined onto one line,
    and tables and lists (paragraphs whose lines start with `|`, `-`, `*` or `1.`) kept line by line so they
    still render as tables and lists."""
    paragraphs = []
    for paragraph in doc.split("\n\n"):
        if not paragraph.strip() or paragraph.startswith("    "):
            continue
        lines = paragraph.strip("\n").splitlines()
        structured = any(re.match(r"\s*(\||[-*] |\d+\. )", line) for line in lines)
        paragraphs.append("\n".join(lines) if structured else " ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def markdown_report(title: str, description: str, rows: Sequence[dict[str, Any]], metric: str,
                    setup: str = "", columns: Sequence[str] = ()) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "stopped", "partial", "pending")}
    status = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    label = dict(COLUMNS).get(metric, metric)
    lines = [f"# {title}", ""]
    if description:
        lines += [description, ""]
    if setup:
        lines += [setup, ""]
    extra = (f" The last columns ({', '.join(columns)}): each run's summary.json value, or a logged training metric's "
             f"mean over the last {FINAL_SHARE:.0%} of the steps." if columns else "")
    lines += [f"Runs: {status}. Per variant: mean ± standard deviation over seeds (finished runs); lower is "
              f"better; sorted by {label}, the best in bold. Per run: results.csv; curves: loss.png.{extra}", "",
              variant_table(rows, metric, columns).to_markdown()]
    stopped = [r for r in rows if r["status"] == "stopped"]
    if stopped:
        lines += ["", "Stopped early: " + ", ".join(
            f"{r['run']} at step {r['steps']}"
            + ("" if r["final_val_loss"] is None else f" (val loss {r['final_val_loss']:.4f})") for r in stopped)]
    lines += ["", f"Collected {datetime.date.today().isoformat()} by `python -m jaxlm.experiment`."]
    return "\n".join(lines) + "\n"


def write_csv(path: pathlib.Path, rows: Sequence[dict[str, Any]]) -> None:
    """`rows` as CSV, replacing `path` whole (`write_bytes_atomically`)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    write_bytes_atomically(path, text.getvalue().encode("utf-8"))


def read_csv(path: str | os.PathLike) -> list[dict[str, Any]]:
    """results.csv or curves.csv back as dicts, numbers as numbers and empty cells as None. A last row
    cut short (the file does not end its line, as `write_csv` always does) is left out with a warning:
    its last cell may be a number cut to fewer digits."""

    def parse(text: str) -> Any:
        if text == "":
            return None
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    text = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    whole = [r for r in rows if None not in r and None not in r.values()]  # (a row with cells missing or extra)
    if rows and not text.endswith("\n") and whole and whole[-1] is rows[-1]:
        whole.pop()
    if len(whole) < len(rows):
        log.warning("%s: %d row(s) not whole (cut by an interrupted write?): left out; python -m jaxlm.experiment "
                    "<file> --collect writes it again", path, len(rows) - len(whole))
    return [{k: (v if k in ("run", "variant", "status", "overrides") else parse(v)) for k, v in r.items()}
            for r in whole]


def mean_curves(
    curves: Sequence[dict[str, Any]], key: str, x: str = "step"
) -> dict[str, tuple[list[float], list[float], list[float], list[float]]]:
    """variant -> (x, mean, min, max) of `key` over the variant's runs that logged each step; x is the step,
    or the mean over those runs of `x` (`tokens_seen`, `wall_s`) at that step."""
    by_variant: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in curves:
        if r[key] is not None and r.get(x) is not None:
            by_variant.setdefault(r["variant"], {}).setdefault(r["step"], []).append((r[x], r[key]))
    out = {}
    for variant, points in by_variant.items():
        steps = sorted(points)
        values = [[v for _, v in points[s]] for s in steps]
        out[variant] = ([statistics.fmean(a for a, _ in points[s]) for s in steps], [statistics.fmean(v) for v in values],
                        [min(v) for v in values], [max(v) for v in values])
    return out


def _ema(values: Sequence[float], weight: float) -> list[float]:
    out, last = [], None
    for v in values:
        last = v if last is None else weight * last + (1 - weight) * v
        out.append(last)
    return out


def plot_curves(curves: Sequence[dict[str, Any]], path: str | os.PathLike | None = None, title: str = "",
                order: Sequence[str] | None = None, x: str = "step"):
    """Training loss (left: the mean over seeds, faint, and its moving average) and validation loss
    (right: the mean over seeds, with the seeds' range shaded) of every variant against `x`: the step,
    the tokens trained on (`tokens_seen`) or the seconds of training (`wall_s`, the mean over seeds);
    saved to `path` when given. Returns the matplotlib Figure (shown inline in a notebook)."""
    if x not in CURVE_X:
        raise UserError(f"plot x={x!r}: use one of {', '.join(CURVE_X)}")
    try:
        from matplotlib.figure import Figure  # local import: optional dependency (pip install jaxlm[notebooks])
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install matplotlib") from None
    train, val = mean_curves(curves, "loss", x), mean_curves(curves, "val_loss", x)
    variants = [v for v in (order or []) if v in train or v in val]
    variants += [v for v in dict.fromkeys(r["variant"] for r in curves) if v not in variants]
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    colors = [f"C{i % 10}" for i in range(len(variants))]
    styles = [("-", "--", ":", "-.")[i // 10 % 4] for i in range(len(variants))]  # past 10 variants, colours repeat
    tops, lows = [], []
    for variant, color, style in zip(variants, colors, styles):
        if variant in train:
            steps, mean, _, _ = train[variant]
            left.plot(steps, mean, color=color, alpha=0.25, linewidth=0.8, gid=f"train:{variant}")
            left.plot(steps, _ema(mean, 0.9), color=color, linestyle=style, linewidth=1.6, label=variant,
                      gid=f"train_ema:{variant}")
            tops.append(_ema(mean, 0.9)[len(mean) // 10])
            lows.append(min(mean))
        if variant in val:
            steps, mean, low, high = val[variant]
            right.plot(steps, mean, color=color, linestyle=style, marker="o", markersize=3, linewidth=1.6, label=variant,
                       gid=f"val:{variant}")
            if any(h > lo for h, lo in zip(high, low)):
                right.fill_between(steps, low, high, color=color, alpha=0.15)
    left.set(xlabel=CURVE_X[x], ylabel="training loss (nats/token)",
             title="training loss (mean over seeds; bold: moving average)")
    if tops and max(tops) > min(lows):  # the first tenth of training (ln(vocab) and falling) is off the top
        left.set_ylim(min(lows) - 0.05 * (max(tops) - min(lows)), max(tops))
    right.set(xlabel=CURVE_X[x], ylabel="validation loss (nats/token)",
              title="validation loss (mean over seeds; shaded: their range)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


@dataclasses.dataclass
class Results:
    rows: list[dict[str, Any]]  # one per run (results.csv)
    curves: list[dict[str, Any]]  # one per run and step (curves.csv)
    metric: str
    directory: pathlib.Path | None = None
    columns: Sequence[str] = ()  # the experiment's extra columns (`Experiment.columns`)

    def table(self):
        return variant_table(self.rows, self.metric, self.columns)

    def plot(self, path=None, title: str = "", x: str = "step"):
        return plot_curves(self.curves, path, title, order=list(dict.fromkeys(r["variant"] for r in self.rows)), x=x)


def collect(runs: Sequence[Run], metric: str, columns: Sequence[str] = ()) -> Results:
    return Results(rows=[run_row(r, columns) for r in runs], curves=curve_rows(runs), metric=metric,
                   columns=tuple(columns))


def write_results(results: Results, directory: pathlib.Path, title: str, description: str = "",
                  setup: str = "", echo: Callable[[str], None] = print) -> list[pathlib.Path]:
    """results.csv, curves.csv, results.md, loss.png and loss_vs_time.png (the same against seconds of
    training; both when matplotlib is installed) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(directory / "results.csv", results.rows)
    write_csv(directory / "curves.csv", results.curves)
    write_bytes_atomically(directory / "results.md",
                           markdown_report(title, description, results.rows, results.metric, setup,
                                           results.columns).encode("utf-8"))
    written = [directory / n for n in ("results.md", "results.csv", "curves.csv")]
    timed = any(c.get("wall_s") is not None for c in results.curves)
    for name, x in (("loss.png", "step"), *((("loss_vs_time.png", "wall_s"),) if timed else ())):
        try:
            results.plot(directory / name, title, x=x)
            written.append(directory / name)
        except UserError as e:
            echo(f"jaxlm.experiment: {name} not drawn: {e}")
            break
    results.directory = directory
    return written


def load_results(directory: str | os.PathLike, metric: str | None = None) -> Results:
    """The results a sweep wrote (results.csv, curves.csv), e.g. committed ones, for a notebook."""
    directory = pathlib.Path(directory)
    for name in ("results.csv", "curves.csv"):
        if not (directory / name).is_file():
            raise UserError(f"{directory} has no {name}; run python -m jaxlm.experiment <file> [--collect] first")
    rows = read_csv(directory / "results.csv")
    if metric is None:
        metric = "final_val_loss" if any(r["final_val_loss"] is not None for r in rows) else "final_loss"
    columns = tuple(k for k in (rows[0] if rows else {}) if k not in ROW_KEYS)  # the experiment's extra ones
    return Results(rows=rows, curves=read_csv(directory / "curves.csv"), metric=metric, directory=directory,
                   columns=columns)


# ----------------------------------------------------------------------------- searches


def search_variants(exp: Experiment, mode: str, trials: int | None) -> dict[str, dict[str, Any]]:
    """grid: every combination of the space's points; random: `trials` draws, trial i always the same."""
    if not exp.search_space:
        raise UserError(f"experiment {exp.name} has no search_space; declare one to use --search")
    if mode == "grid":
        return grid(exp.search_space)
    if trials is None or trials < 1:
        raise UserError("--search random needs --trials N (N >= 1)")
    out = {}
    for i in range(trials):
        rng = np.random.default_rng([exp.search_seed, i])
        out[f"trial-{i:03d}"] = {k: _space(s).sample(rng) for k, s in exp.search_space.items()}
    return out


def _optuna_runs(exp: Experiment, root: pathlib.Path, seeds, extra, trials: int, prune: bool, echo):
    """(lazy runs, stopper, on_finish, already finished) for an Optuna study stored in root/optuna.journal."""
    try:
        import optuna  # local import: optional dependency (pip install jaxlm[search])
    except ImportError:
        raise UserError("--search optuna needs optuna: pip install optuna (or use --search random)") from None
    from optuna.trial import TrialState  # local import: optional dependency, as above

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root.mkdir(parents=True, exist_ok=True)
    try:
        backend = optuna.storages.journal.JournalFileBackend(str(root / "optuna.journal"))
    except AttributeError:  # optuna < 4
        backend = optuna.storages.JournalFileStorage(str(root / "optuna.journal"))
    study = optuna.create_study(
        study_name=exp.name, storage=optuna.storages.JournalStorage(backend), load_if_exists=True,
        direction="minimize", sampler=optuna.samplers.TPESampler(seed=exp.search_seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2) if prune else optuna.pruners.NopPruner(),
    )
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # left by a killed sweep
        study.tell(t.number, state=TrialState.FAIL)
        # resumed from its checkpoint
        study.enqueue_trial(t.params, user_attrs={"run_name": t.user_attrs.get("run_name")})
    finished = [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    live: dict[str, Any] = {}

    def suggest(trial, key, space):
        space = _space(space)
        if isinstance(space, Choice):
            return trial.suggest_categorical(key, list(space.values))
        if isinstance(space, IntUniform):
            return trial.suggest_int(key, space.low, space.high)
        return trial.suggest_float(key, space.low, space.high, log=isinstance(space, LogUniform))

    def runs() -> Iterator[Run]:
        for _ in range(trials - len(finished)):
            trial = study.ask()
            overrides = {k: suggest(trial, k, s) for k, s in exp.search_space.items()}
            name = trial.user_attrs.get("run_name") or f"trial-{trial.number:03d}"
            trial.set_user_attr("run_name", name)
            run = make_runs(exp, {name: overrides}, seeds[:1], root, extra)[0]
            _record(root, [run])
            live[run.name] = trial
            yield run

    def stopper(run: Run, step: int, val_loss: float) -> bool:
        trial = live[run.name]
        trial.report(val_loss, step)
        return trial.should_prune()

    def on_finish(run: Run, outcome: str) -> None:
        trial = live.pop(run.name)
        value = run_row(run).get(exp.metric)
        if outcome.startswith("stopped"):
            study.tell(trial, state=TrialState.PRUNED)
        elif outcome == "done" and value is not None and math.isfinite(value):
            study.tell(trial, value)
        else:
            study.tell(trial, state=TrialState.FAIL)

    return runs(), stopper, on_finish, len(finished), study


def _record(root: pathlib.Path, runs: Sequence[Run], *, rebuilt: bool = False) -> None:
    """Add runs to <sweep>/experiment.json, the list `--collect` reads for optuna searches; replaced whole
    (`write_bytes_atomically`). `rebuilt`: `runs` are all the sweep's (its variants), so a file that is
    not whole is written again from them, with a warning, rather than refused."""
    path = root / "experiment.json"
    known = _read_recorded(path, rebuilt=rebuilt)
    for run in runs:
        known[run.name] = {"variant": run.variant, "seed": run.seed, "overrides": run.overrides, "flags": run.flags}
    write_bytes_atomically(path, (json.dumps({"runs": known}, indent=1) + "\n").encode())


def _read_recorded(path: pathlib.Path, *, rebuilt: bool = False) -> dict[str, dict[str, Any]]:
    """experiment.json's runs ({} when absent). One that is not whole (cut by a killed process or a lost disk)
    is refused in one line, or with `rebuilt` (`_record`) left out with a warning."""
    if not path.is_file():
        return {}
    try:
        runs = json.loads(path.read_text())["runs"]
        if not isinstance(runs, dict) or not all(isinstance(r, dict) and "flags" in r for r in runs.values()):
            raise ValueError("not a list of runs")
    except (ValueError, KeyError, TypeError) as e:
        if rebuilt:
            log.warning("%s is not whole (%s): written again from the experiment's variants", path, e)
            return {}
        raise UserError(f"{path} is not whole ({type(e).__name__}: cut by an interrupted write?); restore it from a "
                        f"copy, or delete it: the search then lists only the trials it runs from now on") from None
    return runs


def _recorded_runs(root: pathlib.Path) -> list[Run]:
    out = []
    for name, r in _read_recorded(root / "experiment.json").items():
        cfg = init_from.config_from_cli(r["flags"])
        out.append(Run(name=name, variant=r["variant"], seed=r["seed"], overrides=r["overrides"], flags=r["flags"],
                       run_dir=root / name, steps=cfg.run.steps))
    return out


# ----------------------------------------------------------------------------- the command


def sweep(exp: Experiment, *, output_dir: str | os.PathLike = "runs", search: str | None = None,
          trials: int | None = None, seeds: Sequence[int] | None = None, overrides: Sequence[tuple[str, Any]] = (),
          parallel: int = 1, early_stop: bool | None = None, only: Sequence[str] | None = None,
          collect_only: bool = False, print_commands: bool = False, results_dir: str | os.PathLike | None = None,
          echo: Callable[[str], None] = print) -> Results | list[Run]:
    """Run (or resume) an experiment's variants or a search and write its results; see the module
    docstring. Returns the Results (or, with `print_commands`, the runs still to do)."""
    root = pathlib.Path(output_dir) / exp.name
    outcomes: dict[str, str] = {}
    if search:
        if search not in ("grid", "random", "optuna"):
            raise UserError(f"--search={search}: use grid, random or optuna")
        root = root / f"search-{search}"
    seeds = list(seeds) if seeds else (list(exp.seeds[:1]) if search else list(exp.seeds))
    extra = list(overrides)
    title = exp.name + (f" ({search} search)" if search else "")
    setup = (f"Recipe `{exp.recipe}` with " + (", ".join(f"`{k}={_flag_value(v)}`" for k, v in [*exp.base.items(), *extra])
                                               or "no overrides") + f"; seeds {', '.join(map(str, seeds))}.")
    description = docstring_markdown(exp.description)

    if search == "optuna":
        if print_commands:
            raise UserError("--print_commands cannot list an optuna search (each trial depends on the last); "
                            "use --search random or grid")
        if not collect_only:
            if trials is None or trials < 1:
                raise UserError("--search optuna needs --trials N (N >= 1)")
            lazy, stopper, on_finish, done, study = _optuna_runs(
                exp, root, seeds, extra, trials, early_stop is not False, echo)
            echo(f"jaxlm.experiment: {title}: {done} of {trials} trials finished; running the rest, {parallel} at a time")
            outcomes = execute(lazy, parallel=max(parallel, 1), stopper=stopper, on_finish=on_finish, echo=echo,
                               total=trials - done)
            best = study.best_trial if any(t.value is not None for t in study.get_trials(deepcopy=False)) else None
            if best is not None:
                echo(f"jaxlm.experiment: best trial {best.user_attrs.get('run_name')}: {exp.metric} {best.value:.4f} "
                     f"with {json.dumps(best.params)}")
        runs = _recorded_runs(root)
    else:
        variants = search_variants(exp, search, trials) if search else dict(exp.variants)
        if only:
            unknown = sorted(set(only) - set(variants))
            if unknown:
                raise UserError(f"--only: no variant {unknown[0]!r}; variants: {', '.join(variants)}")
            variants = {k: v for k, v in variants.items() if k in only}
        runs = make_runs(exp, variants, seeds, root, extra)
        _record(root, runs, rebuilt=True)
        todo = [r for r in runs if run_status(r) not in ("done", "stopped")]
        if print_commands:
            for run in todo:
                print(shlex.join(run.command()))
            echo(f"jaxlm.experiment: {len(todo)} of {len(runs)} runs to do; once they are finished: "
                 f"python -m jaxlm.experiment <file> --collect" + (f" --search {search}" if search else ""))
            return todo
        if not collect_only:
            echo(f"jaxlm.experiment: {title}: {len(runs)} runs ({len(variants)} variants x {len(seeds)} seeds), "
                 f"{len(runs) - len(todo)} finished, {len(todo)} to run"
                 + (f", {parallel} at a time" if parallel > 1 else ""))
            if early_stop and parallel == 0:
                raise UserError("--early_stop needs runs in their own processes (--parallel 1 or more)")
            stopper = MedianStopper(runs) if early_stop else None
            outcomes = execute(todo, parallel=parallel, stopper=stopper, echo=echo, total=len(todo))
    results = collect(runs, exp.metric, exp.columns)
    directory = pathlib.Path(results_dir) if results_dir else root
    written = write_results(results, directory, title, description, setup, echo)
    echo(str(results.table()))
    echo(f"jaxlm.experiment: results in {', '.join(str(p) for p in written)}")
    _report_failures(outcomes)
    return results


class SweepFailed(Exception):
    pass


def _report_failures(outcomes: dict[str, str]) -> None:
    failed = {k: v for k, v in outcomes.items() if v.startswith("failed")}
    if failed:
        raise SweepFailed(f"{len(failed)} run(s) failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


make_parser = commands.experiment_parser  # the command line, declared in jaxlm.commands (light to import)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except UserError as e:  # one line, exit 2, like the other jaxlm commands
        return report_error(e)
    # SIGTERM (a cluster ending this job) stops the runs it started too: they save and can be resumed.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        exp = load_experiment(args.experiment)
        sweep(exp, output_dir=args.output_dir, search=args.search, trials=args.trials, seeds=args.seeds,
              overrides=args.set, parallel=args.parallel, early_stop=args.early_stop, only=args.only,
              collect_only=args.collect, print_commands=args.print_commands, results_dir=args.results_dir,
              echo=lambda line: print(line, file=sys.stderr if args.print_commands else sys.stdout, flush=True))
    except UserError as e:
        return report_error(e)
    except SweepFailed as e:
        print(f"jaxlm.experiment: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so that experiment files and this command share one `Experiment` class.
    from jaxlm.experiment import main as _main

    sys.exit(_main())
