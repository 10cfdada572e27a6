"""One writer per run directory: a lock held by the training run (process 0 of a multi-process run).

`<run dir>/.lock` is locked with `fcntl.flock` while the run lives, and holds who holds it (host,
pid, since) and a heartbeat the holder refreshes every `HEARTBEAT_S` seconds. A second run on the
same directory stops at once with one line naming the holder. The kernel releases a flock when its
process dies, however it dies, so a lock left by a killed run on the same machine is simply taken
(with a warning naming the dead holder). On a shared filesystem where flock does not reach across
machines, the heartbeat decides: a holder on another host whose heartbeat is younger than
`STALE_S` is alive, an older one is taken over with a warning. A run directory the lock itself
created is removed again when the run wrote nothing into it (it stopped on a config or data error).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import pathlib
import socket
import threading
import time

from jaxlm.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
HEARTBEAT_S = 60.0
STALE_S = 10 * HEARTBEAT_S


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _describe(holder: dict) -> str:
    since = datetime.datetime.fromtimestamp(holder.get("since", 0)).isoformat(sep=" ", timespec="seconds")
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {since}"


class RunLock:
    """`with RunLock(run_dir):` holds the directory's lock; `UserError` when another run holds it."""

    def __init__(self, run_dir: str | os.PathLike, *, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
        self.path = pathlib.Path(run_dir) / LOCK_NAME
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._info: dict = {}
        self._created: list[pathlib.Path] = []

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        created = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot lock the run directory {self.path.parent}: {e.strerror or e}; "
                            "set config.run.output_dir to a writable directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UserError(f"{self.path.parent} is in use by another run ({_describe(self._read())}); wait for it "
                            "to finish, stop it, or give this run another config.run.name") from None
        previous = self._read()
        host = socket.gethostname()
        if previous.get("pid") and previous.get("released") is not True:
            age = time.time() - previous.get("heartbeat", 0)
            if previous.get("host") != host and age < self.stale_s:  # a shared filesystem flock does not span
                os.close(fd)
                raise UserError(f"{self.path.parent} is in use by another run ({_describe(previous)}, heartbeat "
                                f"{age:.0f} s ago); wait for it to finish, stop it, or give this run another "
                                "config.run.name")
            why = (f"pid {previous['pid']} is no longer running" if previous.get("host") == host
                   else f"its heartbeat stopped {age:.0f} s ago")
            if previous.get("host") != host or not _alive(previous["pid"]):
                log.warning("run directory %s: taking over the lock of a run that ended without releasing it "
                            "(%s; %s)", self.path.parent, _describe(previous), why)
        now = time.time()
        self._created = created  # removed again on release if the run wrote nothing (a config or data error)
        self._fd, self._info = fd, {"host": host, "pid": os.getpid(), "since": now, "heartbeat": now}
        self._write()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="jaxlm-run-lock", daemon=True)
        self._thread.start()
        return self

    def _write(self) -> None:
        data = json.dumps(self._info).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._info["heartbeat"] = time.time()
            try:
                self._write()
            except OSError as e:  # a full or vanished disk: the run itself will say so
                log.warning("run directory lock: could not refresh the heartbeat (%s)", e)

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._info["released"] = True
            self._write()
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        if self._created and [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
            self.path.unlink()
            for directory in self._created:  # innermost first; only what this lock created, only if empty
                try:
                    directory.rmdir()
                except OSError:
                    break

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
