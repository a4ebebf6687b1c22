"""A parsed request body -> the generation requests its choices run: a pure step (no
HTTP, no engine), over the served model's vocabulary and chat template.

chat template -> tokenize -> GenerationRequest, one per choice. A chat is rendered once
and tokenized once unless a message's text could spell a control token (mesh/front/chat.py).
Tools a template cannot show are described to it (generic_tools). What it refuses is the
request's fault, a 400 naming its `param`: more choices than the engine's lane budget, a
prompt that does not fit the context, more new tokens over the choices than the gateway's
limit, tools whose schemas cannot constrain a call, a model not served (404).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..control.engine import EngineInfo, GenerationRequest
from ..sampler import SamplingParams
from ..tokenizer import Tokenizer
from .chat import ChatTemplate, ChatTemplateMissing, encode_chat, load_chat_template
from .edge import cache_namespace
from .limits import GatewayLimits
from .openai_api import DEFAULT_MAX_TOKENS, ApiError, ParsedRequest, bad
from .reasoning import opened_in, thinks
from .generic_tools import generic_messages
from .tool_calls import ToolCallFormat, auto_constraint, call_constraint, has_tool_history, \
    native_format, reply_format
from .tool_choice import ToolSpecError


@dataclass(frozen=True)
class ModelView:
    """What request building reads of the served model: its name, context and lane
    budget, its vocabulary, and its chat template (None: `template_missing` says why)."""

    model: str
    n_ctx: int
    lanes: int
    tokenizer: Tokenizer
    template: ChatTemplate | None
    template_missing: str = ""
    control_text: bool = False  # message text that spells a control token is that token

    @classmethod
    def of(cls, info: EngineInfo, tokenizer: Tokenizer,
           control_text: bool = False) -> ModelView:
        template, missing = None, ""
        try:
            template = load_chat_template(tokenizer)
        except ChatTemplateMissing as e:
            missing = str(e).split(";")[0]
        return cls(info.model, info.n_ctx, info.lanes, tokenizer, template, missing,
                   control_text)

    @property
    def reads_clock(self) -> bool:
        """Whether the chat template renders the time (`strftime_now`): the same
        messages may then give another prompt another day."""
        return self.template is not None and "strftime_now" in self.template.text


@dataclass(frozen=True)
class BuiltRequest:
    requests: list[GenerationRequest]    # one per choice, in order
    tool_format: ToolCallFormat | None   # the format replies are read in for tool calls
    think: bool | None = None            # a thinking model's: the reply starts in its block


def build_requests(parsed: ParsedRequest, view: ModelView, limits: GatewayLimits,
                   tenant: str = "") -> BuiltRequest:
    """One request per choice: each prompt n times, in order. Seeded copies of a prompt
    take seeds seed, seed + 1, ... so their samples differ, repeatably. Their cache
    namespace is the tenant's (the caller's key), then the request's salt. Tokenizes:
    call it off the event loop."""
    check_model(parsed.model, view.model)
    _check_choices(parsed, view.lanes)
    fmt = _tool_format(parsed, view.template)
    vocab = view.tokenizer.vocab_size
    outside = [t for t, _ in parsed.sampling.logit_bias if t >= vocab]
    if outside:
        raise bad(f"logit_bias token id {outside[0]} is outside the vocabulary "
                  f"(0..{vocab - 1})", "logit_bias")
    parsed = dataclasses.replace(parsed, sampling=_sampling(parsed, fmt, view.tokenizer))
    out = []
    for prompt in (None,) if parsed.chat else parsed.prompts:
        first = _request(parsed, _prompt_ids(parsed, prompt, view), view, limits,
                         cache_namespace(tenant, parsed.cache_salt))
        for copy in range(parsed.n):
            seed = first.sampling.seed
            if seed is None or copy == 0:
                out.append(first)
            else:
                sampling = dataclasses.replace(first.sampling, seed=(seed + copy) % 2**64)
                out.append(dataclasses.replace(first, sampling=sampling))
    _check_tokens(out, limits.max_request_tokens)
    think = None
    if parsed.chat and view.template is not None and thinks(view.template.text):
        think = opened_in(view.tokenizer.decode(out[0].tokens[-8:], special=True))
    return BuiltRequest(out, fmt, think)


def check_model(asked: str, served: str) -> None:
    if asked != served:
        raise not_served(asked, [served])


def not_served(asked: str, served: list[str]) -> ApiError:
    """The 404 for a model this server does not serve."""
    shown = asked if len(asked) <= 100 else asked[:100] + "..."
    names = ", ".join(f"'{n}'" for n in served)
    return ApiError(404, f"the model '{shown}' does not exist; this server serves {names}",
                    param="model", code="model_not_found")


def _prompt_ids(parsed: ParsedRequest, prompt: str | tuple[int, ...] | None,
                view: ModelView) -> list[int]:
    """The token ids of the chat's rendered messages, or of one completions prompt."""
    tokenizer = view.tokenizer
    if parsed.chat:
        if view.template is None:
            raise bad(f"{view.template_missing}, so chat messages cannot be turned "
                      f"into a prompt; use /v1/completions", "messages",
                      "chat_template_missing")
        tools = parsed.tools.template_tools if parsed.tools else None
        messages = list(parsed.messages)
        template = view.template.with_variables(dict(parsed.template_kwargs)) \
            if parsed.template_kwargs else view.template
        if _tools_in(parsed) and \
                native_format(view.template.text, view.template.knows_tools) is None:
            # the template cannot show tools: described and rewritten (generic_tools)
            shown = tools if parsed.tools is not None and parsed.tools.parsed else None
            messages, tools = generic_messages(messages, shown), None
        # what users typed stays text unless the server trusts its clients; bad
        # messages or tools, or the template refusing them, are a RequestError
        return encode_chat(template, tokenizer, messages,
                           control_text=view.control_text, tools=tools)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    vocab = tokenizer.vocab_size
    bad_ids = [t for t in prompt if not 0 <= t < vocab]
    if bad_ids:
        raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{vocab - 1})",
                  "prompt")
    return list(prompt)


