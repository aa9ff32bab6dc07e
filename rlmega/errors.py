"""The one error type for bad input: a config value, a data file or a user function that cannot work.

``rlmega <command>`` prints a ``UserError`` as one line, ``rlmega <command>: <message>``, and exits with
code 2, without a traceback; any other exception is a bug in rlmega and keeps its traceback. So the
message says what is wrong, where (the config field, or the file and row), and how to fix it, on one line.
"""


class UserError(ValueError):
    """Bad input, described in a one-line message that names where it is and how to fix it."""
