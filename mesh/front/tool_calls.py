"""The model's tool calls: the format a chat template uses, and its reply read into
OpenAI's `tool_calls`, as it streams.

One format so far, Hermes / Qwen (what llama.cpp calls Hermes 2 Pro, and picks for any
template that mentions `<tool_call>`): each call is
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
after optional content. A template that does not read `tools`, or writes calls in
another format (Llama 3.1's bare JSON, Mistral's [TOOL_CALLS]), is served the generic
way: the same markers as plain text, the tools described in a system message
(generic_tools.py). A forced call (tool_choice "required" or a named function) is
constrained whole; "auto" by a grammar that starts when the reply opens a call, so a
call names only a function offered, with arguments its schema accepts.

`ToolCallStream` reads the reply as it grows and gives events: content text, or deltas
of OpenAI's streamed tool calls (the first with index, id, type, name and empty
arguments, then pieces of the arguments as the model writes them). The whole-reply
parser is the same stream fed at once, so a streamed reply and a whole one always agree.
The arguments are the model's own JSON text for them; a call that is not JSON is content,
as in llama.cpp. Whitespace between content and a call, or between calls, is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..constraint import Constraint, ConstraintError, check, lark_literal, lark_token, \
    tool_call, tool_call_or_text
from .tool_choice import ToolSpecError, ToolUse

Event = tuple[str, object]  # ("content", str) or ("call", OpenAI's tool-call delta dict)


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    open: str    # what starts a call, as the model writes it
    close: str   # what ends it


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
FORMATS = (HERMES,)
# For a template that cannot show tools (or not in a format read here): the tools are
# described in a system message and calls written in Hermes' markers as plain text
# (mesh/front/generic_tools.py), as llama-server's generic format does for such models.
GENERIC = ToolCallFormat("generic", "<tool_call>", "</tool_call>")


def format_of(template_text: str) -> ToolCallFormat | None:
    """The tool-call format of a chat template (None: one we cannot read)."""
    for fmt in FORMATS:
        if fmt.open in template_text:
            return fmt
    return None


def native_format(template_text: str | None, knows_tools: bool) -> ToolCallFormat | None:
    """The template's own tool-call format, or None where it has none read here (then
    the generic format serves: GENERIC)."""
    if template_text is None or not knows_tools:
        return None
    return format_of(template_text)


def has_tool_history(messages: Iterable) -> bool:
    """Whether a chat holds tool calls or tool results."""
    return any(isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls"))
               for m in messages)


def reply_format(template_text: str | None, knows_tools: bool, tools: ToolUse | None,
                 messages: Iterable[Mapping]) -> ToolCallFormat | None:
    """The format a chat reply is read in for tool calls (None: it is not: no tools, or
    tool_choice "none"): the template's own, or GENERIC where it has none."""
    if tools is None and not has_tool_history(messages):
        return None
    fmt = native_format(template_text, knows_tools) or GENERIC
    return fmt if tools is not None and tools.parsed else None


def call_constraint(fmt: ToolCallFormat, tools: ToolUse,
                    special_id: Callable[[str], int | None]) -> Constraint:
    """The constraint that forces a call (tool_choice "required" or a named function) in
    `fmt`. `special_id(text)`: the id of the vocabulary's special token spelled `text`, or
    None (a marker that is one special token must be written as that token)."""
    def marker(text: str, newline_after: bool) -> str:
        token = special_id(text)
        if token is None:
            return lark_literal(text + "\n" if newline_after else "\n" + text)
        newline = lark_literal("\n")
        return f"{lark_token(token)} {newline}" if newline_after else \
            f"{newline} {lark_token(token)}"

    constraint = tool_call(tools.callable_functions(), open=marker(fmt.open, True),
                           close=marker(fmt.close, False), parallel=tools.parallel)
    try:
        check(constraint)
    except ConstraintError as e:
        raise ToolSpecError(f"the tools' parameters cannot be used to force a call: {e}",
                            "tools") from None
    return constraint


