"""User reward functions given as ``path/to/file.py:function``, and the conversion of any scorer's return value.

The function is called with keyword arguments, as verl calls it::

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)

and returns a number (bool and int count) or a dict with a numeric ``score``; the dict's other numeric entries
are reported as metrics, the rest ignored.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable

from rlmega.errors import UserError


def parse_function_spec(spec: str) -> tuple[str, str]:
    """``"path/to/file.py:fn"`` as (absolute file path, function name); ValueError naming what is wrong."""
    path, separator, name = str(spec).rpartition(":")
    if not separator or not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"reward function {spec!r} must be given as 'path/to/file.py:function_name'")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"reward function {spec!r}: file not found: {path}")
    return path, name


def check_function_defined(spec: str, field: str = "reward.user_function") -> None:
    """UserError (naming the config ``field``) unless the file of ``spec`` defines or imports the
    function's name at its top level.

    The file is parsed, not run: a check before the run starts must not execute user code (which may
    import anything) in the launching process. Names a star import brings in cannot be known and pass."""
    path, name = parse_function_spec(spec)
    shown = str(spec).rpartition(":")[0]
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=shown)
    except (SyntaxError, ValueError) as error:
        line = f" line {error.lineno}" if getattr(error, "lineno", None) else ""
        raise UserError(f"{field}={spec}: {shown}{line}: not valid Python "
                        f"({getattr(error, 'msg', error)})") from None
    functions, other_names, star_import = [], set(), False
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(node.name)
        elif isinstance(node, ast.ClassDef):
            other_names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            star_import |= any(alias.name == "*" for alias in node.names)
            other_names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            other_names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    if name in functions or name in other_names or star_import:
        return
    defined = ", ".join(functions) if functions else "no functions"
    raise UserError(f"{field}={spec}: {shown} has no function {name} (it defines: {defined})")


def _top_level(statements: list[ast.stmt]):
    """The module-level statements, including those inside top-level if / try / with blocks."""
    for node in statements:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                yield from _top_level(block)


def load_function(spec: str) -> Callable[..., Any]:
    """Import the file of ``spec`` as a module (its folder joins ``sys.path`` so it can import its neighbours) and
    return the named callable. A file that fails to import raises UserError naming the file, the line and the error,
    on one line."""
    path, name = parse_function_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = "rlmega_user_reward_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        del sys.modules[module_name]
        raise UserError(f"{where_it_failed(error, path)}; fix that file, or install what it imports") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward function {spec!r}: {path} defines no callable named {name!r}")
    return function


def where_it_failed(error: BaseException, path: str) -> str:
    """``FILE line N: Type: message`` for an exception that running the user's file ``path`` raised, on one line: the
    line of ``path`` it passed through last (a syntax error: where it is), else the innermost line it came from."""
    import traceback

    if isinstance(error, SyntaxError) and error.filename and os.path.abspath(error.filename) == path:
        location, message = f"{path} line {error.lineno}", error.msg
    else:
        frames = traceback.extract_tb(error.__traceback__)
        in_file = [frame for frame in frames if os.path.abspath(frame.filename) == path]
        frame = (in_file or frames or [None])[-1]
        location = f"{frame.filename} line {frame.lineno}" if frame else path
        message = " ".join(str(error).split())
    return f"{location}: {type(error).__name__}: {message}" if message else f"{location}: {type(error).__name__}"


def _as_number(value: Any) -> float | None:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


def as_score(result: Any) -> tuple[float, dict[str, float]]:
    """A scorer's return value as (score, numeric extras); TypeError when it has no finite numeric score."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"reward dict has no 'score' key (keys: {sorted(map(str, result))})")
        score = _as_number(result["score"])
        extras = {str(key): _as_number(value) for key, value in result.items() if key != "score"}
        extras = {key: value for key, value in extras.items() if value is not None}
    else:
        score, extras = _as_number(result), {}
    if score is None:
        raise TypeError(f"reward must be a finite number or a dict with a numeric 'score', got {result!r:.120}")
    return score, extras
