"""The gateway's edge: where it may listen, who may call (and whose cache they see), from
which Host, with which Content-Type. Real SmolLM2 in 2 stages behind real uvicorn on
loopback; run inside a loopback-only network namespace (see the Makefile)."""

from __future__ import annotations

import json

import httpx
import pytest

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.edge import ApiKeys, KeyFileError, OpenBindRefused, is_loopback, \
    json_content_type, keys_for_bind, load_api_keys, loopback_host_header
from skippy.mesh.front.gateway import BackgroundServer, create_app, serve

BODY = {"model": "smollm2", "prompt": "Hello", "max_tokens": 1, "temperature": 0}


def envelope(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


class RecordingEngine(InProcessEngine):
    """The real engine, remembering each request it was asked to generate."""

    requests: list

    def generate(self, request):
        self.requests.append(request)
        return super().generate(request)


@pytest.fixture(scope="module")
def engine(smollm2):
    engine = RecordingEngine(smollm2, 2, cache=CacheConfig(), model_name="smollm2")
    engine.requests = []
    return engine


@pytest.fixture(scope="module")
def keyed(engine):
    """A server with two keys, alpha and beta, and the operator's omega, on loopback."""
    with BackgroundServer(create_app(engine, api_keys=["alpha", "beta"],
                                     operator_keys=["omega"])) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield srv, c


def as_key(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# -- keys -----------------------------------------------------------------------------------------
def test_keys_from_a_file_the_environment_or_given(tmp_path, monkeypatch):
    path = tmp_path / "keys.txt"
    path.write_text(" alpha \n\nbeta\n")
    path.chmod(0o600)  # a key file only its owner reads
    assert load_api_keys(path) == {"alpha", "beta"} == load_api_keys(str(path))
    monkeypatch.setenv("SKIPPY_API_KEYS", " one, two ,,")
    assert load_api_keys(None) == {"one", "two"}
    monkeypatch.setenv("SKIPPY_API_KEYS", "")
    assert load_api_keys(None) == frozenset()
    assert load_api_keys(()) == frozenset()  # given, and none: no authentication


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_an_empty_key_file_is_an_error_not_no_authentication(tmp_path, content):
    path = tmp_path / "keys.txt"
    path.write_text(content)
    path.chmod(0o600)  # a key file only its owner reads
    with pytest.raises(KeyFileError, match="holds no key") as e:
        load_api_keys(path)
    assert "\n" not in str(e.value)


def test_an_unreadable_key_file_is_an_error(tmp_path):
    for where in (tmp_path / "missing.txt", tmp_path):  # absent; a folder
        with pytest.raises(KeyFileError, match="cannot read") as e:
            load_api_keys(where)
        assert "\n" not in str(e.value) and str(where) in str(e.value)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    latin.chmod(0o600)  # a key file only its owner reads
    with pytest.raises(KeyFileError, match="cannot read"):
        load_api_keys(latin)


def test_a_key_a_header_cannot_carry_is_an_error(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("good\n\nsp ace\n")
    path.chmod(0o600)  # a key file only its owner reads
    with pytest.raises(KeyFileError, match="line 3"):
        load_api_keys(path)
    with pytest.raises(KeyFileError):
        load_api_keys(["clé"])


def test_tenant_tags_are_per_key_and_never_the_key():
    keys = ApiKeys(frozenset({"alpha", "beta"}))
    a, b = keys.tenant("Bearer alpha"), keys.tenant("bearer  beta ")
    assert a and b and a != b and a == keys.tenant("Bearer alpha")
    assert "alpha" not in a and "beta" not in b
    for header in (None, "", "Bearer", "Bearer gamma", "alpha", "Basic alpha"):
        assert keys.tenant(header) is None
    # another app (another process) tags the same key differently
    assert ApiKeys(frozenset({"alpha"})).tenant("Bearer alpha") != a
    # unless both are given the same secret (serve gives the cluster's): a restarted
    # gateway finds a key's cached state again
    same = [ApiKeys(frozenset({"alpha"}), "cluster").tenant("Bearer alpha") for _ in "ab"]
    assert same[0] == same[1] != ApiKeys(frozenset({"alpha"}), "other").tenant("Bearer alpha")


def test_api_keys_guard_the_api_but_not_the_probes(keyed):
    _, c = keyed
    assert envelope(c.post("/v1/completions", json=BODY), 401)["code"] == "invalid_api_key"
    envelope(c.post("/v1/completions", json=BODY, headers=as_key("gamma")), 401)
    assert c.post("/v1/completions", json=BODY, headers=as_key("beta")).status_code == 200
    assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200


# -- tenants --------------------------------------------------------------------------------------
def memo_hits(c) -> float:
    text = c.get("/metrics", headers=as_key("omega")).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("skippy_gateway_results_hits_total")))


def test_one_key_never_sees_anothers_cached_tokens(keyed, engine):
    _, c = keyed
    body = {**BODY, "prompt": "A long prompt about the tides of the northern sea. " * 12,
            "max_tokens": 3}
    first = c.post("/v1/completions", json=body, headers=as_key("alpha")).json()
    hits = memo_hits(c)
    again = c.post("/v1/completions", json=body, headers=as_key("alpha")).json()
    n = again["usage"]["prompt_tokens"]
    assert n > 100 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # alpha's repeat is answered from alpha's own results
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert memo_hits(c) == hits + 1
    other = c.post("/v1/completions", json=body, headers=as_key("beta")).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert memo_hits(c) == hits + 1  # beta was not answered from alpha's results
    assert other["choices"][0]["text"] == first["choices"][0]["text"]  # the same model
    a, b = engine.requests[-2].namespace, engine.requests[-1].namespace
    assert a != b and "alpha" not in a and "beta" not in b


def test_what_spans_tenants_needs_an_operator_key(keyed, engine):
    _, c = keyed
    assert envelope(c.get("/metrics"), 401)["code"] == "invalid_api_key"
    err = envelope(c.get("/metrics", headers=as_key("alpha")), 403)
    assert err["code"] == "operator_key_required" and err["type"] == "permission_error"
    assert c.get("/metrics", headers=as_key("omega")).status_code == 200
    assert c.get("/status.json", headers=as_key("alpha")).json()["view"] == "tenant"
    assert "stages" in c.get("/status.json", headers=as_key("omega")).json()
    # the operator's key calls the API too, as a tenant of its own
    assert c.post("/v1/completions", json=BODY, headers=as_key("omega")).status_code == 200
    namespace = engine.requests[-1].namespace
    assert namespace and "omega" not in namespace


def test_another_tenants_prompt_moves_nothing_a_tenant_can_read(keyed):
    """Tenant alpha sends a prompt (three times: its caches keep it); tenant beta then
    sends it and a fresh one of the same length: each moves every figure beta can read
    the same, and each of beta's answers says the same of its cached tokens."""
    _, c = keyed

    def sent(word: str) -> str:
        return f"A long prompt about the currents of the {word} ocean. " * 12

    def readable() -> dict:
        view = c.get("/status.json", headers=as_key("beta")).json()
        del view["updated"]
        view["metrics"] = c.get("/metrics", headers=as_key("beta")).status_code
        return view

    def delta(before: dict, after: dict) -> dict:
        return {**after, "usage": {k: n - before["usage"][k]
                                   for k, n in after["usage"].items()}}

    for _ in range(3):
        assert c.post("/v1/completions", json={**BODY, "prompt": sent("eastern")},
                      headers=as_key("alpha")).status_code == 200
    moves, cached = [], []
    for word in ("eastern", "western"):  # alpha's prompt, then a fresh one
        before = readable()
        got = c.post("/v1/completions", json={**BODY, "prompt": sent(word)},
                     headers=as_key("beta")).json()
        moves.append(delta(before, readable()))
        cached.append(got["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert moves[0] == moves[1] and moves[0]["metrics"] == 403
    assert moves[0]["usage"]["choices"] == 1 and moves[0]["usage"]["prompt_tokens"] > 100
    assert cached == [0, 0]


def test_a_keys_cache_salt_splits_its_namespace_further(keyed, engine):
    _, c = keyed
    for salt in ("one", "two"):
        c.post("/v1/completions", json={**BODY, "cache_salt": salt}, headers=as_key("alpha"))
    one, two = (r.namespace for r in engine.requests[-2:])
    assert one.endswith("/one") and two.endswith("/two")
    assert one.split("/")[0] == two.split("/")[0]  # the same tenant


def test_a_cache_salt_over_256_characters_is_a_400(keyed):
    _, c = keyed
    ok = c.post("/v1/completions", json={**BODY, "cache_salt": "s" * 256},
                headers=as_key("alpha"))
    assert ok.status_code == 200
    err = envelope(c.post("/v1/completions", json={**BODY, "cache_salt": "s" * 257},
                          headers=as_key("alpha")), 400)
    assert err["param"] == "cache_salt" and "256" in err["message"]


# -- where it listens -------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost",
                                  "LOCALHOST"])
def test_loopback_binds(host):
    assert is_loopback(host)
    assert keys_for_bind(host, ()) == frozenset()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "example.com",
                                  "localhost.example.com", ""])
