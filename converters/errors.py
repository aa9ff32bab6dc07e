"""The one error type the converters raise for bad input: its message is one line that names the
problem and the fix, and the command line prints it as it is."""


class ConversionError(Exception):
    """A conversion that cannot go ahead; nothing has been left at the output path."""
