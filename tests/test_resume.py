"""Fault tolerance through the real CLI: kills, preemption, resume, refused config changes."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import floats
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def args(tmp_path, name, *extra, steps=24):
    return [
        "--config=configs/tiny.py", f"--config.run.output_dir={tmp_path}", f"--config.run.name={name}",
        f"--config.run.steps={steps}", "--config.run.log_every=1", "--config.run.eval_every=0",
        "--config.checkpoint.every_steps=5", "--config.data.builtin_max_bytes=400000", "--config.model.vocab_size=512",
        f"--config.data.cache_dir={tmp_path / 'cache'}", *extra,
    ]


def start(argv):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "jaxlm.train", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def run(argv):
    proc = start(argv)
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def run_until(argv, line_prefix, sig):
    """Start a run and send `sig` once it prints a line starting with `line_prefix`."""
    proc, seen = start(argv), []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(line_prefix):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=600)
    return proc.returncode, "".join(seen) + out, err


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    code, out, err = run(args(tmp, "full"))
    assert code == 0, err[-3000:]
    return tmp, losses(tmp / "full")


@pytest.mark.slow
def test_killed_or_preempted_at_any_moment_then_resumed_equals_the_uninterrupted_run(uninterrupted):
    """SIGKILL at step 7 (between saves); SIGTERM at step 9 (saves at the step boundary, exits 75);
    SIGKILL right after the step-15 save starts, and at step 18. Each run resumes from the last
    complete checkpoint, and in the end every step's loss is bit-identical, each step logged once."""
    tmp, expected = uninterrupted
    argv = args(tmp, "killed")
    code, _, _ = run_until(argv, "step      7/", signal.SIGKILL)
    assert code == -signal.SIGKILL
    code, out, err = run_until(argv, "step      9/", signal.SIGTERM)
    assert code == 75, err[-3000:]
    assert "resuming from step 5" in out and "run the same command to resume" in err and "Traceback" not in err
    stopped_at = int(err.split("SIGTERM at step ")[1].split(";")[0])
    assert (tmp / "killed" / "checkpoints" / str(stopped_at)).is_dir()
    for kill_at in ("step     16/", "step     18/"):
        code, out, _ = run_until(argv, kill_at, signal.SIGKILL)
        assert code == -signal.SIGKILL
    assert f"resuming from step {stopped_at}" in out or "resuming from step 15" in out
    code, out, err = run(argv)
    assert code == 0, err[-3000:]
    assert "resuming from step 15" in out
    floats.identical(losses(tmp / "killed"), expected, why=floats.SAME_PROGRAM)  # same steps, once each, same values
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp / "killed" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # several event files, one per process; the killed ones' later points are dropped
    assert len(list((tmp / "killed" / "tensorboard").iterdir())) == 5  # five processes
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, pytest.approx(v)) for s, v in expected]


@pytest.mark.slow
def test_saved_from_device_snapshots_then_resumed_equals_the_uninterrupted_run(uninterrupted):
    """checkpoint.snapshot=device: each save copies the state on the devices and a thread writes
    it while the next steps run. Killed at step 12 and resumed (from step 10, or from 5 where the
    kill came before step 10's write committed), the run computes the uninterrupted run's losses
    bit for bit: each checkpoint holds the state and data position of its own step."""
    tmp, expected = uninterrupted
    argv = args(tmp, "snapshots", "--config.checkpoint.snapshot=device")
    code, _, _ = run_until(argv, "step     12/", signal.SIGKILL)
    assert code == -signal.SIGKILL
    code, out, err = run(argv)
    assert code == 0, err[-3000:]
    assert "resuming from step 10" in out or "resuming from step 5" in out, out
    floats.identical(losses(tmp / "snapshots"), expected, why=floats.SAME_PROGRAM)


