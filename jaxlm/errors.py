"""User-facing errors: one line that says what to change."""


class UserError(ValueError):
    """A mistake in the config, a path or the data; the CLI prints it as one line and exits 2."""
