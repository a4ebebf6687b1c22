"""One request's life at one stage: its lane, its link downstream, its sampler.

The stream's calls (proto/stage.proto):

    plan     -> ask downstream where it starts (d), plan our own start, answer it; the
                last stage may answer an exact repeat of the prompt with its first token;
                with `prefill` set, the prefill below follows at once (one round trip)
    prefill  -> restore, prefill, send rows [d, n) down; the last stage samples
    decode   -> one row, sent down; the last stage samples, and answers a step sent
                with `reply_to` on the driver's reply stream (mesh/stage/replies.py)

A replayed prefill or decode (a request rebuilt after a fault) recomputes its rows exactly
as they were made, and the last stage samples nothing. The lane is taken at the first
call and freed by `close`, so a client that goes away frees every lane down the chain;
a call marked `last` (the request's final token) closes the session before it answers,
which saves the driver a close's round trip.
Errors are replies (topology/errors.py): `invalid` with the `param` at fault (a
RequestError: never retried), `busy` when no lane came free, `retryable` when a link or
this stage failed (the driver rebuilds the request). Any other exception is ours: logged
with its traceback under a new error id, which the reply carries to the gateway.

A traced call (it carries a `traceparent`, mesh/tracing.py) is one span here, under the
caller's; calls sent down carry it. A step that serves several requests is one span per
request, with the step's row count (`skippy.batch`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

import torch

from skippy.proto import stage_pb2 as pb
from skippy.stages.runtime import StageError
from skippy.topology.errors import RequestError, log_ours, new_error_id, one_line

from .. import tracing
from ..sampler import Sampler
from ..wire import decode_onward, frame_from_proto, frame_to_proto, sampling_from_proto, \
    token_to_proto
from .first_step import FirstStep
from .loop import Row
from .pooling import pooled
from .verify import propose_after_prefill, step_answer

log = logging.getLogger(__name__)

LANE_WAIT_S = 30  # how long a request waits for a lane before it is told "busy"


class LinkDown(Exception):
    """The next stage could not be reached (the request is rebuilt)."""


class Busy(Exception):
    """No lane came free in time."""


class _NoLane(StageError):
    pass  # none free now: the session waits for one


class StageSession(FirstStep):
    def __init__(self, server):
        self.server, self.loop, self.cache = server, server.loop, server.cache
        self.last = server.spec.is_last
        self.lane: int | None = None
        self.down = None                     # the link to the next stage, once opened
        self.sampler: Sampler | None = None  # the last stage's
        self.want_logits = False
        self.nextn = None  # the last stage's proposer, where this request runs it
        self.probe, self.scope = False, None  # the request's, chosen at its first call
        self.reply_to = ""  # the driver's reply stream its decode steps named, if any
        self.downstream_start: int | None = None
        self.decoding = False
        self.ending = False  # the call being handled is the request's last
        self.closed = False
        spec = server.spec
        self.trace_attributes = {"skippy.stage.index": spec.stage_index,
                                 "skippy.stage.layer_start": spec.layer_start,
                                 "skippy.stage.layer_end": spec.layer_end}
        self.span = tracing.OFF  # the traced call's span while it runs
        self.loop.opened(1)

    def handle(self, call: pb.StageCall) -> pb.StageResult | None:
        """The call's answer (None: answered on the driver's reply stream); a request's
        `last` call ends the session first (its lane kept warm), here and below."""
        try:
            result = self._handle_call(call)
        finally:
            if call.last:
                self.close()
        if call.WhichOneof("call") == "decode" and call.decode.reply_to:
            return self._direct(call.decode.reply_to, result)
        return result

    def _direct(self, reply_to: str, result: pb.StageResult | None) -> pb.StageResult | None:
        """The last stage answers on the reply stream; one before it, only a failure (and
        ends its call down: the stages below report that end, `close`)."""
        self.reply_to = reply_to
        if self.last:
            if result is not None:  # None: the loop thread sent it (`_decode`)
                self._reply(reply_to, result)
            return None
        if result is not None:
            self._close_down()
        return result

    def _reply(self, reply_to: str, result: pb.StageResult) -> None:
        if not self.server.replies.send(reply_to, result):
            log.info("a reply stream went before its answer (its driver ended it)")

    def _handle_call(self, call: pb.StageCall) -> pb.StageResult:
        kind = call.WhichOneof("call")
        self.ending = call.last
        if kind == "plan" and call.plan.prefill:
            if not call.traceparent and self._alone(call.plan):
                return self._handle("plan+prefill", call)
            return self._plan_and_prefill(call)
        if not call.traceparent:
            return self._handle(kind, call)
        with tracing.joined(call.traceparent, kind or "empty", self.trace_attributes) as span:
            self.span = span
            try:
                result = self._handle(kind, call)
            finally:
                self.span = tracing.OFF
            if result is not None and result.WhichOneof("result") == "error":
                span.fail(result.error.message)
            return result

    def _plan_and_prefill(self, call: pb.StageCall) -> pb.StageResult:
        """A plan that asks to prefill at once: the plan, then the prefill from its start,
        each handled (and traced) as its own call would be; the prefill's token carries
        the plan's reply."""
        plain = pb.StageCall()
        plain.CopyFrom(call)
        plain.plan.prefill = False  # the stages below get a plain plan, then frames
        plain.last = False
        reply = self._handle_call(plain)
        if reply.WhichOneof("result") != "plan":
            return reply  # an exact repeat's first token, or an error
        p = call.plan
        out = self._handle_call(pb.StageCall(
            traceparent=call.traceparent, last=call.last, prefill=pb.Prefill(
                tokens=p.tokens, start=reply.plan.start, sampling=p.sampling, probe=p.probe,
                namespace=p.namespace)))
        if out.WhichOneof("result") == "token":
            out.token.plan.CopyFrom(reply.plan)
        return out

    def _handle(self, kind: str | None, call: pb.StageCall) -> pb.StageResult:
        try:
            if kind == "plan":
                return self._plan(call.plan)
            if kind == "plan+prefill":
                return self._at_once(call.plan)
            if kind == "prefill":
                return self._prefill(call.prefill)
            if kind == "decode":
                return self._decode(call.decode)
            raise StageError("an empty call")  # the sender's bug: ours, not the request's
        except Busy as e:
            return pb.StageResult(error=pb.Error(message=str(e), busy=True))
        except RequestError as e:  # bad sampling settings, a row past the context
            return pb.StageResult(error=pb.Error(message=one_line(e), invalid=True,
                                                 param=e.param or ""))
        except LinkDown as e:
            self._close_down()
            return pb.StageResult(error=pb.Error(message=str(e), retryable=True))
        except Exception as e:  # ours, a builtin ValueError too: the request is rebuilt
            i, error_id = self.server.spec.stage_index, new_error_id()
            log_ours(log, e, error_id, f"stage {i} failed a {kind} call")
            return pb.StageResult(error=pb.Error(
                message=f"stage {i}: {type(e).__name__}: {one_line(e)}", retryable=True,
                error_id=error_id))

    def close(self) -> None:
        if self.closed:  # a last call ended it already
            return
        self.closed = True
        if self.last and self.reply_to and not self.ending:  # the driver may be waiting
            self.server.replies.fail(self.reply_to, "a stage before the last ended the "
                                     "request's session")
        if self.decoding:
            self.loop.decoding_changed(-1)
            self.decoding = False
        self._close_down()
        self.sampler = None  # and a constrained request's grammar state with it
        if self.lane is not None:
            self.loop.call(self._give_back_lane)
            self._lane_freed()
        self.loop.opened(-1)

    def _give_back_lane(self) -> None:
        """On the loop thread: the lane freed, its rows kept warm (a probe's are not)."""
        lane, self.lane = self.lane, None
        self.cache.free_lane(lane, keep_warm=not self.probe)

    def _lane_freed(self) -> None:
        with self.server.lane_freed:  # the next session waiting for a lane wakes
            self.server.lane_freed.notify_all()

    # -- calls ---------------------------------------------------------------------------
    def _prefill(self, p: pb.Prefill) -> pb.StageResult:
        tokens, start = list(p.tokens), p.start
        self._begin(tokens, p.probe, p.namespace)
        if self.server.spec.is_first:
            inputs = torch.tensor(tokens[start:], dtype=torch.long)
        else:
            # the rows' token ids travel in the message, not in the frame's bytes
            inputs = replace(frame_from_proto(p.frame),
                             tokens=torch.tensor(tokens[start:], dtype=torch.long))
            if inputs.start != start:
                raise StageError(f"frame starts at {inputs.start}, not {start}")
        if self.last:
            self._new_sampler(p.sampling)
        self.span.set_attribute("skippy.start", start)
        self.span.set_attribute("skippy.rows", len(tokens) - start)
        if p.replay:
            self.span.set_attribute("skippy.replay", True)
        embed = p.embed if self.last else ""
        answer = self.last and not embed
        out = self.loop.compute("prefill", tracing.carried(self._restore_and_prefill), tokens,
                                inputs, start, rows=len(tokens) - start,
                                logits="hidden" if embed else "last",
                                then=partial(self._answer, tokens, p) if answer else None)
        if embed:  # answered here: nothing is sampled nor decoded
            return pb.StageResult(embedding=pb.Embedding(values=pooled(out.hidden, embed)))
        if answer and self.lane is None:  # the request's last call: its lane given back
            self._lane_freed()
            return out
        self._start_decoding()
        if answer:
            return out
        sent = pb.Prefill(tokens=p.tokens, start=out.frame.start, sampling=p.sampling,
                          probe=p.probe, namespace=p.namespace, replay=p.replay,
                          embed=p.embed)
        sent.frame.CopyFrom(frame_to_proto(out.frame))
        reply = self._ask_down(pb.StageCall(prefill=sent))
        kind = reply.WhichOneof("result")
        if kind in ("token", "done"):  # prompt tokens no stage computed
            msg = getattr(reply, kind)
            msg.cached_tokens = min(msg.cached_tokens, start)
        return reply

    def _decode(self, d: pb.Decode) -> pb.StageResult:
        """One row, or a verify step: the row of `token` and one for each proposed token
        after it; the lane first cut back to `length` (a last step's rejected rows)."""
        if self.lane is None or not self.decoding:
            raise StageError("decode before prefill")
        rewind = partial(self.cache.rewind, self.lane, d.length) if d.HasField("length") \
            else None
        tokens = [d.token, *d.proposed]
        x = torch.tensor(tokens) if self.server.spec.is_first else frame_from_proto(d.frame)
        if not self.server.spec.is_first and self.cache.runtime.frames_need_tokens:
            x = replace(x, tokens=torch.tensor(tokens))  # only where a family reads them
        replay = d.replay
        # Where the last stage answers the driver, the step's answer goes on from the
        # loop thread as the step ends: no wait for this session's thread to wake (a
        # request's last call and replays go from here, after the session has ended).
        link = None if self.last else self._downstream()
        direct = bool(d.reply_to) and not self.ending and not replay and \
            (self.last or getattr(link, "sends_at_once", False))
        traceparent = tracing.traceparent() if direct else ""

        def finish(out):  # on the loop thread, this lane's rows alone
            self.cache.note_decoded(self.lane, tokens)
            if not self.last:
                if direct:
                    link.send(decode_onward(d, out.frame, row.step, row.batch, traceparent))
                    return None
                return out.frame
            if replay:
                return None
            answer = step_answer(self._sample, out, d, self.server.speculated, self.nextn,
                                 self.lane, self.cache.runtime.lane_length(self.lane))
            if direct:
                self._reply(d.reply_to, pb.StageResult(token=answer))
            return answer

        row = Row(self.lane, x, finish, (d.step, d.cohort) if d.cohort else None, rewind)
        out = self.loop.decode(row)
        for key, value in (("batch", row.batch), ("proposed", len(d.proposed)),
                           ("replay", replay), ("direct", bool(d.reply_to))):
            if value:
                self.span.set_attribute(f"skippy.{key}", value)
        if direct:  # sent on already
            return None
        if self.last:
            return pb.StageResult(done=pb.Done()) if replay else pb.StageResult(token=out)
        call = self._traced(decode_onward(d, out, row.step, row.batch))
        if d.reply_to:  # the last stage answers the driver: nothing comes back this way
            return self._downstream().send(call)
        return self._downstream().ask(call)

    # -- pieces --------------------------------------------------------------------------
    def _begin(self, tokens: list[int], probe: bool, namespace: str, then=None):
        """At the first call: the warm lane holding most of the prompt (a probe: a fresh
        one), waiting for one where the runtime has a fixed number; then `then()` in the
        same trip to the loop (its value is returned)."""
        if self.lane is not None:
            return None if then is None else self.loop.call(then)
        self.probe, self.scope = probe, self.cache.scope(namespace, probe)
        deadline = time.monotonic() + LANE_WAIT_S
        while True:
            try:
                return self.loop.call(self._take_lane, [] if probe else tokens, then)
            except _NoLane as e:
                if time.monotonic() > deadline:
                    raise Busy(str(e)) from e
                with self.server.lane_freed:  # the next session's close wakes this
                    self.server.lane_freed.wait(timeout=0.5)

    def _take_lane(self, tokens: list[int], then):
        try:
            self.lane = self.cache.alloc_lane(tokens, self.scope)
        except StageError as e:
            raise _NoLane(str(e)) from e
        return None if then is None else then()

    def _restore_and_prefill(self, tokens, inputs, start: int, logits: str = "last"):
        """On the loop thread. A planned restore cannot fail for lack of its entry (the
        plan pinned it); one that fails anyway (a corrupt block) is a stage fault."""
        restoring = tracing.OFF if not start else tracing.span(
            "restore", {**self.trace_attributes, "skippy.tokens": start})
        with restoring:
            if not self.cache.restore(self.lane, tokens, start, self.scope):
                raise RuntimeError(f"cached state for {start} tokens went away before the "
                                   f"prefill")
        return self.cache.prefill(self.lane, tokens, inputs, start, logits, self.scope,
                                  downstream=self.downstream_start if not self.last else None,
                                  between_chunks=self.loop.run_waiting_rows)

    def _answer(self, tokens: list[int], p: pb.Prefill, out) -> pb.StageResult:
        """The last stage's answer to a prefill, on the loop thread in the prefill's own
        trip there: the prompt's logits kept as its exact result, its first token; the
        request's last call gives its lane back here too (close then has no trip to
        make)."""
        self.cache.remember_result(tokens, out.logits, self.scope)
        if p.replay:
            result = pb.StageResult(done=pb.Done(cached_tokens=p.start))
        else:
            token = self._sample(out.logits, p.start)
            if self.nextn is not None:
                propose_after_prefill(self.nextn, self.lane, tokens, p.start, out, token,
                                      p.sampling.propose)
            result = pb.StageResult(token=token)
        if self.ending:  # the request's last call: its lane given back in this trip
            self._give_back_lane()
        return result

    def _new_sampler(self, sampling: pb.Sampling) -> None:
        params = sampling_from_proto(sampling)
        # the grammar compiles here, on the session's thread, not the stage loop's
        mask = None if params.constraint is None else \
            self.server.vocabulary.mask(params.constraint)
        self.sampler = Sampler(params, sampling.generated, mask)
        self.want_logits = sampling.logits
        self.nextn = getattr(self.server.runtime, "nextn", None) if sampling.propose else None

    def _sample(self, logits: torch.Tensor, cached_tokens: int = 0) -> pb.Token:
        if self.sampler is None:
            raise StageError("decode before prefill")
        token = self.sampler(logits)  # sets sampler.last (its log-probs) when asked for
        msg = token_to_proto(token, self.sampler.last, cached_tokens)
        if self.want_logits:
            msg.logits = logits.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return msg

    def _start_decoding(self) -> None:
        if not self.decoding:
            self.decoding = True
            self.loop.decoding_changed(1)

    def _ask_down(self, call: pb.StageCall) -> pb.StageResult:
        return self._downstream().ask(self._traced(call))

    def _traced(self, call: pb.StageCall) -> pb.StageCall:
        """A call to the next stage, under this call's span when it is traced; the
        request's last prefill or decode is the last there too."""
        call.traceparent = tracing.traceparent()
        call.last = self.ending and call.WhichOneof("call") != "plan"
        return call

    def _downstream(self):
        if self.down is None:
            self.down = self.server.open_downstream()
        return self.down

    def _close_down(self) -> None:
        if self.down is not None:
            down, self.down = self.down, None
            down.close()

