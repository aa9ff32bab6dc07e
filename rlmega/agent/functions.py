"""User code by function path: ``path/to/file.py:name`` (as reward functions are given) or ``package.module:name``.

A check before the run reads the path without running user code (a file is parsed, a module is located);
``load_callable`` imports it, in the process that calls it (a tool worker for tools).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Callable

from rlmega.errors import UserError
from rlmega.rewards.user_function import check_function_defined, load_function


def _split(spec: str, field: str, alternatives: str) -> tuple[str, str]:
    target, separator, name = str(spec).rpartition(":")
    if not separator or not target or not name.isidentifier():
        choices = f"{alternatives} " if alternatives else ""
        raise UserError(f"{field}={spec}: expected {choices}'module:function' or 'path/to/file.py:function'")
    return target, name


def check_function_spec(spec: str, field: str, alternatives: str = "") -> None:
    """UserError naming ``field`` unless ``spec`` names a function that can be found: a file that defines it, or a
    module that exists (its function is checked when it is loaded)."""
    target, _ = _split(spec, field, alternatives)
    if target.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise UserError(f"{field}={spec}: file not found: {path}")
        check_function_defined(spec, field)
        return
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as error:
        raise UserError(f"{field}={spec}: cannot import {target} ({error})") from None
    if found is None:
        raise UserError(f"{field}={spec}: no module named {target}")


def load_callable(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names, imported (a file's folder joins ``sys.path``); ValueError when it is none."""
    target, name = _split(spec, "function", "")
    if target.endswith(".py"):
        return load_function(spec)
    function = getattr(importlib.import_module(target), name, None)
    if not callable(function):
        raise ValueError(f"{spec!r}: module {target} has no callable named {name!r}")
    return function
