"""The HTTP edge's one translation of failures (mesh/front/http_errors.py), through a real
served model: SmolLM2 in 2 stages behind the in-process engine, on a real uvicorn server.

A bug inside a stage (a plain ValueError in its compute) is ours: the client gets a 5xx
naming an error id, never a 400; the stage's log has the traceback under that id and the
gateway's log the id; the server goes on serving. A client's real mistake is still a 400
naming its param.

Run inside a loopback-only network namespace (see the Makefile)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front import http_errors
from skippy.mesh.front.gateway import BackgroundServer, create_app
from skippy.mesh.stage import session as stage_session
from skippy.topology.errors import OverCapacity, RequestError, StageUnavailable

pytestmark = pytest.mark.timeout(600)

# greedy, so a repeat would be answered from the gateway's exact results: each test asks
# its own prompt, so that what answers is the stages
BODY = {"model": "smollm2", "temperature": 0, "max_tokens": 4}
ERROR_ID = re.compile(r"\(error (err_[0-9a-f]{12})\)")


@pytest.fixture(scope="module")
def served(smollm2):
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(enabled=False), n_ctx=512,
                             model_name="smollm2")
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as client:
            yield engine, client


def a_bug(*args, **kwargs):
    raise ValueError("a bug deep inside the stage")


def the_id_told_and_logged(err: dict, caplog) -> str:
    """The id in the client's message; the stage logged the traceback under it and the
    gateway the id; the message tells nothing of the exception."""
    assert "bug" not in err["message"] and "ValueError" not in err["message"]
    found = ERROR_ID.search(err["message"])
    assert found, err
    error_id = found.group(1)
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    at_stage = [r for r in logged if r.name == stage_session.__name__]
    assert at_stage and at_stage[0].exc_info and at_stage[0].exc_info[0] is ValueError
    assert any(r.name == http_errors.__name__ for r in logged)
    return error_id


def computed(r: httpx.Response) -> str:
    """A 200's text, which the stages computed (no cache answered any of it)."""
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["usage"]["completion_tokens"] == BODY["max_tokens"]
    return body["choices"][0]["text"]


def test_a_value_error_inside_a_stage_is_a_5xx_with_an_error_id_and_serving_goes_on(
        served, monkeypatch, caplog):
    engine, client = served
    body = {**BODY, "prompt": "The capital of France is"}
    monkeypatch.setattr(engine.servers[1].runtime, "prefill", a_bug)
    r = client.post("/v1/completions", json=body)
    monkeypatch.undo()
    assert r.status_code == 503, r.text  # never the client's 400
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "stage_unavailable"
    assert err["param"] is None
    the_id_told_and_logged(err, caplog)
    assert computed(client.post("/v1/completions", json=body))  # the same request, served


def test_a_bug_mid_stream_after_the_first_token_is_an_error_event_with_the_id(
        served, monkeypatch, caplog):
    engine, client = served
    monkeypatch.setattr(engine.servers[1].runtime, "decode", a_bug)
    r = client.post("/v1/completions", json={**BODY, "prompt": "Cats like to",
                                              "stream": True})
    monkeypatch.undo()
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in r.text.split("\n\n")[:-2]]  # not [DONE]
    assert events[0]["choices"][0]["text"]  # the stream had begun
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == "stage_unavailable"
    the_id_told_and_logged(errors[0], caplog)


def test_a_fault_recovery_absorbs_is_no_error_at_all(served, monkeypatch, caplog):
    engine, client = served
    runtime = engine.servers[1].runtime
    real, failed = runtime.prefill, []

    def once(*args, **kwargs):
        if not failed:
            failed.append(True)
            a_bug()
        return real(*args, **kwargs)
    monkeypatch.setattr(runtime, "prefill", once)
    body = {**BODY, "prompt": "In 1969, the"}
    r = client.post("/v1/completions", json=body)
    monkeypatch.undo()
    assert failed and computed(r) == computed(
        client.post("/v1/completions", json={**body, "cache_salt": "fault-free"}))
    # still ours, so logged with its traceback at the stage
    assert [r.exc_info[0] for r in caplog.records if r.name == stage_session.__name__
            and r.exc_info] == [ValueError]


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True}, "echo"),                    # an option this server does not take
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 10**6}, "max_tokens"),       # past the context
])
def test_a_real_client_mistake_is_still_a_400_naming_its_param(served, fields, param):
    _, client = served
    r = client.post("/v1/completions", json={**BODY, "prompt": "Hi", **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


# -- the translation itself, type by type ----------------------------------------------------
def test_each_of_our_types_has_its_answer_and_a_builtin_is_ours(caplog):
    told = http_errors.api_error(RequestError("top_p must be in (0, 1]", "top_p", "x"))
    assert (told.status, told.param, told.code) == (400, "top_p", "x")
    busy = http_errors.api_error(OverCapacity("no lane", retry_after=7.2))
    assert busy.status == 503 and busy.headers == {"Retry-After": "8"}
    gone = http_errors.api_error(StageUnavailable("stage 1 died", "err_00000000abcd"))
    assert gone.status == 503 and "(error err_00000000abcd)" in gone.message
    assert "died" not in gone.message
    for builtin in (ValueError("bad value"), KeyError("k"), TypeError("t")):
        ours = http_errors.api_error(builtin)
        assert ours.status == 500 and ours.type == "server_error"
        error_id = ERROR_ID.search(ours.message).group(1)
        assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)
