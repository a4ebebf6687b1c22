"""A request's choices, as they run, rendered as OpenAI answers: one JSON body, or an SSE
stream of chunks (openai_api.ResponseShape writes each object); or one choice as
Anthropic's Message or its stream of events (anthropic_api writes those), or as a
Responses API Response or its stream (responses_api).

A stream interleaves the choices' chunks as their texts grow (each with its index;
content or tool-call deltas), a finish chunk per choice, the usage if asked, then [DONE].
Once its headers are sent, a failure or the deadline travels as an error event instead
of the rest, as OpenAI's servers do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from . import anthropic_api, http_errors, responses_api
from .anthropic_api import MessageEvents, MessageShape
from .responses_api import ResponseEvents
from .responses_api import ResponseShape as ResponseObjects
from .generation import Generation, all_of, collect, pump
from .openai_api import ApiError, ResponseShape, TokenUsage, sse
from .reasoning import ReplyFormat


async def whole_body(runs: list[Generation], shape: ResponseShape,
                     usage: Callable[[], TokenUsage], reply: ReplyFormat,
                     logprobs: bool) -> dict:
    """Every choice's whole reply (read as `reply` says), once all have ended."""
    pieces: list[list] = [[] for _ in runs]
    await all_of(collect(run.texts(), into) for run, into in zip(runs, pieces))
    choices = []
    for run, parts in zip(runs, pieces):
        reasoning, content, reason, calls = reply.whole("".join(t for t, _ in parts),
                                                        run.outcome.finish_reason)
        choices.append((content, reason,
                        [e for _, lp in parts for e in lp] if logprobs else None, calls,
                        reasoning))
    return shape.full(choices, usage())


async def sse_events(runs: list[Generation], shape: ResponseShape,
                     usage: Callable[[], TokenUsage], include_usage: bool,
                     reply_format: ReplyFormat, deadline: float,
                     timed_out: Callable[[], ApiError]) -> AsyncIterator[bytes]:
    """The stream (see the module docstring). `timed_out`: the deadline's error."""
    queue: asyncio.Queue = asyncio.Queue()
    replies = [reply_format.parts() for _ in runs]
    pumps = [asyncio.create_task(pump(i, run, queue)) for i, run in enumerate(runs)]
    try:
        if shape.chat:
            for i in range(len(runs)):
                yield sse(shape.chunk("", first=True, with_usage_field=include_usage,
                                      index=i))
        left = len(runs)
        while left:
            index, delta, logprobs, end = await _by(deadline, queue.get(), timed_out)
            if isinstance(end, BaseException):
                raise end
            ends = end is not None
            reply = replies[index]
            for part in reply.finish() if ends else reply.push(delta, logprobs):
                yield sse(shape.chunk(part.content, with_usage_field=include_usage,
                                      logprobs=part.logprobs, index=index,
                                      tool_call=part.call, reasoning=part.reasoning))
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


async def _whole_reply(run: Generation, reply: ReplyFormat
                       ) -> tuple[str, str | None, str, list[dict]]:
    """One choice's whole reply: (reasoning, content, finish reason, tool calls)."""
    parts: list = []
    await collect(run.texts(), parts)
    return reply.whole("".join(t for t, _ in parts), run.outcome.finish_reason)


class _Deltas:
    """One choice's reply as it grows, as Parts (read as `reply` says), each piece
    awaited by the deadline; `finish_reason()` once it ends."""

    def __init__(self, run: Generation, reply: ReplyFormat, deadline: float,
                 timed_out: Callable[[], ApiError]):
        self.run, self.reply = run, reply.parts()
        self.deadline, self.timed_out = deadline, timed_out

    async def __aiter__(self):
        texts = self.run.texts()
        try:
            while True:
                try:
                    text, logprobs = await _by(self.deadline, anext(texts), self.timed_out)
                except StopAsyncIteration:
                    break
                for part in self.reply.push(text, logprobs):
                    yield part
            for part in self.reply.finish():
                yield part
        finally:
            await texts.aclose()

    def finish_reason(self) -> str:
        return self.reply.finish_reason(self.run.outcome.finish_reason)


async def whole_message(run: Generation, shape: MessageShape,
                        usage: Callable[[], TokenUsage], reply: ReplyFormat) -> dict:
    """One choice's whole reply as Anthropic's Message."""
    reasoning, content, reason, calls = await _whole_reply(run, reply)
    return shape.full(content, reason, calls, run.outcome.stop_sequence, usage(),
                      reasoning)


async def message_events(run: Generation, shape: MessageShape,
                         usage: Callable[[], TokenUsage], reply: ReplyFormat,
                         deadline: float, timed_out: Callable[[], ApiError]
                         ) -> AsyncIterator[bytes]:
    """One choice's reply as the Messages stream: message_start, its content blocks as
    they grow, message_delta (stop reason, usage), message_stop; a failure once the
    headers are sent as an error event."""
    blocks, deltas = MessageEvents(), _Deltas(run, reply, deadline, timed_out)
    try:
        yield shape.start(usage())
        yield anthropic_api.event("ping", {"type": "ping"})
        async for part in deltas:
            for e in blocks.part(part):
                yield e
        for e in blocks.close() + anthropic_api.stream_end(
                deltas.finish_reason(), run.outcome.stop_sequence, usage()):
            yield e
    except Exception as e:  # noqa: BLE001 - headers are gone: an error event
        yield anthropic_api.error_event(http_errors.api_error(e))


async def whole_response(run: Generation, shape: ResponseObjects,
                         usage: Callable[[], TokenUsage], reply: ReplyFormat) -> dict:
    """One choice's whole reply as a Responses API Response object."""
    reasoning, content, reason, calls = await _whole_reply(run, reply)
    status = responses_api.status_of(reason)
    return shape.response(shape.output(content, calls, status, reasoning), status, usage())


async def response_events(run: Generation, shape: ResponseObjects,
                          usage: Callable[[], TokenUsage], reply: ReplyFormat,
                          deadline: float, timed_out: Callable[[], ApiError],
                          done: Callable[[dict], None]) -> AsyncIterator[bytes]:
    """One choice's reply as the Responses stream: response.created, its output items'
    events as they grow, then response.completed (or .incomplete) with the whole
    Response, which `done` receives; a failure once the headers are sent as an error
    event."""
    events, deltas = ResponseEvents(shape), _Deltas(run, reply, deadline, timed_out)
    try:
        for e in events.start():
            yield e
        async for part in deltas:
            for e in events.part(part):
                yield e
        last, response = events.end(responses_api.status_of(deltas.finish_reason()),
                                    usage())
        done(response)
        for e in last:
            yield e
    except Exception as e:  # noqa: BLE001 - headers are gone: an error event
        yield events.failed(http_errors.api_error(e))


async def _by(deadline: float, awaitable, timed_out: Callable[[], ApiError]):
    """`awaitable`'s result, or the deadline's error once it passes. Only around one
    await: a timeout spanning the stream's yields would cancel whatever the stream's
    consumer (Starlette) is doing when it fires."""
    try:
        async with asyncio.timeout_at(deadline):
            return await awaitable
    except TimeoutError:
        raise timed_out() from None


class ClosingStream(StreamingResponse):
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
