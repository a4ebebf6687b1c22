"""Traces of requests (mesh/tracing.py) as a collector receives them: a real OTLP/HTTP
collector on loopback (protobuf bodies decoded with opentelemetry-proto's classes), the
real gateway over SmolLM2 in 2 stages, in process and on Ray; and, with no endpoint,
nothing sent and nothing of the SDK imported.

Runs inside the loopback-only namespace (DESIGN.md §9)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanPb

from skippy.cache.config import CacheConfig
from skippy.mesh import tracing
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.gateway import BackgroundServer, create_app
from skippy.topology.errors import UserError

pytestmark = pytest.mark.timeout(300)

DEFAULT_OTLP_PORT = 4318  # where an exporter sends when nothing says otherwise
CHAT = "/v1/chat/completions"
STORY = ("Here is a long story about a dragon who loved tea, and the village that learned "
         "to brew it for him every morning before the sun came up over the hills. ") * 3


class Collector:
    """An OTLP/HTTP trace collector on loopback: each POST /v1/traces body is decoded and
    its spans kept, with their resource's attributes."""

    def __init__(self, port: int = 0):
        self.spans: list[tuple[dict, SpanPb]] = []
        self.bodies = 0
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = (self.path == "/v1/traces" and
                      self.headers.get("Content-Type") == "application/x-protobuf")
                if ok:
                    collector.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.bodies += 1
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    self.spans.extend((resource, s) for s in ss.spans)

    def clear(self) -> None:
        """Forget what came so far (this process's spans still waiting are sent first)."""
        tracing.flush()
        with self._lock:
            self.spans, self.bodies = [], 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(kvs) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}


class Trace:
    """One request's spans, found by name, stage and parent."""

    def __init__(self, spans: list[tuple[dict, SpanPb]]):
        self.items = spans
        self.spans = [s for _, s in spans]
        self.by_id = {s.span_id: s for s in self.spans}

    def named(self, name: str, stage: int | None = None) -> list[SpanPb]:
        return sorted((s for s in self.spans if s.name == name and
                       (stage is None or attributes(s.attributes).get("skippy.stage.index")
                        == stage)), key=lambda s: s.start_time_unix_nano)

    def parent(self, span: SpanPb) -> SpanPb | None:
        return self.by_id.get(span.parent_span_id)

    def process(self, span: SpanPb) -> str:
        return next(r["skippy.process"] for r, s in self.items if s is span)


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def traced(collector):
    tracing.configure(tracing.traces_url(collector.url))
    yield
    tracing.configure(None)


@pytest.fixture(scope="module")
def client(traced, smollm2):
    engine = InProcessEngine(smollm2, 2, cache=CacheConfig(), model_name="smollm2",
                             weight_format="int4")
    with BackgroundServer(create_app(engine, api_keys=())) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    asyncio.run(engine.close())


def chat(client, text: str, **fields) -> dict:
    r = client.post(CHAT, json={"model": "smollm2", "max_tokens": 4, "temperature": 0,
                                "messages": [{"role": "user", "content": text}], **fields})
    assert r.status_code == 200, r.text
    return r.json()


def one_trace(collector) -> Trace:
    """The one trace the collector holds, once its root span (the gateway's, which ends
    just after the answer's last byte is sent) is in."""
    deadline = time.monotonic() + 10
    while True:
        tracing.flush()
        if any(s.name == f"POST {CHAT}" for _, s in collector.spans) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ids = {s.trace_id for _, s in collector.spans}
    assert len(ids) == 1, f"{len(ids)} traces"
    return Trace(list(collector.spans))


def decode_steps(answer: dict) -> int:
    """Decode calls the driver made: the first token comes from the prefill; a stop ends
    the stream with a decode step whose token is not shown."""
    done = answer["choices"][0]["finish_reason"]
    return answer["usage"]["completion_tokens"] - (done == "length")


def check_stage_chain(trace: Trace, name: str, generate: SpanPb) -> None:
    """Stage 0's `name` spans sit under `generate`; stage 1's, one to one, under them,
    within their time, except a decode step the last stage answers straight to the driver
    (`skippy.direct`): stage 0's step ends once it sent its row on, and the next one's
    follows it."""
    first, second = trace.named(name, 0), trace.named(name, 1)
    assert first and len(first) == len(second)
    for s in first:
        assert trace.parent(s) is generate
    assert sorted(trace.parent(s).span_id for s in second) == \
        sorted(s.span_id for s in first)
    for s in first + second:
        a = attributes(s.attributes)
        assert a["skippy.stage.layer_start"] < a["skippy.stage.layer_end"]
        parent = trace.parent(s)  # within its parent's time
        assert parent.start_time_unix_nano <= s.start_time_unix_nano
        if not a.get("skippy.direct"):
            assert s.end_time_unix_nano <= parent.end_time_unix_nano


# -- in process -------------------------------------------------------------------------------
def test_a_chat_request_is_one_trace_with_a_span_per_stage_step(client, collector):
    collector.clear()
    answer = chat(client, "Name three colors.")
    trace = one_trace(collector)
    roots = [s for s in trace.spans if not s.parent_span_id]
    assert [s.name for s in roots] == [f"POST {CHAT}"]
    root = roots[0]
    assert root.kind == SpanPb.SPAN_KIND_SERVER
    assert attributes(root.attributes)["http.response.status_code"] == 200
    [generate] = trace.named("generate")
    assert trace.parent(generate) is root
    assert attributes(generate.attributes)["skippy.completion_tokens"] == \
        answer["usage"]["completion_tokens"]
    for name in ("plan", "prefill", "decode"):
        check_stage_chain(trace, name, generate)
    for stage in (0, 1):
        assert len(trace.named("plan", stage)) == 1
        assert len(trace.named("prefill", stage)) == 1
        decodes = trace.named("decode", stage)
        assert len(decodes) == decode_steps(answer) >= 3
        assert all(attributes(s.attributes)["skippy.batch"] == 1 for s in decodes)
    assert not trace.named("restore")  # a prompt never seen: nothing to restore
    assert Counter(s.name for s in trace.spans) == Counter(
        {f"POST {CHAT}": 1, "generate": 1, "plan": 2, "prefill": 2,
         "decode": 2 * decode_steps(answer)})