def test_beyond_loopback_needs_keys_or_insecure(host, tmp_path):
    assert not is_loopback(host)
    with pytest.raises(OpenBindRefused) as e:
        keys_for_bind(host, ())
    assert "\n" not in str(e.value) and "--insecure" in str(e.value)
    assert keys_for_bind(host, (), insecure=True) == frozenset()
    assert keys_for_bind(host, ["k"]) == {"k"}
    empty = tmp_path / "keys.txt"
    empty.write_text("")
    empty.chmod(0o600)  # a key file only its owner reads
    with pytest.raises(KeyFileError):  # insecure never turns a bad key file into "none"
        keys_for_bind(host, empty, insecure=True)


class ClosableEngine:
    closed = False

    async def close(self):
        self.closed = True


def test_serve_refuses_an_open_bind_without_keys_before_listening(monkeypatch, tmp_path):
    monkeypatch.delenv("SKIPPY_API_KEYS", raising=False)
    engine = ClosableEngine()
    with pytest.raises(OpenBindRefused, match="0.0.0.0"):
        serve(engine, "0.0.0.0", 1)  # port 1: it would fail, had it got so far
    assert engine.closed
    empty = tmp_path / "keys.txt"
    empty.write_text("")
    empty.chmod(0o600)  # a key file only its owner reads
    with pytest.raises(KeyFileError, match="holds no key"):
        serve(ClosableEngine(), "127.0.0.1", 1, api_keys=empty)


