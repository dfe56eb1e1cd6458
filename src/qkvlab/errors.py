"""User-facing errors: one line, no traceback, exit status 2 from the CLI."""


class UserError(ValueError):
    """Bad input from a user (config value, file, flag). The message is one line that names
    the bad value and what is allowed."""
