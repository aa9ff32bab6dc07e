"""The built-in tools: ``calculator`` (arithmetic by a safe walk over Python's syntax tree, no ``eval``) and
``python`` (a program run in a fresh, isolated interpreter). Both run in a tool worker, under its timeout and
memory limit."""

from __future__ import annotations

import ast
import math
import operator
import subprocess
import sys
import tempfile

from rlmega.agent.tools import ToolError, tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
              "abs": abs, "round": round, "min": min, "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_MAX_EXPONENT = 1000
_MAX_DIGITS = 4000
_MAX_BITS = int(_MAX_DIGITS * 3.33)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        if (isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int)
                and abs(left).bit_length() * right > _MAX_BITS):  # refused before it is computed
            raise ToolError(f"the result would have more than {_MAX_DIGITS} digits (too large)")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, int) and result.bit_length() > _MAX_BITS:
            raise ToolError(f"the result has more than {_MAX_DIGITS} digits (too large)")
        return result
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*(_evaluate(argument) for argument in node.args))
    raise ToolError(f"unsupported expression: {ast.unparse(node)!r} (numbers, + - * / // % **, parentheses, "
                    f"{', '.join(sorted(_FUNCTIONS))}, pi, e)")


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


@tool(description="Evaluate an arithmetic expression and return its value.",
      parameters={"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 3 / sqrt(16)"}})
def calculator(expression: str) -> str:
    try:
        tree = ast.parse(str(expression).strip(), mode="eval")
    except SyntaxError as error:
        raise ToolError(f"not an expression: {error.msg}") from None
    try:
        return _format(_evaluate(tree))
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as error:
        raise ToolError(f"{type(error).__name__}: {error}") from None


@tool(description="Run a Python program and return what it prints (stdout, then stderr).",
      parameters={"code": {"type": "string", "description": "a complete Python program; print the results"}})
def python(code: str) -> str:
    with tempfile.TemporaryDirectory(prefix="rlmega-python-") as folder:
        # -I: isolated (no user site, no PYTHON* variables, the program's folder not on sys.path). The worker's
        # memory limit holds for this child too, and the worker's timeout kills its whole process group.
        result = subprocess.run([sys.executable, "-I", "-c", str(code)], cwd=folder, capture_output=True,
                                stdin=subprocess.DEVNULL, text=True, errors="replace")
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise ToolError(output.strip() or f"the program exited with code {result.returncode}")
    return output if output else "(no output)"


BUILTIN_TOOLS = {"calculator": calculator, "python": python}