def auto_constraint(fmt: ToolCallFormat, tools: ToolUse,
                    special_id: Callable[[str], int | None]) -> Constraint | None:
    """tool_choice "auto": text, or text and then valid calls to the functions offered
    (the grammar starts when the reply opens a call). None where the opening marker is a
    special token of the vocabulary (the reply is then read, not constrained)."""
    if special_id(fmt.open) is not None:
        return None
    constraint = tool_call_or_text(tools.callable_functions(), open_text=fmt.open,
                                   close=lark_literal("\n" + fmt.close),
                                   parallel=tools.parallel)
    try:
        check(constraint)
    except ConstraintError as e:
        raise ToolSpecError(f"the tools' parameters cannot constrain a call: {e}",
                            "tools") from None
    return constraint


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# {"name": "<name>", "arguments": ... : the part of a call that precedes its arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ToolCallStream:
    """Reply text in (`push`, then `finish`), events out (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat, new_id: Callable[[], str] = new_call_id):
        self.fmt, self.new_id = fmt, new_id
        self.calls = 0           # calls begun
        self._buf = ""           # text not yet given out
        self._state = "text"     # text | head (after open) | args | tail (args done)
        self._depth = 0          # JSON nesting within the arguments
        self._in_string = self._escaped = False
        self._after_call = False  # nothing but whitespace since the last call closed

    def push(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            step = getattr(self, f"_{self._state}")(events)
            if not step:
                return events

    def finish(self) -> list[Event]:
        """The reply ended: what was held back, settled."""
        events: list[Event] = []
        if self._state == "text":
            if self._buf and not (self.calls and self._buf.isspace()):
                events.append(("content", self._buf))
        elif self._state == "head":
            call = _whole_call(self._buf.strip())
            if call is not None:
                events += self._begin(*call)
            else:  # not a call after all: the text it was, as in llama.cpp
                events.append(("content", self.fmt.open + self._buf))
        self._buf, self._state = "", "text"
        return events

    # -- states: each consumes what it can and says whether to go on ------------------------
    def _text(self, events: list[Event]) -> bool:
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        at = self._buf.find(self.fmt.open)
        if at >= 0:
            before = self._buf[:at].rstrip()
            if before:
                events.append(("content", before))
            self._buf, self._state = self._buf[at + len(self.fmt.open):], "head"
            return True
        keep = _held(self._buf, self.fmt.open)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        if out:
            events.append(("content", out))
        return False

    def _head(self, events: list[Event]) -> bool:
        head = _HEAD.match(self._buf)
        if head is None or not self._buf[head.end():].lstrip():
            return self._whole_at_close(events)
        rest = self._buf[head.end():]
        name = _json_string(head.group(1))
        if rest.lstrip()[0] != "{" or name is None:  # read once the call closes
            return self._whole_at_close(events)
        events += self._begin(name, "")
        self._buf, self._state = rest.lstrip(), "args"
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _whole_at_close(self, events: list[Event]) -> bool:
        """A call we cannot stream: read it whole once it closes."""
        at = self._buf.find(self.fmt.close)
        if at < 0:
            return False
        call = _whole_call(self._buf[:at].strip())
        if call is None:
            events.append(("content", self.fmt.open + self._buf[:at + len(self.fmt.close)]))
        else:
            events += self._begin(*call)
            self._after_call = True
        self._buf, self._state = self._buf[at + len(self.fmt.close):], "text"
        return True

    def _args(self, events: list[Event]) -> bool:
        end = self._scan()
        piece = self._buf[:end]
        if piece:
            events.append(("call", {"index": self.calls - 1,
                                    "function": {"arguments": piece}}))
        self._buf = self._buf[end:]
        if self._depth == 0 and end > 0:
            self._state = "tail"
            return True
        return False

    def _tail(self, events: list[Event]) -> bool:
        at = self._buf.find(self.fmt.close)
        if at < 0:
            return False
        self._buf, self._state = self._buf[at + len(self.fmt.close):], "text"
        self._after_call = True
        return True

    # -- helpers -------------------------------------------------------------------------------
    def _begin(self, name: str, arguments: str) -> list[Event]:
        """A call's first delta (and its arguments when known whole)."""
        index = self.calls
        self.calls += 1
        events: list[Event] = [("call", {"index": index, "id": self.new_id(),
                                         "type": "function",
                                         "function": {"name": name, "arguments": ""}})]
        if arguments:
            events.append(("call", {"index": index, "function": {"arguments": arguments}}))
        return events

    def _scan(self) -> int:
        """How much of the buffer belongs to the arguments object: up to and including
        the brace that closes it, or all of it while it is still open."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(self._buf)


def _held(text: str, marker: str) -> int:
    """How much of the end of `text` to hold back: a part that could begin `marker`, and
    whitespace that only a call after it would drop."""
    keep = 0
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            keep = k
            break
    body = text[:len(text) - keep]
    return keep + len(body) - len(body.rstrip())


def _json_string(literal: str) -> str | None:
    """A JSON string literal's text; None when its escapes are not JSON's."""
    try:
        return json.loads(literal)
    except ValueError:
        return None


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a complete call body, or None when it is not one.
    Arguments given as a JSON string are taken as that string, as llama.cpp does."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return call["name"], arguments


@dataclass
class ParsedReply:
    """A whole reply: its content (None when it was only calls) and its tool calls."""

    content: str | None
    tool_calls: list[dict]


def parse_reply(fmt: ToolCallFormat, text: str,
                new_id: Callable[[], str] = new_call_id) -> ParsedReply:
    """`text` read at once, as the stream would read it."""
    stream = ToolCallStream(fmt, new_id)
    return merge(stream.push(text) + stream.finish())


def merge(events: list[Event]) -> ParsedReply:
    """Events joined into one message: content concatenated, each call's deltas folded."""
    content, calls = [], []
    for kind, value in events:
        if kind == "content":
            content.append(value)
        elif "id" in value:
            calls.append({"id": value["id"], "type": "function",
                          "function": dict(value["function"])})
        else:
            calls[value["index"]]["function"]["arguments"] += value["function"]["arguments"]
    text = "".join(content)
    return ParsedReply(text if text or not calls else None, calls)


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's finish_reason for a reply that made `calls` tool calls: "tool_calls" when
    it ended by itself after calling, else what ended it."""
    return "tool_calls" if calls and reason == "stop" else reason


def whole_reply(fmt: ToolCallFormat | None, text: str, reason: str
                ) -> tuple[str | None, str, list[dict]]:
    """(content, finish_reason, tool_calls) of a whole reply; `fmt` None: not read for
    calls (no tools, or tool_choice "none")."""
    if fmt is None:
        return text, reason, []
    reply = parse_reply(fmt, text)
    return reply.content, finish_reason(reason, len(reply.tool_calls)), reply.tool_calls


class ReplyDeltas:
    """One streamed choice: its text pieces (with the log-probs of the tokens they came
    from) in, the stream's deltas out as (content, tool-call delta, log-probs) triples.
    Without a format every piece passes as it came; with one, log-probs whose text is held
    back ride with the next delta given out."""

    def __init__(self, fmt: ToolCallFormat | None):
        self.stream = ToolCallStream(fmt) if fmt is not None else None
        self._logprobs: list = []
        self._wanted = False

    def push(self, text: str, logprobs: list | None) -> list[tuple]:
        if self.stream is None:
            return [(text, None, logprobs)]
        return self._out(self.stream.push(text), logprobs)

    def finish(self) -> list[tuple]:
        if self.stream is None:
            return []
        out = self._out(self.stream.finish(), None)
        if self._logprobs:  # tokens whose text came to nothing (whitespace between calls)
            out.append(("", None, self._logprobs))
        return out

    def finish_reason(self, reason: str) -> str:
        return reason if self.stream is None else finish_reason(reason, self.stream.calls)

    def _out(self, events: list[Event], logprobs: list | None) -> list[tuple]:
        if logprobs is not None:
            self._wanted = True
            self._logprobs += logprobs
        out = []
        for kind, value in events:
            lp = self._logprobs if self._wanted else None
            self._logprobs = []
            out.append((value, None, lp) if kind == "content" else (None, value, lp))
        return out
