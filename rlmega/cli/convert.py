"""``rlmega convert``: the checkpoint converters of ``converters/`` as an rlmega subcommand."""

from converters.cli import HELP, add_arguments, run

__all__ = ["HELP", "add_arguments", "run"]
