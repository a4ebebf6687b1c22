"""A stage over gRPC: the servicer, the server, and a stage's link to the next one.

A `Session` stream carries one request's life at this stage (mesh/stage/session.py), then,
where that request ended with its `last` call answered, the next request's (its sender
keeps the stream idle for it: channels.IdleLinks). Channels
carry keepalive pings (mesh/stage/channels.py), so a peer that vanished (a node lost) ends
its streams instead of leaving them hanging; message sizes are capped at the largest
message the model's stages exchange (`message_limit`). Every call carries the cluster's token and, between nodes,
runs over mutual TLS (mesh/stage/security.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures

import grpc

from skippy.cache.blocks import BLOCK_SIZE
from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model

from .channels import CLOSE_S, IdleLinks, channel_options, link_delay_s
from .security import SecretCheck, StageCredentials
from .server import StageServer
from .session import LinkDown

log = logging.getLogger(__name__)
MAX_SESSIONS = 64   # concurrent request streams a stage serves (each holds a thread)
# ... and as many drivers' reply streams (the last stage's), and the block fetches
MAX_RPCS = 2 * MAX_SESSIONS + 4
IDLE_S = 600.0      # a session silent this long is closed and its lane freed

HEADROOM = 1 << 20  # a message's fields besides rows and token ids (sampling, logit_bias)
_VALUE_BYTES = {"f32": 4, "f16": 2, "q8": 1}


def message_limit(model_path: str, n_ctx: int, wire_dtype: str) -> int:
    """The largest message a stage of this model sends or takes, in bytes: a prefill's
    frame of up to n_ctx rows (f16 and q8 rows carry an f32 scale) with the prompt's and
    the generated tokens' ids, a reply's logits row, or a cache block; plus headroom."""
    f = open_model(model_path, verify=False)
    try:
        cfg = ModelConfig.from_gguf(f)
    finally:
        f.close()
    n = min(n_ctx, cfg.context_length or n_ctx)
    row = cfg.frame_width * _VALUE_BYTES.get(wire_dtype, 4) + 4
    prefill = n * row + 2 * n * 5  # a token id is a varint of at most 5 bytes
    # gRPC's limits are int32: a longer prompt of a wider model does not fit one message
    return min(max(prefill, cfg.vocab * 4, BLOCK_SIZE) + HEADROOM, 2**31 - 1)


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, server: StageServer, here: str = ""):
        """`here`: this stage's address (the latency test hooks' delays follow it)."""
        self.server, self.here = server, here
        self.idle = _IdleWatch()

    def Session(self, calls, context):
        session = None
        watched = self.idle.watch(context)
        hop_s = link_delay_s(self.here, context.peer())  # the test hooks: each answer waits
        try:
            # read here, not on a reader thread of its own: a call's way in is one
            # thread hand-off shorter (the watch cancels a session that stays silent)
            for call in calls:
                watched.busy = True
                if session is None:
                    session = self.server.open_session()
                    watched.holding = True
                try:
                    result = session.handle(call)
                finally:
                    watched.seen()
                if result is not None:  # None: answered on the driver's reply stream
                    if hop_s:
                        time.sleep(hop_s)
                    yield result
                if call.last:  # the session ended with its answer; the stream may go on
                    session, watched.holding = None, False
        except grpc.RpcError:  # the client went, or the watch cancelled a silent one
            pass
        finally:
            self.idle.forget(watched)
            if session is not None:
                session.close()

    def Replies(self, request, context):
        replies, q = self.server.replies, queue.Queue()
        replies.open(request.id, q.put)
        context.add_callback(lambda: q.put(None))  # the driver went: so does the stream
        hop_s = link_delay_s(self.here, context.peer())
        try:
            yield pb.StageResult(done=pb.Done())  # registered: calls may name it now
            while (result := q.get()) is not None:
                if hop_s:
                    time.sleep(hop_s)
                yield result
        finally:
            replies.close(request.id, q.put)

    def GetBlocks(self, request, context):
        for h, data in self.server.blocks(request.hashes):
            yield pb.Block(hash=h, data=data)

    def Export(self, request, context):
        return pb.ExportReply(manifest=self.server.export(
            list(request.tokens), request.limit, request.after, request.namespace))


class _Watched:
    def __init__(self, context):
        self.context, self.busy = context, False
        self.holding = False  # a session is open: an idle stream between requests holds none
        self.last = time.monotonic()

    def seen(self) -> None:
        self.last, self.busy = time.monotonic(), False


class _IdleWatch:
    """Cancels a session whose client holds a lane and says nothing for IDLE_S: one
    thread for the server's sessions, started with the first."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sessions: set[_Watched] = set()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, context) -> _Watched:
        w = _Watched(context)
        with self._lock:
            self._sessions.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="session-idle-watch")
                self._thread.start()
        self._wake.set()  # IDLE_S may have changed (tests): the watch looks again
        return w

    def forget(self, w: _Watched) -> None:
        with self._lock:
            self._sessions.discard(w)

    def _run(self) -> None:
        while True:
            self._wake.wait(IDLE_S / 4)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                idle = [w for w in self._sessions
                        if w.holding and not w.busy and now - w.last > IDLE_S]
            for w in idle:
                log.info("a session idle for %.0f s is closed and its lane freed", IDLE_S)
                w.context.cancel()


