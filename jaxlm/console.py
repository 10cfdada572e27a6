"""What a run prints: one line per message, from process 0 only."""

import jax


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def console(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)
