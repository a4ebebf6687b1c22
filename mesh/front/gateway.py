"""The OpenAI-compatible HTTP gateway over any `Engine` (DESIGN.md §4, §8).

validate (openai_api) -> chat template -> tokenize -> GenerationRequest -> the engine's
steps, or the tokens already known for a deterministic request (result_memo) -> text with
stop strings cut (stop_text) -> one JSON body or an SSE stream.

Bodies are parsed by hand rather than by FastAPI models, so every mistake is a 4xx in
OpenAI's error envelope and never FastAPI's 422. A stream starts only once the first
token (or the end) is known, so a busy engine is still a 503, not a broken stream.

Admission (`GatewayLimits`, serve's flags): a request may ask for at most the engine's
lane budget of choices and a bounded number of tokens (400 beyond either); at most so
many requests run at once, the next ones wait briefly in a bounded queue, then get a
503 with Retry-After, as does a busy engine. While the engine says no pipeline can serve,
/ready is 503, /health still 200 but "degraded" (a restarted gateway would not bring the
stages back sooner, so liveness probes should not kill it), and requests get a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import ChatTemplate, ChatTemplateMissing, load_chat_template
from ..control.admission import Admission
from ..control.engine import Engine, EngineBusy, EngineError, GenerationRequest, Step
from .limits import GatewayLimits
from .metrics import CONTENT_TYPE, GatewayMetrics
from .openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    Logprobs,
    ParsedRequest,
    ResponseShape,
    Usage,
    bad,
    parse_json,
    parse_request,
    sse,
)
from .result_memo import KnownRun, ResultMemo, memo_key
from .stop_text import StopText
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2  # what a 503 tells the client when nothing better is known
READY_PROBE_INTERVAL_S = 5.0   # /ready probes the engine at most this often
_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/ready",
              "/metrics"}
_OPEN_PATHS = {"/health", "/ready"}  # liveness and readiness stay reachable without a key


# -- API keys ---------------------------------------------------------------------------------
def load_api_keys(api_keys: Iterable[str] | str | Path | None) -> frozenset[str]:
    """None: $SKIPPY_API_KEYS (comma separated); a str or Path: a file with one key per
    line; otherwise the keys themselves. An empty set means no authentication."""
    if api_keys is None:
        keys: Iterable[str] = os.environ.get("SKIPPY_API_KEYS", "").split(",")
    elif isinstance(api_keys, (str, Path)):
        keys = Path(api_keys).read_text().splitlines()
    else:
        keys = api_keys
    return frozenset(k.strip() for k in keys if k.strip())


def _authorized(header: str | None, keys: frozenset[str]) -> bool:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    # compare against every key in constant time: no early exit that leaks which matched
    matched = [hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys]
    return any(matched)


# -- one generation ------------------------------------------------------------------------------
@dataclass
class _Outcome:
    usage: Usage
    finish_reason: str = "length"


class _Generation:
    """One request's run: from the engine, or replayed from a known deterministic run.

    `start()` waits for the first token (so engine errors surface before any response is
    sent); `texts()` then yields the completion text as it grows and fills `outcome`."""

    def __init__(self, gw: _Gateway, request: GenerationRequest, stops: tuple[str, ...],
                 arrived: float):
        self.gw, self.request, self.stops, self.arrived = gw, request, stops, arrived
        self.outcome = _Outcome(Usage(len(request.tokens)))
        self.key = memo_key(request, gw.engine.info.topology_digest)
        self.known: KnownRun | None = None
        self._replay: tuple[int, ...] | None = None
        self._steps: AsyncIterator | None = None
        self._first = None           # the first Step, or None when the run yielded none
        self._seen: list[int] = []
        self._first_at: float | None = None

    async def start(self) -> None:
        self.known = self.gw.memo.get(self.key)
        if self.known is not None and self._known_suffices(self.known):
            self._replay = self.known.tokens[:self.request.max_tokens]
            self.outcome.usage.cached_tokens = len(self.request.tokens)
            self._first_at = time.perf_counter()
            self.gw.metrics.ttft.observe(self._first_at - self.arrived)
            return
        self._steps = self.gw.engine.generate(self.request)
        try:
            self._first = await anext(self._steps, None)
        except BaseException:
            await self.close()
            raise
        self._first_at = time.perf_counter()
        if self._first is not None:
            self.outcome.usage.cached_tokens = self._first.cached_tokens
            self.gw.metrics.ttft.observe(self._first_at - self.arrived)

    def _known_suffices(self, known: KnownRun) -> bool:
        """Whether the known tokens settle this request: enough of them, the stream ended
        there, or one of this request's stop strings appears within them."""
        if known.complete or len(known.tokens) >= self.request.max_tokens:
            return True
        text = StopText(self.gw.tokenizer, self.stops)
        for t in known.tokens:
            text.push(t)
            if text.stopped:
                return True
        return False

    async def _steps_or_replay(self) -> AsyncIterator[Step]:
        if self._replay is not None:
            for t in self._replay:
                yield Step(t)
            return
        if self._first is None:
            return
        yield self._first
        async for step in self._steps:
            yield step

    async def texts(self) -> AsyncIterator[tuple[str, Logprobs | None]]:
        """The completion text as it grows, each piece with the log-probabilities of the
        tokens it came from (None unless the request asked for them). A token whose text
        is held back (a possible stop string) reports with the next piece; tokens that
        made up a stop string report with the text before it."""
        text = StopText(self.gw.tokenizer, self.stops)
        usage = self.outcome.usage
        wanted = self.request.sampling.logprobs is not None
        pending: Logprobs = []
        ran_out = False  # the token source ended by itself (not cut by a stop string,
        try:             # an error or the client leaving)
            async for step in self._steps_or_replay():
                usage.completion_tokens += 1
                self._seen.append(step.token)
                if wanted and step.logprobs is not None:
                    pending.append((step.token, step.logprobs))
                delta = text.push(step.token)
                if delta or (text.stopped and pending):
                    yield delta, (pending if wanted else None)
                    pending = []
                if text.stopped:
                    break
            else:
                ran_out = True
            if ran_out:
                tail = text.finish()
                if tail or pending:
                    yield tail, (pending if wanted else None)
            # fewer tokens than allowed: an end-of-generation id or a stop string ended it
            limit = self.request.max_tokens
            self.outcome.finish_reason = "length" if (
                ran_out and usage.completion_tokens >= limit) else "stop"
        finally:
            await self.close()
            self._account(ran_out)

    async def close(self) -> None:
        """End the engine's iteration now: its lanes are freed even if the client left."""
        steps, self._steps = self._steps, None
        if steps is not None:
            with contextlib.suppress(Exception):
                await steps.aclose()

    def _account(self, ran_out: bool) -> None:
        n = self.outcome.usage.completion_tokens
        source = "memo" if self._replay is not None else "engine"
        self.gw.metrics.tokens.labels(source).inc(n)
        if n > 1 and self._first_at is not None:
            spent = time.perf_counter() - self._first_at
            if spent > 0:
                self.gw.metrics.tokens_per_second.observe((n - 1) / spent)
        if self._replay is None:
            # An engine run that ended by itself with fewer tokens than allowed met an
            # end-of-generation id: the stream is known to end there. Any other run still
            # gives a true prefix of the stream.
            complete = ran_out and n < self.request.max_tokens
            self.gw.memo.record(self.key, KnownRun(tuple(self._seen), complete), self.known)


