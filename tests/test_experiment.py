"""Experiments (jaxlm.experiment): declarations, searches, and real sweeps of `python -m jaxlm.train`
runs that resume and report exactly what each run logged."""

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

import floats
import numpy as np
import pytest

from helpers import xla_flags
from jaxlm import config as config_lib
from jaxlm import experiment
from jaxlm.experiment import Choice, Experiment, IntUniform, LogUniform, Uniform
from tiny_run import write_corpus

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A model small enough that a run is mostly process start and compilation.
SMALL_BASE = {
    "run.steps": 6, "run.eval_every": 3, "run.log_every": 3, "data.builtin_max_bytes": 400_000,
    "model.vocab_size": 512, "data.val_fraction": 0.3, "data.val_tokens": 1024, "model.d_model": 64,
    "model.n_layers": 2, "model.mlp_dim": 128, "data.seq_len": 64, "data.global_batch_size": 8,
}


def write_experiment(path: pathlib.Path, cache: pathlib.Path, body: str, base: dict | None = None) -> pathlib.Path:
    base = {**(SMALL_BASE if base is None else base), "data.cache_dir": str(cache)}
    path.write_text(
        "from jaxlm.experiment import Experiment, Choice, LogUniform, IntUniform\n"
        f"BASE = {base!r}\n"
        f"EXPERIMENT = Experiment(recipe='tiny', base=BASE, {body})\n"
    )
    return path


def run_cli(*args, env=None):
    # One CPU device per run; the XLA cache under the repository is shared with the other tests.
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "jaxlm.experiment", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)


# ----------------------------------------------------------------------------- no training


def test_grids_name_their_variants_and_random_trials_are_reproducible():
    variants = experiment.grid({"optim.peak_lr": [1e-3, 3e-3], "optim.warmup_steps": IntUniform(0, 40, points=3)})
    assert list(variants) == [f"peak_lr={lr}-warmup_steps={w}" for lr in ("0.001", "0.003") for w in (0, 20, 40)]
    assert variants["peak_lr=0.003-warmup_steps=20"] == {"optim.peak_lr": 3e-3, "optim.warmup_steps": 20}
    assert LogUniform(1e-4, 1e-2).grid() == [1e-4, 1e-3, 1e-2] and Uniform(0.0, 1.0).grid() == [0.0, 0.5, 1.0]
    exp = Experiment(recipe="tiny", search_space={"optim.peak_lr": LogUniform(1e-4, 1e-2), "model.norm":
                                                  Choice(["rmsnorm", "layernorm"]), "optim.warmup_steps": IntUniform(0, 9)})
    five = experiment.search_variants(exp, "random", 5)
    eight = experiment.search_variants(exp, "random", 8)
    assert list(five) == [f"trial-{i:03d}" for i in range(5)]
    # more trials keep the first ones: the same draws, from the same seed
    floats.identical({name: eight[name] for name in five}, five, why=floats.SAME_PROGRAM)
    assert all(1e-4 <= t["optim.peak_lr"] <= 1e-2 and t["optim.warmup_steps"] in range(10) for t in eight.values())
    assert len({t["optim.peak_lr"] for t in eight.values()}) == 8
    other = experiment.search_variants(Experiment(recipe="tiny", search_space=exp.search_space, search_seed=1), "random", 5)
    assert other != five
    assert len(experiment.search_variants(exp, "grid", None)) == 3 * 2 * 3


def test_a_docstring_becomes_markdown_with_its_tables_and_lists_intact():
    doc = ("What it asks,\nover two lines.\n\n| run | loss |\n|---|---|\n| a | 1.0 |\n\n"
           "    python -m jaxlm.experiment x.py\n\n- one\n- two\n\nEnd.")
    assert experiment.docstring_markdown(doc) == (
        "What it asks, over two lines.\n\n| run | loss |\n|---|---|\n| a | 1.0 |\n\n- one\n- two\n\nEnd.")


def test_the_example_experiments_resolve_to_valid_runs(tmp_path):
    for name, count in (("lr_warmup", 12), ("norm_mlp", 8), ("dense_vs_moe", 18)):
        exp = experiment.load_experiment(ROOT / "experiments" / f"{name}.py")
        assert exp.name == name and exp.description
        runs = experiment.make_runs(exp, exp.variants, exp.seeds, tmp_path / name)
        assert len(runs) == count == len({r.run_dir for r in runs})
        for run in runs:
            cfg = config_lib.parse_cli(run.flags)
            assert cfg.run.name == run.name == f"{run.variant}-s{run.seed}" and cfg.run.seed == run.seed
            assert all(cfg[k.split(".")[0]][k.split(".")[1]] == v for k, v in run.overrides.items())


