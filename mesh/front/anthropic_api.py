"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the
gateway's one request path: a Messages body becomes the chat body it means (system,
messages with text, tool_use and tool_result blocks, tools, tool_choice, stop_sequences,
structured outputs), which runs as any chat request does; the answer is rendered back as
a Message, or as the API's stream of named events. Sampling settings (temperature, top_p,
top_k) are taken where a client sends them (the current SDK no longer offers them; older
ones and raw clients do). Errors travel in Anthropic's envelope (`{"type": "error",
"error": {"type", "message"}}`) on every path under /v1/messages.

Usage follows Anthropic's counting: `input_tokens` are the prompt tokens computed,
`cache_read_input_tokens` the ones our caches held (their sum is the prompt).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from .openai_api import ApiError, TokenUsage, bad, model_of

PATH = "/v1/messages"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def is_messages(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def envelope(e: ApiError) -> dict:
    """`e` in Anthropic's error shape."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else
                            "invalid_request_error")
    message = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
    return {"type": "error", "error": {"type": kind, "message": message}}


def event(name: str, data: dict) -> bytes:
    """One named server-sent event, as the Messages stream sends them."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


# -- request -------------------------------------------------------------------------------
def to_chat(body: Mapping, *, count_only: bool = False) -> dict:
    """The OpenAI chat body a Messages body means; ApiError (400) for what it cannot.
    `count_only`: a count_tokens body (no max_tokens, never run)."""
    model = model_of(body)
    max_tokens = body.get("max_tokens")
    if count_only:
        max_tokens = 1
    elif max_tokens is None:
        raise bad("max_tokens is required", "max_tokens")
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise bad("max_tokens must be an integer", "max_tokens")
    chat: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "messages": _system(body.get("system")) + _messages(body)}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("stop_sequences") is not None:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences must be an array of strings", "stop_sequences")
        chat["stop"] = stops
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    if body.get("output_config") is not None:
        chat.update(_output_format(body["output_config"]))
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise bad("metadata must be an object", "metadata")
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "disabled"):
        # where the template reads it (Qwen3's enable_thinking)
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    if body.get("structured_outputs") is not None:  # vLLM's grammar extension
        chat["structured_outputs"] = body["structured_outputs"]
    if body.get("cache_salt") is not None:
        chat["cache_salt"] = body["cache_salt"]
    return chat


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        return [{"role": "system", "content": _text_of(system, "system")}]
    raise bad("system must be a string or an array of text blocks", "system")


def _messages(body: Mapping) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array", "messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where} must be an object whose role is user or assistant", where)
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list):
            out += (_user if m["role"] == "user" else _assistant)(content, where)
        else:
            raise bad(f"{where}.content must be a string or an array of blocks",
                      f"{where}.content")
    return out


def _blocks(content: list, where: str, allowed: tuple[str, ...]) -> list[Mapping]:
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind not in allowed:
            raise bad(f"{where}.content[{j}]: a block of type {kind!r} is not supported "
                      f"here (supported: {', '.join(allowed)})", f"{where}.content")
    return content


def _user(content: list, where: str) -> list[dict]:
    """A user turn: its tool results as tool messages, then its text."""
    out, text = [], []
    for block in _blocks(content, where, ("text", "tool_result")):
        if block["type"] == "text":
            text.append(_string(block.get("text"), f"{where}.content"))
            continue
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str):
            raise bad(f"{where}: a tool_result needs its tool_use_id", f"{where}.content")
        result = block.get("content", "")
        result = result if isinstance(result, str) else _text_of(result, f"{where}.content")
        if block.get("is_error"):
            result = f"Error: {result}"
        out.append({"role": "tool", "tool_call_id": call_id, "content": result})
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(content: list, where: str) -> list[dict]:
    """An assistant turn: its text and its tool calls (thinking blocks are not sent back
    to the model, as Anthropic's own models drop them from earlier turns)."""
    text, calls = [], []
    for block in _blocks(content, where, ("text", "tool_use", "thinking",
                                          "redacted_thinking")):
        if block["type"] == "text":
            text.append(_string(block.get("text"), f"{where}.content"))
        elif block["type"] == "tool_use":
            name, call_id = block.get("name"), block.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad(f"{where}: a tool_use block needs its id and name",
                          f"{where}.content")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name,
                                       "arguments": json.dumps(block.get("input") or {})}})
    message: dict = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return [message]


def _text_of(blocks, param: str) -> str:
    if not isinstance(blocks, list):
        raise bad(f"{param} must be a string or an array of text blocks", param)
    for block in blocks:
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise bad(f"{param}: only text blocks are supported here", param)
    return "".join(_string(b.get("text"), param) for b in blocks)


def _string(value, param: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{param}: a text block's text must be a string", param)
    return value


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise bad(f"tools[{i}] must be an object with a name", "tools")
        function = {"name": tool["name"],
                    "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> dict:
    if not isinstance(choice, Mapping):
        raise bad("tool_choice must be an object", "tool_choice")
    kind = choice.get("type")
    chosen = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice of type tool needs the tool's name", "tool_choice")
        chosen = {"type": "function", "function": {"name": choice["name"]}}
    if chosen is None:
        raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice")
    out: dict = {"tool_choice": chosen}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _output_format(config) -> dict:
    """output_config.format (structured outputs: a JSON schema the reply follows) as the
    chat API's response_format; the effort setting has no meaning here."""
    if not isinstance(config, Mapping):
        raise bad("output_config must be an object", "output_config")
    form = config.get("format")
    if form is None:
        return {}
    if not isinstance(form, Mapping) or form.get("type") != "json_schema" or \
            not isinstance(form.get("schema"), Mapping):
        raise bad("output_config.format must be {type: json_schema, schema: {...}}",
                  "output_config")
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": form["schema"]}}}


# -- answers ---------------------------------------------------------------------------------
def _usage(usage: TokenUsage) -> dict:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens}


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence else _STOP_REASONS.get(finish_reason, "end_turn")


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


class MessageShape:
    """One request's Message (and its stream's events): one id, the model's name."""

    def __init__(self, model: str):
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def full(self, text: str | None, finish_reason: str, calls: list[dict],
             stop_sequence: str | None, usage: TokenUsage, reasoning: str = "") -> dict:
        content = [{"type": "thinking", "thinking": reasoning, "signature": ""}] \
            if reasoning else []
        content += [{"type": "text", "text": text}] if text else []
        content += [_tool_use(c) for c in calls]
        return {**self._head(), "content": content,
                "stop_reason": stop_reason(finish_reason, stop_sequence),
                "stop_sequence": stop_sequence, "usage": _usage(usage)}

    def _head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def start(self, usage: TokenUsage) -> bytes:
        return event("message_start", {"type": "message_start", "message": {
            **self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(usage)}})


class MessageEvents:
    """A streamed reply's parts (reasoning, text pieces, OpenAI tool-call deltas) in, the
    Messages stream's content-block events out: a thinking block while reasoning comes, a
    text block while text comes, a tool_use block per call (its input as input_json_delta
    pieces), each closed when the next begins."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # the kind of the block being written

    def part(self, part) -> list[bytes]:
        """One reasoning.Part's events."""
        if part.reasoning is not None:
            return self._text("thinking", part.reasoning)
        if part.call is not None:
            return self.call(part.call)
        return self._text("text", part.content or "")

    def _text(self, kind: str, piece: str) -> list[bytes]:
        if not piece:
            return []
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": ""}
        out = self._begin(kind, block) if self.open != kind else []
        return out + [event("content_block_delta", {
            "type": "content_block_delta", "index": self.index,
            "delta": {"type": f"{kind}_delta", kind: piece}})]

    def call(self, delta: dict) -> list[bytes]:
        out = []
        function = delta.get("function") or {}
        if "id" in delta:
            out += self._begin("tool_use", {"type": "tool_use", "id": delta["id"],
                                            "name": function.get("name", ""), "input": {}})
        if function.get("arguments"):
            out.append(event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop",
                                             "index": self.index})]

    def _begin(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [event("content_block_start", {"type": "content_block_start",
                                                    "index": self.index,
                                                    "content_block": block})]


def stream_end(finish_reason: str, stop_sequence: str | None, usage: TokenUsage
               ) -> list[bytes]:
    return [event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason(finish_reason,
                                                                         stop_sequence),
                                              "stop_sequence": stop_sequence},
                                    "usage": {"output_tokens": usage.completion_tokens}}),
            event("message_stop", {"type": "message_stop"})]


def error_event(e: ApiError) -> bytes:
    return event("error", envelope(e))
