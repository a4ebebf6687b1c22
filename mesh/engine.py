"""What the gateway asks of whatever runs the stages: one contract, two engines.

`LocalEngine` drives an in-process `LocalPipeline` (tests, the quick path); the Ray
engine (mesh/ray_engine.py) drives stage actors over gRPC. The gateway sees only
`Engine`: token ids in, token ids out, one `Step` at a time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from .sampler import Sampler, SamplingParams, TokenLogprobs


class EngineError(RuntimeError):
    """The engine could not serve a request it accepted (a stage failed for good)."""


class EngineBusy(EngineError):
    """No lane is free for another request right now (the gateway answers 503)."""


@dataclass(frozen=True)
class GenerationRequest:
    tokens: tuple[int, ...]          # the whole prompt, BOS included
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()   # end-of-generation ids: end it, not yielded
    namespace: str = ""              # per-tenant cache separation (`cache_salt`)
    probe: bool = False              # warm-up / health: bypasses every cache


@dataclass(frozen=True)
class Step:
    token: int
    cached_tokens: int = 0           # prompt tokens served from caches (first step only)
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass
class EngineInfo:
    model: str                       # the served model's name (`/v1/models`)
    path: str                        # its GGUF
    n_ctx: int                       # context a request may fill: prompt + max_tokens
    n_stages: int
    topology_digest: str             # stable identity of the split (planner)
    lanes: int = 8                   # lane budget of one pipeline: the most choices (`n`)
                                     # one request may ask for
    extra: dict = field(default_factory=dict)


def check_fits(request: GenerationRequest, n_ctx: int) -> None:
    """ValueError (one line) unless the prompt is non-empty and it fits with max_tokens."""
    if not request.tokens:
        raise ValueError("the prompt has no tokens")
    if len(request.tokens) + request.max_tokens > n_ctx:
        raise ValueError(f"prompt ({len(request.tokens)} tokens) + max_tokens "
                         f"({request.max_tokens}) exceed the context of {n_ctx}")


class Engine(Protocol):
    info: EngineInfo

    def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        """The continuation, a token at a time; a stop id ends it without a Step.
        Cancelling the iteration (client gone) frees the request's lanes."""

    def stats(self) -> dict:
        """Per-stage figures for /metrics: {"stages": [{...}, ...]}."""

    def status(self) -> dict:
        """{"serving": bool, "detail": str}: False while no pipeline can serve (a stage
        down and not yet back): /ready is then 503 and /health says degraded."""

    async def close(self) -> None: ...


class LocalEngine:
    """An in-process pipeline behind the Engine contract. One worker thread runs the
    pipeline (torch work is not thread-safe across lanes); requests interleave a step at
    a time, so concurrent requests all make progress."""

    def __init__(self, pipeline, info: EngineInfo):
        self.pipeline, self.info = pipeline, info
        self._lock = threading.Lock()

    def _run(self, fn, *args, **kwargs):
        with self._lock:
            return fn(*args, **kwargs)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        check_fits(request, self.info.n_ctx)
        pipe, ids = self.pipeline, list(request.tokens)
        sampler = Sampler(request.sampling)
        lanes = await asyncio.to_thread(self._run, pipe.alloc)
        try:
            logits, cached, prefilled = await asyncio.to_thread(
                self._run, pipe.first_logits, lanes, ids, probe=request.probe)
            for i in range(request.max_tokens):
                token = sampler(logits)
                if token in request.stop_ids:
                    return
                yield Step(token, cached if i == 0 else 0, sampler.last)
                if i + 1 == request.max_tokens:
                    return
                if not prefilled:
                    await asyncio.to_thread(self._run, pipe.prefill_cached, lanes, ids,
                                            probe=request.probe)
                    prefilled = True
                logits = await asyncio.to_thread(self._run, pipe.decode, lanes, token)
        finally:
            await asyncio.to_thread(self._run, pipe.free, lanes)

    def stats(self) -> dict:
        return {"stages": self.pipeline.cache_stats()}

    def status(self) -> dict:
        return {"serving": True, "detail": "in process"}

    async def close(self) -> None:
        return None
