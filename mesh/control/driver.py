"""A request's life, written once: plan -> prefill -> decode, over a link to stage 0.

Both engines run this: the in-process one links to stage objects in this process, the Ray
one to stage actors over gRPC. Stage 0 passes each call down the chain and the last
stage's answer back up; the last stage samples, so logits never cross the network.

A stage fault costs time, never the request: the driver holds the tokens produced so far,
has the pipeline repaired (mesh/control/ray_pipeline.py), and rebuilds the request's state
exactly as it was made: the prompt as a prefill, then each produced token replayed as the
decode step it was, so the state and every later token are bitwise the fault-free ones.
A probe (readiness) is the exception: its fault is its answer, "not ready", at once; it
starts the repair and does not wait for it, since a repair can take as long as Ray takes
to declare a node dead and a stage to load elsewhere.

A stage's error reply becomes our own type here (topology/errors.py): `busy` an
OverCapacity, `invalid` a RequestError with its param, and a fault a StageFault carrying
the id the stage logged it under; faults past what rebuilding absorbs end the request
as StageUnavailable with that id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import torch

from skippy.proto import stage_pb2 as pb
from skippy.topology.errors import OverCapacity, RequestError, StageUnavailable

from .. import tracing
from .engine import GenerationRequest, Step
from .draft import DraftModel
from .speculation import FIRST_K, Speculator, StepCosts
from ..wire import sampling_to_proto, token_logprobs

log = logging.getLogger(__name__)

REBUILD_ATTEMPTS = 5  # stage faults one request survives
_repairs: set[asyncio.Task] = set()  # repairs a probe started and left running


class StageFault(Exception):
    """A stage or link failed: the request is rebuilt on a repaired pipeline. `error_id`:
    the id the stage logged its failure under ("" for a link that went down)."""

    def __init__(self, message: str, error_id: str = ""):
        super().__init__(f"{message} [{error_id}]" if error_id else message)
        self.error_id = error_id


class Link(Protocol):
    """One request's session with stage 0 (and through it the whole chain)."""

    async def ask(self, call: pb.StageCall) -> pb.StageResult: ...

    async def close(self) -> None: ...


class Pipeline(Protocol):
    generation: int  # how many times it was repaired
    healthy: bool    # False while a repair has not made the chain whole
    addresses: list[str]  # where each stage listens for peers (empty: not reachable)

    async def open(self) -> Link: ...

    async def repair(self, generation: int) -> None:
        """Make the chain whole again, unless someone already did since `generation`."""


def drive(pipe: Pipeline, request: GenerationRequest,
          on_rebuild=lambda reason: None,
          peers: Callable[[bool], list[str]] = lambda rebuilding: [],
          speculate: Callable[[], bool] | bool = False,
          draft: DraftModel | None = None,
          costs: StepCosts | None = None) -> AsyncIterator[Step]:
    """The continuation a token at a time; a stop id ends it without a Step. Closing the
    iteration (client gone) closes the session, which frees the lanes down the chain.
    `peers(rebuilding)`: another pipeline's stage addresses, for this try's stages to pull
    the prompt's state from (a stage re-placed after a fault starts empty).
    Traced (mesh/tracing.py), the request's life is one `generate` span (a probe's is not
    traced), and each call to stage 0 carries it as the parent of the stages' spans.
    `speculate`: decode steps carry proposed tokens to verify (speculation.py): the same
    tokens, fewer trips through the stages; a callable is asked before each step (the
    engine's: only while the request decodes alone, where batching does not pay more);
    `draft`: a draft model proposes them (else prompt lookup); `costs`: the pipeline's
    measured step costs, which choose how many (kept by the engine per pipeline)."""
    speculate = _Speculation(speculate, draft, costs or StepCosts())
    if request.probe or not tracing.enabled():
        return _drive(pipe, request, [], on_rebuild, peers, tracing.OFF, speculate)
    return _traced(pipe, request, on_rebuild, peers, speculate)


