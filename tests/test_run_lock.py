"""One writer per run directory (`jaxlm.run_lock`): a second training on a directory in use stops at
once with one line naming the holder and touches nothing; a lock left by a dead run is taken over."""

import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxlm.errors import UserError
from jaxlm.run_lock import LOCK_NAME, RunLock

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOLD = ("import sys, time; from jaxlm.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(120)")


def _holder(run_dir: pathlib.Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_second_training_on_a_directory_in_use_stops_in_one_line_and_touches_nothing(tmp_path):
    run_dir = tmp_path / "runs" / "busy"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    holder = _holder(run_dir)
    try:
        before = _snapshot(tmp_path)
        for extra in ([], ["--config.run.fresh=true"]):  # fresh must not move a directory in use either
            result = subprocess.run(
                [sys.executable, "-m", "jaxlm.train", "--config=configs/tiny.py", f"--config.run.output_dir={tmp_path}/runs",
                 "--config.run.name=busy", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300,
            )
            assert result.returncode == 2, result.stderr[-2000:]
            errors = [line for line in result.stderr.splitlines() if line.startswith("jaxlm: error:")]
            assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
            assert f"is in use by another run (host {socket.gethostname()}, pid {holder.pid}, since " in errors[0]
            assert _snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.joinpath("runs").iterdir()) == ["busy"]
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with caplog.at_level(logging.WARNING, logger="jaxlm.run_lock"), RunLock(tmp_path) as lock:
        info = json.loads(lock.path.read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert f"pid {holder.pid} is no longer running" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxlm.run_lock"), RunLock(tmp_path):  # released cleanly: no warning
        pass
    assert caplog.text == ""


def test_on_a_shared_filesystem_the_heartbeat_decides(tmp_path, caplog):
    other = {"host": "another-node", "pid": 4242, "since": time.time() - 3600}
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(json.dumps({**other, "heartbeat": time.time() - 5}))
    with pytest.raises(UserError, match=r"in use by another run \(host another-node, pid 4242, .*heartbeat 5 s ago"):
        RunLock(tmp_path, stale_s=600).acquire()
    lock_file.write_text(json.dumps({**other, "heartbeat": time.time() - 900}))
    with caplog.at_level(logging.WARNING, logger="jaxlm.run_lock"), RunLock(tmp_path, stale_s=600):
        assert json.loads(lock_file.read_text())["host"] == socket.gethostname()
    assert "its heartbeat stopped 900 s ago" in caplog.text


def test_the_holder_refreshes_its_heartbeat(tmp_path):
    with RunLock(tmp_path, heartbeat_s=0.05) as lock:
        first = json.loads(lock.path.read_text())["heartbeat"]
        time.sleep(0.3)
        assert json.loads(lock.path.read_text())["heartbeat"] > first
    assert json.loads(lock.path.read_text())["released"] is True


def test_a_run_directory_that_cannot_be_created_is_one_clear_error(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError, match="cannot lock the run directory .*a_file/run.*set config.run.output_dir"):
        RunLock(tmp_path / "a_file" / "run").acquire()
