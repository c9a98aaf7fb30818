"""Tool-call extraction: the non-streaming rules case by case, and the streaming parser against the
non-streaming one on random texts split at random points (Hypothesis)."""

from __future__ import annotations

import itertools
import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from oxibonsai.server.tool_parser import StreamingToolParser, ToolCall, parse_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def named(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def test_single_call_without_content() -> None:
    content, calls = parse_tool_calls(WEATHER)
    assert content is None
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_call_ids_are_openai_style_and_unique() -> None:
    _, calls = parse_tool_calls(WEATHER + WEATHER)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


def test_text_before_and_several_blocks() -> None:
    text = "Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo")
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert named(calls) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]


def test_text_after_a_call_is_kept() -> None:
    content, calls = parse_tool_calls("A\n" + WEATHER + "\nB  ")
    assert content == "A\n\nB"
    assert len(calls) == 1


def test_plain_text_has_no_calls() -> None:
    assert parse_tool_calls("  just text \n") == ("just text", [])
    assert parse_tool_calls("") == (None, [])
    assert parse_tool_calls(" \n ") == (None, [])


def test_arguments_keep_non_ascii_text() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>')
    assert calls[0].arguments == '{"city": "Zürich"}'


def test_arguments_as_json_string_pass_through() -> None:
    args = '{"city":  "Paris"}'
    block = "<tool_call>" + json.dumps({"name": "f", "arguments": args}) + "</tool_call>"
    assert named(parse_tool_calls(block)[1]) == [("f", args)]


def test_missing_or_null_arguments_are_empty_object() -> None:
    for payload in ('{"name": "f"}', '{"name": "f", "arguments": null}'):
        assert named(parse_tool_calls(f"<tool_call>{payload}</tool_call>")[1]) == [("f", "{}")]


INVALID_BLOCKS = [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "[1, 2]"}</tool_call>',
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
]


def test_invalid_blocks_stay_in_content() -> None:
    for block in INVALID_BLOCKS:
        content, calls = parse_tool_calls("x " + block + " " + WEATHER)
        assert content == "x " + block, block[:60]
        assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_unterminated_block_is_content() -> None:
    text = 'ok <tool_call>\n{"name": "f", "arguments": {}}'
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls(WEATHER + "<tool_call>")[0] == "<tool_call>"


def test_block_ends_at_the_first_closing_tag() -> None:
    # An opening tag inside a block is just text of that block, so the block is invalid.
    text = '<tool_call> <tool_call>{"name": "f"}</tool_call>'
    assert parse_tool_calls(text) == (text, [])


def test_streaming_holds_a_partial_tag_back() -> None:
    parser = StreamingToolParser()
    assert parser.feed("Hi <tool") == ("Hi ", [])
    assert parser.feed("box>") == ("<toolbox>", [])
    assert parser.feed(" <") == (" ", [])
    assert parser.feed("tool_call>\n{") == ("", [])
    content, calls = parser.feed('"name": "f", "arguments": {"a": 1}}\n</tool_')
    assert (content, calls) == ("", [])
    content, calls = parser.feed("call> bye")
    assert content == " bye" and named(calls) == [("f", '{"a": 1}')]
    assert parser.finish() == ("", [])


def test_streaming_finish_returns_held_text_and_unterminated_blocks() -> None:
    parser = StreamingToolParser()
    assert parser.feed("a <tool_ca") == ("a ", [])
    assert parser.finish() == ("<tool_ca", [])
    parser = StreamingToolParser()
    assert parser.feed('<tool_call>{"name"') == ("", [])
    assert parser.finish() == ('<tool_call>{"name"', [])


# -- streaming == non-streaming ---------------------------------------------------------------------

PROSE_PIECES = [
    "a",
    " ",
    "\n",
    "<",
    ">",
    "/",
    "tool",
    "_call",
    "<tool",
    "<tool_call",
    "</tool_call>",
    "é",
    "{",
]
prose = st.lists(st.sampled_from(PROSE_PIECES), max_size=8).map("".join)
names = st.text("abcxyz_", min_size=1, max_size=6)
arguments = st.dictionaries(
    st.text("kqé", max_size=3), st.integers() | st.text(" <>\"'é", max_size=4), max_size=3
)


@st.composite
def valid_block(draw: st.DrawFn) -> str:
    args: object = draw(arguments)
    if draw(st.booleans()):
        args = json.dumps(args)
    payload = json.dumps({"name": draw(names), "arguments": args}, ensure_ascii=draw(st.booleans()))
    return "<tool_call>" + draw(st.sampled_from(["", "\n", " \n"])) + payload + "\n</tool_call>"


invalid_block = st.sampled_from(
    [
        "<tool_call>\n{oops}\n</tool_call>",
        '<tool_call>{"name": 1}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        "<tool_call>\n",
    ]
)


@st.composite
def tool_text(draw: st.DrawFn) -> str:
    blocks = draw(st.lists(valid_block() | invalid_block, max_size=3))
    return draw(prose) + "".join(block + draw(prose) for block in blocks)


@st.composite
def split(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_streaming_matches_parse_tool_calls(data: st.DataObject) -> None:
    """Streamed content joined and stripped is the non-streaming content (None as ""); the calls are
    the same names and arguments in the same order (ids are random)."""
    text = data.draw(tool_text())
    parser = StreamingToolParser()
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in [*data.draw(split(text)), None]:
        piece, done = parser.feed(delta) if delta is not None else parser.finish()
        content.append(piece)
        calls += done
    expected_content, expected_calls = parse_tool_calls(text)
    assert "".join(content).strip() == (expected_content or "")
    assert named(calls) == named(expected_calls)