def _tools_in(parsed: ParsedRequest) -> bool:
    """Whether a chat offers tools or holds tool calls or results."""
    return parsed.tools is not None or has_tool_history(parsed.messages)


def _tool_format(parsed: ParsedRequest, template: ChatTemplate | None
                 ) -> ToolCallFormat | None:
    """The format the reply is read in for tool calls (tool_calls.reply_format); a 400
    when the request needs tool support that the model's template lacks."""
    if not parsed.chat:
        return None
    text = template.text if template else None
    knows_tools = template is not None and template.knows_tools
    try:
        return reply_format(text, knows_tools, parsed.tools, parsed.messages)
    except ToolSpecError as e:
        raise bad(str(e), e.param, e.code) from None


def _sampling(parsed: ParsedRequest, fmt: ToolCallFormat | None,
              tokenizer: Tokenizer) -> SamplingParams:
    """The request's sampling settings, with the constraint that forces a tool call when
    tool_choice asks for one, or (tool_choice "auto") the one that lets the reply open
    only valid calls to the functions offered. A forced call replaces a response_format's
    constraint:
    the format is for a reply's text, and this reply is a call (as OpenAI's API, where an
    agent with an output type sends both on a turn that must call a tool)."""
    tools = parsed.tools
    if fmt is None or (not tools.forced and parsed.sampling.constraint is not None):
        return parsed.sampling  # "auto" beside a response_format: the format governs
    try:
        constraint = call_constraint(fmt, tools, tokenizer.special_id) if tools.forced \
            else auto_constraint(fmt, tools, tokenizer.special_id)
    except ToolSpecError as e:
        raise bad(str(e), e.param) from None
    if constraint is None:
        return parsed.sampling
    return dataclasses.replace(parsed.sampling, constraint=constraint)


def _request(parsed: ParsedRequest, ids: list[int], view: ModelView,
             limits: GatewayLimits, namespace: str) -> GenerationRequest:
    if not ids:
        raise bad("the prompt is empty", "messages" if parsed.chat else "prompt")
    n_ctx, room = view.n_ctx, view.n_ctx - len(ids)
    max_tokens = parsed.max_tokens
    if max_tokens is None:
        if room < 1:
            raise bad(f"the prompt ({len(ids)} tokens) fills the context of {n_ctx} "
                      f"tokens", "prompt", "context_length_exceeded")
        # a request that names no limit gets its share of the token budget, not a 400
        share = max(1, limits.max_request_tokens // parsed.choices)
        max_tokens = min(DEFAULT_MAX_TOKENS, room, share)
    elif max_tokens > room:
        raise bad(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceed the "
                  f"context of {n_ctx} tokens", "max_tokens", "context_length_exceeded")
    return GenerationRequest(tokens=tuple(ids), max_tokens=max_tokens,
                             sampling=parsed.sampling, stop_ids=view.tokenizer.eog_ids,
                             namespace=namespace, siblings=parsed.choices)


def _check_choices(parsed: ParsedRequest, lanes: int) -> None:
    """At most the engine's lane budget of choices: each takes a lane of its own, and a
    request needing more lanes than a pipeline has could never start."""
    if parsed.choices > lanes:
        asked = f"n = {parsed.n}" if parsed.choices == parsed.n else \
            f"{len(parsed.prompts)} prompts x n = {parsed.n}"
        raise bad(f"{asked} asks for {parsed.choices} choices; this server runs at most "
                  f"{lanes} per request (its lane budget)", "n")


def _check_tokens(requests: list[GenerationRequest], limit: int) -> None:
    total = sum(r.max_tokens for r in requests)
    if total > limit:
        raise bad(f"n x max_tokens over the request's choices is {total} tokens; this "
                  f"server allows at most {limit}", "max_tokens")
