"""One pipeline of stage actors on Ray, and the driver's gRPC link to its stage 0.

Repair makes the chain whole after a fault: it waits for Ray to restart dead actors,
re-creates one Ray has given up on, and tells each stage where the next one listens.
Only links whose address changed are replaced; a replaced channel closes once its
streams end, so other requests' sessions never see a repair.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import grpc
import ray
from ray.exceptions import ActorUnschedulableError, RayActorError

from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc

from ..stage.channels import CLOSE_S, channel_options
from ..stage.security import StageCredentials
from .driver import StageFault

log = logging.getLogger(__name__)

ACTOR_START_TIMEOUT = 900  # a stage loads its weights within this
DRAIN_S = 600              # a replaced channel closes when its streams end, or after this
REPLY_TIMEOUT_S = 900.0    # the longest a stage chain may take to answer (a long prefill)


class GrpcStageLink:
    """The driver's session with stage 0 over a grpc.aio stream."""

    def __init__(self, stub: stage_pb2_grpc.StageStub, metadata=()):
        self._call = stub.Session(metadata=metadata)

    async def ask(self, call: pb.StageCall) -> pb.StageResult:
        try:
            await self._call.write(call)
            reply = await asyncio.wait_for(self._call.read(), REPLY_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise StageFault(f"stage 0 is unreachable: {e.code().name}") from e
        except asyncio.TimeoutError as e:
            raise StageFault(f"no reply from the stages in {REPLY_TIMEOUT_S:.0f} s") from e
        if reply is grpc.aio.EOF:
            raise StageFault("stage 0 closed the stream")
        return reply

    async def close(self) -> None:
        """Ends the session and waits (CLOSE_S at most) until stage 0 has ended it, and
        through it every stage: their lanes are then warm for the request's follow-up."""
        try:
            await self._call.done_writing()
            await asyncio.wait_for(self._call.code(), CLOSE_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            pass
        finally:
            self._call.cancel()


class RayPipeline:
    def __init__(self, make_actor: Callable[[int], object], n_stages: int, *,
                 credentials: StageCredentials, max_message: int):
        """`credentials` are the driver's own for its calls to stage 0."""
        self._make = make_actor
        self._credentials = credentials
        self._options = channel_options(max_message)
        self.actors = [make_actor(i) for i in range(n_stages)]
        self.addresses: list[str] = []
        self.generation = 0
        self.healthy = False
        self.recreated = 0
        self._lock = threading.Lock()
        self._channels: dict[int, tuple[str, object, stage_pb2_grpc.StageStub]] = {}

    def wire(self) -> list[str]:
        """Every stage's address (waiting for restarts), each told the next one's."""
        addresses = [self._address(i) for i in range(len(self.actors))]
        ray.get([a.connect.remote(addresses[i + 1] if i + 1 < len(addresses) else None)
                 for i, a in enumerate(self.actors)], timeout=60)
        self.addresses = addresses
        self.healthy = True
        return addresses

    def _address(self, i: int) -> str:
        try:
            return ray.get(self.actors[i].address.remote(), timeout=ACTOR_START_TIMEOUT)
        # Ray gave up restarting it, or cannot restart it where it was (its node is
        # lost): a new actor, placed anew
        except (RayActorError, ActorUnschedulableError) as e:
            log.warning("stage %d is gone for good (%s); creating it again", i, e)
            self.actors[i] = self._make(i)
            self.recreated += 1
            return ray.get(self.actors[i].address.remote(), timeout=ACTOR_START_TIMEOUT)

    async def repair(self, generation: int) -> None:
        await asyncio.to_thread(self._repair, generation)

    def _repair(self, generation: int) -> None:
        with self._lock:
            if self.generation != generation:
                return  # another request's repair already made the chain whole
            self.healthy = False
            try:
                self.wire()
            except Exception as e:
                log.error("pipeline repair failed: %s", e)
            finally:
                self.generation += 1

    async def open(self) -> GrpcStageLink:
        """A session with stage 0 over this event loop's channel (grpc.aio binds one)."""
        if not self.healthy:
            raise StageFault("the pipeline is being repaired")
        loop = asyncio.get_running_loop()
        address = self.addresses[0]
        entry = self._channels.get(id(loop))
        if entry is None or entry[0] != address:
            channel = self._credentials.channel(address, self._options, aio=True)
            if entry is not None:  # drain the replaced channel, then close it
                asyncio.ensure_future(entry[1].close(grace=DRAIN_S))
            entry = self._channels[id(loop)] = (address, channel,
                                                stage_pb2_grpc.StageStub(channel))
        return GrpcStageLink(entry[2], self._credentials.metadata)

    async def close(self) -> None:
        for _, channel, _ in self._channels.values():
            try:
                await channel.close()
            except Exception:  # its event loop may be gone already
                pass
        self._channels.clear()
        try:  # free their blocks in the nodes' stores, then end them
            await asyncio.wait_for(asyncio.gather(*(a.close.remote() for a in self.actors)),
                                   timeout=10)
        except Exception as e:  # a dead or hung stage: its blocks are swept later
            log.warning("a stage did not close cleanly: %s", e)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