def test_a_repeated_prompt_shows_each_stage_restoring_its_prefix(client, collector):
    collector.clear()
    chat(client, STORY, max_tokens=2)
    one_trace(collector)  # all of its spans in, before they are forgotten
    collector.clear()
    # sampled, so the gateway's exact results do not answer it: the stages do
    chat(client, STORY, max_tokens=2, temperature=0.7)
    trace = one_trace(collector)
    for stage in (0, 1):
        [restore] = trace.named("restore", stage)
        assert attributes(restore.attributes)["skippy.tokens"] >= 64
        [prefill] = trace.named("prefill", stage)
        assert trace.parent(restore) is prefill
        assert attributes(prefill.attributes)["skippy.start"] == \
            attributes(restore.attributes)["skippy.tokens"]


def test_a_streamed_answer_keeps_its_spans_under_the_gateway_span_to_the_end(client,
                                                                              collector):
    collector.clear()
    with client.stream("POST", CHAT, json={
            "model": "smollm2", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Count to five."}]}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    trace = one_trace(collector)
    [root] = trace.named(f"POST {CHAT}")
    [generate] = trace.named("generate")
    assert trace.parent(generate) is root
    check_stage_chain(trace, "decode", generate)
    answer = {"usage": events[-1]["usage"], "choices": [
        next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
        ["choices"][0]]}
    assert len(trace.named("decode", 1)) == decode_steps(answer) >= 2
    last = max(s.end_time_unix_nano for s in trace.spans if s is not root)
    assert last <= root.end_time_unix_nano


def test_a_caller_trace_context_becomes_the_gateway_span_parent(client, collector):
    collector.clear()
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = client.post(CHAT, headers={"traceparent": caller},
                    json={"model": "smollm2", "max_tokens": 1, "temperature": 0,
                          "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    trace = one_trace(collector)
    [root] = trace.named(f"POST {CHAT}")
    assert root.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
    assert root.parent_span_id.hex() == "b7ad6b7169203331"


def test_probes_and_metrics_make_no_spans(client, collector):
    collector.clear()
    assert client.get("/ready").status_code == 200
    assert client.get("/metrics").status_code == 200
    tracing.flush()
    assert collector.spans == []


# -- on Ray: the stage actors' own spans join the trace ------------------------------------------
def test_stage_actors_export_their_spans_into_the_request_trace(traced, collector, smollm2):
    from skippy.mesh.control.ray_engine import RayEngine
    engine = RayEngine(smollm2, 2, model_name="smollm2", n_ctx=512)
    try:
        with BackgroundServer(create_app(engine, api_keys=())) as srv, \
                httpx.Client(base_url=srv.url, timeout=120) as c:
            collector.clear()
            answer = chat(c, "Name three colors.")
    finally:
        asyncio.run(engine.close())  # each actor sends what it holds before it ends
    trace = one_trace(collector)
    [generate] = trace.named("generate")
    for name in ("plan", "prefill", "decode"):
        check_stage_chain(trace, name, generate)
    for stage in (0, 1):
        assert {trace.process(s) for s in trace.named("decode", stage)} == {f"stage {stage}"}
        assert len(trace.named("decode", stage)) == decode_steps(answer)
    assert trace.process(generate) == "gateway"


# -- off ----------------------------------------------------------------------------------------
OFF_SCRIPT = """
import json, sys
import httpx
from skippy.mesh import tracing
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.gateway import BackgroundServer, create_app
engine = InProcessEngine(sys.argv[1], 2, model_name="smollm2")
with BackgroundServer(create_app(engine, api_keys=())) as srv:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "Name three colors."}]})
    assert r.status_code == 200, r.text
print(json.dumps({"on": tracing.enabled(),
                  "modules": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}))
"""


def test_with_no_endpoint_nothing_is_sent_and_the_sdk_is_never_imported(smollm2):
    try:  # a collector where an exporter sends by default, to catch one that does
        collector = Collector(DEFAULT_OTLP_PORT)
    except OSError:
        pytest.skip(f"port {DEFAULT_OTLP_PORT} is taken")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        r = subprocess.run([sys.executable, "-c", OFF_SCRIPT, str(smollm2)], env=env,
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["on"] is False
        assert not [m for m in seen["modules"] if m.startswith(
            ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto"))]
        assert collector.bodies == 0
    finally:
        collector.close()


# -- where spans go -----------------------------------------------------------------------------
def test_the_endpoint_comes_from_the_flag_then_the_environment():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318/",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/custom"}
    assert tracing.traces_url("http://flag:4318", env) == "http://flag:4318/v1/traces"
    assert tracing.traces_url("http://flag:4318/v1/traces", env) == \
        "http://flag:4318/v1/traces"
    assert tracing.traces_url(None, env) == "http://traces:4318/custom"
    del env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    assert tracing.traces_url(None, env) == "http://base:4318/v1/traces"
    assert tracing.traces_url(None, {**env, "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.traces_url(None, {}) is None
    for bad in ("collector:4318", "ftp://collector", "http://"):
        with pytest.raises(UserError, match="OTLP endpoint"):
            tracing.traces_url(bad, {})
