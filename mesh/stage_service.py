"""One stage served over gRPC: the data plane of a stage actor (proto/stage.proto).

A `Session` stream is one request's life at this stage. Its lane is taken when the
stream opens and freed when it closes, so a client that goes away frees every lane
down the chain. A non-final stage opens its own stream to the next stage for the same
request and passes the last stage's answers back up:

    plan     -> ask downstream where it starts (d), plan our own start, answer it
    prefill  -> restore, prefill, send rows [d, n) down; the last stage samples
    decode   -> one row, sent down; the last stage samples

Runtime work is serial per stage (one turn at a time); different stages work on
different requests at the same time, so a 2-stage chain pipelines concurrent requests.
Decode rows that arrive while the stage is busy run together in one runtime call; a long
prefill runs them between its chunks, so one long prompt never stalls other streams.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import torch

from skippy.cache.blocks import BlockError
from skippy.cache.config import CacheConfig
from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc
from skippy.stages.factory import make_runtime
from skippy.stages.runtime import StageError, StageSpec
from skippy.stages.stage_cache import StageCache

from .sampler import Sampler
from .wire import frame_from_proto, frame_to_proto, sampling_from_proto, token_to_proto

log = logging.getLogger(__name__)

MAX_SESSIONS = 64  # concurrent request streams a stage serves (each holds a thread)
LANE_WAIT_S = 120  # how long a request waits for a lane before it is told "busy"
# How long a free stage waits for the other decoding sessions' rows to join a batch.
# Without it, rows settle into groups that take turns (each group's next rows arrive
# while the other group runs) and a lane batch of 8 runs half-empty.
GATHER_S = 0.003


class Downstream:
    """This request's stream to the next stage: send a call, read its answer."""

    def __init__(self, stub: stage_pb2_grpc.StageStub):
        self._calls: queue.Queue = queue.Queue()
        self._replies = stub.Session(iter(self._calls.get, None))

    def ask(self, call: pb.StageCall) -> pb.StageResult:
        self._calls.put(call)
        return next(self._replies)

    def close(self) -> None:
        self._calls.put(None)
        self._replies.cancel()


@dataclass
class _Step:
    """One session's decode row, possibly run by another session's thread."""
    lane: int
    x: object
    token: int
    sampler: Sampler | None = None  # the last stage's: the row's output is then a Token
    done: bool = False
    out: object = None
    error: BaseException | None = None


@dataclass
class _Timing:
    """Seconds spent in this stage's compute, by step kind (for /metrics)."""
    seconds: dict = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    count: dict = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    rows: int = 0  # decode rows: rows / count["decode"] is the mean batch

    def add(self, kind: str, dt: float) -> None:
        self.seconds[kind] += dt
        self.count[kind] += 1


class _ComputeThread:
    """One thread for every torch call of a stage: loading, prefill, decode, sampling.

    OpenMP keeps a team of worker threads for each thread that starts parallel work, and
    gRPC runs sessions on pool threads: the stage loaded on one thread and computed on
    others, and the teams fought over the cores. Measured on SmolLM2 int4, one stage
    behind the gateway: a decode step took 22.6 ms in the actor against 12.7 ms when one
    thread does everything; on this thread, 13.9 ms (14.6 ms a token over HTTP, was 23;
    8 clients 72 tokens/s, was 47)."""

    def __init__(self):
        self._pool = futures.ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="stage-compute")
        self._ident = self._pool.submit(threading.get_ident).result()

    def run(self, fn, *args, **kwargs):
        if threading.get_ident() == self._ident:  # already here (a prefill's between_chunks)
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()


