"""The ``rlmega`` command line; subcommands are registered in :mod:`rlmega.cli.main`."""