class _Speculation:
    """Whether a request's steps verify proposals now, and where they come from."""

    def __init__(self, now: Callable[[], bool] | bool, draft: DraftModel | None,
                 costs: StepCosts):
        self.now = now if callable(now) else (lambda: bool(now))
        self.wanted, self.draft, self.costs = bool(now), draft, costs

    def first_k(self, request: GenerationRequest) -> int:
        """The proposals a last stage with a proposer of its own (a NextN layer) sends
        with the request's first token: none where a draft model proposes, or where the
        request does not decode alone (its prompt's rows then cost the proposer nothing)."""
        return FIRST_K if self.wanted and self.draft is None and not request.probe \
            and self.now() else 0

    def start(self, prompt: list[int], staged: bool = False, offered=()) -> Speculator:
        """`staged`: the last stage proposes (PlanReply.propose; `offered`: with the
        first token), unless a draft does."""
        draft = None if self.draft is None else self.draft.session()
        spec = Speculator(prompt, draft, self.costs, staged=staged and draft is None)
        spec.offered = list(offered)
        return spec


async def _traced(pipe: Pipeline, request: GenerationRequest, on_rebuild, peers,
                  speculate) -> AsyncIterator[Step]:
    span = tracing.start("generate", {"skippy.prompt_tokens": len(request.tokens),
                                      "skippy.max_tokens": request.max_tokens})
    produced: list[int] = []
    try:
        async with contextlib.aclosing(_drive(pipe, request, produced, on_rebuild, peers,
                                              span, speculate)) as steps:
            async for step in steps:
                yield step
    except (StageUnavailable, OverCapacity, StageFault) as e:
        span.fail(str(e))
        raise
    finally:
        span.set_attribute("skippy.completion_tokens", len(produced))
        span.end()


async def _drive(pipe: Pipeline, request: GenerationRequest, produced: list[int],
                 on_rebuild, peers, span, speculate: _Speculation) -> AsyncIterator[Step]:
    """`drive`'s tries: each on a fresh session, after a repair when a stage failed."""
    traceparent = tracing.traceparent(span)
    failures = 0
    while True:
        generation = pipe.generation
        link = None
        try:
            link = await pipe.open()
            if traceparent:
                link = _Traced(link, traceparent)
            async for step in _attempt(link, request, produced, peers(failures > 0),
                                       speculate):
                produced.append(step.token)
                yield step
            return
        except StageFault as e:
            failures += 1
            if request.probe:
                repair = asyncio.ensure_future(pipe.repair(generation))
                _repairs.add(repair)
                repair.add_done_callback(_repairs.discard)
                raise OverCapacity(f"a stage failed; the pipeline is being repaired: {e}",
                                   retry_after=5.0) from e
            if failures > REBUILD_ATTEMPTS:
                if not pipe.healthy:  # down, not broken: come back later
                    raise OverCapacity(f"no stage chain can serve now: {e}",
                                       retry_after=5.0) from e
                raise StageUnavailable(f"the pipeline failed {failures} times: {e}",
                                       e.error_id) from e
            log.warning("stage fault (%s); rebuilding the request after %d tokens",
                        e, len(produced))
            span.add_event("rebuild", {"reason": str(e), "skippy.tokens": len(produced)})
            on_rebuild(str(e))
        finally:
            if link is not None:
                await link.close()
        await pipe.repair(generation)
        if not pipe.healthy:
            await asyncio.sleep(min(0.2 * 2 ** failures, 5.0))


async def embed(pipe: Pipeline, tokens: tuple[int, ...], pooling: str,
                namespace: str = "") -> torch.Tensor:
    """An embedding of `tokens`: every row computed from the start (no stage reuses a
    prefix, so the bits are those of a cold run whatever the caches hold), the last
    stage's final hidden rows pooled (`pooling`: mean or last). A stage fault is
    rebuilt as a generation's is: the request simply runs again."""
    failures = 0
    while True:
        generation = pipe.generation
        link = await pipe.open()
        try:
            plan = pb.StageCall(plan=pb.Plan(tokens=tokens, limit=0, namespace=namespace))
            start = _expect(await _ask(link, plan), "plan").plan.start
            reply = await _ask(link, pb.StageCall(prefill=pb.Prefill(
                tokens=tokens, start=start, namespace=namespace, embed=pooling)))
            values = _expect(reply, "embedding").embedding.values
            return torch.frombuffer(bytearray(values), dtype=torch.float32)
        except StageFault as e:
            failures += 1
            if failures > REBUILD_ATTEMPTS:
                raise StageUnavailable(f"the pipeline failed {failures} times: {e}",
                                       e.error_id) from e
            log.warning("stage fault (%s); running the embedding again", e)
        finally:
            await link.close()
        await pipe.repair(generation)
        if not pipe.healthy:
            await asyncio.sleep(min(0.2 * 2 ** failures, 5.0))


