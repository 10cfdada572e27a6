"""What a crash leaves behind (issue 47): a process killed or a machine losing power mid-write leaves a file cut
short. Every file jaxlm writes and later reads back, cut at a random byte, is read back tolerantly (a warning and
the whole part kept, or the cache made again) or refused in one `jaxlm: error:` line: never a traceback, and the
checkpoints it did not cut stay intact.

Generated, not hand-picked: the files are found by walking what real commands wrote (a training run with its data
cache, a sweep's directory, a prepared corpus), and each is cut at a byte drawn by a seeded `random.Random`. The
checkpoints' array files all take one path (their sizes against the manifest), so one file of each kind (its path
with the numbers and array names left out) is cut per checkpoint; JAXLM_TEST_CUT_EVERY_FILE=1 cuts every file.
"""

import concurrent.futures
import json
import os
import pathlib
import random
import re
import shutil
import subprocess

import pytest
from command_forks import run_command

from helpers import xla_flags
from jaxlm import checkpoint, experiment, metrics, run_dir

ROOT = pathlib.Path(__file__).resolve().parent.parent
ONE_DEVICE = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=1"), JAX_PLATFORMS="cpu")
STEPS, MORE_STEPS = 4, 6  # trained with a checkpoint every 2 steps, then resumed to 6


def train_args(directory: pathlib.Path, steps: int) -> list[str]:
    """A seconds-long tiny-recipe run `directory/r` on the built-in corpus, prepared into `directory/cache`."""
    return [
        "--config=configs/tiny.py", f"--config.run.output_dir={directory}", "--config.run.name=r",
        f"--config.run.steps={steps}", "--config.run.log_every=1", "--config.run.eval_every=0",
        "--config.checkpoint.every_steps=2", "--config.data.builtin_max_bytes=100000", "--config.model.vocab_size=512",
        "--config.model.d_model=32", "--config.model.n_layers=1", "--config.model.mlp_dim=64",
        "--config.data.seq_len=32", "--config.data.global_batch_size=4", f"--config.data.cache_dir={directory / 'cache'}",
        "--config.run.compile_cache_dir=",
    ]


def train(argv: list[str]) -> subprocess.CompletedProcess:
    return run_command("train", argv, cwd=ROOT, env=ONE_DEVICE, timeout=600)


def cut_at_random_byte(path: pathlib.Path, rng: random.Random) -> int:
    """Keep the first bytes of `path`, as many as `rng` draws (fewer than it had); returns how many."""
    data = path.read_bytes()
    keep = rng.randrange(len(data))
    path.write_bytes(data[:keep])
    return keep


def kind(relative: str) -> str:
    """A file's kind: its path with numbers (steps, shard indices) and array names left out."""
    return re.sub(r"\d+", "N", re.sub(r"/(params|opt_state)\.[^/]+", "/ARRAY", relative))


def files_to_cut(root: pathlib.Path, rng: random.Random) -> list[str]:
    """Every non-empty file under `root` (relative paths); without JAXLM_TEST_CUT_EVERY_FILE, one of each
    kind per checkpoint, drawn by `rng`."""
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.stat().st_size)
    if os.environ.get("JAXLM_TEST_CUT_EVERY_FILE") == "1":
        return files
    groups: dict[tuple[str, str], list[str]] = {}
    for rel in files:
        step = re.search(r"checkpoints/(\d+)/", rel)
        groups.setdefault((step.group(1) if step else "", kind(rel)), []).append(rel)
    return sorted(rng.choice(group) for group in groups.values())


def checkpoint_of(rel: str) -> tuple[pathlib.Path, pathlib.Path] | None:
    """(the checkpoint directory a run file lies in, the file relative to it), or None."""
    parts = pathlib.PurePath(rel).parts
    if "checkpoints" not in parts:
        return None
    i = parts.index("checkpoints")
    return pathlib.Path(*parts[: i + 2]), pathlib.Path(*parts[i + 2:])


def assert_one_line_or_resumed(code: int, out: str, err: str, what: str) -> None:
    """Never a traceback; exit 0, or 2 / 74 with one `jaxlm: error:` line."""
    assert "Traceback" not in err, f"{what}:\n{err[-3000:]}"
    if code:
        errors = [line for line in err.splitlines() if line.startswith("jaxlm: error:")]
        assert code in (2, 74) and len(errors) == 1, f"{what}: exit {code}\n{err[-3000:]}"


