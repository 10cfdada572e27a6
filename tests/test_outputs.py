"""What a command may write (`jaxlm.run_dir`): whole new directories (`new_output`), only its own kind
of directory or file (`check_run_dir`, `check_new_output`, `check_output_file`). The real commands go
through them in tests/test_bad_inputs.py; here the mechanism itself."""

from __future__ import annotations

import json

import pytest

from jaxlm import run_dir
from jaxlm.errors import UserError


def _run(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"run": {}, "model": {}}))
    return path


def test_a_new_output_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with run_dir.new_output(out) as partial:
            (partial / "half.safetensors").write_text("x")
            raise RuntimeError("the disk filled")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the output nor its partial sibling
    run_dir.partial_path(out).mkdir()  # what a killed attempt leaves: cleared by the next one
    (run_dir.partial_path(out) / "stale").write_text("x")
    out.mkdir()  # an empty directory given as the output: replaced
    with run_dir.new_output(out) as partial:
        (partial / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and sorted(p.name for p in out.iterdir()) == [
        "config.json"]


def test_outputs_are_refused_where_they_would_mix_with_what_another_command_owns(tmp_path):
    run = _run(tmp_path / "run")
    (run / "checkpoints" / "20").mkdir(parents=True)
    with pytest.raises(UserError, match="exists and is not empty"):
        run_dir.check_new_output(run)
    with pytest.raises(UserError, match="is inside the run directory"):
        run_dir.check_new_output(run / "checkpoints" / "99")  # an export too: never inside checkpoints
    run_dir.check_new_output(run / "hf")  # an export beside a run's files: allowed
    with pytest.raises(UserError, match="is inside the run directory"):
        run_dir.check_new_output(run / "int8", is_a_run=True)  # a run inside a run: never
    hf_model = tmp_path / "hf"
    hf_model.mkdir()
    (hf_model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UserError, match="holds files jaxlm did not write"):
        run_dir.check_run_dir(hf_model)
    run_dir.check_run_dir(run)  # a jaxlm run: resumed
    run_dir.check_run_dir(tmp_path / "new")  # a new directory


def test_an_output_file_replaces_only_an_earlier_result(tmp_path):
    run = _run(tmp_path / "run")
    (run / "checkpoints" / "20").mkdir(parents=True)
    for taken in (run / "config.json", run / "checkpoints" / "20" / "x.json"):
        with pytest.raises(UserError):
            run_dir.check_output_file(taken)
    earlier = run / "eval-20.json"
    earlier.write_text(json.dumps({"run_dir": str(run), "step": 20}))
    run_dir.check_output_file(earlier)
    run_dir.check_output_file(tmp_path / "new.json")


def test_a_run_file_cut_at_any_byte_reads_back_without_a_traceback(tmp_path, caplog):
    """What a killed process leaves: metrics.jsonl and summary.json cut at every byte of their last record.
    Resuming keeps every whole record up to the resume step and drops the cut one with a warning; the
    summary reads as empty with a warning; the experiment reader sees the whole records."""
    import random

    from jaxlm import config, experiment

    lines = [json.dumps({"step": s, "loss": 5.0 - s / 10}) for s in range(1, 6)]
    whole = "".join(line + "\n" for line in lines).encode()
    cuts = sorted(random.Random(0).sample(range(len(whole) - len(lines[-1]) - 1, len(whole)), 8))
    for cut in cuts:
        run = tmp_path / f"cut{cut}"
        run.mkdir()
        (run / "metrics.jsonl").write_bytes(whole[:cut])
        caplog.clear()
        run_dir.make_run_dir(run, config.base_config(), resume_step=4)
        kept = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert kept == [1, 2, 3, 4], cut
        (run / "metrics.jsonl").write_bytes(whole[:cut])
        train, _ = experiment.read_metrics(run)
        complete = cut >= len(whole) - 1  # the last record whole (its newline or not)
        assert [r["step"] for r in train] == [1, 2, 3, 4, 5][: 5 if complete else 4], cut
        assert any("not a whole record" in r.getMessage() for r in caplog.records) != complete, cut
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": 5, "final_loss": 4.5}, indent=2)[:-7])
    caplog.clear()
    assert run_dir.read_json(summary) == {} and any("could not be read" in r.getMessage() for r in caplog.records)