class _Traced:
    """A link whose calls carry the request's trace context to the stages."""

    def __init__(self, link: Link, traceparent: str):
        self.link, self.traceparent = link, traceparent

    async def ask(self, call: pb.StageCall) -> pb.StageResult:
        call.traceparent = self.traceparent
        return await self.link.ask(call)

    async def ask_direct(self, call: pb.StageCall) -> pb.StageResult:
        call.traceparent = self.traceparent
        return await self.link.ask_direct(call)

    @property
    def reply_id(self) -> str:
        return getattr(self.link, "reply_id", "")

    async def close(self) -> None:
        await self.link.close()


async def _attempt(link: Link, request: GenerationRequest, produced: list[int],
                   peers: list[str], speculate: _Speculation | None = None
                   ) -> AsyncIterator[Step]:
    """One try: plan, prefill (or rebuild what `produced` already holds), then decode,
    with proposals to verify where every stage can and `speculate` says so (before each
    step, where it is a callable: speculation.py).
    The caller appends each yielded token to `produced`."""
    prompt = list(request.tokens)
    k0 = 0 if speculate is None else speculate.first_k(request)  # the stage's proposer's
    # a first try plans and prefills in one call; a rebuilt one replays, after its plan
    reply = await _ask(link, _plan(request, produced, results=not produced, peers=peers,
                                   prefill=not produced, propose=k0,
                                   last=not produced and request.max_tokens == 1))
    if reply.WhichOneof("result") == "token" and not reply.token.HasField("plan"):
        if reply.token.id in request.stop_ids:  # an exact repeat, answered from results
            return
        yield _step(reply.token, len(prompt))
        if len(produced) >= request.max_tokens:
            return
        reply = await _ask(link, _plan(request, produced, results=False, peers=peers))
    plan, reply = await _prefilled(link, request, produced, reply, k0)
    first = not produced
    if produced:
        reply = await _replayed(link, request, produced)
    tokens = _tokens(_expect(reply, "token").token)
    speculating = speculate is not None and speculate.wanted and plan.verify and \
        not request.probe and len(produced) + 1 < request.max_tokens  # steps to come
    spec = speculate.start(prompt + produced, plan.propose, tokens[0].proposals) \
        if speculating else None
    seen = len(produced)  # produced tokens the speculator has seen
    try:
        while True:
            for token in tokens:
                if token.id in request.stop_ids:
                    return
                yield _step(token, token.cached_tokens if first else 0)
                first = False
                if len(produced) >= request.max_tokens:
                    return
            alone = spec is not None and speculate.now()  # steps timed: none batched in
            t0 = time.perf_counter()
            proposed = [] if spec is None else await _proposals(
                spec, produced[seen:], request.max_tokens - len(produced) - 1
                if alone else 0)
            t1 = time.perf_counter()
            seen = len(produced)
            last = len(produced) + 1 >= request.max_tokens
            call = _decode(tokens[-1].id, proposed, len(prompt) + len(produced) - 1
                           if spec else None, last=last, reply_to=_reply_to(link, last),
                           propose=spec.wanted(alone) if spec else 0)
            tokens = _tokens(_expect(await _ask(link, call), "token").token)
            if spec is not None:
                spec.observe(len(proposed), len(tokens) - 1, tokens[0].proposals)
                if alone:
                    if spec.draft is not None:
                        speculate.costs.observe_draft(len(proposed), t1 - t0)
                    speculate.costs.observe_step(1 + len(proposed), time.perf_counter() - t1)
    finally:
        if spec is not None and spec.draft is not None:
            await asyncio.to_thread(spec.draft.close)


async def _replayed(link: Link, request: GenerationRequest, produced: list[int]
                    ) -> pb.StageResult:
    """A rebuilt request's tokens run again as the decode rows they were (the stages'
    state bitwise what it was), the last one sampled anew: its reply."""
    for token in produced[:-1]:
        _expect(await _ask(link, _decode(token, replay=True)), "done")
    return await _ask(link, _decode(produced[-1],
                                    last=len(produced) + 1 >= request.max_tokens))


