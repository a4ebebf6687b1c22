"""A stage session's first step (mesh/stage/session.py keeps the rest): the plan call
(lane, exact result and plan in one trip to the loop where the stage asks no one), and a
one-stage pipeline's plan, prefill and answer in one trip (a trip costs a short request
0.1-0.2 ms of thread hand-offs; three were half of the stage's own time on a warm hit)."""

from __future__ import annotations

from functools import partial

import torch

from skippy.proto import stage_pb2 as pb

from .state_pull import peer_named, start_pull
from .verify import plan_reply


class FirstStep:
    """StageSession's planning half; the session holds the lane, cache, loop, sampler and
    the calls these methods use."""

    def _plan(self, p: pb.Plan) -> pb.StageResult:
        tokens = list(p.tokens)
        # a last stage that pulls nothing asks no one: lane, exact result and plan in one
        # trip to the loop (each trip costs a short request 0.1 ms)
        peer = peer_named(self.server, p)
        alone = self.last and peer is None
        logits, start = self._begin(tokens, p.probe, p.namespace,
                                    partial(self._plan_here, tokens, p, alone))
        if logits is not None:  # an exact repeat: its first token, nothing computed
            self.span.set_attribute("skippy.exact_result", True)
            self._new_sampler(p.sampling)
            return pb.StageResult(token=self._sample(logits, len(tokens)))
        reply = None
        if not alone:  # a pull runs while the stages below plan theirs
            pulling = None if peer is None else start_pull(self.server, peer, self.lane, p)
            reply = None if self.last else self._ask_down(pb.StageCall(plan=p))
            if pulling is not None:
                pulling.join()
            if reply is not None and reply.WhichOneof("result") != "plan":
                return reply
            self.downstream_start = None if reply is None else reply.plan.start
            start = self.loop.call(self.cache.plan, self.lane, tokens, p.limit,
                                   self.downstream_start, self.scope)
        self.span.set_attribute("skippy.start", start)
        return pb.StageResult(plan=plan_reply(self.server.runtime, start,
                                              None if reply is None else reply.plan))

    def _alone(self, p: pb.Plan) -> bool:
        """A one-stage pipeline that pulls from no peer: it plans and prefills alone."""
        return self.last and self.server.spec.is_first and peer_named(self.server, p) is None

    def _at_once(self, p: pb.Plan) -> pb.StageResult:
        """A one-stage pipeline's first step: lane, exact result, plan, prefill and
        answer in one trip to the loop, and the request's last call gives its lane back
        in it too (a trip costs a short request 0.1-0.2 ms; three were half of the
        stage's own time on a warm hit)."""
        tokens = list(p.tokens)
        self._new_sampler(p.sampling)  # a grammar compiles here, not on the loop
        out = self._begin(tokens, p.probe, p.namespace, partial(self._at_once_here, tokens, p))
        if self.lane is None:
            self._lane_freed()
        elif out.WhichOneof("result") == "token" and out.token.HasField("plan"):
            self._start_decoding()
        return out

    def _at_once_here(self, tokens: list[int], p: pb.Plan) -> pb.StageResult:
        logits, start = self._plan_here(tokens, p, True)
        if logits is not None:  # an exact repeat: its first token, nothing computed
            out = pb.StageResult(token=self._sample(logits, len(tokens)))
            if self.ending:
                self._give_back_lane()
            return out
        sent = pb.Prefill(tokens=p.tokens, start=start, sampling=p.sampling, probe=p.probe,
                          namespace=p.namespace)
        out = self.loop.compute("prefill", self._restore_and_prefill, tokens,
                                torch.tensor(tokens[start:], dtype=torch.long), start,
                                rows=len(tokens) - start,
                                then=partial(self._answer, tokens, sent))
        if out.WhichOneof("result") == "token":
            out.token.plan.CopyFrom(plan_reply(self.server.runtime, start, None))
        return out

    def _plan_here(self, tokens: list[int], p: pb.Plan, alone: bool):
        """On the loop thread, the lane held: (the exact result's logits, None) where the
        last stage keeps them, else (None, the plan's start if `alone`, else None)."""
        if self.last and p.results and p.HasField("sampling"):
            if (logits := self.cache.cached_result(tokens, self.scope)) is not None:
                return logits, None
        return None, self.cache.plan(self.lane, tokens, p.limit, None, self.scope) \
            if alone else None