def test_a_bad_override_is_one_line_before_anything_runs(tmp_path, capsys):
    path = write_experiment(tmp_path / "bad.py", tmp_path / "cache",
                            "variants={'ok': {}, 'typo': {'optim.peak_lrr': 1e-3}}")
    assert experiment.main([str(path), "--output_dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jaxlm: error: experiment bad, variant typo: unknown config key 'optim.peak_lrr' (did you mean 'optim.peak_lr'?); "
        "keys under 'optim': " + ", ".join(sorted(config_lib.base_config().optim.keys()))]
    assert not (tmp_path / "runs").exists()


def test_extra_columns_are_summary_keys_or_logged_metrics_means_over_the_last_tenth(tmp_path):
    """`Experiment.columns` (no training: run directories written here): a summary.json key is copied,
    a logged metric is its mean over the last tenth of the logged steps, a key in neither is empty; the
    table shows them per variant, integers with separators; results.csv keeps them and load_results
    finds them again. A column that is already one, or a string for a list, is refused in one line."""
    columns = ["active_params", "aux/moe_dropped", "compile_s"]
    exp = Experiment(recipe="tiny", base={"run.steps": 20}, variants={"a": {}, "b": {"optim.peak_lr": 1e-3}},
                     seeds=[0, 1], columns=columns, name="cols")
    exp.check()
    runs = experiment.make_runs(exp, exp.variants, exp.seeds, tmp_path)
    logged, active = {}, {"a": 1_000_000, "b": 2_000_000}
    for k, run in enumerate(runs):
        run.run_dir.mkdir(parents=True)
        dropped = [0.5 + 0.01 * k + 0.001 * step for step in range(1, 21)]
        logged[run.name] = dropped
        records = [{"step": s, "loss": 5.0 - 0.1 * s - k, "aux/moe_dropped": d} for s, d in zip(range(1, 21), dropped)]
        records.insert(10, {"step": 10, "val_loss": 4.0 - k})  # (an evaluation record has no aux metric)
        records.append({"step": 20, "val_loss": 3.0 - k})
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        summary = {"steps": 20, "tokens_per_s": 100.0, "active_params": active[run.variant] + 2 * run.seed}
        (run.run_dir / "summary.json").write_text(json.dumps(summary))

    results = experiment.collect(runs, exp.metric, exp.columns)
    for row in results.rows:
        # the last tenth of 20 logged steps: steps 19 and 20, averaged here with numpy
        expected = float(np.mean(logged[row["run"]][-2:]))
        assert row["aux/moe_dropped"] == pytest.approx(expected, rel=1e-15) and row["compile_s"] is None
        assert row["active_params"] == active[row["variant"]] + 2 * row["seed"]
        assert list(row) == [*experiment.ROW_KEYS, *columns]  # (load_results tells the extra columns by this)
    table = results.table()
    assert table.columns[-3:] == columns
    cells = {r[0].strip("*"): r[-3:] for r in table.rows}
    mean_a, std_a = mean_and_std([float(np.mean(logged[f"a-s{s}"][-2:])) for s in (0, 1)])
    assert cells["a"] == ["1,000,001 ± 1", f"{mean_a:.4f} ± {std_a:.4f}", "–"]
    assert cells["b"][0] == "2,000,001 ± 1"

    experiment.write_results(results, tmp_path / "out", "cols", echo=lambda line: None)
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "| active_params | aux/moe_dropped | compile_s |" in markdown
    assert "(active_params, aux/moe_dropped, compile_s): each run's summary.json value, or a logged" in markdown
    again = experiment.load_results(tmp_path / "out")
    assert again.columns == tuple(columns)
    assert again.table().rows == table.rows

    for bad, words in ((["tokens_per_s"], "'tokens_per_s': give distinct"), (["x", "x"], "'x': give distinct"),
                       ("active_params", "give a list of keys, e.g. columns=['active_params']")):
        with pytest.raises(experiment.UserError, match=re.escape(words)):
            Experiment(recipe="tiny", columns=bad, name="bad").check()


def test_print_commands_gives_one_train_command_per_unfinished_run(tmp_path, capsys):
    path = write_experiment(tmp_path / "sweep.py", tmp_path / "cache",
                            "variants={'a': {'optim.peak_lr': 1e-3}, 'b': {'model.norm': 'layernorm'}}, seeds=[0, 3]")
    code = experiment.main([str(path), "--print_commands", "--output_dir", str(tmp_path / "runs"), "--set", "run.steps=4"])
    result = capsys.readouterr()
    assert code == 0, result.err
    commands = [line.split() for line in result.out.splitlines()]
    assert [c[:3] for c in commands] == [["python", "-m", "jaxlm.train"]] * 4
    configs = [config_lib.parse_cli(c[3:]) for c in commands]
    assert [(c.run.name, c.run.seed, c.run.steps) for c in configs] == [
        ("a-s0", 0, 4), ("a-s3", 3, 4), ("b-s0", 0, 4), ("b-s3", 3, 4)]
    assert configs[0].optim.peak_lr == 1e-3 and configs[2].model.norm == "layernorm"
    assert all(c.run.output_dir == str(tmp_path / "runs" / "sweep") for c in configs)
    assert "4 of 4 runs to do" in result.err


# ----------------------------------------------------------------------------- real sweeps


def metrics_of(run_dir: pathlib.Path):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def mean_and_std(values: list[float]) -> tuple[float, float]:
    """Computed here, not by the code under test: numpy's mean and sample standard deviation."""
    return float(np.mean(values)), float(np.std(values, ddof=1))


def assert_reports_hold_each_runs_own_metrics(sweep: pathlib.Path, variants, seeds, steps: int, eval_steps):
    """results.csv, curves.csv, results.md and loss.png of a finished sweep against each run's own
    metrics.jsonl and summary.json, the per-variant statistics computed here."""
    names = [f"{v}-s{s}" for v in variants for s in seeds]
    results = experiment.load_results(sweep)  # read back from results.csv and curves.csv
    assert [r["run"] for r in results.rows] == names
    for row in results.rows:
        train, evals = metrics_of(sweep / row["run"])
        assert [r["step"] for r in train] == list(range(1, steps + 1)) and [r["step"] for r in evals] == eval_steps
        assert row["status"] == "done" and row["steps"] == steps
        # the reports copy (and pick among) what each run logged: to the bit
        summary = json.loads((sweep / row["run"] / "summary.json").read_text())
        floats.identical(
            [row["final_loss"], row["best_loss"], row["final_val_loss"], row["best_val_loss"],
             row["final_val_bits_per_byte"], row["tokens_per_s"]],
            [train[-1]["loss"], min(r["loss"] for r in train), evals[-1]["val_loss"], min(r["val_loss"] for r in evals),
             evals[-1]["val_bits_per_byte"], summary["tokens_per_s"]], why=floats.MOVED, err_msg=row["run"])
        curve = [c for c in results.curves if c["run"] == row["run"]]
        floats.identical([(c["step"], c["loss"]) for c in curve], [(r["step"], r["loss"]) for r in train],
                         why=floats.MOVED)
        assert [(c["step"], c["tokens_seen"], c["wall_s"]) for c in curve] == [
            (r["step"], r["tokens_seen"], r["wall_s"]) for r in train]
        floats.identical([(c["step"], c["val_loss"]) for c in curve if c["val_loss"] is not None],
                         [(r["step"], r["val_loss"]) for r in evals], why=floats.MOVED)
    markdown = (sweep / "results.md").read_text()
    lines = {line.get_gid(): line for ax in results.plot().axes for line in ax.get_lines()}
    final_val = {}
    for variant in variants:
        runs = [metrics_of(sweep / f"{variant}-s{seed}") for seed in seeds]
        columns = (  # the table's: final val loss, best val loss, final train loss, val bits/byte
            [evals[-1]["val_loss"] for _, evals in runs], [min(r["val_loss"] for r in evals) for _, evals in runs],
            [train[-1]["loss"] for train, _ in runs], [evals[-1]["val_bits_per_byte"] for _, evals in runs])
        cells = ["{:.4f} ± {:.4f}".format(*mean_and_std(values)) for values in columns]
        final_val[variant] = mean_and_std([evals[-1]["val_loss"] for _, evals in runs])[0]
        row = rf"\| (\*\*)?{variant}(\*\*)? \|[^\n]*\| {len(seeds)} \| " + r" \| ".join(map(re.escape, cells)) + r" \|"
        assert re.search(row, markdown), (row, markdown)
        mean_loss = [float(np.mean([train[i]["loss"] for train, _ in runs])) for i in range(steps)]
        mean_val = [float(np.mean([evals[i]["val_loss"] for _, evals in runs])) for i in range(len(eval_steps))]
        assert list(lines[f"train:{variant}"].get_xdata()) == list(range(1, steps + 1))
        assert list(lines[f"train:{variant}"].get_ydata()) == pytest.approx(mean_loss, rel=1e-12)
        assert list(lines[f"val:{variant}"].get_xdata()) == eval_steps
        assert list(lines[f"val:{variant}"].get_ydata()) == pytest.approx(mean_val, rel=1e-12)
    # against seconds of training: each step at the mean over seeds of the runs' own clocks
    timed = {line.get_gid(): line for ax in results.plot(x="wall_s").axes for line in ax.get_lines()}
    for variant in variants:
        runs = [metrics_of(sweep / f"{variant}-s{seed}") for seed in seeds]
        seconds = {r["step"]: [] for r in runs[0][0]}
        for train, _ in runs:
            for r in train:
                seconds[r["step"]].append(r["wall_s"])
        assert list(timed[f"val:{variant}"].get_xdata()) == pytest.approx([np.mean(seconds[s]) for s in eval_steps],
                                                                         rel=1e-12)
    best = min(variants, key=final_val.__getitem__)
    assert f"| **{best}** |" in markdown and markdown.count("| **") == 1
    for name in ("loss.png", "loss_vs_time.png"):
        assert (sweep / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_sweep_reports_each_runs_own_metrics(tmp_path):
    """A real sweep small enough for the default suite (2 variants x 2 seeds of 4 steps of a tiny
    model, one after the other in one process), its reports checked against what each run logged.
    (Runs side by side in their own processes, and a resumed sweep: the slow test below.)"""
    write_corpus(tmp_path / "facts.txt")
    base = {"run.steps": 4, "run.eval_every": 2, "run.log_every": 1, "model.vocab_size": 300, "model.d_model": 32,
            "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 2, "model.mlp_dim": 64, "data.seq_len": 32,
            "data.global_batch_size": 4, "data.corpus": str(tmp_path / "facts.txt"), "data.separator": "\n\n",
            "data.val_fraction": 0.2, "data.val_tokens": 256, "data.tokenize_on_the_fly": True,
            "optim.warmup_steps": 0}
    path = write_experiment(tmp_path / "lr.py", tmp_path / "cache", "variants={'lr_low': {'optim.peak_lr': 1e-3}, "
                            "'lr_high': {'optim.peak_lr': 1e-2}}, seeds=[0, 1]", base=base)
    result = run_cli(path, "--parallel", 0, "--output_dir", tmp_path / "runs")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_reports_hold_each_runs_own_metrics(tmp_path / "runs" / "lr", ("lr_low", "lr_high"), seeds=(0, 1), steps=4,
                                              eval_steps=[2, 4])


@pytest.mark.slow
def test_an_experiment_runs_resumes_only_what_is_missing_and_reports_each_runs_own_metrics(tmp_path):
    path = write_experiment(tmp_path / "lr.py", tmp_path / "cache",
                            "variants={'lr_low': {'optim.peak_lr': 1e-3}, 'lr_high': {'optim.peak_lr': 1e-2}}, seeds=[0, 1]")
    out = tmp_path / "runs"
    result = run_cli(path, "--parallel", 2, "--output_dir", out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sweep = out / "lr"
    names = ["lr_low-s0", "lr_low-s1", "lr_high-s0", "lr_high-s1"]
    for name in names:
        assert json.loads((sweep / name / "summary.json").read_text())["steps"] == 6
        assert (sweep / "logs" / f"{name}.log").is_file()

    # Resume after losing one run: only that one is trained again.
    kept = {n: (sweep / n / "metrics.jsonl").read_bytes() for n in names if n != "lr_high-s1"}
    stamps = {n: (sweep / n / "metrics.jsonl").stat().st_mtime_ns for n in kept}
    import shutil

    shutil.rmtree(sweep / "lr_high-s1")
    result = run_cli(path, "--output_dir", out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "4 runs (2 variants x 2 seeds), 3 finished, 1 to run" in result.stdout
    started = re.findall(r"\] (\S+): started", result.stdout)
    assert started == ["lr_high-s1"]
    assert {n: (sweep / n / "metrics.jsonl").read_bytes() for n in kept} == kept
    assert {n: (sweep / n / "metrics.jsonl").stat().st_mtime_ns for n in kept} == stamps
    assert (sweep / "lr_high-s1" / "summary.json").is_file()

    # The CSV, the table and the plot hold exactly what each run logged.
    assert_reports_hold_each_runs_own_metrics(sweep, ("lr_low", "lr_high"), seeds=(0, 1), steps=6, eval_steps=[3, 6])


@pytest.mark.slow
def test_early_stopping_stops_a_bad_trial_from_its_logged_val_loss_and_a_resume_skips_it(tmp_path):
    # A grid in order: two good learning rates finish, then a hopeless one is stopped at its first
    # evaluation, being worse than the median of the others at that step.
    path = write_experiment(tmp_path / "stop.py", tmp_path / "cache",
                            "search_space={'optim.peak_lr': Choice([3e-3, 2e-3, 1e-7])}")
    out = tmp_path / "runs"
    args = [path, "--search", "grid", "--early_stop", "--output_dir", out, "--set", "run.steps=150",
            "--set", "run.eval_every=2", "--set", "optim.warmup_steps=0"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sweep = out / "stop" / "search-grid"
    bad = "peak_lr=1e-07-s0"
    stopped = json.loads((sweep / bad / experiment.STOPPED).read_text())
    train, evals = metrics_of(sweep / bad)
    assert stopped["step"] == 2
    floats.identical(stopped["val_loss"], evals[0]["val_loss"], why=floats.MOVED)  # the logged one, decided on
    others = [metrics_of(sweep / f"peak_lr={lr}-s0")[1][0]["val_loss"] for lr in ("0.003", "0.002")]
    assert evals[0]["step"] == 2 and evals[0]["val_loss"] > statistics.median(others)
    assert train[-1]["step"] < 150 and not (sweep / bad / "summary.json").exists()
    rows = {r["run"]: r for r in experiment.load_results(sweep).rows}
    assert rows[bad]["status"] == "stopped"
    assert [rows[f"peak_lr={lr}-s0"]["status"] for lr in ("0.003", "0.002")] == ["done"] * 2
    assert "Stopped early: peak_lr=1e-07-s0" in (sweep / "results.md").read_text()

    result = run_cli(*args)
    assert result.returncode == 0 and "3 finished, 0 to run" in result.stdout


@pytest.mark.slow
def test_an_optuna_search_prunes_from_the_logged_val_loss_and_resumes(tmp_path):
    import optuna  # in the dev extra: `make test-slow` runs this, never skips it
    path = write_experiment(tmp_path / "bayes.py", tmp_path / "cache",
                            "search_space={'optim.peak_lr': Choice([3e-3, 2e-3, 1e-7])}")
    out = tmp_path / "runs"
    sweep = out / "bayes" / "search-optuna"
    sweep.mkdir(parents=True)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(sweep / "optuna.journal")))
    study = optuna.create_study(study_name="bayes", storage=storage, direction="minimize")
    for lr in (3e-3, 2e-3, 1e-7):  # the first trials, in this order: the third is hopeless
        study.enqueue_trial({"optim.peak_lr": lr})
    args = [path, "--search", "optuna", "--output_dir", out, "--set", "run.steps=150", "--set", "run.eval_every=2",
            "--set", "optim.warmup_steps=0"]
    result = run_cli(*args, "--trials", 3)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = optuna.load_study(study_name="bayes", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    rows = {r["run"]: r for r in experiment.load_results(sweep).rows}
    for trial in trials:
        row = rows[f"{trial.user_attrs['run_name']}-s0"]
        assert json.loads(row["overrides"]) == trial.params
        evals = {r["step"]: r["val_loss"] for r in metrics_of(sweep / row["run"])[1]}
        # reported from the run's own log
        floats.identical(dict(trial.intermediate_values), {s: evals[s] for s in trial.intermediate_values},
                         why=floats.MOVED)
        if trial.state.name == "COMPLETE":
            assert row["status"] == "done"
            floats.identical(trial.value, row["final_val_loss"], why=floats.MOVED)
    pruned = rows["trial-002-s0"]
    assert pruned["status"] == "stopped" and pruned["steps"] < 150
    assert json.loads((sweep / "trial-002-s0" / experiment.STOPPED).read_text())["step"] == 2

    result = run_cli(*args, "--trials", 4)  # one more trial; nothing is redone
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 of 4 trials finished" in result.stdout and re.findall(r"\] (\S+): started", result.stdout) == ["trial-003-s0"]
    assert len(optuna.load_study(study_name="bayes", storage=storage).trials) == 4
