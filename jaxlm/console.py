"""What a run prints, from process 0 only: message lines, and a progress bar on a terminal."""

import logging
import sys

import jax
from tqdm import tqdm


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class _CommandLines(logging.Formatter):
    """jaxlm's records as `jaxlm: <message>`, another library's as `LEVEL name: <message>`."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "jaxlm" or record.name.startswith("jaxlm."):
            return f"jaxlm: {record.getMessage()}"
        return f"{record.levelname} {record.name}: {record.getMessage()}"


def command_logging() -> None:
    """A command's logging: jaxlm's own records from INFO up as `jaxlm: <message>` lines on stderr, other
    libraries' from WARNING up (the root logger's level), as `python -m jaxlm.train` shows them: INFO for
    every logger would print Orbax's and JAX's records of each checkpoint read ahead of a command's own
    lines. Where logging is configured already (a notebook, pytest), only jaxlm's level is set."""
    logging.getLogger("jaxlm").setLevel(logging.INFO)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_CommandLines())
        root.addHandler(handler)


def console(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


class Progress:
    """A progress bar (steps, rate, ETA and the key figures on one line) when `mode` is 'bar', or
    'auto' on a terminal; otherwise nothing, and the periodic step lines tell the progress.

    Lines printed through `line` go above the bar, so the bar stays the last line.
    """

    def __init__(self, total: int, initial: int, mode: str = "auto"):
        self.bar = None
        if jax.process_index() == 0 and (mode == "bar" or (mode == "auto" and sys.stdout.isatty())):
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, smoothing=0.1,
                            file=sys.stdout, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")

    def update(self, step: int, figures: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(figures, refresh=False)
            self.bar.update(step - self.bar.n)

    def line(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
            sys.stdout.flush()
        else:
            console(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
