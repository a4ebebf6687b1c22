"""The model's tool calls read into OpenAI's tool_calls: the Hermes format whole and as it
streams (they must agree however the text is cut), what is content and what a call, the
template checks, and the constraint that forces a call (compiled by the grammar engine)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy.mesh.constraint import lark_token
from skippy.mesh.front.tool_calls import (
    GENERIC,
    HERMES,
    ReplyDeltas,
    ToolCallStream,
    auto_constraint,
    call_constraint,
    format_of,
    merge,
    new_call_id,
    parse_reply,
    reply_format,
    whole_reply,
)
from skippy.mesh.front.tool_choice import ToolSpecError, parse_tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add"}}]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def whole(text: str):
    return parse_reply(HERMES, text, ids())


def streamed(text: str, cuts: list[int]):
    stream, events, at = ToolCallStream(HERMES, ids()), [], 0
    for cut in [*cuts, len(text)]:
        events += stream.push(text[at:cut])
        at = cut
    return merge(events + stream.finish()), events


def test_a_call_alone_is_a_tool_call_with_null_content():
    reply = whole(CALL)
    assert reply.content is None
    assert reply.tool_calls == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {
        "city": "Paris", "days": [1, 2]}


def test_text_before_calls_is_content_and_whitespace_between_is_dropped():
    text = f"Let me look.\n\n{CALL}\n{CALL.replace('get_weather', 'add')}\n"
    reply = whole(text)
    assert reply.content == "Let me look."
    assert [c["function"]["name"] for c in reply.tool_calls] == ["get_weather", "add"]
    assert [c["id"] for c in reply.tool_calls] == ["call_0", "call_1"]


def test_plain_text_is_all_content_even_when_it_looks_like_the_start_of_a_call():
    assert whole("Hello <tool_ca") == parse_reply(HERMES, "Hello <tool_ca")
    assert whole("Hello <tool_ca").content == "Hello <tool_ca"
    assert whole("").content == "" and whole("").tool_calls == []


def test_a_call_that_is_not_json_stays_text():
    text = "<tool_call>not json</tool_call> then"
    assert whole(text).content == text and whole(text).tool_calls == []


def test_arguments_given_as_a_string_or_before_the_name_are_read_whole():
    reply = whole('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>'
                  '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert [c["function"]["arguments"] for c in reply.tool_calls] == ['{"a": 1}', '{"a": 2}']


def test_a_call_cut_short_keeps_what_was_written():
    reply = whole(CALL[:60])
    assert reply.tool_calls[0]["function"]["name"] == "get_weather"
    assert reply.tool_calls[0]["function"]["arguments"] == CALL[CALL.index("{\"city"):60]


def test_the_stream_gives_the_name_first_then_pieces_of_the_arguments():
    _, events = streamed(CALL, list(range(1, len(CALL))))  # one character at a time
    calls = [v for kind, v in events if kind == "call"]
    assert calls[0] == {"index": 0, "id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    pieces = [c["function"]["arguments"] for c in calls[1:]]
    assert len(pieces) > 10 and all(set(c) == {"index", "function"} for c in calls[1:])
    assert "".join(pieces) == '{"city": "Paris", "days": [1, 2]}'
    assert not [v for kind, v in events if kind == "content"]


REPLIES = st.lists(st.sampled_from([
    CALL, "Sure.", "\n", " ", "<tool_call>", "</tool_call>", '{"name": "x", "arguments": {}}',
    '"}"', "<tool", "text with } and { braces", "\\", '{"a": "\\"}"}', "é世",
    '{"name": "a\\x", "arguments": {}}']) | st.text(max_size=4), max_size=8)


@settings(max_examples=300, deadline=None)
@given(parts=REPLIES, data=st.data())
def test_however_the_text_is_cut_the_stream_agrees_with_the_whole(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    assert streamed(text, cuts)[0] == whole(text)


def test_call_ids_look_like_openais():
    a, b = new_call_id(), new_call_id()
    assert a.startswith("call_") and len(a) == 29 and a != b


def test_finish_reason_is_tool_calls_only_when_the_reply_ended_after_calling():
    assert whole_reply(HERMES, CALL, "stop")[1] == "tool_calls"
    assert whole_reply(HERMES, CALL[:40], "length")[1] == "length"
    assert whole_reply(HERMES, "no call", "stop") == ("no call", "stop", [])
    assert whole_reply(None, CALL, "stop") == (CALL, "stop", [])  # tool_choice "none"


def test_streamed_deltas_carry_held_back_logprobs_with_the_next_delta():
    deltas = ReplyDeltas(HERMES)
    assert deltas.push("Hi ", ["a"]) == [("Hi", None, ["a"])]  # the space is held
    assert deltas.push("<tool", ["b"]) == []
    out = deltas.push('_call>{"name": "add", "arguments": {}}</tool_call>', ["c"])
    assert out[0][0] is None and out[0][1]["function"]["name"] == "add"
    assert out[0][2] == ["b", "c"]
    assert deltas.finish() == [] and deltas.finish_reason("stop") == "tool_calls"
    plain = ReplyDeltas(None)
    assert plain.push("x", None) == [("x", None, None)] and plain.finish() == []


# -- what the template can do ----------------------------------------------------------------
def test_the_format_comes_from_the_template_text():
    assert format_of("... <tool_call> ...") is HERMES
    assert format_of("{{ tools }} [TOOL_CALLS]") is None


def test_auto_is_constrained_where_the_marker_is_text_and_read_where_a_token():
    tools = parse_tools({"tools": TOOLS})
    c = auto_constraint(HERMES, tools, lambda text: None)
    assert c is not None and 'lead[stop="<tool_call>"]' in c.text
    assert auto_constraint(HERMES, tools, lambda text: 7) is None


def test_a_template_without_its_own_tool_format_is_served_the_generic_one():
    tools = parse_tools({"tools": TOOLS})
    assert reply_format("{{ messages }}", False, tools, []) is GENERIC
    assert reply_format("{{ tools }} [TOOL_CALLS]", True, tools, []) is GENERIC
    assert reply_format("{{ tools }} <tool_call>", True, tools, []) is HERMES
    history = [{"role": "tool", "tool_call_id": "x", "content": "1"}]
    assert reply_format("{{ messages }}", False, None, history) is None  # nothing to read
    assert reply_format("{{ messages }}", False, None, [{"role": "user"}]) is None


def test_none_renders_tools_but_reads_no_calls():
    template = "{{ tools }} <tool_call>"
    assert reply_format(template, True, parse_tools({"tools": TOOLS}), []) is HERMES
    none = parse_tools({"tools": TOOLS, "tool_choice": "none"})
    assert reply_format(template, True, none, []) is None


# -- forcing a call ------------------------------------------------------------------------------
def test_a_forced_call_is_a_grammar_over_the_named_functions():
    named = parse_tools({"tools": TOOLS, "parallel_tool_calls": False,
                         "tool_choice": {"type": "function", "function": {"name": "add"}}})
    grammar = call_constraint(HERMES, named, lambda text: None).text
    assert '"<tool_call>\\n"' in grammar and '"\\n</tool_call>"' in grammar
    assert '"const":"add"' in grammar and "get_weather" not in grammar
    required = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    grammar = call_constraint(HERMES, required, lambda text: None).text
    assert "get_weather" in grammar and '"const":"add"' in grammar


def test_markers_that_are_special_tokens_are_named_by_id():
    required = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    special = {"<tool_call>": 7, "</tool_call>": 8}
    grammar = call_constraint(HERMES, required, special.get).text
    assert f'{lark_token(7)} "\\n"' in grammar and f'"\\n" {lark_token(8)}' in grammar


def test_parameters_the_grammar_engine_cannot_use_are_the_clients_mistake():
    tools = parse_tools({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(?<=a)b"}}}}}], "tool_choice": "required"})
    with pytest.raises(ToolSpecError) as e:
        call_constraint(HERMES, tools, lambda text: None)
    assert e.value.param == "tools" and "\n" not in str(e.value)
