"""One completion request's life, from its body to its last byte (DESIGN.md §4, §8).

body (read up to max_body_bytes) -> validate (openai_api) -> generation requests
(request_building, off the event loop) -> admission (a slot and every choice's lane) ->
each choice's run (generation: the engine's steps, or the tokens already known for a
deterministic request) -> one JSON body or an SSE stream (rendering).

A stream starts only once every choice's first token (or end) is known, so a busy engine
is still a 503, not a broken stream. A request ends by its deadline (`request_timeout_s`)
or as soon as its client leaves (disconnect), and its lanes are free then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ..control.engine import GenerationRequest
from . import anthropic_api, embeddings_api, responses_api, tokenize_api
from .admission import timed_out
from .body_budget import BodyBudget
from .built_memo import BuiltMemo
from .disconnect import CLIENT_GONE_STATUS, ClientGone, unless_client_leaves
from .edge import TENANT, cache_namespace
from .fronts import Fronts, ModelFront
from .generation import Generation, all_of, total_usage
from .limits import GatewayLimits
from .openai_api import ApiError, ParsedRequest, ResponseShape, bad, parse_json, parse_request
from .rendering import (ClosingStream, message_events, response_events, sse_events,
                        whole_body, whole_message, whole_response)
from .reasoning import ReplyFormat
from .responses_api import ResponseStore
from .request_building import build_requests
from .tool_choice import CheckedSchemas


REFUSAL_HOLD_S = 1.0  # a request over its caller's body budget waits this long for its 429
INLINE_HASH_BYTES = 64 * 1024  # bodies up to this are hashed on the event loop (~16 us)
# a plain body up to this is parsed, rendered and tokenized on the event loop (~0.25 ms a
# KiB): two trips to a worker thread cost a short request more (0.5-0.8 ms on 2 cores)
INLINE_BUILD_BYTES = 4 * 1024
# what a body may ask for that costs more than its size says: schemas checked, grammars
# compiled (parse_request)
_COSTLY_KEYS = ("tools", "functions", "response_format", "structured_outputs")
# the APIs answered
COMPLETIONS, CHAT, MESSAGES, RESPONSES = "completions", "chat", "messages", "responses"


@dataclasses.dataclass
class Completions:
    """What every completion reads: the models' fronts (each request's by the model it
    names: fronts.py) and the gateway's limits."""

    fronts: Fronts
    limits: GatewayLimits

    def __post_init__(self):
        self.budget = BodyBudget(self.limits.body_bytes_per_s, 2 * self.limits.max_body_bytes)
        self.schemas = CheckedSchemas()  # each tenant's tool schemas, checked once
        self.stored = ResponseStore()    # each tenant's stored Responses API responses

    async def complete(self, request: Request, chat: bool) -> Response:
        """The answer to one POST of OpenAI's API, by its deadline, unless the client
        leaves first (then its work stops and nobody reads what we send)."""
        return await self._within_deadline(request, CHAT if chat else COMPLETIONS)

    async def message(self, request: Request) -> Response:
        """The answer to one POST /v1/messages (Anthropic's API), as `complete`."""
        return await self._within_deadline(request, MESSAGES)

    async def response(self, request: Request) -> Response:
        """The answer to one POST /v1/responses (OpenAI's Responses API), as `complete`."""
        return await self._within_deadline(request, RESPONSES)

    async def count_tokens(self, request: Request) -> dict:
        """POST /v1/messages/count_tokens: the prompt's tokens, as a Messages request
        with that body would have them."""
        tenant = request.scope.get(TENANT, "")
        body = await self._read_body(request)

        def count(front: ModelFront) -> int:
            chat = anthropic_api.to_chat(body, count_only=True)
            parsed = parse_request(chat, chat=True, schemas=self.schemas.checker(tenant))
            return len(build_requests(parsed, front.view, self.limits, tenant)
                       .requests[0].tokens)
        async with self._front(body) as front:
            return {"input_tokens": await asyncio.to_thread(count, front)}

    async def embeddings(self, request: Request) -> dict:
        """POST /v1/embeddings (embeddings_api): every input at once, each in a lane."""
        tenant = request.scope.get(TENANT, "")
        body = await self._read_body(request)
        namespace = cache_namespace(tenant, "")  # the prefills leave entries there
        async with asyncio.timeout(self.limits.request_timeout_s), \
                self._front(body) as front:
            parsed = await asyncio.to_thread(embeddings_api.parse, body, front.view,
                                             self.limits, front.pooling)
            vectors = await asyncio.gather(*(front.engine.embed(ids, parsed.pooling,
                                                                namespace)
                                             for ids in parsed.inputs))
        return await asyncio.to_thread(embeddings_api.render, parsed, vectors,
                                       front.view.model)

    async def tokenize(self, request: Request, *, detokenize: bool = False) -> dict:
        """POST /tokenize or /detokenize (tokenize_api): nothing runs on the engine."""
        tenant = request.scope.get(TENANT, "")
        body = await self._read_body(request)
        async with self._front(body) as front:
            if detokenize:
                return await asyncio.to_thread(tokenize_api.detokenize, body, front.view)
            return await asyncio.to_thread(tokenize_api.tokenize, body, front.view,
                                           self.limits, tenant)

    @contextlib.asynccontextmanager
    async def _front(self, body: dict):
        """The front of the model `body` names, held while the block runs."""
        front, release = await self.fronts.hold(model_named(body))
        try:
            yield front
        finally:
            release()

    async def _within_deadline(self, request: Request, api: str) -> Response:
        arrived = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.limits.request_timeout_s
        tenant = request.scope.get(TENANT, "")
        try:
            async with asyncio.timeout_at(deadline) as within:
                raw = await self._read_raw(request)
                body = parse_json(raw)
                front, held = await self.fronts.hold(model_named(body))
                try:
                    return await unless_client_leaves(request.receive, self._answer(
                        front, held, body, raw, api, tenant, arrived, deadline))
                except BaseException:
                    held()
                    raise
        except TimeoutError:
            if not within.expired():
                raise
            raise timed_out(self.limits) from None
        except (ClientGone, ClientDisconnect):
            return Response(status_code=CLIENT_GONE_STATUS)

    async def _read_body(self, request: Request) -> dict:
        return parse_json(await self._read_raw(request))

    async def _read_raw(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        limit = self.limits.max_body_bytes
        too_large = ApiError(413, f"the request body exceeds {limit} bytes",
                             code="request_too_large")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > limit:
            raise too_large
        # the caller's budget of bytes parsed: before reading, where the size is declared
        caller = request.scope.get(TENANT) or (request.client.host if request.client else "")
        if declared is not None:
            await self._spend(caller, declared)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise too_large
        if declared is None:
            await self._spend(caller, len(raw))
        return bytes(raw)

    async def _spend(self, caller: str, nbytes: int) -> None:
        try:
            self.budget.take(caller, nbytes)
        except ApiError:
            # held a while first (a sleep costs nothing): a caller repeating refused
            # requests would otherwise cost the loop as much in answers as in parses
            await asyncio.sleep(REFUSAL_HOLD_S)
            raise

    async def _answer(self, front: ModelFront, held: Callable[[], None], body: dict,
                      raw: bytes, api: str, tenant: str, arrived: float, deadline: float
                      ) -> Response:
        """`held`: the hold on `front`'s model, ended with the request's slot; `raw`:
        the body's bytes (a body built before is not built again: built_memo.py)."""
        # off the event loop, where the streams of other requests run: checking tool
        # schemas and compiling a response_format's grammar (parse_request), and templates
        # and tokenizers on long prompts (build_requests)
        def parse() -> tuple[ParsedRequest, responses_api.Turn | None]:
            turn, chat_body = None, body
            if api == MESSAGES:
                chat_body = anthropic_api.to_chat(body)
            elif api == RESPONSES:
                given = body
                if isinstance(body, dict) and body.get("model") is None:
                    # optional in the Responses API: the model that `front` serves
                    given = {**body, "model": front.view.model}
                turn = responses_api.to_chat(given, self._previous(given, tenant))
                chat_body = turn.chat
            return parse_request(chat_body, chat=api != COMPLETIONS,
                                 schemas=self.schemas.checker(tenant)), turn
        pure = api == COMPLETIONS or (api == CHAT and not front.view.reads_clock)
        key = None
        if pure:  # a big body is hashed off the event loop (about 1 ms a 4 MiB)
            key = BuiltMemo.key(api, tenant, raw) if len(raw) <= INLINE_HASH_BYTES else \
                await asyncio.to_thread(BuiltMemo.key, api, tenant, raw)
        known = None if key is None else front.built.get(key)
        if known is not None:
            (parsed, built), turn = known, None
        else:
            if _cheap(api, body, raw):
                parsed, turn = parse()
                built = build_requests(parsed, front.view, self.limits, tenant)
            else:
                parsed, turn = await asyncio.to_thread(parse)
                built = await asyncio.to_thread(build_requests, parsed, front.view,
                                                self.limits, tenant)
            if key is not None:
                front.built.put(key, raw, parsed, built)
        admitted = await front.admission.admit(len(built.requests))

        def release() -> None:
            try:
                admitted()
            finally:
                held()
        try:
            requests = [dataclasses.replace(r, admitted=True) for r in built.requests]
            return await self._respond(front, parsed, requests, arrived, release, deadline,
                                       ReplyFormat(built.tool_format, built.think), tenant,
                                       api, turn)
        except BaseException:
            release()
            raise

    async def _respond(self, front: ModelFront, parsed: ParsedRequest,
                       requests: list[GenerationRequest],
                       arrived: float, release: Callable[[], None], deadline: float,
                       fmt: ReplyFormat, tenant: str, api: str,
                       turn: responses_api.Turn | None = None) -> Response:
        """Run the choices and answer in `api`'s shape; `release` ends the request's slot
        and lanes once the answer is complete (a stream's when its last event is sent or
        the client left). `fmt`: the tool-call format replies are read in (None: they are
        plain content); `tenant`: the caller's, whose status page lists these runs."""
        runs = [Generation(front.runs, r, parsed.stop, arrived, tenant, i % parsed.n == 0)
                for i, r in enumerate(requests)]

        async def close() -> None:
            for run in runs:
                await run.close()
            release()

        try:  # every choice's first token, so engine errors surface before any response
            await all_of(run.start() for run in runs)
        except BaseException:
            await close()
            raise
        usage = functools.partial(total_usage, runs, parsed.n)  # read once the choices end
        model = front.view.model
        if api == MESSAGES:
            return await self._message(runs[0], model, usage, fmt, parsed.stream, deadline,
                                       close, release)
        if api == RESPONSES:
            return await self._response(runs[0], model, usage, fmt, parsed.stream, deadline,
                                        close, release, turn, tenant)
        tokenizer = front.view.tokenizer
        shape = ResponseShape(parsed.chat, model,
                              lambda t: tokenizer.piece(t, special=True), front.fingerprint)
        if parsed.stream:
            events = sse_events(runs, shape, usage, parsed.include_usage, fmt, deadline,
                                self._timed_out)
            return ClosingStream(events, on_close=close, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
        try:
            body = await whole_body(runs, shape, usage, fmt,
                                    parsed.sampling.logprobs is not None)
        finally:
            release()
        return JSONResponse(body)

    def _timed_out(self) -> ApiError:
        return timed_out(self.limits)

    async def _message(self, run: Generation, model: str, usage, fmt: ReplyFormat,
                       stream: bool, deadline: float, close, release) -> Response:
        shape = anthropic_api.MessageShape(model)
        return await self._one_choice(
            stream, lambda: message_events(run, shape, usage, fmt, deadline,
                                           self._timed_out),
            lambda: whole_message(run, shape, usage, fmt), close, release)

    def _previous(self, body: dict, tenant: str) -> responses_api.Stored | None:
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is None:
            return None
        if not isinstance(previous, str):
            raise bad("previous_response_id must be a string", "previous_response_id")
        return self.stored.get(tenant, previous)

    async def _response(self, run: Generation, model: str, usage, fmt: ReplyFormat,
                        stream: bool, deadline: float, close, release,
                        turn: responses_api.Turn, tenant: str) -> Response:
        shape = responses_api.ResponseShape(model, turn)

        def keep(response: dict) -> dict:
            if turn.echo["store"]:
                self.stored.put(tenant, shape.stored(response))
            return response
        return await self._one_choice(
            stream, lambda: response_events(run, shape, usage, fmt, deadline,
                                            self._timed_out, keep),
            lambda: whole_response(run, shape, usage, fmt), close, release, keep)

    async def _one_choice(self, stream: bool, events, whole, close, release,
                          then=lambda body: body) -> Response:
        """A one-choice answer (Messages, Responses): `events()` streamed, or the body
        `whole()` gives, passed through `then`."""
        if stream:
            return ClosingStream(events(), on_close=close, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
        try:
            body = await whole()
        finally:
            release()
        return JSONResponse(then(body))


def _cheap(api: str, body: object, raw: bytes) -> bool:
    """Whether building the request is cheap enough to do on the event loop: a small
    completions or chat body that asks for no schema or grammar."""
    return api in (COMPLETIONS, CHAT) and len(raw) <= INLINE_BUILD_BYTES and \
        isinstance(body, dict) and not any(body.get(k) is not None for k in _COSTLY_KEYS)


def model_named(body: object) -> str | None:
    """The model a body names (None: the default; a missing or wrong one is the parse's
    to refuse)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