class GrpcLink:
    """A request's stream to the next stage: send a call, read its answer. Once the
    request's `last` call is answered, `close` leaves the stream open in `idle` (where
    given) for the next request."""

    def __init__(self, stub: stage_pb2_grpc.StageStub, metadata=(),
                 idle: IdleLinks | None = None, hop_s: float = 0.0):
        """`hop_s`: the latency test hooks' delay, each call waits this long."""
        self._calls: queue.Queue = queue.Queue()
        self._replies = stub.Session(iter(self._calls.get, None), metadata=metadata)
        self._idle, self.ended = idle, False
        self._hop_s = hop_s
        # `send` only queues the call: a stage's loop thread may send on (the latency
        # test hooks' delay is slept by the sender, which must then be the session)
        self.sends_at_once = not hop_s

    def ask(self, call: pb.StageCall) -> pb.StageResult:
        self.send(call)
        try:
            reply = next(self._replies)
        except grpc.RpcError as e:
            raise LinkDown(f"the next stage is unreachable: {e.code().name}") from e
        except StopIteration as e:
            raise LinkDown("the next stage closed the stream") from e
        self.ended = call.last and reply.WhichOneof("result") != "error"
        return reply

    def send(self, call: pb.StageCall) -> None:
        """A call answered elsewhere (a decode step with `reply_to`): nothing to read."""
        if self._hop_s:
            time.sleep(self._hop_s)
        self._calls.put(call)

    def close(self) -> None:
        if self.ended and self._idle is not None:
            self.ended = False
            for link in self._idle.put(self):
                link.end()
            return
        self.end()

    def end(self) -> None:
        """End the stream: the next stage's session ends, and its own link with it."""
        ended = threading.Event()
        self._replies.add_done_callback(lambda _: ended.set())
        self._calls.put(None)
        ended.wait(CLOSE_S)
        self._replies.cancel()


class GrpcOpener:
    """Opens links over one channel to the next stage's `address`, an idle stream where
    one waits. A channel replaced by a newer one is closed by the garbage collector once
    the last stream on it ends: it drains."""

    def __init__(self, address: str, credentials: StageCredentials, max_message: int,
                 here: str = ""):
        """`here`: this stage's own address (the latency test hooks' delays follow it)."""
        channel = credentials.channel(address, channel_options(max_message))
        self._stub, self._metadata = stage_pb2_grpc.StageStub(channel), credentials.metadata
        self.idle = IdleLinks()
        self._hop_s = link_delay_s(here, address)

    def __call__(self) -> GrpcLink:
        link, stale = self.idle.take()
        for old in stale:
            old.end()
        return link if link is not None else GrpcLink(self._stub, self._metadata, self.idle,
                                                      self._hop_s)

    def close(self) -> None:
        """End the idle streams (the next stage moved, or this one is closing)."""
        for link in self.idle.drain():
            link.end()


def start_server(server: StageServer, host: str, credentials: StageCredentials,
                 max_message: int | None = None) -> tuple[grpc.Server, str]:
    """Serve `server` on host:<free port>; returns the gRPC server and its address.
    max_message: the stage's `message_limit` when the caller has it already."""
    spec = server.spec
    if max_message is None:
        max_message = message_limit(spec.model_path, spec.n_ctx, spec.wire_dtype)
    return serve(StageServicer(server, host), host, credentials, max_message=max_message)


def serve(servicer: stage_pb2_grpc.StageServicer, host: str, credentials: StageCredentials,
          *, max_message: int) -> tuple[grpc.Server, str]:
    """Any Stage servicer on host:<free port> (benchmarks serve a trivial one), taking
    calls that carry the credentials' token only, over TLS when they have certificates."""
    options = channel_options(max_message) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000)]
    rpc = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_RPCS),
                      interceptors=[SecretCheck(credentials.token)], options=options,
                      maximum_concurrent_rpcs=MAX_RPCS)
    stage_pb2_grpc.add_StageServicer_to_server(servicer, rpc)
    port = credentials.add_port(rpc, host)
    rpc.start()
    return rpc, f"{host}:{port}"