def cut_and_resume(original: pathlib.Path, rel: str, work: pathlib.Path, seed: int, steps: int,
                   args=train_args, must_resume: bool = False) -> str:
    """Copy `original`, cut its file `rel` at a random byte and train the copy on to `steps`: the checks of
    the module docstring; `must_resume`, the run must reach `steps` (another checkpoint was there to resume
    from). Returns what happened, for the caller's report."""
    copy = work / re.sub(r"[^A-Za-z0-9_.-]", "_", rel)
    shutil.copytree(original, copy, symlinks=True)
    keep = cut_at_random_byte(copy / rel, random.Random(f"{seed}:{rel}"))
    what = f"{rel} cut to {keep} bytes"
    run = copy / "r"
    cut_checkpoint = checkpoint_of(rel)
    others = [s for s in checkpoint.complete_steps(run / "checkpoints")
              if cut_checkpoint is None or run / "checkpoints" / str(s) != copy / cut_checkpoint[0]]
    result = train(args(copy, steps))
    assert_one_line_or_resumed(result.returncode, result.stdout, result.stderr, what)
    assert result.returncode == 0 or not must_resume, f"{what}: exit {result.returncode}\n{result.stderr[-3000:]}"
    for s in others:  # the checkpoints it did not cut: intact (retention keeps 3: none was dropped)
        assert checkpoint.verify_step(run / "checkpoints" / str(s)), f"{what}: checkpoint {s}"
    if cut_checkpoint is not None:  # the cut one: where it was, or set aside, never deleted
        step_dir, inside = cut_checkpoint
        assert (copy / step_dir / inside).exists() or (run / "damaged_checkpoints" / step_dir.name / inside).exists(), what
    if result.returncode == 0:
        assert run_dir.read_json(run / "summary.json")["steps"] == steps, what
        logged = [r["step"] for r in run_dir.read_jsonl(run / "metrics.jsonl") if "loss" in r]
        assert logged == sorted(set(logged)) and logged[-2:] == [steps - 1, steps], f"{what}: steps {logged}"
        return f"{what}: exit 0"
    return f"{what}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1]}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    """A 4-step run with checkpoints 2 and 4, and its data cache (a trained tokenizer, a prepared corpus)."""
    directory = tmp_path_factory.mktemp("trained")
    result = train(train_args(directory, STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint.complete_steps(directory / "r" / "checkpoints") == [2, 4]
    return directory


@pytest.mark.slow
def test_a_run_resumes_or_says_what_to_do_whatever_file_a_crash_cut(trained, tmp_path):
    """Every file of a run directory (its lock, config, metrics, summary, tokenizer, TensorBoard events, each
    checkpoint's files and manifest) and of its data cache (the trained tokenizer, the prepared corpus's manifest,
    tokenizer and shards), each cut in a copy, then the same command with more steps: it reaches them, from the
    checkpoint the cut left whole (the cache made whole again, config.json written again)."""
    rng = random.Random(47)
    cases = files_to_cut(trained, rng)
    assert any(c.startswith("cache/") for c in cases) and any("jaxlm_manifest.json" in c for c in cases)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # (each is a process of its own)
        outcomes = list(pool.map(lambda rel: cut_and_resume(trained, rel, tmp_path, 47, MORE_STEPS, must_resume=True),
                                 cases))
    print("\n".join(outcomes))


def test_a_run_cut_at_one_file_resumes_or_says_what_to_do(facts_run, tmp_path):
    """The fast representative of the test above, on the run the suite already trained (tests/tiny_run.py):
    one of its files, drawn among their kinds, cut; the same command with two more steps."""
    from tiny_run import STEPS as FACTS_STEPS
    from tiny_run import train_args as facts_args

    original = tmp_path / "original"
    shutil.copytree(facts_run, original / "r", symlinks=True)
    rel = random.Random(47).choice(files_to_cut(original, random.Random(47)))

    def args(directory: pathlib.Path, steps: int) -> list[str]:
        return [*facts_args(facts_run.parent, steps), f"--config.run.output_dir={directory}", "--config.run.name=r"]

    print(cut_and_resume(original, rel, tmp_path / "cut", 47, FACTS_STEPS + 2, args))


# ----------------------------------------------------------------------------- a sweep, a prepared corpus, W&B


def write_sweep(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """An experiment of two variants whose runs are made up (metrics.jsonl, summary.json, one stopped early),
    collected once: (the experiment file, the sweep directory with experiment.json and the results)."""
    path = tmp_path / "lr.py"
    path.write_text("from jaxlm.experiment import Experiment\n"
                    "EXPERIMENT = Experiment(recipe='tiny', base={'run.steps': 4}, seeds=[0],\n"
                    "                        variants={'low': {'optim.peak_lr': 1e-3}, 'high': {'optim.peak_lr': 1e-2}})\n")
    sweep = tmp_path / "runs" / "lr"
    for name, stop in (("low-s0", False), ("high-s0", True)):
        run = sweep / name
        run.mkdir(parents=True)
        records = [{"step": s, "loss": 5.0 - s / 7} for s in range(1, 5)] + [{"step": 2, "val_loss": 4.9}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run / "summary.json").write_text(json.dumps({"steps": 4, "tokens_per_s": 1000.5}, indent=2) + "\n")
        if stop:
            (run / experiment.STOPPED).write_text(json.dumps({"step": 2, "val_loss": 4.9}) + "\n")
    assert experiment.main([str(path), "--collect", "--output_dir", str(tmp_path / "runs")]) == 0
    return path, sweep


def test_a_sweep_collects_whatever_file_a_crash_cut(tmp_path, capsys):
    """Every file of a sweep's directory (experiment.json, results.csv, curves.csv, results.md, each run's
    metrics.jsonl, summary.json and stopped.json) cut in a copy: `--collect` and `load_results` (a notebook's
    reader) read the whole part, and the collected results hold both runs again."""
    path, sweep = write_sweep(tmp_path)
    rng = random.Random(47)
    names = sorted(str(p.relative_to(sweep)) for p in sweep.rglob("*") if p.is_file() and p.suffix != ".png")
    assert {"experiment.json", "results.csv", "curves.csv", "high-s0/stopped.json"} <= set(names)
    for rel in names:
        copy = tmp_path / "cut" / rel.replace("/", "_") / "lr"
        shutil.copytree(sweep, copy)
        keep = cut_at_random_byte(copy / rel, rng)
        if rel.endswith(".csv"):
            experiment.load_results(copy)  # before --collect writes it again: the whole rows
        capsys.readouterr()
        code = experiment.main([str(path), "--collect", "--output_dir", str(copy.parent)])
        err = capsys.readouterr().err
        assert code == 0 and "Traceback" not in err, f"{rel} cut to {keep} bytes: {err}"
        rows = experiment.load_results(copy).rows
        assert [r["run"] for r in rows] == ["low-s0", "high-s0"], rel
        assert rows[1]["status"] == "stopped", rel  # the marker counts by its presence, cut or not


def test_an_optuna_search_list_cut_is_refused_in_one_line(tmp_path, capsys):
    """experiment.json of an optuna search is the only list of its trials: cut, `--collect` says so in one
    line rather than collect fewer trials; a sweep of variants writes it again (above)."""
    path, sweep = write_sweep(tmp_path)
    search = sweep / "search-optuna"
    runs = experiment.make_runs(experiment.load_experiment(path), {"trial-000": {"optim.peak_lr": 1e-3}}, [0],
                                search, [])
    experiment._record(search, runs)
    whole = (search / "experiment.json").read_bytes()
    (search / "experiment.json").write_bytes(whole[:random.Random(47).randrange(len(whole))])
    capsys.readouterr()
    code = experiment.main([str(path), "--collect", "--search", "optuna", "--output_dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("jaxlm: error:")]
    assert code == 2 and len(errors) == 1 and "experiment.json is not whole" in errors[0], err


def test_a_prepared_corpus_cut_anywhere_is_refused_in_one_line_and_prepare_mends_it(tmp_path):
    """Every file of a prepared corpus (jaxlm.data.prepare's output) cut in a copy: reading it refuses in one
    line naming what to run, and that command (prepare again, same arguments) makes it whole."""
    from jaxlm.data import prepare
    from jaxlm.data.sources import SourceSpec
    from jaxlm.data.tokenizer import SentencePieceTokenizer
    from jaxlm.errors import UserError
    from tiny_run import write_corpus

    docs = write_corpus(tmp_path / "facts.txt", documents=60)
    source = SourceSpec(str(tmp_path / "facts.txt"), separator="\n\n")
    tok = SentencePieceTokenizer.train(docs, 300, "bpe")
    original = tmp_path / "prepared"
    prepare.prepare(source, tok, original, val_fraction=0.2, shard_docs=16, progress=False)
    rng = random.Random(47)
    for rel in sorted(str(p.relative_to(original)) for p in original.rglob("*") if p.is_file()):
        copy = tmp_path / "cut" / rel
        shutil.copytree(original, copy)
        keep = cut_at_random_byte(copy / rel, rng)
        assert prepare.damage(copy), f"{rel} cut to {keep} bytes"
        with pytest.raises(UserError) as refused:
            prepare.open_prepared(copy, "train")
            prepare.open_prepared(copy, "val")
            tokenizer_sha256 = type(tok).load(prepare.tokenizer_file(copy)).sha256
            assert tokenizer_sha256 == tok.sha256
        assert "\n" not in str(refused.value), (rel, refused.value)
        if rel != prepare.MANIFEST:  # (a manifest cut short is refused: prepare into a new directory)
            prepare.prepare(source, tok, copy, val_fraction=0.2, shard_docs=16, progress=False)
            assert prepare.damage(copy) is None and (copy / rel).read_bytes() == (original / rel).read_bytes(), rel


def test_a_wandb_id_cut_short_is_not_taken_for_another_run(tmp_path, caplog):
    """A cut wandb_id would log a resumed run into a W&B run of that shorter id: a new id instead, with a warning."""
    run_id = metrics.wandb_run_id(tmp_path)
    assert metrics.wandb_run_id(tmp_path) == run_id  # kept: a resumed run continues its W&B run
    whole = (tmp_path / "wandb_id").read_bytes()
    for keep in sorted(random.Random(47).sample(range(len(whole) - 1), 4)):  # the id itself cut (not the newline)
        (tmp_path / "wandb_id").write_bytes(whole[:keep])
        caplog.clear()
        new = metrics.wandb_run_id(tmp_path)
        assert new != run_id and metrics.WANDB_ID.fullmatch(new), keep
        assert any("not a whole W&B run id" in r.getMessage() for r in caplog.records), keep
        assert (tmp_path / "wandb_id").read_text() == new + "\n"
