"""Between two stages on one node: the session stream over a Unix socket instead of gRPC.

A decode row's hop over gRPC on loopback wakes five threads in two processes (the sender's
request-iterator thread, the receiver's poller and handler, then its loop) and costs
~0.9 ms on this project's 2-core test machine; over a socket of the kernel's own, the
sender's loop thread writes the message itself and the receiver's session thread reads it:
two wake-ups. The messages, the session's life and its errors are the gRPC stream's
(`StageServicer.Session` serves both); only the transport differs.

The socket lives in the network namespace's abstract space, named after the stage's gRPC
address: a stage whose next one listens in the same namespace finds it there, one on
another node (or a test's other "host") does not and stays on gRPC. The abstract space
has no file modes, so a connection is served only when its peer is this user (the
kernel's SO_PEERCRED) and its first message carries the cluster token.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator

from skippy.proto import stage_pb2 as pb

from .channels import CLOSE_S, IdleLinks
from .session import LinkDown

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
# A connection's first message: its kind, then the cluster token
SESSION, REPLIES = b"S", b"R"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_name(address: str) -> bytes:
    """The abstract socket of the stage serving gRPC at `address` (host:port)."""
    return b"\0skippy-stage/" + address.encode()


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(LENGTH.pack(len(payload)) + payload)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None where the peer closed first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            return None
        got += k
    return bytes(buf)


def _receive(sock: socket.socket) -> bytes | None:
    head = _read_exact(sock, LENGTH.size)
    return None if head is None else _read_exact(sock, LENGTH.unpack(head)[0])


class LocalListener:
    """Serves `servicer`'s session streams on the abstract socket of `address`, a thread
    a connection (at most `limit` at once, as the gRPC server's own cap)."""

    def __init__(self, servicer, address: str, token: str, limit: int):
        self.servicer, self.address = servicer, address
        self._token = token.encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(socket_name(address))
        self._sock.listen(limit)
        self._open = threading.BoundedSemaphore(limit)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True,
                                           name="local-accept")
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._open.acquire(blocking=False):
                conn.close()  # as many sessions as the stage serves: the caller uses gRPC
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="local-session").start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            kind = self._admitted(conn)
            if kind is not None:
                with self._lock:
                    self.servicer.server.local_streams += 1
            if kind == SESSION:
                stream = self.servicer.Session(_calls(conn), _Context(conn, self.address))
                with contextlib.closing(stream):  # its session closes, the caller gone too
                    for result in stream:
                        _send(conn, result.SerializeToString())
            elif kind == REPLIES:
                self._replies(conn)
        except OSError:
            pass  # the caller went
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._open.release()

    def _replies(self, conn: socket.socket) -> None:
        """A driver's reply stream: the loop thread writes each answer to the socket as
        its step ends (no thread between); the stream lasts until the driver closes it."""
        stream_id, lock = (_receive(conn) or b"").decode(), threading.Lock()

        def sink(result: pb.StageResult) -> None:
            with lock:
                _send(conn, result.SerializeToString())
        replies = self.servicer.server.replies
        replies.open(stream_id, sink)
        try:
            _send(conn, b"ok")  # registered: calls may name it now
            while conn.recv(1 << 10):
                pass
        finally:
            replies.close(stream_id, sink)

    def _admitted(self, conn: socket.socket) -> bytes | None:
        """The stream's kind where the caller is this user with the cluster's token."""
        _pid, uid, _gid = _CRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        hello = _receive(conn) or b""
        kind, token = hello[:1], hello[1:]
        if uid != os.getuid() or not hmac.compare_digest(token, self._token):
            log.warning("a local connection without this cluster's token (uid %d) refused",
                        uid)
            return None
        if kind == SESSION:
            _send(conn, b"ok")
        return kind

    def close(self) -> None:
        """Stop taking connections and end the open ones (their sessions close)."""
        _shut(self._sock)  # wakes the accept: the name is free once it has returned
        self._accepting.join(5)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shut(conn)


def _calls(conn: socket.socket) -> Iterator[pb.StageCall]:
    while (payload := _receive(conn)) is not None:
        yield pb.StageCall.FromString(payload)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Context:
    """What the servicer asks of a gRPC context: who called (a process on this node:
    the latency test hooks give it no delay), and how to cut it off."""

    def __init__(self, conn: socket.socket, here: str):
        self._conn, self._here = conn, here

    def peer(self) -> str:
        return self._here

    def cancel(self) -> None:
        _shut(self._conn)


class LocalLink:
    """A request's stream to the next stage over its socket, with GrpcLink's calls: the
    sender's own thread writes each message (no thread of the link's own)."""

    def __init__(self, sock: socket.socket, idle: IdleLinks | None = None):
        self._sock, self._idle, self.ended = sock, idle, False
        self._lock = threading.Lock()  # a loop thread's send and the session's ask
        self.sends_at_once = True

    def ask(self, call: pb.StageCall) -> pb.StageResult:
        self.send(call)
        try:
            payload = _receive(self._sock)
        except OSError as e:
            raise LinkDown(f"the next stage is unreachable: {e}") from e
        if payload is None:
            raise LinkDown("the next stage closed the stream")
        reply = pb.StageResult.FromString(payload)
        self.ended = call.last and reply.WhichOneof("result") != "error"
        return reply

    def send(self, call: pb.StageCall) -> None:
        try:
            with self._lock:
                _send(self._sock, call.SerializeToString())
        except OSError as e:
            raise LinkDown(f"the next stage is unreachable: {e}") from e

    def close(self) -> None:
        if self.ended and self._idle is not None:
            self.ended = False
            for link in self._idle.put(self):
                link.end()
            return
        self.end()

    def end(self) -> None:
        """End the stream; the next stage's session ends (and its link down with it)
        before its side closes, which this waits for as GrpcLink.end does."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
            self._sock.settimeout(CLOSE_S)
            while self._sock.recv(1 << 16):
                pass  # answers nobody reads (a failed step sent on): the close follows
        except OSError:
            pass
        self._sock.close()


class LocalOpener:
    """Opens links to the stage serving gRPC at `address`, over its socket in this
    namespace; `LocalOpener.reaching` says whether there is one."""

    def __init__(self, address: str, token: str):
        self._name, self._token = socket_name(address), token.encode()
        self.idle = IdleLinks()

    @classmethod
    def reaching(cls, address: str, token: str) -> LocalOpener | None:
        """An opener where the stage at `address` answers on a socket here, else None."""
        opener = cls(address, token)
        try:
            opener().end()
        except (OSError, LinkDown):
            return None
        return opener

    def __call__(self) -> LocalLink:
        link, stale = self.idle.take()
        for old in stale:
            old.end()
        return link if link is not None else LocalLink(self._connect(), self.idle)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._name)
            _send(sock, SESSION + self._token)
            if _receive(sock) != b"ok":
                raise LinkDown("the next stage refused this cluster's token")
        except OSError as e:
            sock.close()
            raise LinkDown(f"the next stage is unreachable: {e}") from e
        except LinkDown:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        for link in self.idle.drain():
            link.end()