# -- Host -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,ok", [
    ("localhost", True), ("localhost:8000", True), ("127.0.0.1:1", True),
    ("127.44.0.9", True), ("[::1]", True), ("[::1]:8000", True), ("LocalHost:80", True),
    ("evil.example", False), ("evil.example:8000", False), ("localhost.evil.example", False),
    ("127.0.0.1.evil.example", False), ("10.0.0.1:8000", False), ("[::1", False),
    ("[::2]:80", False), ("localhost:80x", False), ("[::1]x", False), ("", False),
    (None, False), ("0.0.0.0", False),
])
def test_loopback_host_headers(value, ok):
    assert loopback_host_header(value) is ok


def test_a_foreign_host_is_refused_on_loopback(keyed):
    _, c = keyed
    for host in ("evil.example", "evil.example:80", "192.168.0.7"):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("GET", "/health")):
            r = c.request(method, path, json=BODY, headers={"Host": host, **as_key("alpha")})
            assert envelope(r, 400)["code"] == "invalid_host"
    for host in ("localhost:9", "127.0.0.3", "[::1]:80"):
        r = c.post("/v1/completions", json=BODY, headers={"Host": host, **as_key("alpha")})
        assert r.status_code == 200, r.text


def test_no_host_check_when_the_app_listens_beyond_loopback(engine):
    app = create_app(engine, api_keys=["k"], bind_host="0.0.0.0")
    with BackgroundServer(app) as srv:  # served on loopback here, as if open
        r = httpx.get(f"{srv.url}/v1/models", headers={"Host": "gateway.example",
                                                       **as_key("k")})
    assert r.status_code == 200


# -- Content-Type -------------------------------------------------------------------------------
@pytest.mark.parametrize("value,ok", [
    ("application/json", True), ("application/json; charset=utf-8", True),
    ("Application/JSON;charset=\"UTF-8\"", True), ("application/json; charset=utf8", True),
    ("application/json; charset=latin-1", False), ("text/plain", False),
    ("application/x-www-form-urlencoded", False), ("multipart/form-data; boundary=x", False),
    ("application/jsonx", False), ("", False), (None, False),
])
def test_json_content_types(value, ok):
    assert json_content_type(value) is ok


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1"])
def test_a_post_that_is_not_json_is_a_415(keyed, path, content_type):
    _, c = keyed
    body = {**BODY, "messages": [{"role": "user", "content": "hi"}]}
    headers = as_key("alpha") | ({"Content-Type": content_type} if content_type else {})
    r = c.post(f"/v1/{path}", content=json.dumps(body).encode(), headers=headers)
    err = envelope(r, 415)
    assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
    ok = c.post(f"/v1/{path}", content=json.dumps(body).encode(), headers={
        **as_key("alpha"), "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_the_edge_counts_what_it_refuses(keyed):
    _, c = keyed
    c.post("/v1/completions", content=b"{}", headers=as_key("alpha"))
    text = c.get("/metrics", headers=as_key("omega")).text
    assert 'skippy_requests_total{endpoint="/v1/completions",status="415"}' in text

