"""Experiments (jaxlm.experiment): declarations, searches, and real sweeps of `python -m jaxlm.train`
runs that resume and report exactly what each run logged."""

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

import pytest

from jaxlm import config as config_lib
from jaxlm import experiment
from jaxlm.experiment import Choice, Experiment, IntUniform, LogUniform, Uniform

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A model small enough that a run is mostly process start and compilation.
SMALL_BASE = {
    "run.steps": 6, "run.eval_every": 3, "run.log_every": 3, "data.builtin_max_bytes": 400_000,
    "model.vocab_size": 512, "data.val_fraction": 0.3, "data.val_tokens": 1024, "model.d_model": 64,
    "model.n_layers": 2, "model.mlp_dim": 128, "data.seq_len": 64, "data.global_batch_size": 8,
}


def write_experiment(path: pathlib.Path, cache: pathlib.Path, body: str) -> pathlib.Path:
    base = {**SMALL_BASE, "data.cache_dir": str(cache)}
    path.write_text(
        "from jaxlm.experiment import Experiment, Choice, LogUniform, IntUniform\n"
        f"BASE = {base!r}\n"
        f"EXPERIMENT = Experiment(recipe='tiny', base=BASE, {body})\n"
    )
    return path


def run_cli(*args, env=None):
    # One CPU device per run; the XLA cache under the repository is shared with the other tests.
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1", **(env or {})}
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
    assert all(eight[name] == trial for name, trial in five.items())  # more trials keep the first ones
    assert all(1e-4 <= t["optim.peak_lr"] <= 1e-2 and t["optim.warmup_steps"] in range(10) for t in eight.values())
    assert len({t["optim.peak_lr"] for t in eight.values()}) == 8
    other = experiment.search_variants(Experiment(recipe="tiny", search_space=exp.search_space, search_seed=1), "random", 5)
    assert other != five
    assert len(experiment.search_variants(exp, "grid", None)) == 3 * 2 * 3


def test_the_example_experiments_resolve_to_valid_runs(tmp_path):
    for name, count in (("lr_warmup", 12), ("norm_mlp", 8)):
        exp = experiment.load_experiment(ROOT / "experiments" / f"{name}.py")
        assert exp.name == name and exp.description
        runs = experiment.make_runs(exp, exp.variants, exp.seeds, tmp_path / name)
        assert len(runs) == count == len({r.run_dir for r in runs})
        for run in runs:
            cfg = config_lib.parse_cli(run.flags)
            assert cfg.run.name == run.name == f"{run.variant}-s{run.seed}" and cfg.run.seed == run.seed
            assert all(cfg[k.split(".")[0]][k.split(".")[1]] == v for k, v in run.overrides.items())


def test_the_committed_reports_are_what_the_code_makes_of_their_runs(tmp_path):
    """The committed results.md and loss.png are regenerated here from the committed per-run rows and
    curves (what the sweeps logged) by the code that wrote them, and each variant's mean and
    standard deviation over seeds is computed here independently. (That each row is its run's own
    logged metrics is tested on fresh runs: test_an_experiment_runs_resumes_only_what_is_missing...)"""
    for name in ("lr_warmup", "norm_mlp"):
        directory = ROOT / "experiments" / "results" / name
        results = experiment.load_results(directory)
        assert all(r["status"] == "done" for r in results.rows) and len(results.rows) >= 4
        committed = (directory / "results.md").read_text()
        experiment.write_results(results, tmp_path / name, title="t", echo=lambda _: None)
        table = results.table().to_markdown()
        assert table in committed and table in (tmp_path / name / "results.md").read_text()
        for variant in {r["variant"] for r in results.rows}:
            values = [r["final_val_loss"] for r in results.rows if r["variant"] == variant]
            mean = sum(values) / len(values)
            std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
            assert f"{mean:.4f} ± {std:.4f}" in table
        assert (tmp_path / name / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_override_is_one_line_before_anything_runs(tmp_path, capsys):
    path = write_experiment(tmp_path / "bad.py", tmp_path / "cache",
                            "variants={'ok': {}, 'typo': {'optim.peak_lrr': 1e-3}}")
    assert experiment.main([str(path), "--output_dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jaxlm: error: experiment bad, variant typo: unknown config key 'optim.peak_lrr' (did you mean 'optim.peak_lr'?); "
        "keys under 'optim': " + ", ".join(sorted(config_lib.base_config().optim.keys()))]
    assert not (tmp_path / "runs").exists()


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
    results = experiment.load_results(sweep)
    assert [r["run"] for r in results.rows] == names
    for row in results.rows:
        train, evals = metrics_of(sweep / row["run"])
        assert row["status"] == "done" and row["steps"] == 6
        assert row["final_loss"] == train[-1]["loss"] and row["best_loss"] == min(r["loss"] for r in train)
        assert row["final_val_loss"] == evals[-1]["val_loss"] and [r["step"] for r in evals] == [3, 6]
        assert row["best_val_loss"] == min(r["val_loss"] for r in evals)
        assert row["final_val_bits_per_byte"] == evals[-1]["val_bits_per_byte"]
        assert row["tokens_per_s"] == json.loads((sweep / row["run"] / "summary.json").read_text())["tokens_per_s"]
    markdown = (sweep / "results.md").read_text()
    figure = results.plot()
    lines = {line.get_gid(): line for ax in figure.axes for line in ax.get_lines()}
    for variant in ("lr_low", "lr_high"):
        runs = [metrics_of(sweep / f"{variant}-s{seed}") for seed in (0, 1)]
        finals = [evals[-1]["val_loss"] for _, evals in runs]
        cell = f"{statistics.fmean(finals):.4f} ± {statistics.stdev(finals):.4f}"
        assert re.search(rf"\| (\*\*)?{variant}(\*\*)? \|[^\n]*\| 2 \| {re.escape(cell)} \|", markdown), markdown
        mean_loss = [statistics.fmean(r[0][i]["loss"] for r in runs) for i in range(6)]
        mean_val = [statistics.fmean(r[1][i]["val_loss"] for r in runs) for i in range(2)]
        assert list(lines[f"train:{variant}"].get_xdata()) == list(range(1, 7))
        assert list(lines[f"train:{variant}"].get_ydata()) == pytest.approx(mean_loss, rel=1e-12)
        assert list(lines[f"val:{variant}"].get_xdata()) == [3, 6]
        assert list(lines[f"val:{variant}"].get_ydata()) == pytest.approx(mean_val, rel=1e-12)
    best = min(("lr_low", "lr_high"), key=lambda v: statistics.fmean(
        metrics_of(sweep / f"{v}-s{s}")[1][-1]["val_loss"] for s in (0, 1)))
    assert f"| **{best}** |" in markdown
    assert (sweep / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    assert stopped["step"] == 2 and stopped["val_loss"] == evals[0]["val_loss"]
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
        assert trial.intermediate_values.items() <= evals.items()  # reported from the run's own log
        if trial.state.name == "COMPLETE":
            assert trial.value == row["final_val_loss"] and row["status"] == "done"
    pruned = rows["trial-002-s0"]
    assert pruned["status"] == "stopped" and pruned["steps"] < 150
    assert json.loads((sweep / "trial-002-s0" / experiment.STOPPED).read_text())["step"] == 2

    result = run_cli(*args, "--trials", 4)  # one more trial; nothing is redone
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 of 4 trials finished" in result.stdout and re.findall(r"\] (\S+): started", result.stdout) == ["trial-003-s0"]
    assert len(optuna.load_study(study_name="bayes", storage=storage).trials) == 4
