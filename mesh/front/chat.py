"""Chat messages -> prompt text, with the model's own chat template.

The template is the GGUF's `tokenizer.chat_template`, rendered the way Hugging Face and
llama.cpp render it: Jinja with trim_blocks/lstrip_blocks in a sandbox, the variables
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and a `raise_exception`
function. A file without a template falls back to its family's standard turn format when
we have one (Gemma 3: the 270M base ships none); otherwise `ChatTemplateMissing`.

Double BOS: many templates begin with `{{ bos_token }}` while the tokenizer also adds BOS
(Gemma: add_bos_token = true). We do what llama.cpp's `common_chat_template_direct_apply`
does: the *rendered text* loses a leading BOS string when the tokenizer adds BOS (and a
trailing EOS string when it adds EOS), so `Tokenizer.encode(render(...))` starts with
exactly one BOS id. Our own Gemma template never writes BOS at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Union

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from skippy.mesh.tokenizer import Tokenizer
from skippy.topology.errors import RequestError, UserError, one_line
from skippy.topology.families import GEMMA3
from skippy.topology.gguf_file import GGUFFile

ROLES = ("system", "user", "assistant", "tool")

# Where a template can come from: a GGUF path, an open GGUFFile, a Tokenizer (its file's
# template, with llama.cpp's own BOS/EOS texts and add_bos flag), or a plain mapping of
# GGUF metadata keys ("general.architecture", "tokenizer.chat_template", ...).
ChatSource = Union[str, Path, GGUFFile, Tokenizer, Mapping[str, Any]]


class ChatTemplateMissing(UserError):
    """The model has no chat template and its family has no standard one."""


class ChatTemplateError(RequestError):
    """The template rejected the conversation (`raise_exception`) or failed to render."""

    def __init__(self, message: str):
        super().__init__(message, "messages")


# Gemma's turn format, after Google's Gemma 3 instruction-tuned template: a system message
# becomes a prefix of the first user turn (Gemma has no system role), "assistant" is
# spelled "model", turns must alternate, and turn contents are trimmed. Unlike Google's
# template it never writes `{{ bos_token }}`: Gemma's tokenizer adds BOS itself.
GEMMA_TURNS = (
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = '' -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}\n"
    "    {{- message['content'] | trim }}\n"
    "    {{- '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n"
)

FAMILY_TEMPLATES: dict[str, str] = {GEMMA3.name: GEMMA_TURNS}

# llama.cpp's default for `tokenizer.ggml.add_bos_token` when the key is absent, by
# tokenizer model (llama-vocab.cpp); only used for plain metadata, a Tokenizer knows.
_ADD_BOS_DEFAULT = {"llama": True, "bert": True}


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template with everything needed to render it."""

    model: str           # for messages: the file name or general.name
    source: str          # "gguf" (the file's own) or "family:<arch>"
    text: str            # the Jinja source
    bos_token: str
    eos_token: str
    add_bos: bool        # the tokenizer prepends BOS: a rendered leading BOS is dropped
    add_eos: bool        # the tokenizer appends EOS: a rendered trailing EOS is dropped
    # a request's own template variables (chat_template_kwargs: enable_thinking, ...)
    variables: tuple[tuple[str, object], ...] = ()

    def with_variables(self, variables: Mapping) -> ChatTemplate:
        """This template rendering with a request's own variables beside its messages
        (never in place of what the gateway passes: messages, tools, tokens)."""
        return replace(self, variables=tuple(sorted(variables.items())))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` (validated first); ready for Tokenizer.encode.
        `tools` (OpenAI's [{type: "function", function: {...}}]) reaches the template as
        its `tools` variable, as in transformers' apply_chat_template and llama-server."""
        return self._render(validate_messages(messages), add_generation_prompt, tools)

    @property
    def knows_tools(self) -> bool:
        """Whether the template reads `tools` at all (SmolLM2's and Gemma's do not: they
        would drop the tools silently)."""
        return re.search(r"\btools\b", self.text) is not None

    def segments(self, messages: list[dict], *, add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        """The prompt text for `messages` as (text, from_template) pieces in order: what
        the template wrote, and what the messages said. Tokenized apart (`encode_chat`),
        text a user typed that spells a control token stays text, so chat roles cannot
        be forged.

        The pieces come from rendering twice: once with each content replaced by a
        placeholder (where the contents go) and once for real; the real text must equal
        the first with the contents put in (or, for templates that trim them, the trimmed
        contents). A template that transforms contents otherwise gives no pieces we can
        trust: then a message that spells a control token is refused (RequestError).
        Contents only: what `tools` and tool calls hold is checked by `encode_chat`."""
        return self._segments(validate_messages(messages), add_generation_prompt, tools)

    def _segments(self, checked: list[dict], add_generation_prompt: bool,
                  tools: list[dict] | None) -> list[tuple[str, bool]]:
        text = self._render(checked, add_generation_prompt, tools)
        texts = [i for i, m in enumerate(checked) if isinstance(m["content"], str)]
        holders = {i: f"\ue000{i}\ue001" for i in texts}
        skeleton = self._render([dict(m, content=holders.get(i, m["content"]))
                                 for i, m in enumerate(checked)], add_generation_prompt, tools)
        contents = [checked[i]["content"] for i in texts]
        for fill in (contents, [c.strip() for c in contents]):
            pieces = _fill(skeleton, list(holders.values()), fill)
            if pieces is not None and "".join(t for t, _ in pieces) == text:
                return [(t, ours) for t, ours in pieces if t]
        return [(text, True)]  # encode_chat checks the contents spell no control token

    def _render(self, checked: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> str:
        extra = {**dict(self.variables), **({} if tools is None else {"tools": tools})}
        try:
            text = _compile(self.text).render(
                messages=checked, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.model} failed: "
                                    f"{one_line(e)}") from None
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text


def _fill(skeleton: str, holders: list[str], contents: list[str]
          ) -> list[tuple[str, bool]] | None:
    """The skeleton cut at its placeholders, each replaced by its content; None unless
    every placeholder appears exactly once, in order."""
    pieces, rest = [], skeleton
    for holder, content in zip(holders, contents):
        if skeleton.count(holder) != 1:
            return None
        before, found, rest = rest.partition(holder)
        if not found:
            return None
        pieces += [(before, True), (content, False)]
    return pieces + [(rest, True)]


def encode_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict], *,
                control_text: bool = False, tools: list[dict] | None = None) -> list[int]:
    """The token ids of `messages` (and `tools`) rendered by `template`. Control-token
    spellings in what the messages say are tokenized as plain text unless `control_text`
    (a trusted client's opt-in); what the template writes is tokenized with its control
    tokens. What the client wrote that the template copies beside its own text (tools,
    tool calls, tool names and ids) cannot be told apart from it: there a control-token
    spelling is refused (RequestError).

    When no content can be or become part of a control token's spelling (the usual
    case), the text is rendered once and tokenized whole, as llama-server tokenizes a
    prompt: every control id then comes from the template. Only contents that can are
    tokenized apart, from the template's pieces (`ChatTemplate.segments`)."""
    checked = validate_messages(messages)
    if control_text:
        return tokenizer.encode(template._render(checked, True, tools))
    for where, text in _tool_texts(checked, tools):
        _refuse_control_text(tokenizer, where, text)
    contents = [(i, m["content"]) for i, m in enumerate(checked)
                if isinstance(m["content"], str)]
    if not any(tokenizer.may_touch_control(c) for _, c in contents):
        return tokenizer.encode(template._render(checked, True, tools))
    pieces = template._segments(checked, True, tools)
    if len(pieces) == 1 and pieces[0][1]:  # contents could not be told apart
        for i, content in contents:
            _refuse_control_text(tokenizer, f"messages[{i}].content", content,
                                 "and this model's chat template changes message "
                                 "text, so it cannot be kept as text")
    return tokenizer.encode_pieces(pieces)


def _tool_texts(checked: list[dict], tools: list[dict] | None):
    """(where, text) for each client text about tools a template may copy verbatim."""
    if tools:
        yield "tools", json.dumps(tools, ensure_ascii=False)
    for i, m in enumerate(checked):
        for key in ("tool_calls", "tool_call_id", "name"):
            if key in m:
                yield f"messages[{i}].{key}", json.dumps(m[key], ensure_ascii=False)


def _refuse_control_text(tokenizer: Tokenizer, where: str, text: str,
                         why: str = "which would be read as the token itself") -> None:
    if tokenizer.spells_control(text):
        param = "tools" if where.startswith("tools") else "messages"
        raise RequestError(f"{where} spells a control token, {why}", param)


def load_chat_template(source: ChatSource) -> ChatTemplate:
    """The chat template for `source`; raises ChatTemplateMissing when there is none.

    Paths are cached by (path, size, mtime), so calling this per request is cheap; the
    gateway should still hold the returned object.
    """
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser().resolve()
        st = path.stat()
        return _load_path(path, st.st_size, st.st_mtime_ns)
    if isinstance(source, Tokenizer):
        gguf = GGUFFile(source.path)
        try:
            meta = {k: gguf.metadata.get(k) for k in
                    ("general.architecture", "tokenizer.chat_template")}
        finally:
            gguf.close()
        return _build(meta, source.path.name, tokenizer=source)
    if isinstance(source, GGUFFile):
        return _build(source, source.path.name)
    if isinstance(source, Mapping):
        return _build(source, str(source.get("general.name") or "(unnamed model)"))
    raise TypeError(f"not a chat template source: {type(source).__name__}")


def render_chat(source: ChatSource, messages: list[dict], *,
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """Apply `source`'s chat template to `messages` (see ChatTemplate.render)."""
    return load_chat_template(source).render(messages, tools=tools,
                                             add_generation_prompt=add_generation_prompt)


def has_chat_template(source: ChatSource) -> bool:
    """Whether chat works for `source`: its own template or its family's."""
    try:
        load_chat_template(source)
    except ChatTemplateMissing:
        return False
    return True


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as plain dicts for the template; RequestError (one line, naming
    `messages`) on a bad shape.

    Each has role and content (a string; None for an assistant turn that only calls
    tools). A tool result also keeps tool_call_id (and name when given); an assistant
    turn its tool_calls as [{id, type, function: {name, arguments}}], the arguments
    decoded from their JSON string into an object where they are one, as templates
    written for Hugging Face's apply_chat_template expect. Other keys are accepted and
    not passed to the template.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects",
                           "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(f"messages[{i}] must be an object with role and content, "
                               f"not {type(m).__name__}", "messages")
        role, content = m.get("role"), m.get("content")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)} "
                               f"(got {role!r})", "messages")
        if isinstance(content, list):
            content = _text_parts(content, i)
        calls = _tool_calls(m.get("tool_calls"), i) if role == "assistant" else None
        if not isinstance(content, str) and not (calls and content is None):
            what = "missing" if content is None else type(content).__name__
            raise RequestError(f"messages[{i}].content must be a string or a list of text "
                               f"parts (got {what})", "messages")
        out.append({"role": role, "content": content, **_tool_keys(m, role, calls, i)})
    return out


def _tool_keys(m: Mapping, role: str, calls: list | None, i: int) -> dict:
    """What a tool result or a calling assistant turn adds to {role, content}."""
    if calls:
        return {"tool_calls": calls}
    if role != "tool":
        return {}
    call_id, name = m.get("tool_call_id"), m.get("name")
    if not isinstance(call_id, str):
        raise RequestError(f"messages[{i}].tool_call_id must be a string: a tool message "
                           f"answers the call with that id", "messages")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"messages[{i}].name must be a string", "messages")
    return {"tool_call_id": call_id, **({"name": name} if name else {})}


def _tool_calls(calls: Any, i: int) -> list[dict] | None:
    """An assistant turn's tool_calls, checked, arguments decoded (see validate_messages)."""
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls must be an array", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise RequestError(f"messages[{i}].tool_calls[{j}] must be {{id, type: "
                               f"\"function\", function: {{name, arguments}}}} with string "
                               f"name and arguments", "messages")
        try:
            arguments = json.loads(fn["arguments"])
        except (ValueError, RecursionError):
            arguments = fn["arguments"]  # the template shows it as the client sent it
        if not isinstance(arguments, dict):
            arguments = fn["arguments"]
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _text_parts(parts: list, i: int) -> str:
    """Content given as [{"type": "text", "text": ...}, ...] (as many clients send it)."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise RequestError(f"messages[{i}].content[{j}] must be a text part "
                               f"(got {kind!r}: this model reads text only)", "messages")
        texts.append(part["text"])
    return "".join(texts)


# -- internals -----------------------------------------------------------------------------
@lru_cache(maxsize=32)
def _load_path(path: Path, size: int, mtime_ns: int) -> ChatTemplate:
    gguf = GGUFFile(path)
    try:
        return _build(gguf, path.name)
    finally:
        gguf.close()


def _build(meta, model: str, tokenizer: Tokenizer | None = None) -> ChatTemplate:
    """meta: anything with .get(key) over GGUF metadata keys (GGUFFile or a mapping)."""
    arch = str(meta.get("general.architecture") or "unknown")
    text = meta.get("tokenizer.chat_template")
    source = "gguf"
    if not text:
        text, source = FAMILY_TEMPLATES.get(arch), f"family:{arch}"
    if not text:
        raise ChatTemplateMissing(f"model {model} has no chat template; "
                                  f"use plain completion (without --chat)")
    if tokenizer is not None:
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
        bos_text = tokenizer.token_text(bos) if bos is not None else ""
        eos_text = tokenizer.token_text(eos) if eos is not None else ""
        add_bos, add_eos = tokenizer.add_bos, tokenizer.add_eos
    else:
        bos_text, eos_text = _token_texts(meta)
        tok_model = str(meta.get("tokenizer.ggml.model") or "")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token",
                                _ADD_BOS_DEFAULT.get(tok_model, False)))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return ChatTemplate(model=model, source=source, text=str(text), bos_token=bos_text,
                        eos_token=eos_text, add_bos=add_bos, add_eos=add_eos)


def _token_texts(meta) -> tuple[str, str]:
    """BOS and EOS as text from the GGUF vocab ("" where absent, as llama.cpp does)."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if bos_id is None and eos_id is None:
        return "", ""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def text(i):
        return str(tokens[i]) if i is not None and 0 <= int(i) < len(tokens) else ""

    return text(bos_id), text(eos_id)


def _raise_exception(message: str):
    raise ChatTemplateError(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Hugging Face's tojson (jinja2's own escapes <, >, & for HTML, which templates don't want)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # Same environment as transformers' apply_chat_template, so templates written for it
    # (the ones GGUF files carry) render the same here.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(text: str) -> jinja2.Template:
    try:
        return _environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {one_line(e)}") from None
