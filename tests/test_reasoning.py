"""A thinking model's reasoning comes back apart from its answer (mesh/front/reasoning.py):
the split itself, streamed pieces against the whole text; then over HTTP in all three
APIs, whole and streamed, on a random-weight qwen3 whose template opens a think block in
the prompt (tests/data/think.jinja). Random weights never close the block by themselves:
each request carries a grammar (vLLM's `structured_outputs`, which we take) that makes
the reply a few lowercase words, `</think>`, then one capitalised word. Real uvicorn on
loopback: run inside a loopback-only network namespace."""

from __future__ import annotations

import random

import anthropic
import httpx
import openai
import pytest

from openai_schemas import responses_conform

from skippy.mesh.front.reasoning import ThinkSplit, opened_in, split, thinks

REPLY = r'start: /[a-z]{2,6}( [a-z]{2,6}){0,2}/ "\n</think>\n\n" /[A-Z][a-z]{2,6}/'
GRAMMAR = {"structured_outputs": {"grammar": REPLY}}
ASK = [{"role": "user", "content": "Think, then answer."}]


# -- the split ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "opened", "want"), [
    ("<think>\nplan\n</think>\n\nAnswer.", False, ("plan", "Answer.")),
    ("plan b\n</think>Answer", True, ("plan b", "Answer")),
    ("No block <think> here", False, ("", "No block <think> here")),
    ("  <think>cut off\n", False, ("cut off\n", "")),
    ("<thi", False, ("", "<thi")),
    ("a\n\nb\n</think>\n", True, ("a\n\nb", "")),
])
def test_streamed_pieces_split_as_the_whole_text_does(text, opened, want):
    assert split(text, opened) == want
    rng = random.Random(text)
    for _ in range(100):
        splitter, parts, i = ThinkSplit(opened), [], 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            parts += splitter.push(text[i:j])
            i = j
        parts += splitter.finish()
        assert ("".join(t for k, t in parts if k == "reasoning"),
                "".join(t for k, t in parts if k == "content")) == want


def test_a_template_says_whether_its_model_thinks():
    assert thinks("{{ '<think>' }} ... </think>") and not thinks("{{ messages }}")
    assert opened_in("<|im_start|>assistant\n<think>\n") and not opened_in("assistant\n")


# -- over HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(smollm2, tmp_path_factory):
    from pathlib import Path

    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    from skippy.stages.synth import write_synthetic
    template = (Path(__file__).parent / "data" / "think.jinja").read_text()
    model = write_synthetic("qwen3", layers=2, seed=5, tokenizer_from=smollm2,
                            out=tmp_path_factory.mktemp("synth") / "qwen3-think-L2.gguf",
                            chat_template=template)
    engine = InProcessEngine(model, 1, cache=CacheConfig(enabled=False), model_name="thinker")
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        yield srv.url


def parts(reasoning: str, answer: str) -> None:
    """What every API must give back for the grammar's reply."""
    words = reasoning.split(" ")
    assert 1 <= len(words) <= 3 and all(w.isalpha() and w.islower() for w in words)
    assert answer.isalpha() and answer[0].isupper() and "think>" not in reasoning + answer


def test_chat_gives_reasoning_content(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask = dict(model="thinker", messages=ASK, max_tokens=48, temperature=0, extra_body=GRAMMAR)
    whole = client.chat.completions.create(**ask).choices[0].message
    parts(whole.reasoning_content, whole.content)
    reasoning = content = ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


def test_responses_give_a_reasoning_item(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask = dict(model="thinker", input="Think, then answer.", max_output_tokens=48,
               temperature=0, extra_body=GRAMMAR)
    r = client.responses.create(**ask)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    responses_conform(url + "/v1", {k: v for k, v in ask.items() if k != "extra_body"}
                      | GRAMMAR)  # a reasoning item as OpenAI's schema publishes it
    parts(r.output[0].content[0].text, r.output_text)
    with client.responses.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert final.output[0].content[0].text == r.output[0].content[0].text
    assert final.output_text == r.output_text
    # the next turn sends no reasoning back to the model: the template drops it anyway
    again = client.responses.create(model="thinker", input="And?", previous_response_id=r.id,
                                    max_output_tokens=48, temperature=0, extra_body=GRAMMAR)
    assert again.usage.input_tokens > r.usage.input_tokens


def test_messages_give_a_thinking_block(url):
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    ask = dict(model="thinker", messages=ASK, max_tokens=48,
               extra_body={"temperature": 0, **GRAMMAR})
    m = client.messages.create(**ask)
    assert [b.type for b in m.content] == ["thinking", "text"]
    parts(m.content[0].thinking, m.content[1].text)
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content] == [("thinking", m.content[0].thinking),
                                        ("text", m.content[1].text)]


WORD = {"structured_outputs": {"grammar": 'start: /[A-Z][a-z]{2,6}/'}}


def test_thinking_turned_off_where_the_template_allows_gives_only_an_answer(url):
    """chat_template_kwargs (chat), thinking disabled (Messages), no reasoning effort
    (Responses): the template writes an empty block itself, and the reply is answer."""
    chat = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    on = chat.chat.completions.create(model="thinker", messages=ASK, max_tokens=8,
                                      temperature=0, extra_body=WORD)
    off = chat.chat.completions.create(
        model="thinker", messages=ASK, max_tokens=8, temperature=0,
        extra_body={**WORD, "chat_template_kwargs": {"enable_thinking": False}})
    assert on.choices[0].message.reasoning_content and not on.choices[0].message.content
    message = off.choices[0].message
    assert not getattr(message, "reasoning_content", None) and message.content.isalpha()
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty block, written
    r = chat.responses.create(model="thinker", input=ASK[0]["content"], temperature=0,
                              max_output_tokens=8, reasoning={"effort": "none"},
                              extra_body=WORD)
    assert [item.type for item in r.output] == ["message"]
    m = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
        model="thinker", messages=ASK, max_tokens=8, thinking={"type": "disabled"},
        extra_body={"temperature": 0, **WORD})
    assert [b.type for b in m.content] == ["text"]
    with pytest.raises(openai.BadRequestError) as e:
        chat.chat.completions.create(model="thinker", messages=ASK, max_tokens=1,
                                     extra_body={"chat_template_kwargs": {"messages": 1}})
    assert e.value.param == "chat_template_kwargs"


def test_a_model_that_does_not_think_gives_no_reasoning(url, smollm2):
    # the same request shape on SmolLM2 (its template writes no think tags) is all answer
    del url
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    engine = InProcessEngine(smollm2, 1, cache=CacheConfig(enabled=False), n_ctx=256,
                             model_name="smollm2", weight_format="int4")
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        body = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": ASK, "max_tokens": 8, "temperature": 0}).json()
    assert "reasoning_content" not in body["choices"][0]["message"]
