"""The OpenAI wire format: request bodies -> our types, our results -> response bodies.

Parsing is strict about what we act on (types, ranges, unsupported options such as echo;
a response_format becomes a decoding constraint, mesh/front/response_format.py) and
ignores fields we do not know, as OpenAI-compatible servers do. Every mistake is an `ApiError`, which the gateway turns into OpenAI's error
envelope {"error": {"message", "type", "param", "code"}} with its HTTP status.

Numbers must be finite: Python's json reads NaN, Infinity and 1e999, and a NaN
temperature or bias would otherwise reach the sampler (a 400 here, never a 500 there).
Text must be valid Unicode: JSON's escapes can spell a lone surrogate ("\\ud800"), which
Python's json reads into a string that no UTF-8 encoder (the tokenizer, our own error
messages) accepts.

Defaults follow OpenAI, not our CLI: temperature 1.0 and top_p 1.0 when absent, so a
client that wants greedy (and gateway-cached) output asks for temperature 0.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..constraint import Constraint
from ..sampler import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs
from .response_format import ResponseFormatError, response_constraint, structured_outputs
from .tool_choice import ToolSpecError, ToolUse, check_schema, parse_tools

# max_tokens when the request gives none: what is left of the context, at most this.
# OpenAI's legacy completions default to 16, which cuts most answers short; 256 answers
# a typical question without letting one forgotten limit hold a lane for minutes.
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
MAX_CHOICES = 64  # prompts x n in one request; each runs in a lane of its own
MAX_CACHE_SALT = 256  # characters of `cache_salt`: it becomes part of every cache key

_TYPE_BY_STATUS = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
                   413: "invalid_request_error", 503: "server_error"}


class ApiError(Exception):
    """A request the gateway answers with an error status and OpenAI's envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # sent with the envelope (a 503's Retry-After)
        self.type = type or _TYPE_BY_STATUS.get(
            status, "server_error" if status >= 500 else "invalid_request_error")

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_of(body) -> str:
    """The `model` a body names; a 400 unless it is an object that names one."""
    if not isinstance(body, Mapping):
        raise bad("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model is required and must be a string", "model")
    return model


@dataclass(frozen=True)
class ParsedRequest:
    """A /v1/completions or /v1/chat/completions body, validated, not yet tokenized."""

    chat: bool
    model: str
    prompts: tuple[str | tuple[int, ...], ...] | None  # completions: one or more
    messages: tuple[dict, ...] | None         # chat: {role, content} with string content
    n: int                                    # choices per prompt
    max_tokens: int | None                    # None: DEFAULT_MAX_TOKENS or less
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_salt: str                           # the client's part of its cache namespace
    tools: ToolUse | None = None              # chat: the tools offered, and tool_choice
    template_kwargs: tuple = ()               # chat: chat_template_kwargs, sorted pairs

    @property
    def choices(self) -> int:
        """Choices in the response: n per prompt (chat has one prompt)."""
        return self.n * (1 if self.chat else len(self.prompts))


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise bad("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    # a lone surrogate can only come from a \uD8xx-\uDFxx escape: without one in a UTF-8
    # body, no string needs the walk (a 4 MiB body of tool schemas took as long as its
    # parse)
    if json.detect_encoding(raw) == "utf-8" and not _SURROGATE_ESCAPE.search(raw):
        return body
    field = _invalid_text(body)
    if field is not None:
        raise bad(f"{field or 'a field name'} holds text that is not valid Unicode (a lone "
                  f"surrogate such as \\ud800)", field or None)
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _invalid_text(body: dict) -> str | None:
    """The top-level field whose value holds a string that is not valid Unicode ("" when
    it is a field name), or None. Iterative: json has already bounded the nesting, but
    a recursive walk would start deeper in the stack than json did."""
    for name, value in body.items():
        if not _valid(name):
            return ""
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if not _valid(v):
                    return name
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
    return None


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_request(body: dict, *, chat: bool,
                  schemas: Callable[[Mapping], None] = check_schema) -> ParsedRequest:
    """The body validated. `schemas`: how a tool's parameters are checked as a JSON
    schema (the gateway's remembers each tenant's, tool_choice.CheckedSchemas)."""
    model = _field(body, "model", str)
    if model is None:
        raise bad("model is required", "model")
    n = _field(body, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"n must be in [1, {MAX_CHOICES}], not {n}", "n")
    _unsupported(body, chat)
    if chat:
        prompts, messages = None, _messages(body.get("messages"))
        max_tokens = _field(body, "max_completion_tokens", int)
        param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = _field(body, "max_tokens", int), "max_tokens"
    else:
        prompts, messages = _prompts(body.get("prompt")), None
        max_tokens, param = _field(body, "max_tokens", int), "max_tokens"
        if len(prompts) * n > MAX_CHOICES:
            raise bad(f"{len(prompts)} prompts x n = {n} exceed {MAX_CHOICES} choices",
                      "prompt")
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"{param} must be at least 1, not {max_tokens}", param)
    stream = bool(_field(body, "stream", bool) or False)
    options = _field(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options")
    salt = _field(body, "cache_salt", str) or ""
    if len(salt) > MAX_CACHE_SALT:
        raise bad(f"cache_salt takes at most {MAX_CACHE_SALT} characters, not {len(salt)}",
                  "cache_salt")
    return ParsedRequest(chat=chat, model=model, prompts=prompts, messages=messages, n=n,
                         max_tokens=max_tokens, sampling=_sampling(body, _logprobs(body, chat)),
                         stop=_stop(body.get("stop")), stream=stream,
                         include_usage=stream and include_usage, cache_salt=salt,
                         tools=_tools(body, schemas) if chat else None,
                         template_kwargs=_template_kwargs(body) if chat else ())


def _tools(body: Mapping, schemas: Callable[[Mapping], None]) -> ToolUse | None:
    try:
        return parse_tools(body, schemas)
    except ToolSpecError as e:
        raise bad(str(e), e.param) from None


# -- fields ---------------------------------------------------------------------------------
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               dict: "an object", list: "an array"}


