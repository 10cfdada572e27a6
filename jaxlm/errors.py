"""User-facing errors: one line that says what to change, printed the same way by every command.

Exit codes, the same for every `python -m jaxlm.<command>`:
  2   a mistake in the config, the flags, a path or the data (`UserError`)
  74  the environment failed: a disk full, a path not writable (`EnvironmentFailure`, OSError)
  75  stopped by SIGTERM (a preemption): run the same command again to resume
  130 interrupted by Ctrl-C (SIGINT): run the same command again to resume
The training loop adds 3 (a non-finite step under `optim.on_nonfinite=stop`) and saves a checkpoint
before it exits 75 or 130 (`jaxlm.train`).
"""

import errno
import importlib.util
import pathlib
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import ModuleType

EXIT_USER_ERROR = 2  # every jaxlm command: a mistake in the config, the flags, a path or the data
EXIT_ENVIRONMENT = 74  # EX_IOERR
EXIT_TERMINATED = 75  # EX_TEMPFAIL: "try again", a re-run resumes
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C


class UserError(ValueError):
    """A mistake in the config, a path or the data; the CLI prints it as one line and exits 2."""


class EnvironmentFailure(Exception):
    """The machine, not the config: a disk full, a directory not writable; one line, exit 74."""


class Terminated(Exception):
    """SIGTERM arrived outside the training loop (which handles it itself)."""


def is_utf8(text: str) -> bool:
    """Whether `text` is UTF-8 text. A command-line argument that is not (a file name in another
    encoding) reaches Python holding lone surrogates (PEP 383), which every path and C++ library call
    later fails on; each command refuses it where it reads it, in one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def in_user_file(error: Exception, path: str | pathlib.Path) -> UserError:
    """The error a user's Python file (a recipe, an experiment) raised, as one line naming the file
    and line: a SyntaxError's own line, otherwise the innermost frame inside that file."""
    resolved, line = pathlib.Path(path).resolve(), None
    if isinstance(error, SyntaxError) and error.filename and pathlib.Path(error.filename).resolve() == resolved:
        line, text = error.lineno, error.msg
    else:
        for frame in traceback.extract_tb(error.__traceback__):
            if pathlib.Path(frame.filename).resolve() == resolved:
                line = frame.lineno
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    where = f"{path}:{line}" if line else str(path)
    return UserError(f"{where}: {type(error).__name__}: {text}" if text else f"{where}: {type(error).__name__}")


def run_user_file(path: str | pathlib.Path, module_name: str) -> ModuleType:
    """Execute a user's Python file as module `module_name`; an error in it is one line (`in_user_file`)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever the file does wrong, it is the user's file
        raise in_user_file(e, path) from None
    return module


def report_error(error: BaseException | str) -> int:
    """Print `jaxlm: error: <error>` to stderr; returns the exit code, for `return report_error(e)` in a `main`."""
    print(f"jaxlm: error: {error}", file=sys.stderr)
    return EXIT_USER_ERROR


# OSErrors that say something about the machine or a path, not about jaxlm: one line, never a traceback.
_ENVIRONMENT_ERRNOS = {
    errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied", errno.EPERM: "not permitted",
    errno.EFBIG: "the file grew past the size limit", errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "it is a directory", errno.EEXIST: "it exists and is not a directory", errno.EIO: "an I/O error",
    errno.ENAMETOOLONG: "the file name is too long for the filesystem",
}
# A library's I/O error that is an OSError in all but its type (safetensors', tokenizers' Rust errors end so)
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


def os_errno_in(e: BaseException) -> int | None:
    """The errno a non-OSError exception reports in its text ("... (os error 27)"), or None."""
    found = _OS_ERROR_IN_TEXT.search(str(e))
    return int(found.group(1)) if found else None


def describe_os_error(e: OSError) -> str | None:
    """One line for an OSError of the environment (naming the path), None for any other."""
    if e.errno not in _ENVIRONMENT_ERRNOS:
        return None
    path = f"{e.filename}: " if e.filename else ""
    return f"{path}{_ENVIRONMENT_ERRNOS[e.errno]}"


def _terminate(signum, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def run_command(body: Callable[[], int | None], *, resume: str = "run the same command again to continue") -> int:
    """Run a command's `main` body and turn what ends it into one line and an exit code.

    UserError -> 2; EnvironmentFailure or an OSError of the environment -> 74; SIGTERM -> 75 and
    Ctrl-C -> 130, each with `resume`, which says how to go on (every command leaves what it wrote
    complete or recognisably partial, so the same command continues). Any other exception is a bug
    and keeps its traceback.
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (the package's start-up handler ends here)
    try:
        return body() or 0
    except UserError as e:
        return report_error(e)
    except EnvironmentFailure as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except OSError as e:
        line = describe_os_error(e)
        if line is None:
            raise
        print(f"jaxlm: error: {line}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except Terminated as e:
        print(f"jaxlm: stopped by {e}; {resume}", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print(f"jaxlm: interrupted; {resume}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # a library's own I/O error (safetensors, tokenizers): the environment's, as an OSError
        if str(e).startswith("Unable to initialize backend"):  # JAX_PLATFORMS naming a backend this machine lacks
            print(f"jaxlm: error: {str(e).splitlines()[0]}; `python -m jaxlm.doctor` says what this machine has",
                  file=sys.stderr)
            return EXIT_ENVIRONMENT
        number = os_errno_in(e)
        if number not in _ENVIRONMENT_ERRNOS:
            raise
        print(f"jaxlm: error: {_ENVIRONMENT_ERRNOS[number]} ({str(e).splitlines()[0]})", file=sys.stderr)
        return EXIT_ENVIRONMENT
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
