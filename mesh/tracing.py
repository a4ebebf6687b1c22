"""Optional OpenTelemetry traces of requests, exported over OTLP/HTTP (protobuf).

One trace per HTTP request: the gateway's span (`POST /v1/chat/completions`) -> the
driver's `generate` span (the request's life, rebuilds included) -> each stage's `plan`,
`restore` (a cached prefix taken up), `prefill` and `decode` spans, one per step, each
under the step of the stage before it (stage 0's under `generate`), with the stage's index
and layers as attributes.

Off unless an endpoint is configured (`traces_url`): then nothing of OpenTelemetry is
imported and every call here returns at once (`OFF`, a span that does nothing). A stage
process exports its own spans; they join the request's trace through the W3C
`traceparent` each StageCall carries (proto/stage.proto). A stage makes spans only for
calls that carry one, so probes and untraced requests cost the stages nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from skippy.topology.errors import UserError

TRACES_PATH = "/v1/traces"


class _Off:
    """The span of a request that is not traced: every call does nothing."""

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set_attribute(self, key: str, value) -> None:
        pass

    def add_event(self, name: str, attributes: dict | None = None) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass


OFF = _Off()


class Span:
    """A live span (tracing on)."""

    def __init__(self, raw):
        self.raw = raw

    def set_attribute(self, key: str, value) -> None:
        self.raw.set_attribute(key, value)

    def add_event(self, name: str, attributes: dict | None = None) -> None:
        self.raw.add_event(name, attributes or {})

    def fail(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode
        self.raw.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        self.raw.end()


class _Tracing:
    """The SDK's objects for this process, made by `configure` only."""

    def __init__(self, url: str, role: str):
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import \
            TraceContextTextMapPropagator
        attributes = {"skippy.process": role}
        if not os.environ.get("OTEL_SERVICE_NAME"):  # the user's name wins
            attributes["service.name"] = "skippy"
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.tracer = self.provider.get_tracer("skippy.mesh")
        self.trace, self.propagator = trace, TraceContextTextMapPropagator()
        self.url = url

    def start(self, name: str, attributes: dict | None, parent=None, kind: str = "INTERNAL"):
        return Span(self.tracer.start_span(name, context=parent, attributes=attributes,
                                           kind=getattr(self.trace.SpanKind, kind)))

    @contextlib.contextmanager
    def current(self, span: Span) -> Iterator[Span]:
        with self.trace.use_span(span.raw, end_on_exit=True, record_exception=True,
                                 set_status_on_exception=True):
            yield span

    def extract(self, traceparent: str):
        return self.propagator.extract({"traceparent": traceparent})


_tracing: _Tracing | None = None


def traces_url(endpoint: str | None = None, env=os.environ) -> str | None:
    """Where spans go, or None (tracing off): `endpoint` (serve's --otlp-endpoint: a
    collector's OTLP/HTTP base URL such as http://collector:4318, to which /v1/traces is
    added; a URL already ending in /v1/traces is taken as it is), else
    $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, else $OTEL_EXPORTER_OTLP_ENDPOINT plus
    /v1/traces. $OTEL_SDK_DISABLED=true turns the environment's off. UserError (one
    line) for a URL that is not http(s)://host[:port][/path]."""
    if endpoint:
        url, base = endpoint, not endpoint.rstrip("/").endswith(TRACES_PATH)
    elif env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        url, base = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], False
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        url, base = env["OTEL_EXPORTER_OTLP_ENDPOINT"], True
    else:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"the OTLP endpoint {url!r} is not an http:// or https:// URL")
    return url.rstrip("/") + TRACES_PATH if base else url


def configure(url: str | None, role: str = "gateway") -> bool:
    """Export this process's spans to `url` (see `traces_url`), or stop tracing (None),
    flushing what the previous setup still holds. `role` names the process in its spans'
    resource (`skippy.process`: gateway, stage 0, ...). True if tracing is on."""
    global _tracing
    if _tracing is not None:
        old, _tracing = _tracing, None
        old.provider.shutdown()
    if url:
        _tracing = _Tracing(url, role)
    return _tracing is not None


def enabled() -> bool:
    return _tracing is not None


def exporting_to() -> str | None:
    """This process's traces URL (None: off): a Ray engine's stage actors get it."""
    return None if _tracing is None else _tracing.url


def flush(timeout_s: float = 10.0) -> None:
    """Send the spans still waiting in this process's batch (a stage actor before it
    ends: a killed process runs no exit hooks)."""
    if _tracing is not None:
        _tracing.provider.force_flush(int(timeout_s * 1000))


def span(name: str, attributes: dict | None = None):
    """A context manager: a span under the current one, current within the block; its
    exception, if any, is recorded on it. `OFF` when tracing is off or no span is current
    (work of an untraced request makes no trace of its own)."""
    if _tracing is None or not _tracing.trace.get_current_span().get_span_context().is_valid:
        return OFF
    return _tracing.current(_tracing.start(name, attributes))


def start(name: str, attributes: dict | None = None) -> Span | _Off:
    """A span under the current one that the caller ends; it is not made current (the
    driver's span lives across an async generator's yields, where a current span could
    not be set and reset in one context)."""
    if _tracing is None:
        return OFF
    return _tracing.start(name, attributes)


def joined(traceparent: str, name: str, attributes: dict | None = None, *,
           kind: str = "INTERNAL"):
    """A context manager: a span under the remote caller's (a StageCall's or an HTTP
    request's `traceparent`), current within the block. `OFF` when the call carries no
    trace context or tracing is off; a new root span where `kind` is SERVER and the
    request carries none."""
    if _tracing is None or not (traceparent or kind == "SERVER"):
        return OFF
    parent = _tracing.extract(traceparent) if traceparent else None
    return _tracing.current(_tracing.start(name, attributes, parent, kind))


def traceparent(of: Span | _Off | None = None) -> str:
    """The W3C traceparent of `of` (default: the current span), to send with a call; ""
    when tracing is off or there is no such span."""
    if _tracing is None or of is OFF:
        return ""
    carrier: dict[str, str] = {}
    context = None if of is None else _tracing.trace.set_span_in_context(of.raw)
    _tracing.propagator.inject(carrier, context=context)
    return carrier.get("traceparent", "")


def carried(fn: Callable) -> Callable:
    """`fn`, run in the caller's context wherever it runs (work handed to a stage's
    compute loop keeps its span's parent); `fn` itself when tracing is off."""
    if _tracing is None:
        return fn
    context = contextvars.copy_context()
    return functools.wraps(fn)(lambda *a, **kw: context.run(fn, *a, **kw))


TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class HttpSpans:
    """ASGI middleware: a SERVER span for each generation request (probes, /metrics and
    the model list are not traced), under the caller's `traceparent` header if it sends
    one; it ends when the last byte of the answer (a stream's too) is sent."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if _tracing is None or scope["type"] != "http" or path not in TRACED_PATHS:
            return await self.app(scope, receive, send)
        parent = dict(scope.get("headers", ())).get(b"traceparent", b"").decode("latin-1")
        method = scope["method"]
        attributes = {"http.request.method": method, "url.path": path, "http.route": path}
        with joined(parent, f"{method} {path}", attributes, kind="SERVER") as s:
            async def sending(message):
                if message["type"] == "http.response.start":
                    s.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        s.fail(f"HTTP {message['status']}")
                await send(message)
            await self.app(scope, receive, sending)
