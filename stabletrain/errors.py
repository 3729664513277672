"""The one error a user's mistake raises: a config value, a data file or a checkpoint that
cannot run. Its message is one line naming the problem and the fix; the command line prints
it as ``error: ...`` and exits 2, with no traceback."""


class ConfigError(ValueError):
    """A value that cannot run; the message is one line naming the key and the fix."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty),
    for one-line reports of errors raised by other libraries."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
