"""One pipeline of stage actors on Ray, and the driver's links to its stage 0 (over gRPC,
or the stages' sockets where they run on this node: mesh/control/stage_link.py).

Repair makes the chain whole after a fault: it waits for Ray to restart dead actors,
re-creates one Ray has given up on, and tells each stage where the next one listens.
Only links whose address changed are replaced; a replaced channel closes once its
streams end, so other requests' sessions never see a repair. A stream whose request ended
with its last call answered waits, idle, for the next request (channels.IdleLinks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnschedulableError, RayActorError

from skippy.proto import stage_pb2_grpc

from ..stage.channels import IdleLinks, channel_options, link_delay_s
from ..stage.local_link import LocalOpener
from ..stage.security import StageCredentials
from .driver import StageFault
from .stage_link import GrpcStageLink, LocalStageLink

log = logging.getLogger(__name__)

ACTOR_START_TIMEOUT = 900  # a stage loads its weights within this
DRAIN_S = 600              # a replaced channel closes when its streams end, or after this


@dataclass
class _Channel:
    address: str  # stage 0's; and the last stage's, where there are more
    channel: object
    stub: stage_pb2_grpc.StageStub
    idle: IdleLinks
    last: tuple[object, stage_pb2_grpc.StageStub] | None = None
    # the stages' sockets on this node serve its sessions (mesh/control/stage_link.py);
    # None: not tried yet
    local: bool | None = None

    def channels(self) -> list:
        return [self.channel] + ([self.last[0]] if self.last is not None else [])


class Recut(Exception):
    """A lost stage's layers fit whole on no alive node, but the model does on the alive
    nodes cut anew: `model`, the new plan's served model (mesh/control/ray_engine.py)."""

    def __init__(self, model):
        super().__init__("the model is cut anew over the alive nodes")
        self.model = model


class RayPipeline:
    def __init__(self, make_actor: Callable[[int], object], n_stages: int, *,
                 credentials: StageCredentials, max_message: int,
                 recut: Callable[[object], tuple[Callable[[int], object], int]] | None = None):
        """`credentials` are the driver's own for its calls to stage 0; `recut(model)`
        makes a Recut's plan the engine's and says how to make its stages (and how many)."""
        self._make, self._recut = make_actor, recut
        self._credentials = credentials
        self._options = channel_options(max_message)
        self.actors = [make_actor(i) for i in range(n_stages)]
        self.addresses: list[str] = []
        self.generation = 0
        self.healthy = False
        self.recreated = 0
        self._lock = threading.Lock()
        # per event loop (grpc.aio binds a channel to one; a closed loop's go with it):
        # stage 0's address, the channel, its stub, the streams idle on it
        self._channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Channel] = \
            weakref.WeakKeyDictionary()

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
        # a stage failed: streams kept idle may lead to it (this loop's: links are bound
        # to the loop that opened them)
        entry = self._channels.get(asyncio.get_running_loop())
        for link in entry.idle.drain() if entry is not None else ():
            await link.end()
        await asyncio.to_thread(self._repair, generation)

    def _repair(self, generation: int) -> None:
        with self._lock:
            if self.generation != generation:
                return  # another request's repair already made the chain whole
            self.healthy = False
            try:
                try:
                    self.wire()
                except Recut as cut:
                    self._cut_anew(cut.model)
                    self.wire()
            except Exception as e:
                log.error("pipeline repair failed: %s", e)
            finally:
                self.generation += 1

    def cut_to(self, model) -> None:
        """Cut anew by choice (the plan asked for fits again): as after a loss, requests
        still on the old chain are rebuilt on the new one."""
        with self._lock:
            self.healthy = False
            try:
                self._cut_anew(model)
                self.wire()
            finally:
                self.generation += 1

    def _cut_anew(self, model) -> None:
        """Every stage replaced by the new plan's: the old ones (some alive) end, and
        requests rebuilt on the new chain replay their tokens through it."""
        if self._recut is None:
            raise RuntimeError("this pipeline cannot be cut anew")
        make, n = self._recut(model)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self._make = make
        self.actors = [make(i) for i in range(n)]
        self.recreated += n

    async def open(self) -> GrpcStageLink:
        """A session with stage 0 over this event loop's channel (grpc.aio binds one)."""
        if not self.healthy:
            raise StageFault("the pipeline is being repaired")
        loop = asyncio.get_running_loop()
        first, last = self.addresses[0], self.addresses[-1]
        address = first if len(self.addresses) == 1 else f"{first} {last}"
        entry = self._channels.get(loop)
        stale = []
        if entry is None or entry.address != address:
            if entry is not None:  # drain the replaced channels, then close them
                stale = entry.idle.drain()
                for channel in entry.channels():
                    asyncio.ensure_future(channel.close(grace=DRAIN_S))
            entry = self._channels[loop] = _Channel(address, *self._stub(first), IdleLinks(),
                                                    self._stub(last) if first != last else None)
        link, old_ones = entry.idle.take()
        for old in stale + old_ones:
            await old.end()
        if link is not None:
            return link
        hop_s = link_delay_s(ray.util.get_node_ip_address(), first)
        if entry.local is None:  # both ends on this node (checked once a channel)?
            token = self._credentials.token
            entry.local = not hop_s and await asyncio.to_thread(
                lambda: all(LocalOpener.reaching(a, token) for a in {first, last}))
        if entry.local:
            try:
                return await LocalStageLink.open(first, last if last != first else None,
                                                 self._credentials.token, entry.idle)
            except OSError:  # gone since: gRPC says how (a fault, a repair)
                entry.local = False
        return GrpcStageLink(entry.stub, self._credentials.metadata, entry.idle,
                             entry.last[1] if entry.last is not None else None, hop_s)

    def _stub(self, address: str) -> tuple[object, stage_pb2_grpc.StageStub]:
        channel = self._credentials.channel(address, self._options, aio=True)
        return channel, stage_pb2_grpc.StageStub(channel)

    async def close(self) -> None:
        for entry in list(self._channels.values()):
            for channel in entry.channels():
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
