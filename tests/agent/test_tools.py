"""Tools in their worker processes: the calculator and the python interpreter (results, errors, timeouts, the
memory limit), user tools by file or module path with their schemas, and failures that answer the model."""

import textwrap
import time

import pytest

from rlmega.agent.builtin import calculator
from rlmega.agent.parsers import ToolCall
from rlmega.agent.tools import ToolBox, ToolError, schema_of


@pytest.fixture(scope="module")
def box():
    with ToolBox(["calculator", "python"], num_workers=2, timeout_s=3.0, memory_mb=512, max_output_chars=300) as box:
        yield box


@pytest.mark.parametrize("expression, value", [("3*(4+5)", "27"), ("7/2", "3.5"), ("8/2", "4"), ("-2**3", "-8"),
                                               ("sqrt(16) + max(1, 2)", "6"), ("10 % 4 // 1", "2")])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"), ("__import__('os').system('ls')", "unsupported expression"),
    ("2**100000", "exponent 100000 is too large"), ("3 +", "not an expression"), ("'a' * 3", "unsupported"),
    ("(9**999)**999", "too large"),
])
def test_calculator_refuses_without_evaluating(expression, message):
    with pytest.raises(ToolError, match=message):
        calculator(expression)


def test_builtin_tools_run_in_workers(box):
    assert [schema["function"]["name"] for schema in box.schemas] == ["calculator", "python"]
    assert box.schemas[0]["function"]["parameters"]["required"] == ["expression"]
    results = box.run([ToolCall("calculator", {"expression": "6*7"}), ToolCall("python", {"code": "print(6*7)"}),
                       ToolCall("python", {"code": "pass"})])
    assert [(r.status, r.output) for r in results] == [("ok", "42"), ("ok", "42\n"), ("ok", "(no output)")]


def test_exceptions_become_error_messages(box):
    results = box.run([ToolCall("python", {"code": "raise KeyError('missing')"}),
                       ToolCall("calculator", {"expression": "1/0"}),
                       ToolCall("calculator", {"expr": "1"}),
                       ToolCall("search", {"query": "x"}),
                       ToolCall("", error="the tool call is not valid JSON")])
    assert [r.status for r in results] == ["error"] * 5
    assert "KeyError: 'missing'" in results[0].output
    assert results[1].output == "Error: division by zero"
    assert "unexpected keyword argument 'expr'" in results[2].output
    assert "no tool named 'search' (tools: calculator, python)" in results[3].output
    assert results[4].output == "Error: the tool call is not valid JSON"


def test_timeout_kills_the_call_and_the_pool_goes_on(box):
    started = time.monotonic()
    results = box.run([ToolCall("python", {"code": "while True: pass"}),
                       ToolCall("calculator", {"expression": "1+1"})])
    assert time.monotonic() - started < 10
    assert (results[0].status, results[0].output) == ("timeout", "Error: the tool call timed out after 3 s")
    assert results[1].output == "2"
    assert box.run([ToolCall("python", {"code": "print('alive')"})])[0].output == "alive\n"


def test_memory_limit(box):
    result = box.run([ToolCall("python", {"code": "block = bytearray(2 ** 30)"})])[0]
    assert result.status == "error" and "MemoryError" in result.output
    assert box.run([ToolCall("python", {"code": "print(len(bytearray(2 ** 20)))"})])[0].output == "1048576\n"


def test_long_output_is_cut(box):
    output = box.run([ToolCall("python", {"code": "print('x' * 1000)"})])[0].output
    assert output == "x" * 300 + "..."


USER_TOOLS = '''
from rlmega.agent import tool, ToolError

def lookup(city: str, year: int = 2024) -> str:
    """Population of a city.

    More text that is not part of the description."""
    if city == "Atlantis":
        raise ToolError(f"no data for {city}")
    return {"city": city, "year": year, "population": 1000}

@tool(description="Grow memory in this worker.", parameters={"megabytes": {"type": "integer"}})
def hog(megabytes):
    block = bytearray(megabytes * 2 ** 20)
    return str(len(block))
'''


def test_user_tools_by_path_with_schemas(tmp_path):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent(USER_TOOLS))
    specs = [f"{tmp_path}/my_tools.py:lookup", f"{tmp_path}/my_tools.py:hog", "rlmega.agent.builtin:calculator"]
    with ToolBox(specs, num_workers=1, timeout_s=5.0, memory_mb=256, max_output_chars=1000) as box:
        lookup, hog, calc = box.schemas
        assert lookup["function"] == {"name": "lookup", "description": "Population of a city.", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
            "required": ["city"]}}
        assert hog["function"]["parameters"]["properties"] == {"megabytes": {"type": "integer"}}
        assert calc["function"]["name"] == "calculator"
        results = box.run([ToolCall("lookup", {"city": "Paris"}), ToolCall("lookup", {"city": "Atlantis"}),
                           ToolCall("hog", {"megabytes": 1024}), ToolCall("hog", {"megabytes": 1})])
        assert results[0].output == '{"city": "Paris", "year": 2024, "population": 1000}'
        assert (results[1].status, results[1].output) == ("error", "Error: no data for Atlantis")
        assert results[2].status == "error" and "out of memory (limit 256 MB)" in results[2].output
        assert results[3].output == str(2 ** 20)


def test_schema_from_signature_without_annotations():
    def echo(text, times=1):
        return text * times

    assert schema_of(echo)["function"]["parameters"] == {
        "type": "object", "properties": {"text": {}, "times": {}}, "required": ["text"]}


def test_a_tool_that_cannot_load_names_itself(tmp_path):
    (tmp_path / "bad.py").write_text("raise ImportError('no such thing')\n")
    with pytest.raises(ValueError, match="tool .*bad.py:f.* failed to load"):
        ToolBox([f"{tmp_path}/bad.py:f"], num_workers=1, timeout_s=5.0, memory_mb=256, max_output_chars=100)
