"""The OpenAI-compatible HTTP gateway over any `Engine` (DESIGN.md §4, §8).

edge (host, keys, content type) -> validate (openai_api) -> chat template -> tokenize ->
GenerationRequest -> each choice's run (generation: the engine's steps, or the tokens
already known for a deterministic request) -> one JSON body or an SSE stream.

Bodies are parsed by hand rather than by FastAPI models, so every mistake is a 4xx in
OpenAI's error envelope and never FastAPI's 422. A stream starts only once the first
token (or the end) is known, so a busy engine is still a 503, not a broken stream.

Admission (`GatewayLimits`, serve's flags): a request may ask for at most the engine's
lane budget of choices and a bounded number of tokens (400 beyond either); at most so
many requests run at once, the next ones wait briefly in a bounded queue, then get a
503 with Retry-After, as does a busy engine. While the engine says no pipeline can serve,
/ready is 503, /health still 200 but "degraded" (a restarted gateway would not bring the
stages back sooner, so liveness probes should not kill it), and requests get a 503.
Neither says why to whoever asks: the reason is logged.

A request ends by its deadline (`request_timeout_s`) or as soon as its client leaves
(disconnect), and its lanes are free then. Every failure becomes its answer in
mesh/front/http_errors.py (by our own types; ours are logged with their traceback and
answered with an error id, never the exception's text).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from skippy.topology.errors import OverCapacity, UserError, one_line

from .. import tracing
from .chat import ChatTemplate, ChatTemplateMissing, encode_chat, load_chat_template
from ..control.admission import LaneAdmission
from ..control.engine import Engine, GenerationRequest
from .disconnect import CLIENT_GONE_STATUS, ClientGone, unless_client_leaves
from .edge import TENANT, ApiKeys, Edge, cache_namespace, is_loopback, keys_for_bind, \
    load_api_keys
from .generation import Generation, RunContext, all_of, collect, pump, total_usage
from . import http_errors
from .limits import GatewayLimits
from .metrics import CONTENT_TYPE, GatewayMetrics
from .openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ParsedRequest,
    ResponseShape,
    TokenUsage,
    bad,
    parse_json,
    parse_request,
    sse,
)
from .result_memo import ResultMemo
from .status import StatusBoard, add_status_routes
from ..tokenizer import Tokenizer
from .tool_calls import ReplyDeltas, ToolCallFormat, call_constraint, reply_format, \
    whole_reply
from .tool_choice import ToolSpecError

__all__ = ["BackgroundServer", "create_app", "load_api_keys", "serve"]

log = logging.getLogger(__name__)

READY_PROBE_INTERVAL_S = 5.0   # /ready probes the engine at most this often
_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/ready",
              "/metrics", "/", "/status.json"}


# -- the app ----------------------------------------------------------------------------------------
class _Gateway:
    """What the routes share: the engine, its tokenizer and template, memo, metrics."""

    def __init__(self, engine: Engine, limits: GatewayLimits, memo: ResultMemo,
                 control_text: bool = False):
        self.engine, self.limits, self.memo = engine, limits, memo
        self.control_text = control_text
        n = limits.max_concurrent_requests
        self.slots = LaneAdmission(n, queue=n, wait_s=limits.queue_timeout_s)
        self.tokenizer = Tokenizer(engine.info.path)
        self.template: ChatTemplate | None = None
        self.template_missing = ""
        try:
            self.template = load_chat_template(self.tokenizer)
        except ChatTemplateMissing as e:
            self.template_missing = str(e).split(";")[0]
        self.metrics = GatewayMetrics(engine.stats, memo.stats, self.slots.stats)
        self.runs = RunContext(engine, memo, self.metrics, self.tokenizer)
        self.status = StatusBoard(engine, self.metrics, self.runs.in_flight)
        self.created = int(time.time())
        # system_fingerprint: the split and the weights it serves (a new one means a
        # seeded request may answer differently)
        self.fingerprint = "fp_" + engine.info.topology_digest[:12]
        self._probe_ids = tuple(self.tokenizer.encode("Hello") or [0])
        self._ready_at = 0.0
        self._ready_lock = asyncio.Lock()
        self._said_down = ""  # the last reason logged for not serving

    def count(self, path: str, status: int) -> None:
        """One answer, by endpoint and status (the edge calls this for every request)."""
        endpoint = path if path in _ENDPOINTS else (
            "/v1/models" if path.startswith("/v1/models/") else "other")
        self.metrics.requests.labels(endpoint, str(status)).inc()

    # -- request -> GenerationRequest ---------------------------------------------------------
    async def read_body(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        limit = self.limits.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise self._too_large()
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise self._too_large()
        return parse_json(bytes(raw))

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body exceeds {self.limits.max_body_bytes} bytes",
                        code="request_too_large")

    def check_model(self, model: str) -> None:
        if model != self.engine.info.model:
            shown = model if len(model) <= 100 else model[:100] + "..."
            raise ApiError(404, f"the model '{shown}' does not exist; this server serves "
                                f"'{self.engine.info.model}'", param="model",
                           code="model_not_found")

    def prompt_ids(self, parsed: ParsedRequest,
                   prompt: str | tuple[int, ...] | None = None) -> list[int]:
        """The token ids of the chat's rendered messages, or of one completions prompt."""
        if parsed.chat:
            if self.template is None:
                raise bad(f"{self.template_missing}, so chat messages cannot be turned "
                          f"into a prompt; use /v1/completions", "messages",
                          "chat_template_missing")
            tools = parsed.tools.template_tools if parsed.tools else None
            # what users typed stays text unless the server trusts its clients; bad
            # messages or tools, or the template refusing them, are a RequestError
            return encode_chat(self.template, self.tokenizer, list(parsed.messages),
                               control_text=self.control_text, tools=tools)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.tokenizer.vocab_size
        bad_ids = [t for t in prompt if not 0 <= t < vocab]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{vocab - 1})",
                      "prompt")
        return list(prompt)

    def tool_format(self, parsed: ParsedRequest) -> ToolCallFormat | None:
        """The format the reply is read in for tool calls (tool_calls.reply_format); a
        400 when the request needs tool support that the model's template lacks."""
        if not parsed.chat:
            return None
        text = self.template.text if self.template else None
        knows_tools = self.template is not None and self.template.knows_tools
        try:
            return reply_format(text, knows_tools, parsed.tools, parsed.messages)
        except ToolSpecError as e:
            raise bad(str(e), e.param, e.code) from None

    def sampling(self, parsed: ParsedRequest, fmt: ToolCallFormat | None):
        """The request's sampling settings, with the constraint that forces a tool call
        when tool_choice asks for one."""
        tools = parsed.tools
        if fmt is None or not tools.forced:
            return parsed.sampling
        if parsed.sampling.constraint is not None:
            raise bad("response_format constrains the reply's content, and this "
                      "tool_choice forces a tool call instead: ask for one of them",
                      "response_format")
        try:
            constraint = call_constraint(fmt, tools, self.tokenizer.special_id)
        except ToolSpecError as e:
            raise bad(str(e), e.param) from None
        return dataclasses.replace(parsed.sampling, constraint=constraint)

    def generation_requests(self, parsed: ParsedRequest, tenant: str = "",
                            fmt: ToolCallFormat | None = None) -> list[GenerationRequest]:
        """One request per choice: each prompt n times, in order. Seeded copies of a
        prompt take seeds seed, seed + 1, ... so their samples differ, repeatably. Their
        cache namespace is the tenant's (the caller's key), then the request's salt.
        `fmt`: the reply's tool-call format (a forced call is constrained to it).
        Tokenizes: call it off the event loop."""
        vocab = self.tokenizer.vocab_size
        outside = [t for t, _ in parsed.sampling.logit_bias if t >= vocab]
        if outside:
            raise bad(f"logit_bias token id {outside[0]} is outside the vocabulary "
                      f"(0..{vocab - 1})", "logit_bias")
        parsed = dataclasses.replace(parsed, sampling=self.sampling(parsed, fmt))
        out = []
        for prompt in (None,) if parsed.chat else parsed.prompts:
            first = self.generation_request(parsed, self.prompt_ids(parsed, prompt),
                                            cache_namespace(tenant, parsed.cache_salt))
            for copy in range(parsed.n):
                seed = first.sampling.seed
                if seed is None or copy == 0:
                    out.append(first)
                else:
                    sampling = dataclasses.replace(first.sampling, seed=(seed + copy) % 2**64)
                    out.append(dataclasses.replace(first, sampling=sampling))
        return out

    def generation_request(self, parsed: ParsedRequest, ids: list[int],
                           namespace: str) -> GenerationRequest:
        if not ids:
            raise bad("the prompt is empty", "messages" if parsed.chat else "prompt")
        n_ctx, room = self.engine.info.n_ctx, self.engine.info.n_ctx - len(ids)
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            if room < 1:
                raise bad(f"the prompt ({len(ids)} tokens) fills the context of {n_ctx} "
                          f"tokens", "prompt", "context_length_exceeded")
            # a request that names no limit gets its share of the token budget, not a 400
            share = max(1, self.limits.max_request_tokens // parsed.choices)
            max_tokens = min(DEFAULT_MAX_TOKENS, room, share)
        elif max_tokens > room:
            raise bad(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceed the "
                      f"context of {n_ctx} tokens", "max_tokens", "context_length_exceeded")
        return GenerationRequest(tokens=tuple(ids), max_tokens=max_tokens,
                                 sampling=parsed.sampling,
                                 stop_ids=self.tokenizer.eog_ids,
                                 namespace=namespace)

    # -- admission ------------------------------------------------------------------------------
    def check_choices(self, parsed: ParsedRequest) -> None:
        """At most the engine's lane budget of choices: each takes a lane of its own, and
        a request needing more lanes than a pipeline has could never start."""
        lanes = self.engine.info.lanes
        if parsed.choices > lanes:
            asked = f"n = {parsed.n}" if parsed.choices == parsed.n else \
                f"{len(parsed.prompts)} prompts x n = {parsed.n}"
            raise bad(f"{asked} asks for {parsed.choices} choices; this server runs at most "
                      f"{lanes} per request (its lane budget)", "n")

    def check_tokens(self, requests: list[GenerationRequest]) -> None:
        total, limit = sum(r.max_tokens for r in requests), self.limits.max_request_tokens
        if total > limit:
            raise bad(f"n x max_tokens over the request's choices is {total} tokens; this "
                      f"server allows at most {limit}", "max_tokens")

    def serving(self) -> bool:
        """The engine's word on whether a pipeline can serve; one that cannot say cannot.
        Why not is logged (once per reason), never told to the caller."""
        try:
            status = self.engine.status()
            serving, detail = bool(status["serving"]), str(status.get("detail", ""))
        except Exception as e:  # noqa: BLE001
            serving, detail = False, f"the engine's status failed: {one_line(e)}"
        if not serving and detail != self._said_down:
            log.warning("no pipeline can serve: %s", detail)
        self._said_down = "" if serving else detail
        return serving

    async def admit(self) -> Callable[[], None]:
        """A slot among the concurrent requests (waiting for one a short while), or a
        503; returns what ends the slot (idempotent)."""
        if not self.serving():
            raise http_errors.unavailable("no pipeline can serve right now; retry later",
                                          "unavailable")
        try:
            await self.slots.acquire()
        except OverCapacity:
            raise http_errors.unavailable(f"this server is at its limit of "
                               f"{self.limits.max_concurrent_requests} concurrent requests; "
                               f"retry later", "server_busy") from None
        return _once(self.slots.release)

    # -- responses ------------------------------------------------------------------------------
    async def complete(self, request: Request, chat: bool) -> Response:
        """The answer to one POST, by its deadline, unless the client leaves first (then
        its work stops and nobody reads what we send)."""
        arrived = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.limits.request_timeout_s
        tenant = request.scope.get(TENANT, "")
        try:
            async with asyncio.timeout_at(deadline) as within:
                body = await self.read_body(request)
                return await unless_client_leaves(request.receive, self._answer(
                    body, chat, tenant, arrived, deadline))
        except TimeoutError:
            if not within.expired():
                raise
            raise self._timed_out() from None
        except (ClientGone, ClientDisconnect):
            return Response(status_code=CLIENT_GONE_STATUS)

    async def _answer(self, body: dict, chat: bool, tenant: str, arrived: float,
                      deadline: float) -> Response:
        parsed = parse_request(body, chat=chat)
        self.check_model(parsed.model)
        self.check_choices(parsed)
        fmt = self.tool_format(parsed)
        # templates and tokenizers take their time on long prompts: off the event loop
        requests = await asyncio.to_thread(self.generation_requests, parsed, tenant, fmt)
        self.check_tokens(requests)
        release = await self.admit()
        try:
            # every choice's lane at once: a request never waits holding some of them
            lanes = await self.engine.reserve(len(requests))
            release = _both(release, lanes)
            requests = [dataclasses.replace(r, admitted=True) for r in requests]
            return await self._respond(parsed, requests, arrived, release, deadline, fmt,
                                       tenant)
        except BaseException:
            release()
            raise

    def _timed_out(self) -> ApiError:
        # 504, not 408: 408 says the client was slow to send its request (and invites it
        # to resend at once); here the stages did not finish in time. OpenAI's clients
        # raise their InternalServerError for it, which callers already handle and the
        # clients retry with backoff, as for OpenAI's own timeouts.
        return ApiError(504, f"the request did not finish within this server's limit of "
                             f"{self.limits.request_timeout_s:g} s", code="timeout")

    async def _respond(self, parsed: ParsedRequest, requests: list[GenerationRequest],
                       arrived: float, release: Callable[[], None], deadline: float,
                       fmt: ToolCallFormat | None = None, tenant: str = "") -> Response:
        """Run the choices and answer; `release` ends the request's slot once the answer
        is complete (a stream's when its last event is sent or the client left). `fmt`:
        the tool-call format replies are read in (None: they are plain content); `tenant`:
        the caller's, whose status page lists these runs."""
        runs = [Generation(self.runs, r, parsed.stop, arrived, tenant) for r in requests]

        async def close() -> None:
            for run in runs:
                await run.close()
            release()

        try:  # every choice's first token, so engine errors surface before any response
            await all_of(run.start() for run in runs)
        except BaseException:
            await close()
            raise
        shape = ResponseShape(parsed.chat, self.engine.info.model,
                              lambda t: self.tokenizer.piece(t, special=True),
                              self.fingerprint)
        usage = functools.partial(total_usage, runs, parsed.n)  # read once the choices end
        if parsed.stream:
            events = self._events(runs, shape, usage, parsed.include_usage, deadline, fmt)
            return _ClosingStream(events, on_close=close, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
        pieces: list[list] = [[] for _ in runs]
        try:
            await all_of(collect(run.texts(), into) for run, into in zip(runs, pieces))
        finally:
            release()
        wanted = parsed.sampling.logprobs is not None
        choices = []
        for run, parts in zip(runs, pieces):
            content, reason, calls = whole_reply(fmt, "".join(t for t, _ in parts),
                                                 run.outcome.finish_reason)
            choices.append((content, reason,
                            [e for _, lp in parts for e in lp] if wanted else None, calls))
        return JSONResponse(shape.full(choices, usage()))

    async def _events(self, runs: list[Generation], shape: ResponseShape,
                      usage: Callable[[], TokenUsage], include_usage: bool,
                      deadline: float, fmt: ToolCallFormat | None = None
                      ) -> AsyncIterator[bytes]:
        """The choices' chunks as their texts grow (interleaved, each with its index;
        content or tool-call deltas), a finish chunk per choice, the usage if asked, then
        [DONE]; an error event instead of the rest once something fails or the deadline
        passes."""
        queue: asyncio.Queue = asyncio.Queue()
        replies = [ReplyDeltas(fmt) for _ in runs]
        pumps = [asyncio.create_task(pump(i, run, queue)) for i, run in enumerate(runs)]
        try:
            if shape.chat:
                for i in range(len(runs)):
                    yield sse(shape.chunk("", first=True, with_usage_field=include_usage,
                                          index=i))
            left = len(runs)
            while left:
                index, delta, logprobs, end = await self._by(deadline, queue.get())
                if isinstance(end, BaseException):
                    raise end
                ends = end is not None
                reply = replies[index]
                for text, call, lp in reply.finish() if ends else reply.push(delta, logprobs):
                    yield sse(shape.chunk(text, with_usage_field=include_usage,
                                          logprobs=lp, index=index, tool_call=call))
                if not ends:
                    continue
                left -= 1
                yield sse(shape.chunk(None if shape.chat else "", reply.finish_reason(end),
                                      index=index, with_usage_field=include_usage))
            if include_usage:
                yield sse(shape.usage_chunk(usage()))
        except Exception as e:  # noqa: BLE001
            # headers are gone: the error travels as an event, as OpenAI's servers do
            yield http_errors.event(e)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        yield sse("[DONE]")

    async def _by(self, deadline: float, awaitable):
        """`awaitable`'s result, or the deadline's error once it passes. Only around one
        await: a timeout spanning the stream's yields would cancel whatever the stream's
        consumer (Starlette) is doing when it fires."""
        try:
            async with asyncio.timeout_at(deadline):
                return await awaitable
        except TimeoutError:
            raise self._timed_out() from None

    def health(self) -> dict:
        return {"status": "ok" if self.serving() else "degraded"}

    async def ready(self) -> Response:
        """Ready while the engine says a pipeline can serve and it answers a 1-token probe
        (no cache read or written). The body says only that: the reason is logged."""
        down = JSONResponse({"status": "unavailable"}, status_code=503)
        if not self.serving():
            self._ready_at = 0.0
            return down
        async with self._ready_lock:
            if time.monotonic() - self._ready_at > READY_PROBE_INTERVAL_S:
                probe = GenerationRequest(self._probe_ids, 1, probe=True)
                try:  # a probe is a request too: it ends by the deadline
                    async with asyncio.timeout(self.limits.request_timeout_s):
                        async for _ in self.engine.generate(probe):
                            pass
                except Exception as e:  # noqa: BLE001
                    self._ready_at = 0.0
                    log.warning("readiness probe failed: %s", one_line(e))
                    return down
                self._ready_at = time.monotonic()
        return JSONResponse({"status": "ready"})

    def model_card(self) -> dict:
        info = self.engine.info
        return {"id": info.model, "object": "model", "created": self.created,
                "owned_by": "skippy-mesh", "max_model_len": info.n_ctx}


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that ends the generation as soon as the response ends (the
    client may leave while we wait to send, or before the first chunk), rather than
    whenever the generators are garbage-collected."""

    def __init__(self, content, *, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._on_close()


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def call() -> None:
        try:
            second()
        finally:
            first()
    return _once(call)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()
    return call


async def _guarded(awaitable):
    """Failures become an error answer here (a handler registered for Exception would
    still let Starlette re-raise the failure and log it a second time)."""
    try:
        return await awaitable
    except Exception as e:  # noqa: BLE001
        raise http_errors.api_error(e) from None


def create_app(engine: Engine, *, api_keys: Iterable[str] | str | Path | None = None,
               limits: GatewayLimits | None = None, memo: ResultMemo | None = None,
               close_engine: bool = False, bind_host: str = "127.0.0.1",
               control_text: bool = False, tenant_secret: str | None = None) -> FastAPI:
    """The gateway app for `engine`.

    api_keys: see `load_api_keys` (None reads $SKIPPY_API_KEYS). limits: what it admits
    (the defaults by default). memo: the exact-results store (a fresh bounded one by
    default). close_engine: close the engine when the app shuts down (`serve` does; tests
    that share an engine do not). bind_host: where the server listens; on loopback the
    app answers only requests addressed to loopback (the Host header), against DNS
    rebinding. control_text: message text that spells a control token is that token
    (trusted clients only; by default it is text). tenant_secret: keys each API key's
    cache namespace (see `ApiKeys`)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if close_engine:
            await engine.close()

    gw = _Gateway(engine, limits or GatewayLimits(), memo or ResultMemo(), control_text)
    app = FastAPI(title="skippy-mesh", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gateway = gw
    http_errors.install(app)
    _routes(app, gw)
    add_status_routes(app, gw.status)
    app.add_middleware(Edge, keys=ApiKeys(load_api_keys(api_keys), tenant_secret),
                       loopback=is_loopback(bind_host), count=gw.count)
    if tracing.enabled():  # outermost: a request's span holds the edge's refusals too
        app.add_middleware(tracing.HttpSpans)
    return app


def _routes(app: FastAPI, gw: _Gateway) -> None:
    @app.get("/health")
    async def health():
        return gw.health()

    @app.get("/ready")
    async def ready():
        return await gw.ready()

    @app.get("/metrics")
    async def metrics():
        # the engine's figures may come from Ray (a blocking call): off the event loop
        return Response(await asyncio.to_thread(gw.metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [gw.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        gw.check_model(model)
        return gw.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _guarded(gw.complete(request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _guarded(gw.complete(request, chat=True))


# -- running it ---------------------------------------------------------------------------------------
def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000,
          api_keys: Iterable[str] | str | Path | None = None, *, insecure: bool = False,
          **app_options) -> None:
    """Serve until Ctrl-C (uvicorn handles the signal), then close the engine.

    api_keys: see `load_api_keys`. Beyond loopback without keys it refuses to start
    (OpenBindRefused) unless `insecure`; a key file that cannot be read or holds no key is
    a KeyFileError (both UserErrors). Either way the engine is closed."""
    import uvicorn
    try:
        keys = keys_for_bind(host, api_keys, insecure)
    except UserError:
        asyncio.run(engine.close())
        raise
    app = create_app(engine, api_keys=keys, close_engine=True, bind_host=host,
                     **app_options)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run()


class BackgroundServer:
    """uvicorn in a daemon thread on a free loopback port (tests, embedding)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                     log_level="warning"))
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=self._server.run, daemon=True,
                                        name=f"gateway:{port}")

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