def _field(body: Mapping, name: str, kind: type) -> Any:
    """body[name] checked against `kind` (None when absent or null). bool is not accepted
    as a number, and an integer is accepted where a number is expected."""
    value = body.get(name)
    if value is None:
        return None
    if kind is float and _non_finite(value):
        raise bad(f"{name} must be a finite number, not {_json_type(value)}", name)
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise bad(f"{name} must be {_TYPE_NAMES[kind]}, not {_json_type(value)}", name)
    return value


def _json_type(value: Any) -> str:
    if _non_finite(value):  # how JSON spells it (Python's json reads 1e999 as Infinity)
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _unsupported(body: Mapping, chat: bool) -> None:
    if not chat:
        if body.get("echo"):
            raise bad("echo is not supported by this server", "echo")
        best_of = body.get("best_of")
        if best_of is not None and best_of != 1:
            raise bad("only best_of = 1 is supported", "best_of")
        if body.get("suffix"):
            raise bad("suffix is not supported by this server", "suffix")


# what the gateway itself passes a chat template: a request cannot set these
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                           "eos_token", "raise_exception"})


def _template_kwargs(body: Mapping) -> tuple:
    """chat_template_kwargs (vLLM's and llama-server's): more variables for the chat
    template, such as Qwen3's enable_thinking; JSON scalars only."""
    kwargs = _field(body, "chat_template_kwargs", dict) or {}
    for name, value in kwargs.items():
        if name in _TEMPLATE_OWN or not name.isidentifier():
            raise bad(f"chat_template_kwargs cannot set {name!r}", "chat_template_kwargs")
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            raise bad(f"chat_template_kwargs.{name} must be a string, number, boolean or "
                      f"null", "chat_template_kwargs")
    return tuple(sorted(kwargs.items()))


def _logprobs(body: Mapping, chat: bool) -> int | None:
    """How many top alternatives to report with each token's log-prob; None: no log-probs.
    Chat asks with logprobs: true and top_logprobs: k; completions with logprobs: k."""
    if chat:
        wanted, top = _field(body, "logprobs", bool), _field(body, "top_logprobs", int)
        if top is not None and not wanted:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        count, param = (top or 0) if wanted else None, "top_logprobs"
    else:
        count, param = _field(body, "logprobs", int), "logprobs"
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise bad(f"{param} must be in [0, {MAX_TOP_LOGPROBS}], not {count}", param)
    return count


def _sampling(body: Mapping, logprobs: int | None = None) -> SamplingParams:
    temperature = _field(body, "temperature", float)
    top_p = _field(body, "top_p", float)
    top_k = _field(body, "top_k", int)
    seed = _field(body, "seed", int)
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    if temperature < 0:
        raise bad(f"temperature must be >= 0, not {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], not {top_p}", "top_p")
    if top_k is not None and top_k < -1:
        raise bad(f"top_k must be >= 0 (or -1: no limit), not {top_k}", "top_k")
    if seed is not None and not -2**63 <= seed < 2**64:
        raise bad("seed must fit in 64 bits", "seed")
    if seed is not None:
        seed %= 2**64  # torch's generator reads a negative seed this way; the wire is uint64
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _field(body, name, float)
        if value is not None and not -2 <= value <= 2:
            raise bad(f"{name} must be in [-2, 2], not {value}", name)
        penalties[name] = value or 0.0
    # its own checks (a RequestError naming the field) catch what the ones above let through
    return SamplingParams(temperature, top_p, max(top_k or 0, 0), seed,
                          logit_bias=_logit_bias(_field(body, "logit_bias", dict)),
                          logprobs=logprobs, constraint=_constraint(body), **penalties)


def _constraint(body: Mapping) -> Constraint | None:
    """What response_format (or vLLM's structured_outputs) asks the reply to be
    (mesh/front/response_format.py)."""
    param = "structured_outputs" if body.get("structured_outputs") is not None \
        else "response_format"
    if param == "structured_outputs" and body.get("response_format") is not None:
        raise bad("give response_format or structured_outputs, not both", param)
    try:
        if param == "structured_outputs":
            return structured_outputs(body["structured_outputs"])
        return response_constraint(body.get("response_format"))
    except ResponseFormatError as e:
        raise bad(str(e), param) from None


