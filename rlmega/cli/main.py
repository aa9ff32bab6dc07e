"""The ``rlmega`` console entry point: argparse with one subcommand per module.

To add a subcommand, write a module with a one-line ``HELP``, ``add_arguments(parser)`` and
``run(args) -> exit code``, and register it in ``SUBCOMMANDS``. A ``rlmega.errors.UserError`` that ``run``
raises (a bad config value, data file or reward function) is printed as ``rlmega <command>: <message>``
on one line, and the exit code is 2. Ctrl-C prints ``rlmega <command>: interrupted`` and exits with code 130
(``rlmega.cli.interrupts``); a failed allocation is one line too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional, Tuple

import rlmega
from rlmega.cli import convert, doctor, gateway, plan, sft, smoke, train
from rlmega.cli.interrupts import interrupts_end, print_interrupted
from rlmega.errors import RunFailure, UserError

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

# name -> (one-line help, add_arguments, run); the order here is the order in `rlmega --help`.
SUBCOMMANDS: Dict[str, Tuple[str, AddArguments, Run]] = {
    "train": (train.HELP, train.add_arguments, train.run),
    "sft": (sft.HELP, sft.add_arguments, sft.run),
    "quickstart": (train.QUICKSTART_HELP, train.add_arguments, train.run),
    "smoke": (smoke.HELP, smoke.add_arguments, smoke.run),
    "doctor": (doctor.HELP, doctor.add_arguments, doctor.run),
    "convert": (convert.HELP, convert.add_arguments, convert.run),
    "plan": (plan.HELP, plan.add_arguments, plan.run),
    "gateway": (gateway.HELP, gateway.add_arguments, gateway.run),
}

DESCRIPTION = (
    "rlmega: reinforcement-learning post-training of large language models on Megatron-Core.\n"
    "It runs the same code on GPU clusters and, for development and tests, on CPU-only machines."
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="rlmega",
        description=DESCRIPTION,
        epilog="Run 'rlmega <command> --help' for the options of one command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rlmega {rlmega.__version__}")
    commands = parser.add_subparsers(
        title="commands", dest="command", metavar="<command>", required=True
    )
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the chosen subcommand, return its exit code."""
    try:
        parser = build_parser()
        args, extras = parser.parse_known_args(argv)
        # argparse fills a positional list once: overrides after a flag (`resume=never --overwrite a.b=1`) come
        # back unrecognised, and are overrides all the same.
        if extras and isinstance(getattr(args, "overrides", None), list) and not any(e.startswith("-") for e in extras):
            args.overrides += extras
        elif extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
    except SystemExit as exit_request:
        # argparse exits on --help, --version and usage errors; return the code so callers
        # (tests, other tools) get an exit status from main() in every case.
        return int(exit_request.code or 0)
    with interrupts_end(args.command):  # Ctrl-C ends the command, even one stuck in native code
        try:
            return args.run(args)
        except UserError as error:
            # Bad input is the user's to fix, not a bug: one line, no traceback, exit code 2 (as for usage errors).
            print(f"rlmega {args.command}: {' '.join(str(error).splitlines())}", file=sys.stderr)
            return 2
        except RunFailure as error:
            # A worker died or failed: one line naming it; the traceback is in the run's logs.
            details = f" (details: {error.details})" if error.details else ""
            print(f"rlmega {args.command}: {' '.join(str(error).splitlines())}{details}", file=sys.stderr)
            return 1
        except MemoryError as error:  # a Python allocation failed (the data readers name their file themselves)
            reason = " ".join(str(error).split()) or "an allocation failed"
            print(f"rlmega {args.command}: out of memory ({reason}); raise the process's memory limit (ulimit -v, "
                  "the job's memory request) or make the run smaller", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return print_interrupted(args.command)


if __name__ == "__main__":
    sys.exit(main())
