"""Run `python -m jaxlm.<command> ...` in processes forked from one that imported the libraries once.

Most of a failing command's time is its start-up: the interpreter importing JAX, Flax and jaxlm
before the command refuses its input in one line. `CommandForks` starts this file once as a server
(`python tests/command_forks.py`), which imports the command modules and what they import at the
top, without starting any JAX backend (no device, no array: a process forked after that would
inherit XLA's threads, and JAX warns at such a fork), then forks one child per command. Each child
is its own process, as a subprocess would be, and becomes what `python -m jaxlm.<command> args` is:
the command's environment, working directory, file-size limit, sys.path[0] (the working directory,
as -m puts it), sys.argv and sys.orig_argv; the package's start-up (`jaxlm/__init__.py` parses the
arguments early when sys.orig_argv holds `-m jaxlm.<command>`: re-run by reloading the package);
the module run as `__main__` by runpy; and the interpreter's exit (SystemExit's code or message, a
traceback and exit 1, non-daemon threads joined, atexit handlers run, stdio flushed). Its stdin is
/dev/null or a file the caller names (all of a subprocess's input written at once, then its end); its
stdout and stderr go to files the caller names.

Only a command whose environment is the server's is the same when forked: JAX reads its JAX_*
variables when it is imported (here, once). A caller runs a command with another environment (or
one it signals while reading its output) as a real subprocess instead. `run_command`, for any test,
keeps one server per environment in the test's process (started on first use, stopped and checked at
the session's end by tests/conftest.py) and answers as `subprocess.run` would.

Protocol: one JSON object a line on the server's stdin, {"id", "command", "args", "cwd", "env",
"stdin", "stdout", "stderr", "file_size_limit"}; on its stdout {"ready": true, ...} once the imports are
done, then {"id", "pid"} when a child is forked and {"id", "code"} when it ends (a death by a
signal as minus the signal's number, as subprocess reports it). The server's own stderr (a file
the caller gives) must stay empty: a warning there (a library's at import, JAX's at a fork) is a
difference from a real start-up.
"""

from __future__ import annotations

import collections
import json
import os
import select
import sys
import threading

# The command modules, imported once here with what they import at the top (JAX, Flax, optax, ...; not
# what jaxlm imports when first used, Orbax and grain: importing Orbax configures the root logger, which a
# command's own logging set-up, `console.command_logging`, then leaves alone)
COMMANDS = ("jaxlm.train", "jaxlm.evaluate", "jaxlm.generate", "jaxlm.hf", "jaxlm.plan", "jaxlm.data.prepare",
            "jaxlm.data.tokenizer", "jaxlm.experiment", "jaxlm.compress.cli")
# What `python -m jaxlm.<command>` has imported when runpy looks for the command's module: the package (and,
# under -m, its `jaxlm.commands`) and the command's parent package. A command module among them stays
# (runpy then warns that it was imported already, as it does in a real start); any other is removed in the
# child, which runs it afresh as __main__ the way -m does.
_IMPORTED_FIRST: set[str] = set()


# ----------------------------------------------------------------------------- the server


def _preload() -> dict:
    import importlib
    import logging

    for name in ("jaxlm", "jaxlm.commands", *{c.rpartition(".")[0] for c in COMMANDS}):
        importlib.import_module(name)
    _IMPORTED_FIRST.update(name for name in sys.modules if name.startswith("jaxlm."))
    for name in COMMANDS:
        importlib.import_module(name)
    from jax._src import xla_bridge

    assert not xla_bridge._backends, "a JAX backend was initialised while importing: forking would not be safe"
    assert not logging.getLogger().handlers, f"a library configured logging at import: {logging.getLogger().handlers}"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    return {"ready": True, "python_threads": threading.active_count(), "os_threads": threads}