def _logit_bias(value: dict | None) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} as (id, bias) pairs in id order."""
    if not value:
        return ()
    if len(value) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or str(token) != key.strip():
            raise bad(f"logit_bias keys must be token ids, not {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            shown = _json_type(bias) if _non_finite(bias) else repr(bias)
            raise bad(f"logit_bias values must be finite numbers in [-100, 100], not "
                      f"{shown}", "logit_bias")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
    if any(not s for s in stops):
        raise bad("stop strings must not be empty", "stop")
    return tuple(dict.fromkeys(stops))


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, an array of token ids, or an array of those (one choice each)."""
    def one(p: Any) -> str | tuple[int, ...] | None:
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p):
            return tuple(p)
        return None

    if value is None:
        raise bad("prompt is required", "prompt")
    single = one(value)
    if single is not None:
        return (single,)
    if isinstance(value, list) and value:
        many = [one(p) for p in value]
        if all(p is not None for p in many):
            return tuple(many)
    raise bad("prompt must be a string, an array of token ids, or an array of those",
              "prompt")


def _messages(value: Any) -> tuple[dict, ...]:
    """Messages with string content; OpenAI's content parts are accepted when they are
    all text (joined), since a chat template takes one string per turn."""
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty array of {role, content} objects",
                  "messages")
    out = []
    for i, m in enumerate(value):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = m["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in parts):
                raise bad(f"messages[{i}].content: only text parts are supported",
                          "messages")
            m = {**m, "content": "".join(p["text"] for p in parts)}
        out.append(m)
    return tuple(out)


# -- responses --------------------------------------------------------------------------------
@dataclass
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


# (token id, its log-probabilities) for each token a piece of text came from
Logprobs = list[tuple[int, TokenLogprobs]]


class ResponseShape:
    """Builds one request's response bodies and stream chunks (same id and timestamp).
    `piece(id)` gives a token's bytes, for log-probability entries."""

    def __init__(self, chat: bool, model: str, piece: Callable[[int], bytes] = bytes,
                 fingerprint: str | None = None):
        self.chat, self.model, self.piece = chat, model, piece
        self.fingerprint = fingerprint  # system_fingerprint: the backend's configuration
        self._offset: dict[int, int] = {}  # per choice: text_offset runs on across chunks
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.fingerprint is not None:
            head["system_fingerprint"] = self.fingerprint
        return head

    def logprobs(self, entries: Logprobs | None, index: int = 0) -> dict | None:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel
        lists (text_offset counted in characters from the start of the completion)."""
        if entries is None:
            return None
        text = lambda i: self.piece(i).decode("utf-8", errors="replace")  # noqa: E731
        if self.chat:
            def item(i: int, lp: float) -> dict:
                return {"token": text(i), "logprob": lp, "bytes": list(self.piece(i))}
            return {"content": [{**item(i, e.logprob),
                                 "top_logprobs": [item(j, lp) for j, lp in e.top]}
                                for i, e in entries], "refusal": None}
        tokens = [text(i) for i, _ in entries]
        offsets, at = [], self._offset.get(index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self._offset[index] = at
        return {"tokens": tokens,
                "token_logprobs": [e.logprob for _, e in entries],
                "top_logprobs": [{text(j): lp for j, lp in e.top} for _, e in entries],
                "text_offset": offsets}

    def full(self, choices: list[tuple], usage: TokenUsage) -> dict:
        """The whole response: (text, finish_reason, logprobs) per choice, in order; a
        chat choice may add its tool calls (OpenAI's tool_calls list) as a fourth item,
        and then its text may be None, and its reasoning (a thinking model's) as a
        fifth."""
        out = []
        for index, (text, finish_reason, logprobs, *more) in enumerate(choices):
            block = self.logprobs(logprobs, index)
            calls, reasoning = (more + [None, None])[:2]
            if self.chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                if reasoning:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = calls
                out.append({"index": index, "message": message,
                            "logprobs": block, "finish_reason": finish_reason})
            else:
                out.append({"index": index, "text": text, "logprobs": block,
                            "finish_reason": finish_reason})
        return {**self._head(self.object), "choices": out, "usage": usage.as_dict()}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *,
              first: bool = False, with_usage_field: bool = False,
              logprobs: Logprobs | None = None, index: int = 0,
              tool_call: dict | None = None, reasoning: str | None = None) -> dict:
        """A stream chunk with a text delta (chat: the first one also carries the role)
        or a tool call's delta, and, when asked for, the log-probabilities of the tokens
        it came from."""
        block = self.logprobs(logprobs, index)
        if self.chat:
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if tool_call is not None:
                delta["tool_calls"] = [tool_call]
            choice = {"index": index, "delta": delta, "logprobs": block,
                      "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": block,
                      "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if with_usage_field:  # OpenAI: null on every chunk but the last when usage is asked
            out["usage"] = None
        return out

    def usage_chunk(self, usage: TokenUsage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage.as_dict()}


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
