"""A request's choices, as they run, rendered as OpenAI answers: one JSON body, or an SSE
stream of chunks (openai_api.ResponseShape writes each object); or one choice as
Anthropic's Message or its stream of events (anthropic_api writes those).

A stream interleaves the choices' chunks as their texts grow (each with its index;
content or tool-call deltas), a finish chunk per choice, the usage if asked, then [DONE].
Once its headers are sent, a failure or the deadline travels as an error event instead
of the rest, as OpenAI's servers do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from . import anthropic_api, http_errors
from .anthropic_api import MessageEvents, MessageShape
from .generation import Generation, all_of, collect, pump
from .openai_api import ApiError, ResponseShape, TokenUsage, sse
from .tool_calls import ReplyDeltas, ToolCallFormat, whole_reply


async def whole_body(runs: list[Generation], shape: ResponseShape,
                     usage: Callable[[], TokenUsage], fmt: ToolCallFormat | None,
                     logprobs: bool) -> dict:
    """Every choice's whole reply (tool calls read in `fmt`), once all have ended."""
    pieces: list[list] = [[] for _ in runs]
    await all_of(collect(run.texts(), into) for run, into in zip(runs, pieces))
    choices = []
    for run, parts in zip(runs, pieces):
        content, reason, calls = whole_reply(fmt, "".join(t for t, _ in parts),
                                             run.outcome.finish_reason)
        choices.append((content, reason,
                        [e for _, lp in parts for e in lp] if logprobs else None, calls))
    return shape.full(choices, usage())


async def sse_events(runs: list[Generation], shape: ResponseShape,
                     usage: Callable[[], TokenUsage], include_usage: bool,
                     fmt: ToolCallFormat | None, deadline: float,
                     timed_out: Callable[[], ApiError]) -> AsyncIterator[bytes]:
    """The stream (see the module docstring). `timed_out`: the deadline's error."""
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
            index, delta, logprobs, end = await _by(deadline, queue.get(), timed_out)
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


async def whole_message(run: Generation, shape: MessageShape,
                        usage: Callable[[], TokenUsage], fmt: ToolCallFormat | None) -> dict:
    """One choice's whole reply as Anthropic's Message."""
    parts: list = []
    await collect(run.texts(), parts)
    content, reason, calls = whole_reply(fmt, "".join(t for t, _ in parts),
                                         run.outcome.finish_reason)
    return shape.full(content, reason, calls, run.outcome.stop_sequence, usage())


async def message_events(run: Generation, shape: MessageShape,
                         usage: Callable[[], TokenUsage], fmt: ToolCallFormat | None,
                         deadline: float, timed_out: Callable[[], ApiError]
                         ) -> AsyncIterator[bytes]:
    """One choice's reply as the Messages stream: message_start, its content blocks as
    they grow, message_delta (stop reason, usage), message_stop; a failure once the
    headers are sent as an error event."""
    reply, blocks = ReplyDeltas(fmt), MessageEvents()
    texts = run.texts()

    def out(deltas) -> list[bytes]:
        return [e for content, call, _ in deltas
                for e in (blocks.call(call) if call is not None else blocks.text(content))]
    try:
        yield shape.start(usage())
        yield anthropic_api.event("ping", {"type": "ping"})
        while True:
            try:
                text, logprobs = await _by(deadline, anext(texts), timed_out)
            except StopAsyncIteration:
                break
            for e in out(reply.push(text, logprobs)):
                yield e
        for e in out(reply.finish()) + blocks.close():
            yield e
        for e in anthropic_api.stream_end(reply.finish_reason(run.outcome.finish_reason),
                                          run.outcome.stop_sequence, usage()):
            yield e
    except Exception as e:  # noqa: BLE001 - headers are gone: an error event
        yield anthropic_api.error_event(http_errors.api_error(e))
    finally:
        await texts.aclose()


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
