"""The driver's session with a pipeline's stage 0, and its reply stream at the last stage:
over grpc.aio (`GrpcStageLink`), or, where the stages listen on this node, over their
Unix sockets (`LocalStageLink`, mesh/stage/local_link.py): a step's way in and its
answer's way home without gRPC's threads. Both carry the same messages with the same
meaning; only the transport differs.
"""

from __future__ import annotations

import asyncio
import socket
import uuid

import grpc
from grpc._cython import cygrpc

from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc

from ..stage.channels import CLOSE_S, IdleLinks, hop_delay_s
from ..stage.local_link import LENGTH, REPLIES, SESSION, socket_name
from .driver import StageFault

REPLY_TIMEOUT_S = 900.0    # the longest a stage chain may take to answer (a long prefill)


class GrpcStageLink:
    """The driver's session with stage 0 over a grpc.aio stream, and, where the pipeline
    has more stages, its reply stream at the last one (`reply_id`: decode steps sent with
    it as `reply_to` are answered there, not back through every stage)."""

    EOF = grpc.aio.EOF
    FAULTS: tuple[type[BaseException], ...] = (grpc.aio.AioRpcError,)

    def __init__(self, stub: stage_pb2_grpc.StageStub, metadata=(),
                 idle: IdleLinks | None = None,
                 last: stage_pb2_grpc.StageStub | None = None, hop_s: float | None = None):
        """`hop_s`: the latency test hooks' delay each call waits (None: the uniform
        hook's, hop_delay_s)."""
        self._call = stub.Session(metadata=metadata) if stub is not None else None
        self._idle, self.ended = idle, False
        self._last, self._metadata = last, metadata
        self.reply_id = uuid.uuid4().hex if last is not None else ""
        self._replies = None  # the reply stream, opened by the first direct step
        # reads left waiting by a direct step: stage 0 answers such a step only with an
        # error; the reply stream, only with the next step's answer
        self._pending: dict[str, asyncio.Task] = {}
        self._hop_s = hop_delay_s() if hop_s is None else hop_s

    @staticmethod
    def _why(e: BaseException) -> str:
        return e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e) or \
            type(e).__name__

    async def _write(self, call: pb.StageCall) -> None:
        if self._hop_s:
            await asyncio.sleep(self._hop_s)
        await self._call.write(call)

    async def _open_replies(self) -> None:
        self._replies = self._last.Replies(pb.ReplyTo(id=self.reply_id),
                                           metadata=self._metadata)
        await asyncio.wait_for(self._replies.read(), REPLY_TIMEOUT_S)  # registered

    async def ask(self, call: pb.StageCall) -> pb.StageResult:
        try:
            await self._write(call)
            reply = await asyncio.wait_for(self._read("stage 0"), REPLY_TIMEOUT_S)
        except self.FAULTS as e:
            raise StageFault(f"stage 0 is unreachable: {self._why(e)}") from e
        except asyncio.TimeoutError as e:
            raise StageFault(f"no reply from the stages in {REPLY_TIMEOUT_S:.0f} s") from e
        if reply is self.EOF:
            raise StageFault("stage 0 closed the stream")
        self.ended = call.last and reply.WhichOneof("result") != "error"
        return reply

    async def ask_direct(self, call: pb.StageCall) -> pb.StageResult:
        """A decode step sent with `reply_to`: its answer from the last stage, or an error
        stage 0 gave instead (any stage's failure reaches one of the two streams)."""
        try:
            if self._replies is None:
                await self._open_replies()
            await self._write(call)
            for name in ("stage 0", "last"):
                if name not in self._pending:
                    self._pending[name] = asyncio.ensure_future(self._stream(name).read())
            done, _ = await asyncio.wait(self._pending.values(), timeout=REPLY_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise asyncio.TimeoutError
            name = "last" if self._pending["last"] in done else "stage 0"
            reply = self._pending.pop(name).result()
        except self.FAULTS as e:
            raise StageFault(f"a stage is unreachable: {self._why(e)}") from e
        except asyncio.TimeoutError as e:
            raise StageFault(f"no reply from the stages in {REPLY_TIMEOUT_S:.0f} s") from e
        if reply is self.EOF:
            raise StageFault(f"the {name} stage closed its stream")
        if name == "stage 0" and reply.WhichOneof("result") != "error":
            raise StageFault(f"stage 0 answered a step the last stage answers: {reply}")
        return reply

    async def _read(self, name: str):
        """The next message of stage 0's stream or the reply stream (`name`), taking
        over a read a direct step left waiting."""
        pending = self._pending.pop(name, None)
        if pending is not None:
            return await pending
        return await self._stream(name).read()

    def _stream(self, name: str):
        return self._call if name == "stage 0" else self._replies

    async def close(self) -> None:
        """Ends the session. Where its last call was answered, every stage had ended it
        already (their lanes warm for a follow-up) and the stream waits in `idle` for the
        next request; else the stream ends (CLOSE_S at most for stage 0, and through it
        every stage, to end the session)."""
        if self.ended and self._idle is not None:
            self.ended = False
            for link in self._idle.put(self):
                await link.end()
            return
        await self.end()

    async def end(self) -> None:
        for task in self._pending.values():
            task.cancel()
        self._pending.clear()
        if self._replies is not None:
            self._replies.cancel()
        try:
            await self._call.done_writing()
            await asyncio.wait_for(self._call.code(), CLOSE_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError,
                cygrpc.BaseError):
            # A stream a dying stage broke may fail its close inside grpc (its own
            # ExecuteBatchError, not an AioRpcError): the session ends either way.
            pass
        finally:
            self._call.cancel()


class _Socket:
    """One of a local link's streams: length-prefixed StageResults, EOF at the end."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, name: bytes, *hello: bytes) -> _Socket:
        """A stream to the socket `name`, once the stage answered the `hello` messages
        (its kind and the cluster token first) with its "ok"."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(name)  # an abstract socket on this node: no wait to speak of
        except OSError:
            sock.close()
            raise
        stream = cls(*await asyncio.open_unix_connection(sock=sock))
        for message in hello:
            stream.send(message)
        if await stream.raw() != b"ok":
            stream.writer.close()
            raise ConnectionRefusedError("the stage refused this cluster's token")
        return stream

    def send(self, payload: bytes) -> None:
        self.writer.write(LENGTH.pack(len(payload)) + payload)

    async def raw(self) -> bytes | None:
        try:
            head = await self.reader.readexactly(LENGTH.size)
            return await self.reader.readexactly(LENGTH.unpack(head)[0])
        except asyncio.IncompleteReadError:
            return None

    async def read(self):
        payload = await self.raw()
        return LocalStageLink.EOF if payload is None else pb.StageResult.FromString(payload)

    def cancel(self) -> None:
        self.writer.close()


class LocalStageLink(GrpcStageLink):
    """The same session over the stages' sockets on this node (mesh/stage/local_link.py):
    the driver's event loop writes each call and reads each answer itself."""

    FAULTS = (OSError, EOFError)

    def __init__(self, first: _Socket, token: bytes, idle: IdleLinks | None = None,
                 last: bytes | None = None):
        """`first`: the open stream to stage 0; `last`: the last stage's socket name
        (None: stage 0 is the last)."""
        super().__init__(None, idle=idle, hop_s=0.0)
        self._call, self._token, self._last_name = first, token, last
        self.reply_id = uuid.uuid4().hex if last is not None else ""

    @classmethod
    async def open(cls, first: str, last: str | None, token: str,
                   idle: IdleLinks | None = None) -> LocalStageLink:
        """A session with the stage serving gRPC at `first` over its socket (OSError
        where none listens here); `last`: the last stage's gRPC address, if another."""
        key = token.encode()
        stream = await _Socket.open(socket_name(first), SESSION + key)
        return cls(stream, key, idle, None if last is None else socket_name(last))

    async def _write(self, call: pb.StageCall) -> None:
        self._call.send(call.SerializeToString())

    async def _open_replies(self) -> None:
        self._replies = await asyncio.wait_for(_Socket.open(
            self._last_name, REPLIES + self._token, self.reply_id.encode()), REPLY_TIMEOUT_S)

    async def end(self) -> None:
        for task in self._pending.values():
            task.cancel()
        self._pending.clear()
        if self._replies is not None:
            self._replies.cancel()
        try:
            self._call.writer.write_eof()
            while await asyncio.wait_for(self._call.raw(), CLOSE_S) is not None:
                pass  # answers nobody reads (a failed step sent on): the close follows
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            self._call.cancel()