class StageService(stage_pb2_grpc.StageServicer):
    def __init__(self, spec: StageSpec, cache: CacheConfig, policy: str, runtime: str = "torch",
                 *, burst_threads: int | None = None):
        self._compute = _ComputeThread()
        if spec.threads:
            self._compute.run(torch.set_num_threads, spec.threads)
        self.spec = spec
        self.runtime = self._compute.run(make_runtime, spec, runtime)
        # Stages sharing a node take one share of its cores each, as they all compute at
        # once under concurrent requests. One session alone keeps them computing in turn:
        # each may then take `burst_threads` (its pipeline's cores on the node), where
        # the runtime's bits do not depend on the thread count.
        self._threads = spec.threads
        self._burst = burst_threads if (spec.threads and burst_threads and
                                        burst_threads > spec.threads and
                                        self.runtime.thread_invariant) else None
        self.cache = StageCache(self.runtime, cache, policy=policy)
        self.is_last = spec.is_last
        self._cv = threading.Condition()  # guards _busy and _pending; wakes waiters
        self._busy = False                 # someone holds the stage's turn
        self._pending: list[_Step] = []    # decode rows waiting for the stage
        self._decoding = 0                 # sessions past their prefill: rows to expect
        self._free_at = 0.0                # when the last turn ended
        self._next: stage_pb2_grpc.StageStub | None = None
        self._channel: grpc.Channel | None = None
        self.timing = _Timing()
        self.sessions = 0

    def connect(self, address: str | None) -> None:
        """Where the next stage listens (None for the last stage)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = self._next = None
        if address:
            self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._next = stage_pb2_grpc.StageStub(self._channel)

    # -- the data plane ----------------------------------------------------------------------
    def Session(self, calls, context):
        lane, down, sampler, probe, decoding = None, None, None, False, False
        planned: dict[str, int | None] = {"downstream": None}
        self.sessions += 1
        try:
            for call in calls:
                kind = call.WhichOneof("call")
                try:
                    if lane is None:
                        # the warm lane holding most of the prompt (a probe: a fresh one);
                        # a call of another kind reads as an empty Prefill here
                        first = call.plan if kind == "plan" else call.prefill
                        probe = first.probe
                        lane = self._alloc_lane([] if probe else list(first.tokens),
                                                first.namespace)
                    if not self.is_last and down is None:
                        if self._next is None:
                            raise StageError(f"stage {self.spec.stage_index} has no next stage")
                        down = Downstream(self._next)
                    if kind == "plan":
                        yield self._plan(call.plan, lane, down, planned)
                    elif kind == "prefill":
                        p = call.prefill
                        if self.is_last:
                            sampler = Sampler(sampling_from_proto(p.sampling),
                                              p.sampling.generated)
                        reply = self._prefill(p, lane, down, sampler, planned)
                        if not decoding and reply.WhichOneof("result") != "error":
                            decoding = True
                            with self._cv:
                                self._decoding += 1
                        yield reply
                    elif kind == "decode":
                        yield self._decode(call.decode, lane, down, sampler)
                    else:
                        yield _error("empty call")
                except _Busy as e:
                    yield pb.StageResult(error=pb.Error(message=str(e), busy=True))
                except (StageError, ValueError) as e:
                    yield _error(str(e))
                except grpc.RpcError as e:
                    yield _error(f"stage {self.spec.stage_index + 1} is unreachable: "
                                 f"{e.code().name}", retryable=True)
                    down = None
        finally:
            self.sessions -= 1
            if decoding:
                with self._cv:
                    self._decoding -= 1
                    self._cv.notify_all()  # a gathering row may now have all it expects
            if down is not None:
                down.close()
            if lane is not None:
                with self._turn():
                    self._compute.run(self.cache.free_lane, lane, keep_warm=not probe)

    @contextmanager
    def _turn(self):
        """The stage's one turn: runtime and cache calls are serial."""
        with self._cv:
            self._cv.wait_for(lambda: not self._busy)
            self._busy = True
        try:
            yield
        finally:
            self._end_turn()

    def _end_turn(self) -> None:
        with self._cv:
            self._busy = False
            self._free_at = time.monotonic()
            self._cv.notify_all()

    def _alloc_lane(self, tokens: list[int], namespace: str) -> int:
        """A lane, waiting for one to come free where the runtime has a fixed number."""
        deadline = time.monotonic() + LANE_WAIT_S
        while True:
            with self._turn():
                try:
                    return self._compute.run(self.cache.alloc_lane, tokens, namespace)
                except StageError as e:
                    error = e
            if time.monotonic() > deadline:
                raise _Busy(str(error)) from error
            with self._cv:  # every turn's end (a freed lane among them) wakes this
                self._cv.wait(timeout=1.0)

    def _plan(self, plan: pb.Plan, lane: int, down: Downstream | None, planned) -> pb.StageResult:
        d = None
        if down is not None:
            reply = down.ask(pb.StageCall(plan=plan))
            if reply.WhichOneof("result") != "plan":
                return reply
            d = reply.plan.start
        with self._turn():
            start = self._compute.run(self.cache.plan, lane, list(plan.tokens), plan.limit, d,
                                      probe=plan.probe, namespace=plan.namespace)
        planned["downstream"] = d
        return pb.StageResult(plan=pb.PlanReply(start=start))

    def _prefill(self, p: pb.Prefill, lane: int, down: Downstream | None, sampler,
                 planned) -> pb.StageResult:
        tokens, start = list(p.tokens), p.start
        if self.spec.is_first:
            inputs = torch.tensor(tokens[start:], dtype=torch.long)
        else:
            inputs = frame_from_proto(p.frame)
            if inputs.start != start:
                raise StageError(f"frame starts at {inputs.start}, not {start}")

        def restore_and_prefill():  # on the compute thread; the last stage samples there
            self._fit_threads()
            if not self.cache.restore(lane, tokens, start, namespace=p.namespace):
                return None
            out = self.cache.prefill(lane, tokens, inputs, start, probe=p.probe,
                                     namespace=p.namespace,
                                     downstream=planned["downstream"] if down else None,
                                     between_chunks=self._run_waiting_rows)
            return out if down else _token(sampler, out.logits, cached_tokens=start)

        t = time.perf_counter()
        with self._turn():
            out = self._compute.run(restore_and_prefill)
        if out is None:
            return _error("cached state went away before the prefill", retryable=True)
        self.timing.add("prefill", time.perf_counter() - t)
        if down is None:
            return pb.StageResult(token=out)
        sent = pb.Prefill(tokens=p.tokens, start=out.frame.start, sampling=p.sampling,
                          probe=p.probe, namespace=p.namespace, max_tokens=p.max_tokens)
        sent.frame.CopyFrom(frame_to_proto(out.frame))
        reply = down.ask(pb.StageCall(prefill=sent))
        if reply.WhichOneof("result") == "token":  # tokens no stage computed
            reply.token.cached_tokens = min(reply.token.cached_tokens, start)
        return reply

    def _decode(self, d: pb.Decode, lane: int, down: Downstream | None,
                sampler) -> pb.StageResult:
        x = torch.tensor(d.token) if self.spec.is_first else frame_from_proto(d.frame)
        if down is None and sampler is None:
            raise StageError("decode before prefill")
        out = self._decode_together(_Step(lane, x, d.token, sampler if down is None else None))
        if down is None:
            return pb.StageResult(token=out)
        sent = pb.Decode(token=d.token)
        sent.frame.CopyFrom(frame_to_proto(out.frame))
        return down.ask(pb.StageCall(decode=sent))

    def _decode_together(self, step: _Step):
        """One decode row for this lane, run in one runtime call with every other
        session's row that is waiting at the same moment: whoever takes the stage's turn
        runs all pending rows, and a prefill runs them between its chunks (the runtime
        pads to its fixed lane batch, so a lane's arithmetic never depends on who else is
        decoding)."""
        with self._cv:
            self._pending.append(step)
            self._cv.notify_all()  # a row gathering its batch may have waited for this one
            while not step.done:
                if not self._busy:
                    wait = self._free_at + GATHER_S - time.monotonic()
                    if len(self._pending) >= self._decoding or wait <= 0:
                        break
                    self._cv.wait(timeout=wait)
                else:
                    self._cv.wait()
            mine = not step.done
            if mine:
                self._busy = True  # this row's session takes the turn
        if mine:
            try:
                self._run_waiting_rows()  # every pending row, this one among them
            finally:
                self._end_turn()
        if step.error is not None:
            raise step.error
        return step.out

    def _run_waiting_rows(self) -> None:
        """The caller holds the turn (a decode row's session, or a prefill between its
        chunks): run the decode rows waiting now and wake their sessions."""
        with self._cv:
            batch, self._pending = self._pending, []
        if batch:
            self._run_rows(batch)
            with self._cv:
                self._cv.notify_all()

    def _run_rows(self, batch: list[_Step]) -> None:
        """One runtime decode call for the rows; each row learns its output (the last
        stage: its sampled Token) or the error."""
        t = time.perf_counter()
        try:
            self._compute.run(self._decode_rows, batch)
        except Exception as e:  # every row of the batch learns it
            for s in batch:
                s.error = e
        finally:
            for s in batch:
                s.done = True
        self.timing.add("decode", time.perf_counter() - t)
        self.timing.rows += len(batch)

    def _fit_threads(self) -> None:
        """On the compute thread, before a prefill or decode call: the burst while this
        stage serves one session, its share otherwise."""
        if self._burst:
            n = self._burst if self.sessions <= 1 else self.spec.threads
            if n != self._threads:
                torch.set_num_threads(n)
                self._threads = n

    def _decode_rows(self, batch: list[_Step]) -> None:
        self._fit_threads()
        outs = self.runtime.decode([(s.lane, s.x) for s in batch])
        for s, out in zip(batch, outs):
            s.out = out if s.sampler is None else _token(s.sampler, out.logits)
            self.cache.note_decoded(s.lane, s.token)

    def GetBlocks(self, request, context):
        store = self.cache.store
        for h in request.hashes:
            data = b""
            if store is not None:
                try:
                    data = store.get(h)
                except BlockError:  # absent or corrupt here: the asker recomputes
                    data = b""
            yield pb.Block(hash=h, data=data)

    # -- control plane (called through the Ray actor) ------------------------------------------
    def stats(self) -> dict:
        s = self.cache.stats()
        s["stage_index"] = self.spec.stage_index
        s["layers"] = [self.spec.layer_start, self.spec.layer_end]
        s["seconds"] = dict(self.timing.seconds)
        s["steps"] = dict(self.timing.count)
        s["decode_rows"] = self.timing.rows
        s["sessions"] = self.sessions
        return s


_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20),
                    ("grpc.max_receive_message_length", 256 << 20)]


class _Busy(Exception):
    """No lane came free in time."""


def _token(sampler: Sampler, logits, cached_tokens: int = 0) -> pb.Token:
    token = sampler(logits)  # sets sampler.last (its log-probs) when they were asked for
    return token_to_proto(token, sampler.last, cached_tokens)


def _error(message: str, retryable: bool = False) -> pb.StageResult:
    return pb.StageResult(error=pb.Error(message=message, retryable=retryable))


def start_server(service: StageService, host: str) -> tuple[grpc.Server, str]:
    """Serve `service` on host:<free port>; returns the server and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_SESSIONS + 4),
                         options=_CHANNEL_OPTIONS)
    stage_pb2_grpc.add_StageServicer_to_server(service, server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, f"{host}:{port}"
