"""One choice of a request, run: from the engine, or replayed from the tokens a
deterministic request already produced (result_memo), as completion text with stop
strings cut (stop_text) and the figures it leaves (usage, metrics, the memo).

`Generation.start()` waits for the first token, so engine errors surface before any
response is sent; `texts()` then yields the text as it grows. Whatever ends a run (its
last token, a stop string, an error, a cancelled task when the client left or the
deadline passed), its engine iteration is closed at once, which frees its lanes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..control.engine import Engine, GenerationRequest, Step
from .in_flight import InFlight
from .metrics import GatewayMetrics
from .openai_api import Logprobs, TokenUsage
from .result_memo import KnownRun, ResultMemo, memo_key
from .stop_text import StopText
from ..tokenizer import Tokenizer


@dataclass(frozen=True)
class RunContext:
    """What every run reads and feeds: one per gateway."""

    engine: Engine
    memo: ResultMemo
    metrics: GatewayMetrics
    tokenizer: Tokenizer
    in_flight: InFlight = field(default_factory=InFlight)  # the status page lists them


@dataclass
class Outcome:
    usage: TokenUsage
    finish_reason: str = "length"
    stop_sequence: str | None = None  # the stop string that ended it, if one did


class Generation:
    """One choice's run (see the module docstring)."""

    def __init__(self, ctx: RunContext, request: GenerationRequest, stops: tuple[str, ...],
                 arrived: float, tenant: str = "", counts_prompt: bool = True):
        self.ctx, self.request, self.stops, self.arrived = ctx, request, stops, arrived
        self.tenant = tenant  # whose status page lists it
        self.counts_prompt = counts_prompt  # the first of the n choices of its prompt
        self.outcome = Outcome(TokenUsage(len(request.tokens)))
        self.key = memo_key(request, ctx.engine.info.topology_digest)
        self.known: KnownRun | None = None
        self._replay: tuple[int, ...] | None = None
        self._steps: AsyncIterator | None = None
        self._first = None           # the first Step, or None when the run yielded none
        self._seen: list[int] = []
        self._first_at: float | None = None

    async def start(self) -> None:
        self.ctx.in_flight.add(self)
        self.known = self.ctx.memo.get(self.key)
        if self.known is not None and self._known_suffices(self.known):
            self._replay = self.known.tokens[:self.request.max_tokens]
            self.outcome.usage.cached_tokens = len(self.request.tokens)
            self._first_at = time.perf_counter()
            self.ctx.metrics.ttft.observe(self._first_at - self.arrived)
            return
        self._steps = self.ctx.engine.generate(self.request)
        try:
            self._first = await anext(self._steps, None)
        except BaseException:
            await self.close()
            raise
        self._first_at = time.perf_counter()
        if self._first is not None:
            self.outcome.usage.cached_tokens = self._first.cached_tokens
            self.ctx.metrics.ttft.observe(self._first_at - self.arrived)

    def _known_suffices(self, known: KnownRun) -> bool:
        """Whether the known tokens settle this request: enough of them, the stream ended
        there, or one of this request's stop strings appears within them."""
        if known.complete or len(known.tokens) >= self.request.max_tokens:
            return True
        text = StopText(self.ctx.tokenizer, self.stops)
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
        text = StopText(self.ctx.tokenizer, self.stops)
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
                    self.outcome.stop_sequence = text.matched
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
        self.ctx.in_flight.remove(self)
        steps, self._steps = self._steps, None
        if steps is not None:
            with contextlib.suppress(Exception):
                await steps.aclose()

    def figures(self, now: float) -> dict:
        """This run as the status page lists it at perf_counter `now`: its age, prompt
        and cached tokens, tokens so far, time to first token and decode speed (tokens
        after the first over the seconds since it, as skippy_decode_tokens_per_second
        counts them) once known."""
        usage, first = self.outcome.usage, self._first_at
        n = usage.completion_tokens
        return {"age_s": now - self.arrived, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens, "tokens": n,
                "ttft_s": None if first is None else first - self.arrived,
                "tokens_per_s": (n - 1) / (now - first)
                if first is not None and n > 1 and now > first else None}

    def _account(self, ran_out: bool) -> None:
        usage = self.outcome.usage
        n = usage.completion_tokens
        self.ctx.in_flight.ended(self.tenant, usage.prompt_tokens * self.counts_prompt,
                                 usage.cached_tokens * self.counts_prompt, n)
        source = "memo" if self._replay is not None else "engine"
        self.ctx.metrics.tokens.labels(source).inc(n)
        if n > 1 and self._first_at is not None:
            spent = time.perf_counter() - self._first_at
            if spent > 0:
                self.ctx.metrics.tokens_per_second.observe((n - 1) / spent)
        if self._replay is None:
            # An engine run that ended by itself with fewer tokens than allowed met an
            # end-of-generation id: the stream is known to end there. Any other run still
            # gives a true prefix of the stream.
            complete = ran_out and n < self.request.max_tokens
            self.ctx.memo.record(self.key, KnownRun(tuple(self._seen), complete), self.known)


# -- several choices together ------------------------------------------------------------------
async def collect(texts: AsyncIterator, into: list) -> None:
    async for piece in texts:
        into.append(piece)


async def all_of(awaitables) -> None:
    """Await every one together; the first failure is raised once all have ended (so no
    choice is left running unseen). One is awaited as it is (gather's task for it cost
    a turn of the event loop)."""
    awaitables = list(awaitables)
    if len(awaitables) == 1:
        await awaitables[0]
        return
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def pump(index: int, run: Generation, queue: asyncio.Queue) -> None:
    """One choice's text pieces into the shared queue: (index, text, logprobs, None),
    then (index, None, None, finish_reason), or the failure in the last place."""
    try:
        async for delta, logprobs in run.texts():
            await queue.put((index, delta, logprobs, None))
        await queue.put((index, None, None, run.outcome.finish_reason))
    except Exception as e:  # noqa: BLE001
        await queue.put((index, None, None, e))


def total_usage(runs: list[Generation], n: int) -> TokenUsage:
    """The usage of a response's choices: each prompt counted once (its n copies share
    it), the completion tokens of every choice."""
    firsts = [r.outcome.usage for r in runs[::n]]
    return TokenUsage(sum(u.prompt_tokens for u in firsts),
                 sum(r.outcome.usage.completion_tokens for r in runs),
                 sum(u.cached_tokens for u in firsts))
