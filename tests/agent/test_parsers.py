"""Reading tool calls from a turn: Hermes / Qwen blocks, malformed ones, several per turn, user parsers."""

import textwrap

from rlmega.agent.parsers import ToolCall, hermes_parser, load_parser, parse_turn


def test_one_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*7"}}\n</tool_call>'
    assert hermes_parser(text) == [ToolCall("calculator", {"expression": "3*7"})]


def test_several_calls_in_one_turn_keep_their_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>')
    assert hermes_parser(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]})]


def test_no_call_is_an_answer():
    assert hermes_parser("The answer is 8.") == []


def test_invalid_calls_become_errors_not_exceptions():
    calls = hermes_parser('<tool_call>{"name": "a", "arguments": {"x": 1</tool_call>'
                          '<tool_call>["not", "an", "object"]</tool_call>'
                          '<tool_call>{"name": "c", "arguments": 5}</tool_call>'
                          '<tool_call>{"name": "d"}</tool_call>'
                          '<tool_call>{"name": "e", "arguments": {}')
    assert [call.error is None for call in calls] == [False, False, False, True, False]
    assert "not valid JSON" in calls[0].error
    assert '"name"' in calls[1].error
    assert '"arguments" must be a JSON object' in calls[2].error
    assert calls[3] == ToolCall("d", {})
    assert "not closed" in calls[4].error


def test_user_parser_by_file_and_module_path(tmp_path):
    path = tmp_path / "my_parser.py"
    path.write_text(textwrap.dedent("""
        def parse(text):
            if text.endswith("="):
                return [{"name": "calculator", "arguments": {"expression": text[:-1]}}]
            return []

        def broken(text):
            raise RuntimeError("oops")

        def wrong_type(text):
            return "calculator"
    """))
    parser = load_parser(f"{path}:parse")
    assert parse_turn(parser, "3+5=") == ([ToolCall("calculator", {"expression": "3+5"})], None)
    assert parse_turn(parser, "8") == ([], None)
    assert parse_turn(load_parser(f"{path}:broken"), "x") == ([], "RuntimeError: oops")
    calls, failure = parse_turn(load_parser(f"{path}:wrong_type"), "x")
    assert calls == [] and "not a list" in failure
    assert load_parser("rlmega.agent.parsers:hermes_parser") is hermes_parser
    assert load_parser("hermes") is hermes_parser