def _exit_code_of(exc: BaseException | None) -> int:
    """What the interpreter does with what ended `__main__` (Python/pythonrun.c: _Py_HandleSystemExit and
    PyErr_Print): the exit status."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr)
        return 1
    sys.excepthook(type(exc), exc, exc.__traceback__)
    return 1


def _child(request: dict, reply_fd: int) -> None:
    """In the forked child: become `python -m jaxlm.<command> args`, run it, exit. Never returns."""
    code = 1
    exc: BaseException | None = None
    try:
        os.close(reply_fd)
        stdin = os.open(request.get("stdin") or os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("file_size_limit"):
            import resource

            limit = int(request["file_size_limit"])
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        module = f"jaxlm.{request['command']}"
        args = list(request["args"])
        # `python -m`: sys.path[0] is the working directory; while the package imports, sys.argv[0] is "-m"
        sys.path[0] = os.getcwd()
        sys.argv = ["-m", *args]
        sys.orig_argv = [sys.executable, "-m", module, *args]
        # the command module runs as __main__, not as the copy imported here
        for name in (module, f"{module}.__main__"):
            if name in sys.modules and name not in _IMPORTED_FIRST:
                del sys.modules[name]
                parent, _, child = name.rpartition(".")
                if hasattr(sys.modules.get(parent), child):
                    delattr(sys.modules[parent], child)
        import importlib
        import runpy

        import jaxlm

        try:
            importlib.reload(jaxlm)  # the package's start-up for `-m jaxlm.<command>` (its early parse)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except BaseException as e:  # noqa: BLE001 -- the interpreter's own handling, below
            exc = e
        code = _exit_code_of(exc)
        threading._shutdown()  # the interpreter's exit: non-daemon threads joined, then atexit
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 -- a failure of this harness: shown, and an exit status no command uses
        import traceback

        traceback.print_exc()
        code = 99
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        if isinstance(exc, KeyboardInterrupt):  # as the interpreter ends on an uncaught Ctrl-C: by SIGINT
            import signal

            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def serve(max_children: int = 3) -> None:
    # the replies go to the original stdout; fd 1 becomes stderr so that nothing printed here mixes into them
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(reply_fd, "w", buffering=1)
    reply.write(json.dumps(_preload()) + "\n")
    pending: collections.deque[dict] = collections.deque()
    children: dict[int, object] = {}
    data, eof = b"", False
    while not eof or pending or children:
        while pending and len(children) < max_children:
            request = pending.popleft()
            pid = os.fork()
            if pid == 0:
                _child(request, reply_fd)
            children[pid] = request["id"]
            reply.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
        if not eof:
            readable, _, _ = select.select([0], [], [], 0.02)
            if readable:
                chunk = os.read(0, 65536)
                eof = not chunk
                data += chunk
                *lines, data = data.split(b"\n")
                pending.extend(json.loads(line) for line in lines if line.strip())
        elif children:
            select.select([], [], [], 0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply.write(json.dumps({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)}) + "\n")


# ----------------------------------------------------------------------------- the client


class CommandForks:
    """The server, started by the caller's process; `run` is safe from several threads at once."""

    def __init__(self, cwd, env: dict[str, str], log_path, max_children: int = 3):
        import subprocess

        self.env = dict(env)
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 -- closed by close()
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(max_children)], cwd=cwd,
                                      env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, bufsize=1)
        self._lock = threading.Lock()
        self._futures: dict[int, dict] = {}
        self._next = 0
        self._ready = threading.Event()
        self.info: dict = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self.info = message
                self._ready.set()
                continue
            with self._lock:
                entry = self._futures[message["id"]]
            if "pid" in message:
                entry["pid"] = message["pid"]
            else:
                entry["future"].set_result(message["code"])
        self._ready.set()
        with self._lock:
            for entry in self._futures.values():
                if not entry["future"].done():
                    entry["future"].set_exception(RuntimeError(f"the fork server ended: {self.server_stderr()}"))

    def server_stderr(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def run(self, command: str, args, *, cwd, stdout, stderr, file_size_limit: int = 0, timeout: float = 600,
            stdin=None, env: dict[str, str] | None = None) -> int:
        """`python -m jaxlm.<command> args` in `cwd` with the server's environment (or `env`, which may differ
        from it only in variables no library reads at import), its output written to the files `stdout` and
        `stderr` (its input read from the file `stdin`, if given); its exit code."""
        import concurrent.futures
        import signal
        import subprocess

        self._ready.wait(timeout)
        if not self.info:
            raise RuntimeError(f"the fork server did not start: {self.server_stderr()}")
        with self._lock:
            self._next += 1
            ident = self._next
            entry = self._futures[ident] = {"future": concurrent.futures.Future()}
            self._proc.stdin.write(json.dumps({
                "id": ident, "command": command, "args": [str(a) for a in args], "cwd": str(cwd),
                "env": dict(self.env if env is None else env),
                "stdin": str(stdin) if stdin is not None else "", "stdout": str(stdout), "stderr": str(stderr),
                "file_size_limit": file_size_limit}) + "\n")
            self._proc.stdin.flush()
        try:
            return entry["future"].result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if "pid" in entry:
                os.kill(entry["pid"], signal.SIGKILL)
            raise subprocess.TimeoutExpired([command, *args], timeout) from None

    def close(self) -> str:
        """Stop the server (after its children end); its stderr."""
        self._proc.stdin.close()
        self._proc.wait(timeout=600)
        self._reader.join(timeout=60)
        self._log.close()
        return self.server_stderr()


# ----------------------------------------------------------------------------- one server per environment


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's: its jaxlm is imported
_SERVERS: dict[tuple, CommandForks] = {}
_SERVERS_LOCK = threading.Lock()
_OUTPUTS: list = []


# What pytest sets in the environment for each test (its name and phase): read by no library, so a command
# whose environment differs from a server's only there forks from it, with its own value
_PER_TEST = ("PYTEST_CURRENT_TEST",)


def _server(env: dict[str, str]) -> CommandForks:
    """This process's server for the environment `env` (started on first use; `close_all` stops them)."""
    import tempfile

    key = tuple(sorted((k, v) for k, v in env.items() if k not in _PER_TEST))
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            if not _OUTPUTS:
                _OUTPUTS.append(tempfile.TemporaryDirectory(prefix="jaxlm-forks-"))
            log = os.path.join(_OUTPUTS[0].name, f"server-{len(_SERVERS)}.err")
            _SERVERS[key] = CommandForks(_ROOT, env, log)
        return _SERVERS[key]


def run_command(command: str, args, *, env: dict[str, str], cwd, input: str | None = None, timeout: float = 600):
    """`python -m jaxlm.<command> args` as `subprocess.run(..., capture_output=True, text=True)` runs it, with
    the environment `env` and standard input `input` (then its end): a `subprocess.CompletedProcess`. Forked
    from this process's server for `env` (the same process a real start makes: this file's docstring), or
    a real subprocess under JAXLM_TEST_NO_FORK=1. Not for a command signalled or read while it runs."""
    import subprocess

    argv = [sys.executable, "-m", f"jaxlm.{command}", *(str(a) for a in args)]
    if os.environ.get("JAXLM_TEST_NO_FORK") == "1":
        return subprocess.run(argv, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout)
    server = _server(dict(env))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jaxlm-fork-") as directory:
        out, err, given = (os.path.join(directory, name) for name in ("out", "err", "in"))
        if input is not None:
            with open(given, "w") as f:
                f.write(input)
        code = server.run(command, argv[3:], cwd=cwd, stdout=out, stderr=err, timeout=timeout,
                          stdin=given if input is not None else None, env=env)
        with open(out) as f_out, open(err) as f_err:
            return subprocess.CompletedProcess(argv, code, f_out.read(), f_err.read())


def close_all() -> dict[str, str]:
    """Stop this process's servers; what each wrote to its stderr, by its log's path (empty when all is well)."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    said = {server.log_path: server.close() for server in servers}
    for server in servers:  # the server forks from one thread only (a fork copies no other)
        assert server.info.get("python_threads") == 1, (server.info, said[server.log_path][-3000:])
    while _OUTPUTS:
        _OUTPUTS.pop().cleanup()
    return said


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` has it: the working directory's jaxlm, not an installed one
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
