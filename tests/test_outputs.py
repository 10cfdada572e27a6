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