# -- the app ----------------------------------------------------------------------------------------
class _Gateway:
    """What the routes share: the engine, its tokenizer and template, memo, metrics."""

    def __init__(self, engine: Engine, api_keys: frozenset[str], limits: GatewayLimits,
                 memo: ResultMemo):
        self.engine, self.api_keys, self.limits = engine, api_keys, limits
        self.memo = memo
        n = limits.max_concurrent_requests
        self.slots = Admission(n, queue=n, wait_s=limits.queue_timeout_s)
        self.tokenizer = Tokenizer(engine.info.path)
        self.template: ChatTemplate | None = None
        self.template_missing = ""
        try:
            self.template = load_chat_template(self.tokenizer)
        except ChatTemplateMissing as e:
            self.template_missing = str(e).split(";")[0]
        self.metrics = GatewayMetrics(engine.stats, memo.stats, self.slots.stats)
        self.created = int(time.time())
        self._ready_at = 0.0
        self._ready_lock = asyncio.Lock()

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
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
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
            try:
                text = self.template.render(list(parsed.messages))
            except ValueError as e:  # bad messages, or the template refused them
                raise bad(" ".join(str(e).split()), "messages") from None
            return self.tokenizer.encode(text)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.tokenizer.vocab_size
        bad_ids = [t for t in prompt if not 0 <= t < vocab]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{vocab - 1})",
                      "prompt")
        return list(prompt)

    def generation_requests(self, parsed: ParsedRequest) -> list[GenerationRequest]:
        """One request per choice: each prompt n times, in order. Seeded copies of a
        prompt take seeds seed, seed + 1, ... so their samples differ, repeatably."""
        vocab = self.tokenizer.vocab_size
        outside = [t for t, _ in parsed.sampling.logit_bias if t >= vocab]
        if outside:
            raise bad(f"logit_bias token id {outside[0]} is outside the vocabulary "
                      f"(0..{vocab - 1})", "logit_bias")
        out = []
        for prompt in (None,) if parsed.chat else parsed.prompts:
            first = self.generation_request(parsed, self.prompt_ids(parsed, prompt))
            for copy in range(parsed.n):
                seed = first.sampling.seed
                if seed is None or copy == 0:
                    out.append(first)
                else:
                    sampling = dataclasses.replace(first.sampling, seed=(seed + copy) % 2**64)
                    out.append(dataclasses.replace(first, sampling=sampling))
        return out

    def generation_request(self, parsed: ParsedRequest, ids: list[int]) -> GenerationRequest:
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
                                 namespace=parsed.namespace)

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

    def serving(self) -> tuple[bool, str]:
        """The engine's word on whether a pipeline can serve; one that cannot say cannot."""
        try:
            status = self.engine.status()
            return bool(status["serving"]), str(status.get("detail", ""))
        except Exception as e:  # noqa: BLE001
            return False, f"the engine's status failed: {_one_line(e)}"

    async def admit(self) -> Callable[[], None]:
        """A slot among the concurrent requests (waiting for one a short while), or a
        503; returns what ends the slot (idempotent)."""
        serving, detail = self.serving()
        if not serving:
            raise _unavailable(f"no pipeline can serve right now ({detail})", "unavailable")
        try:
            await self.slots.acquire()
        except EngineBusy:
            raise _unavailable(f"this server is at its limit of "
                               f"{self.limits.max_concurrent_requests} concurrent requests; "
                               f"retry later", "server_busy") from None
        return _once(self.slots.release)

    # -- responses ------------------------------------------------------------------------------
    async def complete(self, request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        parsed = parse_request(await self.read_body(request), chat=chat)
        self.check_model(parsed.model)
        self.check_choices(parsed)
        requests = self.generation_requests(parsed)
        self.check_tokens(requests)
        release = await self.admit()
        try:
            # every choice's lane at once: a request never waits holding some of them
            lanes = await self.engine.reserve(len(requests))
            release = _both(release, lanes)
            requests = [dataclasses.replace(r, admitted=True) for r in requests]
            return await self._respond(parsed, requests, arrived, release)
        except BaseException:
            release()
            raise

    async def _respond(self, parsed: ParsedRequest, requests: list[GenerationRequest],
                       arrived: float, release: Callable[[], None]) -> Response:
        """Run the choices and answer; `release` ends the request's slot once the answer
        is complete (a stream's when its last event is sent or the client left)."""
        runs = [_Generation(self, r, parsed.stop, arrived) for r in requests]

        async def close() -> None:
            for run in runs:
                await run.close()
            release()

        try:  # every choice's first token, so engine errors surface before any response
            await _all(run.start() for run in runs)
        except BaseException:
            await close()
            raise
        shape = ResponseShape(parsed.chat, self.engine.info.model,
                              lambda t: self.tokenizer.piece(t, special=True))
        usage = functools.partial(_usage, runs, parsed.n)  # read once the choices end
        if parsed.stream:
            return _ClosingStream(self._events(runs, shape, usage, parsed.include_usage),
                                  on_close=close, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
        pieces: list[list] = [[] for _ in runs]
        try:
            await _all(_collect(run.texts(), into) for run, into in zip(runs, pieces))
        finally:
            release()
        wanted = parsed.sampling.logprobs is not None
        choices = [("".join(t for t, _ in parts), run.outcome.finish_reason,
                    [e for _, lp in parts for e in lp] if wanted else None)
                   for run, parts in zip(runs, pieces)]
        return JSONResponse(shape.full(choices, usage()))

    async def _events(self, runs: list[_Generation], shape: ResponseShape,
                      usage: Callable[[], Usage], include_usage: bool) -> AsyncIterator[bytes]:
        """The choices' chunks as their texts grow (interleaved, each with its index),
        a finish chunk per choice, the usage if asked, then [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, run, queue)) for i, run in enumerate(runs)]
        try:
            if shape.chat:
                for i in range(len(runs)):
                    yield sse(shape.chunk("", first=True, with_usage_field=include_usage,
                                          index=i))
            left = len(runs)
            while left:
                index, delta, logprobs, end = await queue.get()
                if isinstance(end, BaseException):
                    raise end
                if end is None:
                    yield sse(shape.chunk(delta, with_usage_field=include_usage,
                                          logprobs=logprobs, index=index))
                    continue
                left -= 1
                yield sse(shape.chunk(None if shape.chat else "", end, index=index,
                                      with_usage_field=include_usage))
            if include_usage:
                yield sse(shape.usage_chunk(usage()))
        except Exception as e:  # noqa: BLE001
            # headers are gone: the error travels as an event, as OpenAI's servers do
            yield sse(_as_api_error(e).envelope())
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        yield sse("[DONE]")

    def health(self) -> dict:
        serving, detail = self.serving()
        return {"status": "ok"} if serving else {"status": "degraded", "detail": detail}

    async def ready(self) -> Response:
        """Ready while the engine says a pipeline can serve and it answers a 1-token probe
        (no cache read or written)."""
        serving, detail = self.serving()
        if not serving:
            self._ready_at = 0.0
            return JSONResponse({"status": "unavailable", "reason": detail}, status_code=503)
        async with self._ready_lock:
            if time.monotonic() - self._ready_at > READY_PROBE_INTERVAL_S:
                probe_ids = self.tokenizer.encode("Hello") or [0]
                probe = GenerationRequest(tuple(probe_ids), 1, probe=True)
                try:
                    async for _ in self.engine.generate(probe):
                        pass
                except Exception as e:  # noqa: BLE001
                    self._ready_at = 0.0
                    log.warning("readiness probe failed: %s", _one_line(e))
                    return JSONResponse({"status": "unavailable", "reason": _one_line(e)},
                                        status_code=503)
                self._ready_at = time.monotonic()
        return JSONResponse({"status": "ready", "model": self.engine.info.model})

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


async def _collect(texts: AsyncIterator, into: list) -> None:
    async for piece in texts:
        into.append(piece)


async def _all(awaitables) -> None:
    """Await every one together; the first failure is raised once all have ended (so no
    choice is left running unseen)."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def _pump(index: int, run: _Generation, queue: asyncio.Queue) -> None:
    """One choice's text pieces into the shared queue: (index, text, logprobs, None),
    then (index, None, None, finish_reason), or the failure in the last place."""
    try:
        async for delta, logprobs in run.texts():
            await queue.put((index, delta, logprobs, None))
        await queue.put((index, None, None, run.outcome.finish_reason))
    except Exception as e:  # noqa: BLE001
        await queue.put((index, None, None, e))


def _usage(runs: list[_Generation], n: int) -> Usage:
    """The usage of a response's choices: each prompt counted once (its n copies share
    it), the completion tokens of every choice."""
    firsts = [r.outcome.usage for r in runs[::n]]
    return Usage(sum(u.prompt_tokens for u in firsts),
                 sum(r.outcome.usage.completion_tokens for r in runs),
                 sum(u.cached_tokens for u in firsts))


def _as_api_error(e: Exception) -> ApiError:
    """A failure as the client's answer: busy -> 503 with Retry-After; a ValueError (the
    request refused, by us or by the engine's InvalidRequest) -> 400; an engine failure or
    anything else -> 500, logged in one line."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineBusy):
        return _unavailable(f"the engine is busy, retry later ({_one_line(e)})",
                            "engine_busy", e.retry_after)
    if isinstance(e, ValueError):
        return bad(_one_line(e))
    if isinstance(e, EngineError):
        log.error("engine failed: %s", _one_line(e))
        return ApiError(500, f"the engine failed: {_one_line(e)}")
    log.error("unexpected failure: %s: %s", type(e).__name__, _one_line(e))
    return ApiError(500, f"internal error: {_one_line(e)}")


def _unavailable(message: str, code: str, retry_after: float = RETRY_AFTER_S) -> ApiError:
    seconds = str(max(1, math.ceil(retry_after)))  # HTTP wants whole seconds
    return ApiError(503, message, code=code, headers={"Retry-After": seconds})


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
    """Failures become a one-line error here, logged without a traceback (a handler
    registered for Exception would still let Starlette re-raise and log one)."""
    try:
        return await awaitable
    except Exception as e:  # noqa: BLE001
        raise _as_api_error(e) from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class _Edge:
    """API keys and request counting, as pure ASGI middleware: it sees streams and errors
    alike without buffering bodies (Starlette's BaseHTTPMiddleware would wrap streams)."""

    def __init__(self, app, gw: _Gateway):
        self.app, self.gw = app, gw

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else (
            "/v1/models" if path.startswith("/v1/models/") else "other")
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.gw.api_keys and path not in _OPEN_PATHS and not _authorized(
                    _header(scope, b"authorization"), self.gw.api_keys):
                e = ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                             code="invalid_api_key")
                await JSONResponse(e.envelope(), status_code=401)(scope, receive,
                                                                  counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.gw.metrics.requests.labels(endpoint, str(status[0])).inc()


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def create_app(engine: Engine, *, api_keys: Iterable[str] | str | Path | None = None,
               limits: GatewayLimits | None = None,
               memo: ResultMemo | None = None, close_engine: bool = False) -> FastAPI:
    """The gateway app for `engine`.

    api_keys: see `load_api_keys` (None reads $SKIPPY_API_KEYS). limits: what it admits
    (the defaults by default). memo: the exact-results store (a fresh bounded one by
    default). close_engine: close the engine when the app shuts down (`serve` does; tests
    that share an engine do not)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if close_engine:
            await engine.close()

    gw = _Gateway(engine, load_api_keys(api_keys), limits or GatewayLimits(),
                  memo or ResultMemo())
    app = FastAPI(title="skippy-mesh", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gateway = gw
    _error_handlers(app)
    _routes(app, gw)
    app.add_middleware(_Edge, gw=gw)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's envelope, in one line."""

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return JSONResponse(e.envelope(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).envelope(),
                            status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        return JSONResponse(bad(f"invalid request: {_one_line(e)}").envelope(), 400)

    @app.exception_handler(Exception)
    async def _unexpected(_request, e: Exception):
        log.error("unexpected failure: %s: %s", type(e).__name__, _one_line(e))
        return JSONResponse(ApiError(500, f"internal error: {_one_line(e)}").envelope(),
                            status_code=500)


def _routes(app: FastAPI, gw: _Gateway) -> None:
    @app.get("/health")
    async def health():
        return gw.health()

    @app.get("/ready")
    async def ready():
        return await gw.ready()

    @app.get("/metrics")
    async def metrics():
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE)

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
          api_keys: Iterable[str] | str | Path | None = None, **app_options) -> None:
    """Serve until Ctrl-C (uvicorn handles the signal), then close the engine."""
    import uvicorn
    app = create_app(engine, api_keys=api_keys, close_engine=True, **app_options)
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
