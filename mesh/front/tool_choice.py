"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, validated.

What each tool_choice does here, after llama.cpp's server:
- "auto" (the default with tools): the tools are rendered by the chat template, the model
  writes what it likes, and a tool call in its reply is parsed into `tool_calls`.
- "none": the tools are still rendered (llama-server renders them too: the conversation
  may hold earlier calls to them), nothing is forced and nothing parsed.
- "required" / {"type": "function", "function": {"name": ...}}: the reply is constrained
  to a call (to any of the tools / to that one), arguments matching its parameters.

Only function tools exist here (OpenAI's "custom" tools and "allowed_tools" choice are
refused). A tool's parameters must be a JSON schema (checked here, so a bad one is a 400
whatever the choice). Checking one against JSON Schema 2020-12 takes about 5 ms, and an
agent sends the same tools every turn: each tenant's checked schemas are remembered
(`CheckedSchemas`), never another tenant's (a faster answer would tell one tenant that
another had sent the same schema).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from skippy.topology.errors import RequestError

MAX_TOOLS = 128  # OpenAI's limit
# Checking a schema (and compiling a forced call's grammar) costs with its size, before
# admission: bounded here, as response_format's schema is. All the tools together go
# into the prompt, where more than this would not fit any context we serve.
MAX_TOOL_SCHEMA_CHARS = 64 * 1024
MAX_TOOLS_CHARS = 256 * 1024
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
CHOICES = ("auto", "none", "required")


class ToolSpecError(RequestError):
    """A bad tools / tool_choice / parallel_tool_calls; `param` names the field."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message, param, code)


def bad(message: str, param: str) -> ToolSpecError:
    return ToolSpecError(message, param)


@dataclass(frozen=True)
class ToolUse:
    """The tools a chat request offers and what it asks of them."""

    tools: tuple[str, ...]   # each tool as canonical JSON (hashable, the template's input)
    choice: str              # "auto", "none", "required" or "function"
    function: str | None     # the function a named choice forces
    parallel: bool           # more than one call allowed (parallel_tool_calls)

    @property
    def template_tools(self) -> list[dict]:
        """The tools as the chat template receives them (OpenAI's shape)."""
        return [json.loads(t) for t in self.tools]

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def parsed(self) -> bool:
        """Whether the reply is read for tool calls (not with "none")."""
        return self.choice != "none"

    def callable_functions(self) -> list[dict]:
        """The `function` objects a forced call may name."""
        fns = [t["function"] for t in self.template_tools]
        return [f for f in fns if f["name"] == self.function] if self.function else fns


def check_schema(params: Mapping) -> None:
    """jsonschema.SchemaError unless `params` is a valid JSON schema (or RecursionError)."""
    jsonschema.validators.validator_for(params).check_schema(params)


class CheckedSchemas:
    """The schemas each tenant has had checked: their digests, the most recent
    `max_entries` over all tenants. Parsing runs in worker threads: one lock."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._lock = threading.Lock()

    def checker(self, tenant: str) -> Callable[[Mapping], None]:
        """`check_schema` for `tenant`, skipped for a schema it has had checked."""
        def check(params: Mapping) -> None:
            text = json.dumps(params, sort_keys=True, ensure_ascii=False)
            key = (tenant, hashlib.sha256(text.encode()).digest())
            with self._lock:
                if key in self._seen:
                    self._seen.move_to_end(key)
                    return
            check_schema(params)  # an invalid one raises, and is not remembered
            with self._lock:
                self._seen[key] = None
                while len(self._seen) > self.max_entries:
                    self._seen.popitem(last=False)
        return check


def parse_tools(body: Mapping, check: Callable[[Mapping], None] = check_schema
                ) -> ToolUse | None:
    """The request's tool use, or None when it offers no tools; ToolSpecError on a bad
    shape. tool_choice "auto" or "none" without tools is accepted and means nothing.
    `check`: how each tool's parameters are checked as a JSON schema."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(old) is not None:  # ignoring them would answer as if no tools
            raise bad(f"{old} is OpenAI's deprecated form of {new}; send {new}", old)
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice is not None and choice not in ("auto", "none"):
            raise bad("tool_choice needs tools: name the functions the model may call",
                      "tool_choice")
        return None
    canonical = _tools(tools, check)
    names = [json.loads(t)["function"]["name"] for t in canonical]
    kind, function = _choice(choice, names)
    return ToolUse(canonical, kind, function, True if parallel is None else parallel)


def _tools(tools: Any, check: Callable[[Mapping], None]) -> tuple[str, ...]:
    if not isinstance(tools, list):
        raise bad("tools must be an array of {type: \"function\", function: {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"tools takes at most {MAX_TOOLS} functions, not {len(tools)}", "tools")
    # the size of all of them before any schema is checked: checking is the costly part
    sent = _json_size(tools, "tools")
    if sent > MAX_TOOLS_CHARS:
        raise bad(f"tools take at most {MAX_TOOLS_CHARS} characters of JSON together, not "
                  f"{sent}", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = _function(tool, i, check)
        if fn["name"] in seen:
            raise bad(f"tools[{i}]: the function name {fn['name']!r} is used twice", "tools")
        seen.add(fn["name"])
        # no larger than what was sent: it keeps only the fields it checked
        out.append(json.dumps({"type": "function", "function": fn}, ensure_ascii=False))
    return tuple(out)


def _function(tool: Any, i: int, check: Callable[[Mapping], None]) -> dict:
    """tools[i].function checked: name, and description / parameters / strict if given."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind != "function":
        raise bad(f"tools[{i}].type must be \"function\" (got {kind!r}): this server "
                  f"calls functions only", "tools")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise bad(f"tools[{i}].function must be an object with a name", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or - "
                  f"(got {_shown(name)})", "tools")
    out: dict = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        out["description"] = description
    params = fn.get("parameters")
    if params is not None:
        out["parameters"] = _schema(params, i, check)
    strict = fn.get("strict")
    if strict is not None:  # a forced call is always strict; the template may read it
        if not isinstance(strict, bool):
            raise bad(f"tools[{i}].function.strict must be a boolean", "tools")
        out["strict"] = strict
    return out


def _json_size(value: Any, where: str) -> int:
    """Characters of `value` as JSON (a request's own JSON: it can be written back)."""
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        raise bad(f"{where} cannot be read as JSON", "tools") from None


def _schema(params: Any, i: int, check: Callable[[Mapping], None]) -> dict:
    if not isinstance(params, Mapping):
        raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    size = _json_size(params, f"tools[{i}].function.parameters")
    if size > MAX_TOOL_SCHEMA_CHARS:
        raise bad(f"tools[{i}].function.parameters takes at most {MAX_TOOL_SCHEMA_CHARS} "
                  f"characters of JSON, not {size}", "tools")
    try:
        check(params)
    except jsonschema.SchemaError as e:
        raise bad(f"tools[{i}].function.parameters is not a valid JSON schema: "
                  f"{' '.join(e.message.split())}", "tools") from None
    except RecursionError:
        raise bad(f"tools[{i}].function.parameters cannot be read as a JSON schema",
                  "tools") from None
    return dict(params)


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad(f"tool_choice must be one of {', '.join(CHOICES)} or "
                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                      f"(got {_shown(choice)})", "tool_choice")
        return choice, None
    if not isinstance(choice, Mapping) or choice.get("type") != "function":
        raise bad("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": "
                  "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise bad("tool_choice.function.name must be a string", "tool_choice")
    if name not in names:
        raise bad(f"tool_choice names the function {_shown(name)}, which is not among "
                  f"the tools", "tool_choice")
    return "function", name


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
