"""The Ray actor around a stage: Ray places it, restarts it and asks it for figures;
requests reach it over gRPC (mesh/stage/grpc_service.py), from a stage before it on the
same node over a socket (mesh/stage/local_link.py), never through Ray calls."""

from __future__ import annotations

import dataclasses
import logging
import os

import ray

from skippy.cache.config import CacheConfig
from skippy.stages.runtime import StageSpec
from skippy.stages.runtime_kind import TORCH, RuntimeKind

from .. import tracing
from .channels import link_delay_s
from .grpc_service import MAX_RPCS, GrpcOpener, StageServicer, message_limit, serve
from .local_link import LocalListener, LocalOpener
from .security import StageCredentials
from .node_store import cold_store, node_store
from .server import StageServer
from .stage_parts import PartSource, local_package
from .state_pull import StatePuller


@ray.remote
class StageActor:
    def __init__(self, spec: StageSpec, cache: CacheConfig, policy: str,
                 runtime: RuntimeKind = TORCH, host: str | None = None,
                 burst_threads: int | None = None, *,
                 credentials: StageCredentials, parts: PartSource | None = None,
                 traces: str | None = None, turn: str | None = None):
        """Serves on `host` (default: Ray's address of this node), taking calls that carry
        `credentials`' token (over TLS when they hold certificates) and making its own.
        `traces`: where this process exports its spans (mesh/tracing.py; None: off);
        `turn`: the turn its pipeline's stages on this node take (mesh/stage/turns.py)."""
        logging.basicConfig(level=logging.INFO)
        tracing.configure(traces, role=f"stage {spec.stage_index}")
        if parts is not None:  # a package: its parts from this node, fetched here if need be
            spec = dataclasses.replace(spec, model_path=local_package(parts, credentials))
        host = host or ray.util.get_node_ip_address()
        self.server = StageServer(
            spec, cache, policy, runtime, burst_threads=burst_threads, turn=turn,
            store=node_store(host, cache.block_store_max_bytes),
            cold_store=cold_store(host, cache.cold_max_bytes) if cache.cold_max_bytes else None)
        self._credentials = credentials
        self._limit = message_limit(spec.model_path, spec.n_ctx, spec.wire_dtype)
        self.server.puller = StatePuller(credentials, self._limit)
        servicer = StageServicer(self.server, host)
        self._rpc, self._address = serve(servicer, host, credentials, max_message=self._limit)
        # the same sessions over a socket for a stage before this one on this node
        try:
            self._local: LocalListener | None = LocalListener(
                servicer, self._address, credentials.token, MAX_RPCS)
        except OSError as e:  # callers on this node use gRPC, as the others do
            logging.getLogger(__name__).warning("no local socket for stage %d: %s",
                                                spec.stage_index, e)
            self._local = None
        self._next: str | None = None

    def address(self) -> str:
        return self._address

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def connect(self, next_address: str | None) -> None:
        """Where the next stage listens; a link to an unchanged address is kept."""
        if next_address == self._next:
            return
        self._next = next_address
        if next_address is None:
            self.server.link_next(None)
            return
        local = None if link_delay_s(self._address, next_address) else \
            LocalOpener.reaching(next_address, self._credentials.token)
        self.server.link_next(local or GrpcOpener(next_address, self._credentials,
                                                  self._limit, here=self._address))

    def stats(self) -> dict:
        return self.server.stats()

    def compute(self) -> str:
        """How this stage computes on its node: the CPU kind torch uses and the kernels
        its weight format runs on (both part of its identity)."""
        policy = self.server.loop.call(self.server.runtime.identity).get("numeric_policy", {})
        return " ".join(f"{k}={policy[k]}" for k in ("cpu", "weights", "kernels") if k in policy)

    def close(self) -> None:
        """Stop serving and let go of this stage's blocks in the node's shared store
        (what a killed stage leaves there is swept by the next stage to open it)."""
        self._rpc.stop(grace=None)
        if self._local is not None:
            self._local.close()
        self.server.link_next(None)  # idle streams to the next stage end
        tracing.flush()
        cache = self.server.cache
        self.server.loop.call(cache.clear)
        self.server.loop.call(self.server.loop.end_turn)
        cache.store.close()
        if cache.tiers.cold is not None:
            cache.tiers.cold.store.close()

    def memory(self) -> dict[str, int]:
        """This process's resident bytes now and at its peak (VmRSS, VmHWM)."""
        with open("/proc/self/status") as fh:
            status = dict(line.split(":", 1) for line in fh)
        return {"rss": int(status["VmRSS"].split()[0]) * 1024,
                "peak_rss": int(status["VmHWM"].split()[0]) * 1024}
