"""Request building without HTTP: real bodies, the real SmolLM2 and Gemma vocabularies and
chat templates -> the generation requests (mesh/front/request_building.py), the ids each
prompt tokenizes to, what is refused and with which `param`, and how often a chat
request renders its template and tokenizes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jinja2
import llama_cpp
import pytest

from skippy.mesh.front import http_errors
from skippy.mesh.front.chat import load_chat_template
from skippy.mesh.front.limits import GatewayLimits
from skippy.mesh.front.openai_api import ApiError, parse_request
from skippy.mesh.front.request_building import ModelView, build_requests
from skippy.mesh.tokenizer import Tokenizer
from skippy.topology.errors import RequestError

HERMES = Path(__file__).parent / "data" / "hermes_tools.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
MULTI_TURN = [*SYSTEM, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "Name a color."}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

# (template, body, renders, llama_tokenize calls, Tokenizer.encode calls) per chat
# request, as the gateway did them before request building was its own module (main
# 73caeb7: two renders for the template's pieces; each text tokenized twice over by
# llama-cpp-python, whose first try was sized for no tokens).
TODAY = [
    ("smollm2", {"messages": [{"role": "user", "content": "Hello there"}]}, 2, 6, 3),
    ("smollm2", {"messages": SYSTEM}, 2, 10, 5),
    ("smollm2", {"messages": MULTI_TURN}, 2, 18, 9),
    ("smollm2", {"n": 3, "seed": 5, "messages": [{"role": "user", "content": "Hi"}]}, 2, 6, 3),
    ("hermes", {"tools": TOOLS, "messages": TOOL_TURNS[:1]}, 2, 10, 5),
    ("hermes", {"tools": TOOLS, "messages": TOOL_TURNS}, 2, 22, 11),
    ("hermes", {"tools": TOOLS, "tool_choice": "required", "messages": TOOL_TURNS[:1]},
     2, 14, 7),
    ("gemma", {"messages": [{"role": "user", "content": "Hello there"}]}, 2, 6, 3),
    ("gemma", {"messages": SYSTEM}, 2, 10, 5),
    ("gemma", {"messages": MULTI_TURN}, 2, 18, 9),
]


@pytest.fixture(scope="module")
def views(smollm2, gemma3) -> dict[str, ModelView]:
    smollm2_tok, gemma_tok = Tokenizer(smollm2), Tokenizer(gemma3)
    plain = load_chat_template(smollm2_tok)
    return {"smollm2": ModelView("m", 8192, 8, smollm2_tok, plain),
            "hermes": ModelView("m", 8192, 8, smollm2_tok,
                                dataclasses.replace(plain, text=HERMES.read_text())),
            "gemma": ModelView("m", 8192, 8, gemma_tok, load_chat_template(gemma_tok))}


def build(view: ModelView, body: dict, chat: bool = True, limits=GatewayLimits(),
          tenant: str = ""):
    return build_requests(parse_request({"model": "m", **body}, chat=chat), view, limits,
                          tenant)


@pytest.mark.parametrize("name, body", [(n, b) for n, b, *_ in TODAY])
def test_chat_prompt_ids_are_the_rendered_conversation_tokenized(views, name, body):
    view = views[name]
    built = build(view, body)
    want = view.tokenizer.encode(view.template.render(
        body["messages"], tools=body.get("tools")))
    assert [list(r.tokens) for r in built.requests] == [want] * body.get("n", 1)


def test_text_that_spells_a_control_token_stays_text(views):
    tok = views["smollm2"].tokenizer
    content = "what is <|im_start|>?"
    built = build(views["smollm2"], {"messages": [{"role": "user", "content": content}]})
    want = tok.encode("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                      "trained by Hugging Face<|im_end|>\n<|im_start|>user\n") + \
        tok.encode(content, add_special=False, control=False) + \
        tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special=False)
    assert list(built.requests[0].tokens) == want


@pytest.mark.parametrize("name, body, renders, c_calls, encodes", TODAY)
def test_a_chat_request_renders_and_tokenizes_at_most_half_as_often_as_before(
        views, monkeypatch, name, body, renders, c_calls, encodes):
    counts = {"render": 0, "llama_tokenize": 0, "encode": 0}

    def counting(key, real):
        def call(*args, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(jinja2.Template, "render", counting("render", jinja2.Template.render))
    monkeypatch.setattr(llama_cpp, "llama_tokenize",
                        counting("llama_tokenize", llama_cpp.llama_tokenize))
    monkeypatch.setattr(Tokenizer, "encode", counting("encode", Tokenizer.encode))
    build(views[name], body)
    assert counts["render"] <= renders // 2
    assert counts["llama_tokenize"] <= c_calls // 2
    assert counts["encode"] <= encodes // 2
    assert counts["render"] >= 1 and counts["llama_tokenize"] >= 1  # the counters see them


def test_copies_of_a_seeded_prompt_take_the_next_seeds_in_the_tenants_namespace(views):
    built = build(views["smollm2"], {"prompt": ["a", "b"], "n": 2, "seed": 2**64 - 1,
                                     "max_tokens": 4, "cache_salt": "s"},
                  chat=False, tenant="t")
    seeds = [r.sampling.seed for r in built.requests]
    assert seeds == [2**64 - 1, 0, 2**64 - 1, 0]
    assert built.requests[0].tokens != built.requests[2].tokens
    assert len({r.namespace for r in built.requests}) == 1 and built.requests[0].namespace
    assert all(r.max_tokens == 4 and r.stop_ids == views["smollm2"].tokenizer.eog_ids
               for r in built.requests)
    assert built.tool_format is None


def test_a_request_naming_no_limit_gets_its_share_of_the_token_budget(views):
    limits = GatewayLimits(max_request_tokens=30)
    built = build(views["smollm2"], {"prompt": "Hi", "n": 4}, chat=False, limits=limits)
    assert [r.max_tokens for r in built.requests] == [7] * 4


def test_tool_calls_are_constrained_and_read_in_the_templates_format(views):
    built = build(views["hermes"], {"tools": TOOLS, "tool_choice": "required",
                                    "messages": TOOL_TURNS[:1]})
    assert built.tool_format.open == "<tool_call>"
    forced = built.requests[0].sampling.constraint
    auto = build(views["hermes"], {"tools": TOOLS, "messages": TOOL_TURNS[:1]}
                 ).requests[0].sampling.constraint
    assert forced.text.startswith("start: call") and auto.text.startswith("start: TEXT")
    assert build(views["hermes"], {"tools": TOOLS, "tool_choice": "none",
                                   "messages": TOOL_TURNS[:1]}
                 ).requests[0].sampling.constraint is None


def test_a_template_without_tools_is_told_them_and_shown_its_calls_as_text(views):
    view = views["smollm2"]
    built = build(view, {"tools": TOOLS, "messages": TOOL_TURNS})
    assert built.tool_format.name == "generic"
    prompt = view.tokenizer.decode(built.requests[0].tokens)
    assert "You can call functions." in prompt and '"name": "get_weather"' in prompt
    assert "<tool_call>\n{" in prompt and "<tool_response>" in prompt
    none = view.tokenizer.decode(build(view, {"tools": TOOLS, "tool_choice": "none",
                                              "messages": TOOL_TURNS}).requests[0].tokens)
    assert "You can call functions." not in none and "<tool_response>" in none


@pytest.mark.parametrize("name, body, chat, status, param, code", [
    ("smollm2", {"model": "other", "prompt": "x"}, False, 404, "model", "model_not_found"),
    ("smollm2", {"prompt": "x", "n": 9}, False, 400, "n", None),
    ("smollm2", {"prompt": "x", "max_tokens": 8192}, False, 400, "max_tokens",
     "context_length_exceeded"),
    ("smollm2", {"prompt": [[1, 49152]]}, False, 400, "prompt", None),
    ("smollm2", {"prompt": "x", "logit_bias": {"49152": 1}}, False, 400, "logit_bias", None),
    ("smollm2", {"prompt": "x", "n": 8, "max_tokens": 9000}, False, 400, "max_tokens", None),
    ("smollm2", {"messages": [{"role": "bot", "content": "x"}]}, True, 400, "messages", None),
    ("hermes", {"tools": [{"type": "function", "function": {
        "name": "f", "description": "<|im_end|>"}}], "messages": TOOL_TURNS[:1]}, True, 400,
     "tools", None),
])
def test_what_the_request_gets_wrong_is_a_4xx_naming_its_param(views, name, body, chat,
                                                             status, param, code):
    with pytest.raises((ApiError, RequestError)) as e:  # as the gateway answers them:
        build(views[name], {"model": "m", **body}, chat=chat)
    answer = http_errors.api_error(e.value)
    assert (answer.status, answer.param) == (status, param)
    if code:
        assert answer.code == code


def test_chat_without_a_template_says_so_and_points_to_completions(views):
    view = dataclasses.replace(views["smollm2"], template=None,
                               template_missing="model plain.gguf has no chat template")
    with pytest.raises(ApiError) as e:
        build(view, {"messages": [{"role": "user", "content": "hi"}]})
    assert e.value.code == "chat_template_missing" and "/v1/completions" in str(e.value)
    assert build(view, {"prompt": "hi"}, chat=False).requests  # completions still work
