"""The one error type for bad input: a config value, a data file or a user function that cannot work.

``rlmega <command>`` prints a ``UserError`` as one line, ``rlmega <command>: <message>``, and exits with
code 2, without a traceback; any other exception is a bug in rlmega and keeps its traceback. So the
message says what is wrong, where (the config field, or the file and row), and how to fix it, on one line.
"""


class UserError(ValueError):
    """Bad input, described in a one-line message that names where it is and how to fix it."""


class RunFailure(RuntimeError):
    """A part of a running job failed (a worker died, raised or stopped answering): one line naming it and
    why; ``details`` is the file that keeps the full traceback, once the run has written it."""

    details: str | None = None

    def relocate(self, old_dir: str, new_dir: str) -> None:
        """The run's logs moved from ``old_dir`` to ``new_dir``: name the files where they are now."""
        self.args = tuple(str(arg).replace(old_dir, new_dir) for arg in self.args)
        if self.details:
            self.details = self.details.replace(old_dir, new_dir)
