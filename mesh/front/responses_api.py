"""OpenAI's Responses API (`/v1/responses`) on the gateway's one request path: a
Responses body becomes the chat body it means, which runs as any chat request does; the
answer is rendered back as a Response object, or as the API's stream of typed events.

- input: a string, or items: messages (`input_text` / `output_text` parts; `developer`
  is a system message), `function_call` and `function_call_output` (a tool round trip),
  `reasoning` items (dropped, as the template would); `instructions` lead as a system
  message and, as OpenAI's do, are not carried to a later response.
- tools: function tools (flat, as the API writes them), `tool_choice`,
  `parallel_tool_calls`; `text.format` (text, json_object, json_schema) as
  response_format; `max_output_tokens`, `temperature`, `top_p`.
- `previous_response_id`: the conversation is kept server-side, per tenant (`store`,
  true by default; GET and DELETE by id; another tenant's id is not found): the next
  turn's prompt begins with the last one's and its reply, which the stages still hold,
  so a later turn reports them as cached tokens.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .openai_api import ApiError, TokenUsage, bad, model_of

STORED_PER_TENANT = 1024  # responses a tenant may keep; the oldest go first
# and their bytes: each keeps its whole conversation, so a long previous_response_id chain
# holds every earlier turn once per response
STORED_BYTES_PER_TENANT = 64 * 2**20


@dataclass(frozen=True)
class Stored:
    response: dict             # as GET /v1/responses/{id} gives it
    conversation: tuple        # chat messages through its output, without instructions

    def size(self) -> int:
        """About the bytes it holds (its JSON)."""
        return len(json.dumps([self.response, self.conversation], ensure_ascii=False,
                              default=str))


class ResponseStore:
    """Stored responses by tenant, each tenant's least recently used dropped past
    `per_tenant` responses or `bytes_per_tenant`: no tenant sees or pushes out
    another's."""

    def __init__(self, per_tenant: int = STORED_PER_TENANT,
                 bytes_per_tenant: int = STORED_BYTES_PER_TENANT):
        self.per_tenant, self.bytes_per_tenant = per_tenant, bytes_per_tenant
        self._by: dict[str, OrderedDict[str, tuple[Stored, int]]] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str, response_id: str) -> Stored:
        with self._lock:
            own = self._by.get(tenant, {})
            if response_id not in own:
                raise not_found(response_id)
            own.move_to_end(response_id)
            return own[response_id][0]

    def put(self, tenant: str, stored: Stored) -> None:
        size = stored.size()
        if size > self.bytes_per_tenant:  # kept, it would push out all the others
            return
        with self._lock:
            own = self._by.setdefault(tenant, OrderedDict())
            own[stored.response["id"]] = (stored, size)
            self._bytes[tenant] = self._bytes.get(tenant, 0) + size
            while own and (len(own) > self.per_tenant or
                           self._bytes[tenant] > self.bytes_per_tenant):
                _, (_, dropped) = own.popitem(last=False)
                self._bytes[tenant] -= dropped

    def delete(self, tenant: str, response_id: str) -> None:
        with self._lock:
            gone = self._by.get(tenant, {}).pop(response_id, None)
            if gone is None:
                raise not_found(response_id)
            self._bytes[tenant] -= gone[1]


def not_found(response_id: str) -> ApiError:
    shown = response_id if len(response_id) <= 100 else response_id[:100] + "..."
    return ApiError(404, f"Response with id '{shown}' not found.", param="response_id")


# -- request -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    chat: dict            # the chat body to run
    new: tuple            # the chat messages this request adds to the conversation
    history: tuple        # the conversation it continues (previous_response_id's)
    echo: dict            # request settings the Response object repeats


