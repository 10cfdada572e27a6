"""jaxlm: train decoder language models with JAX and Flax NNX.

`python -m jaxlm.<command> ...` imports this package first: its arguments are parsed here, before the
command imports JAX (seconds), so that `--help` and a bad flag are answered at once
(`jaxlm.commands.parse_early`; `benchmarks/cli_startup.py`). Importing jaxlm any other way (a
notebook, a script, the tests) does nothing more.
"""

import sys as _sys


def _command_line(argv=None) -> tuple[str, list[str]] | None:
    """(the module, its arguments) when this process is `python [options] -m jaxlm.<command> ...`: the
    interpreter's own options, then -m (a script, -c or a -m of another module is not a command)."""
    argv = list(getattr(_sys, "orig_argv", ()) if argv is None else argv)
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        i += 2 if argv[i] in ("-X", "-W") else 1  # (the options that take a separate value)
    if i + 1 < len(argv) and argv[i] == "-m" and argv[i + 1].startswith("jaxlm."):
        return argv[i + 1], argv[i + 2:]
    return None


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
