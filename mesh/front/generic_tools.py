"""Tools for a model whose chat template cannot show them (SmolLM2's never reads
`tools`): the chat is rewritten into messages any template renders.

- The tools, and how to call one, are described in a system message (joined to the
  chat's own first system message, or leading the chat).
- An assistant's earlier calls become its text, each call written as the reply writes
  it (tool_calls.GENERIC: `<tool_call>`, the JSON of the call, `</tool_call>`).
- A tool's result becomes a user message, inside `<tool_response>` tags.

The reply is then read for calls in the same markers, and constrained by the same
grammars as a template's own format (request_building)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from skippy.topology.errors import RequestError

from .tool_calls import GENERIC


def describe(tools: Iterable[Mapping]) -> str:
    """The system text that offers `tools` (OpenAI's tools[i] objects)."""
    functions = [t.get("function", t) for t in tools]
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return ("You can call functions. To call one, reply with only the call, written as:\n"
            f"{GENERIC.open}\n"
            '{"name": "<the function\'s name>", "arguments": {<its arguments>}}\n'
            f"{GENERIC.close}\n"
            f"The functions:\n{listed}")


def generic_messages(messages: Iterable, tools: list[dict] | None) -> list:
    """`messages` as any template renders them (see the module docstring); `tools`: the
    tools to describe (None: none offered now, only the history is rewritten)."""
    out: list = []
    for m in messages:
        if not isinstance(m, Mapping):  # the template refuses it, as it would anyway
            out.append(m)
            continue
        role = m.get("role")
        if role == "tool":
            out.append({"role": "user", "content": "<tool_response>\n"
                        f"{_text(m.get('content'))}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in _calls(m["tool_calls"]))
            text = _text(m.get("content"))
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append(dict(m))
    if tools:
        offer = describe(tools)
        if out and isinstance(out[0], Mapping) and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{offer}"}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


def _calls(calls) -> list[Mapping]:
    if not isinstance(calls, list) or not all(
            isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls):
        raise RequestError("an assistant message's tool_calls must be an array of calls, "
                           "each with its function", "messages")
    return calls


def _call_text(call: Mapping) -> str:
    function = call["function"]
    raw = function.get("arguments") or "{}"
    if not isinstance(raw, str):
        raise RequestError("a tool call's arguments must be a string (of JSON)", "messages")
    try:
        arguments = json.loads(raw)
    except ValueError:
        arguments = raw
    body = json.dumps({"name": function.get("name"), "arguments": arguments},
                      ensure_ascii=False)
    return f"{GENERIC.open}\n{body}\n{GENERIC.close}"


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and
                                         isinstance(p.get("text", ""), str) for p in content):
        return "".join(p.get("text", "") for p in content)
    raise RequestError("a message's content must be a string or an array of text parts",
                       "messages")
