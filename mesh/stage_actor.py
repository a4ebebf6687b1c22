"""The Ray actor around a stage: Ray places it, restarts it and asks it for figures;
requests reach it over gRPC (mesh/stage_service.py), never through Ray calls."""

from __future__ import annotations

import logging

import ray

from skippy.cache.config import CacheConfig
from skippy.stages.runtime import StageSpec

from .stage_service import StageService, start_server


@ray.remote
class StageActor:
    def __init__(self, spec: StageSpec, cache: CacheConfig, policy: str, runtime: str = "torch",
                 host: str | None = None, burst_threads: int | None = None):
        logging.basicConfig(level=logging.INFO)
        self.service = StageService(spec, cache, policy, runtime, burst_threads=burst_threads)
        host = host or ray.util.get_node_ip_address()
        self._server, self._address = start_server(self.service, host)

    def address(self) -> str:
        return self._address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def connect(self, next_address: str | None) -> None:
        self.service.connect(next_address)

    def stats(self) -> dict:
        return self.service.stats()

    def memory(self) -> dict[str, int]:
        """This process's resident bytes now and at its peak (VmRSS, VmHWM)."""
        with open("/proc/self/status") as fh:
            status = dict(line.split(":", 1) for line in fh)
        return {"rss": int(status["VmRSS"].split()[0]) * 1024,
                "peak_rss": int(status["VmHWM"].split()[0]) * 1024}
