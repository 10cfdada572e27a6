"""User-facing errors: one line that says what to change, printed the same way by every command."""

import sys

EXIT_USER_ERROR = 2  # every jaxlm command: a mistake in the config, the flags, a path or the data


class UserError(ValueError):
    """A mistake in the config, a path or the data; the CLI prints it as one line and exits 2."""


def report_error(error: BaseException | str) -> int:
    """Print `jaxlm: error: <error>` to stderr; returns the exit code, for `return report_error(e)` in a `main`."""
    print(f"jaxlm: error: {error}", file=sys.stderr)
    return EXIT_USER_ERROR