async def _prefilled(link: Link, request: GenerationRequest, produced: list[int],
                     reply: pb.StageResult, propose: int = 0
                     ) -> tuple[pb.PlanReply, pb.StageResult]:
    """The plan and the prefill's reply: as they came where stage 0 planned and
    prefilled in one call, else the prefill (a replay once tokens were produced) sent
    after the plan."""
    if reply.WhichOneof("result") == "token":
        return reply.token.plan, reply
    plan = _expect(reply, "plan").plan
    return plan, await _ask(link, pb.StageCall(prefill=pb.Prefill(
        tokens=request.tokens, start=plan.start,
        sampling=_sampling(request, produced, propose),
        probe=request.probe, namespace=request.namespace, replay=bool(produced))))


async def _proposals(spec: Speculator, tail: list[int], room: int) -> list[int]:
    """The next step's proposals (a draft model computes: off the event loop)."""
    if spec.draft is None or room <= 0:
        return spec.propose(tail, room)
    return await asyncio.to_thread(spec.propose, tail, room)


def _tokens(token: pb.Token) -> list[pb.Token]:
    """A step's tokens: the one sampled, and a verify step's further ones."""
    return [token, *token.more]


def _plan(request: GenerationRequest, produced: list[int], results: bool,
          peers: list[str] = (), prefill: bool = False, last: bool = False,
          propose: int = 0) -> pb.StageCall:
    """`last`: its token is the request's last (max_tokens 1): the stages end their
    sessions with the answer."""
    return pb.StageCall(last=last, plan=pb.Plan(
        tokens=request.tokens, limit=len(request.tokens) - 1, probe=request.probe,
        namespace=request.namespace, sampling=_sampling(request, produced, propose),
        results=results and not request.probe, peers=peers, prefill=prefill))


def _sampling(request: GenerationRequest, produced: list[int], propose: int = 0
              ) -> pb.Sampling:
    """`propose`: the proposals the last stage's proposer sends with the first token (0:
    the request does not run it)."""
    msg = sampling_to_proto(request.sampling, produced)
    msg.logits, msg.propose = request.logits, propose
    return msg


def _decode(token: int, proposed: list[int] = (), length: int | None = None,
            replay: bool = False, last: bool = False, reply_to: str = "",
            propose: int = 0) -> pb.StageCall:
    """A decode step appending `token` at position `length` (None: where the lanes are),
    with the tokens `proposed` after it to verify; `last`: its token is the request's
    last (max_tokens reached), so the stages end their sessions with the answer (it
    comes back through every stage); `reply_to`: the link's reply stream at the last
    stage, which then answers straight to the driver; `propose`: the proposals the last
    stage's proposer sends with the answer, for the next step."""
    return pb.StageCall(last=last, decode=pb.Decode(token=token, replay=replay,
                                                    proposed=proposed, length=length,
                                                    reply_to=reply_to, propose=propose))


def _reply_to(link: Link, last: bool) -> str:
    """Where the last stage answers a decode step: the link's reply stream (Ray
    pipelines of several stages), but a request's last step comes back through every
    stage, ending their sessions on its way."""
    return "" if last else getattr(link, "reply_id", "")


def _step(token: pb.Token, cached: int) -> Step:
    logits = None
    if token.logits:
        logits = torch.frombuffer(bytearray(token.logits), dtype=torch.float32)
    return Step(token.id, cached, token_logprobs(token), logits)


async def _ask(link: Link, call: pb.StageCall) -> pb.StageResult:
    direct = call.WhichOneof("call") == "decode" and call.decode.reply_to
    reply = await (link.ask_direct(call) if direct else link.ask(call))
    if reply.WhichOneof("result") == "error":
        e = reply.error
        if e.busy:
            raise OverCapacity(e.message)
        if e.invalid:
            raise RequestError(e.message, e.param or None)
        raise StageFault(e.message, e.error_id)
    return reply


def _expect(reply: pb.StageResult, kind: str) -> pb.StageResult:
    got = reply.WhichOneof("result")
    if got != kind:
        raise StageFault(f"expected a {kind} reply, got {got}")
    return reply