def to_chat(body: Mapping, previous: Stored | None) -> Turn:
    """The chat a Responses body means, after `previous` (its previous_response_id's);
    ApiError (400) for what it cannot mean."""
    model = model_of(body)
    raw = body.get("input")
    if isinstance(raw, str):
        new = [{"role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        new = _items(raw)
    else:
        raise bad("input must be a string or a non-empty array of items", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    history = list(previous.conversation) if previous else []
    lead = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"model": model, "messages": lead + history + new}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "stream", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        # no effort is no thinking, where the template reads it (Qwen3's enable_thinking)
        chat["chat_template_kwargs"] = {"enable_thinking": reasoning["effort"] != "none"}
    if body.get("structured_outputs") is not None:  # vLLM's grammar extension
        chat["structured_outputs"] = body["structured_outputs"]
    form = _format(body.get("text"))
    if form is not None:
        chat["response_format"] = form
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": [_echo_tool(t) for t in body.get("tools") or []],
            # null is "not given" in OpenAI's API: the defaults it stands for
            "tool_choice": _given(body, "tool_choice", "auto"),
            "parallel_tool_calls": _given(body, "parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}, "user": body.get("user"),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True) is not False}
    return Turn(chat, tuple(new), tuple(history), echo)


def _given(body: Mapping, key: str, default):
    value = body.get(key)
    return default if value is None else value


def _items(items: list) -> list[dict]:
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be user, assistant, system or developer",
                          "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "{}")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise bad(f"{where}: a function_call needs call_id, name and arguments "
                          f"(strings)", "input")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn's calls
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}: a function_call_output needs its call_id", "input")
            output = item.get("output", "")
            output = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise bad(f"{where}: an item of type {kind!r} is not supported here "
                      f"(message, function_call, function_call_output, reasoning)", "input")
    if not out:
        raise bad("input has no message to answer", "input")
    return out


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad(f"{where}: a content part of type {kind!r} is not supported "
                      f"(text only)", "input")
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise bad(f"{where}: a text part's text must be a string", "input")
        texts.append(value)
    return "".join(texts)


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise bad(f"tools[{i}]: a tool of type {kind!r} is not supported here "
                      f"(function tools only)", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _echo_tool(tool: Mapping) -> dict:
    """A function tool as a Response object lists it (strict by default, as OpenAI's)."""
    return {"type": "function", "name": tool["name"],
            "description": tool.get("description"), "parameters": tool.get("parameters"),
            "strict": tool.get("strict", True)}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice  # auto, none, required: the chat API checks them
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad("tool_choice must be auto, none, required or {type: function, name}",
              "tool_choice")


def _format(text) -> dict | None:
    if text is None:
        return None
    form = text.get("format") if isinstance(text, Mapping) else None
    kind = form.get("type") if isinstance(form, Mapping) else None
    if kind in (None, "text") and (form is None or isinstance(form, Mapping)):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description")
                  if k in form}
        return {"type": "json_schema", "json_schema": schema}
    raise bad("text.format.type must be text, json_object or json_schema", "text")


# -- answers ---------------------------------------------------------------------------------
# settings a Response object says null for when unset (the others are left out)
_NULLABLE = frozenset({"instructions", "max_output_tokens", "temperature", "top_p",
                       "previous_response_id"})


def _usage(usage: TokenUsage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape:
    """One request's Response object, its stream's events and its stored conversation."""

    def __init__(self, model: str, turn: Turn):
        self.model, self.turn = model, turn
        self.id = _new_id("resp")
        self.created = int(time.time())

    def response(self, output: list[dict], status: str, usage: TokenUsage | None) -> dict:
        echo = self.turn.echo
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"}
               if status == "incomplete" else None,
               "model": self.model, "output": output,
               "truncation": "disabled", "reasoning": {"effort": None, "summary": None},
               **{k: v for k, v in echo.items() if v is not None or k in _NULLABLE}}
        if usage is not None:  # known once it ends
            out["usage"] = _usage(usage)
        return out

    def output(self, text: str | None, calls: list[dict], status: str,
               reasoning: str = "") -> list[dict]:
        items = [reasoning_item(reasoning, status)] if reasoning else []
        items += [message_item(text, status)] if text else []
        return items + [call_item(c) for c in calls]

    def stored(self, response: dict) -> Stored:
        """`response` to keep: the conversation through its output, as chat messages."""
        out = response["output"]
        text = "".join(part["text"] for item in out if item["type"] == "message"
                       for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in out if item["type"] == "function_call"]
        reply: dict = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            reply["tool_calls"] = calls
        return Stored(response, self.turn.history + self.turn.new + (reply,))


def status_of(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(text: str, status: str) -> dict:
    return {"type": "reasoning", "id": _new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(call: dict, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


class ResponseEvents:
    """The stream's typed events, numbered: a reply's deltas (text, OpenAI tool-call
    deltas) in, the output items' events out; `end` closes the last item and gives the
    final Response's event."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.seq = 0
        self.items: list[dict] = []   # the output so far, each item as it stands
        self.open: dict | None = None

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def start(self) -> list[bytes]:
        head = self.shape.response([], "in_progress", None)
        return [self.event("response.created", response=head),
                self.event("response.in_progress", response=head)]

    def part(self, part) -> list[bytes]:
        """One reasoning.Part's events."""
        if part.reasoning is not None:
            return self.reasoning(part.reasoning)
        if part.call is not None:
            return self.call(part.call)
        return self.text(part.content or "")

    def reasoning(self, piece: str) -> list[bytes]:
        if not piece:
            return []
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self._close()
            out += self._add(reasoning_item("", "in_progress"))
        self.open["content"][0]["text"] += piece
        return out + [self.event("response.reasoning_text.delta", **self._at(),
                                 content_index=0, delta=piece)]

    def text(self, piece: str) -> list[bytes]:
        if not piece:
            return []
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self._close()
            out += self._add(message_item("", "in_progress"))
            out.append(self.event("response.content_part.added", **self._at(),
                                  content_index=0, part=self._part("")))
        self.open["content"][0]["text"] += piece
        return out + [self.event("response.output_text.delta", **self._at(),
                                 content_index=0, delta=piece, logprobs=[])]

    def call(self, delta: dict) -> list[bytes]:
        out = []
        function = delta.get("function") or {}
        if "id" in delta:
            out += self._close()
            out += self._add(call_item({"id": delta["id"], "function": {
                "name": function.get("name", ""), "arguments": ""}}, status="in_progress"))
        if function.get("arguments"):
            self.open["arguments"] += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", **self._at(),
                                  delta=function["arguments"]))
        return out

    def end(self, status: str, usage: TokenUsage) -> tuple[list[bytes], dict]:
        out = self._close(status)
        response = self.shape.response(self.items, status, usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self.event(kind, response=response)], response

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _add(self, item: dict) -> list[bytes]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=item)]

    def _close(self, status: str = "completed") -> list[bytes]:
        item = self.open
        if item is None:
            return []
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **self._at(),
                                  content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            out += [self.event("response.output_text.done", **self._at(), content_index=0,
                               text=text, logprobs=[]),
                    self.event("response.content_part.done", **self._at(), content_index=0,
                               part=self._part(text))]
        else:
            out.append(self.event("response.function_call_arguments.done", **self._at(),
                                  name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1,
                              item=item))
        self.open = None
        return out

    def failed(self, e: ApiError) -> bytes:
        return self.event("error", code=e.code, message=e.message, param=e.param)