@pytest.mark.slow
def test_a_finished_run_whose_final_checkpoint_is_damaged_trains_the_lost_steps_again(uninterrupted):
    """The final checkpoint no longer matches the sizes and checksums recorded when it was saved:
    evaluate says so in one line and uses step 20; the same training command moves it aside (kept)
    and trains steps 21-24 again, to the same losses."""
    import shutil

    tmp, expected = uninterrupted
    run_dir = tmp / "damaged"
    shutil.copytree(tmp / "full", run_dir)
    final = run_dir / "checkpoints" / "24"
    assert (final / "jaxlm_manifest.json").is_file()
    victim = max((f for f in (final / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with open(victim, "r+b") as f:  # same size, one byte changed: only the checksum can tell
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    text = tmp / "some.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    ev = subprocess.run([sys.executable, "-m", "jaxlm.evaluate", f"--run_dir={run_dir}", f"--corpus={text}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "step 20" in ev.stdout and "Traceback" not in ev.stderr
    warnings = [line for line in ev.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and str(final) in warnings[0] and "CRC-32" in warnings[0], ev.stderr

    code, out, err = run(args(tmp, "damaged"))
    assert code == 0, err[-3000:]
    assert "already complete" not in out and "resuming from step 20" in out
    assert "Traceback" not in err and f"moved to {run_dir / 'damaged_checkpoints' / '24'}" in out
    floats.identical(losses(run_dir), expected, why=floats.SAME_PROGRAM)
    kept = run_dir / "damaged_checkpoints" / "24" / victim.relative_to(final)
    assert kept.read_bytes()[:1] == bytes([first[0] ^ 0xFF])  # set aside, not deleted
    from jaxlm import checkpoint

    assert checkpoint.verify_step(final)  # saved again, with its manifest
    code, out, _ = run(args(tmp, "damaged"))
    assert code == 0 and "already complete at step 24" in out


@pytest.mark.slow
def test_a_full_disk_during_a_save_stops_in_one_line_and_the_run_resumes(uninterrupted):
    """Files may not grow past 64 kB from step 7 on (RLIMIT_FSIZE, as a disk that filled up): the
    save that fails is reported in one line, exit 74, naming the newest complete checkpoint, which
    stays complete and verified; the same command, once there is room, resumes to the same losses."""
    import resource

    from jaxlm import checkpoint

    tmp, expected = uninterrupted
    argv = args(tmp, "full_disk")
    proc = start(argv)
    for line in proc.stdout:
        if line.startswith("step      7/"):
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (64_000, 64_000))
            break
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 74, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    complete = checkpoint.complete_steps(tmp / "full_disk" / "checkpoints")
    newest = tmp / "full_disk" / "checkpoints" / str(complete[-1]) if complete else "none"
    assert len(lines) == 1 and "File too large" in lines[0], err[-3000:]
    assert f"the newest complete checkpoint is {newest};" in lines[0]
    assert all(checkpoint.verify_step(tmp / "full_disk" / "checkpoints" / str(s)) for s in complete)
    code, out, err = run(argv)
    assert code == 0, err[-3000:]
    assert (f"resuming from step {complete[-1]}" in out) if complete else "resuming" not in out
    floats.identical(losses(tmp / "full_disk"), expected, why=floats.SAME_PROGRAM)


@pytest.mark.slow
def test_a_finished_run_is_not_redone_and_changes_that_matter_are_refused(uninterrupted):
    tmp, _ = uninterrupted
    code, out, _ = run(args(tmp, "full"))
    assert code == 0 and "already complete at step 24" in out
    code, _, err = run(args(tmp, "full", "--config.model.d_model=64", "--config.optim.peak_lr=1e-3", steps=30))
    assert code == 2
    assert "model.d_model: 128 -> 64" in err and "optim.peak_lr: 0.003 -> 0.001" in err
    assert "run.steps" not in err  # more steps is how a run is extended, not a difference
    before = (tmp / "full" / "metrics.jsonl").read_bytes()
    code, out, err = run(args(tmp, "full", "--config.run.fresh=true", steps=3))
    assert code == 0, err[-2000:]
    aside = [p for p in tmp.iterdir() if p.name.startswith("full-replaced-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_bytes() == before  # moved, not deleted
    assert [s for s, _ in losses(tmp / "full")] == [1, 2, 3]


@pytest.mark.slow
def test_resuming_with_another_tokenizer_is_refused(tmp_path):
    """Same config, but the tokenizer file behind data.tokenizer_path changed: its hash tells."""
    from jaxlm.data.sources import SourceSpec, iter_documents
    from jaxlm.data.tokenizer import SentencePieceTokenizer

    docs = list(iter_documents(SourceSpec("builtin", max_bytes=200_000)))
    model = tmp_path / "tok.model"
    SentencePieceTokenizer.train(docs, 512, "bpe").save(model)
    argv = args(tmp_path, "tok", f"--config.data.tokenizer_path={model}", steps=2)
    code, _, err = run(argv)
    assert code == 0, err[-2000:]
    SentencePieceTokenizer.train(docs, 512, "unigram").save(model)
    code, _, err = run([*argv, "--config.run.steps=4"])  # the later flag wins
    assert code == 2 and "was trained with another tokenizer" in err, err[-2000:]


@pytest.mark.slow
def test_tokenized_on_the_fly_with_workers_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Raw documents tokenized in 2 grain worker processes: the iterator state in the checkpoint
    (a document mid-way through its chunks, in each worker) resumes the same stream."""
    extra = ("--config.data.tokenize_on_the_fly=true", "--config.data.num_workers=2")
    code, out, err = run(args(tmp_path, "whole", *extra, steps=12))
    assert code == 0, err[-3000:]
    assert "training documents, tokenized on the fly" in out
    code, _, err = run_until(args(tmp_path, "parts", *extra, steps=12), "step      7/", signal.SIGTERM)
    assert code == 75, err[-3000:]
    code, out, err = run(args(tmp_path, "parts", *extra, steps=12))
    assert code == 0 and "resuming from step" in out, err[-3000:]
    floats.identical(losses(tmp_path / "parts"), losses(tmp_path / "whole"), why=floats.SAME_PROGRAM)
    code, _, err = run(args(tmp_path, "parts", steps=14))  # switching to prepared data changes the stream
    assert code == 2 and "data.tokenize_on_the_fly: True -> False" in err, err[-2000:]


@pytest.mark.slow
def test_a_muon_run_killed_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """optim.name=muon: SIGKILL at step 8 (after the step-5 save), resumed: every step's loss bit-identical to
    the uninterrupted run's (Muon's momentum and AdamW's moments restored exactly, in their partition)."""
    code, _, err = run(args(tmp_path, "full", "--config.optim.name=muon", steps=12))
    assert code == 0, err[-3000:]
    argv = args(tmp_path, "killed", "--config.optim.name=muon", steps=12)
    code, _, _ = run_until(argv, "step      8/", signal.SIGKILL)
    assert code == -signal.SIGKILL
    code, out, err = run(argv)
    assert code == 0, err[-3000:]
    assert "resuming from step 5" in out
    expected = losses(tmp_path / "full")
    assert [s for s, _ in expected] == list(range(1, 13))
    floats.identical(losses(tmp_path / "killed"), expected, why=floats.SAME_PROGRAM)
