"""jaxlm: train decoder language models with JAX and Flax NNX.

`python -m jaxlm.<command> ...` imports this package first: its arguments are parsed here, before the
command imports JAX (seconds), so that `--help` and a bad flag are answered at once
(`jaxlm.commands.parse_early`; `benchmarks/cli_startup.py`). Importing jaxlm any other way (a
notebook, a script, the tests) does nothing more.
"""

import sys as _sys


def _command_line() -> tuple[str, list[str]] | None:
    """(the module, its arguments) when this process is `python [options] -m jaxlm.<command> ...`."""
    argv = list(getattr(_sys, "orig_argv", ()))
    if "-m" not in argv[1:]:
        return None
    at = argv.index("-m", 1)
    if at + 1 >= len(argv) or not argv[at + 1].startswith("jaxlm."):
        return None
    return argv[at + 1], argv[at + 2:]


def _interrupted_while_starting(signum, frame) -> None:
    """Ctrl-C while a command imports its libraries (seconds): one line and exit 130, not a traceback
    from inside an import; the command's own handling (`errors.run_command`) takes over once it runs."""
    print("jaxlm: interrupted while starting, before anything was written; run the same command again",
          file=_sys.stderr)
    raise SystemExit(130)


if (_command := _command_line()) is not None:
    import signal as _signal

    _signal.signal(_signal.SIGINT, _interrupted_while_starting)
    from jaxlm import commands as _commands

    _commands.parse_early(*_command)
