"""Imported once by the process that forks ``run_on_ranks``' ranks (``rlmega.parallel.spawn``), so that
each rank starts with torch and Megatron-Core already imported instead of importing them itself (about
4 s of CPU per rank here). Quiet: the libraries' import-time warnings would otherwise reach the console
of whoever started the first rank."""

import importlib
import logging
import warnings

MODULES = ("torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "rlmega.parallel.cpu_platform")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        import torch

        # One thread while imports run: a thread pool started here would not survive the fork into each rank.
        torch.set_num_threads(1)
        for name in MODULES:
            try:
                importlib.import_module(name)
            except ImportError:  # a rank that needs it reports the error itself
                pass
    finally:
        root.setLevel(level)
