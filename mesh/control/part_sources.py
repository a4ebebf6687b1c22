"""Where each stage of a package gets its parts: here already, or from a node serving them.

Serving a package, the head needs its manifest and shared part only (for the plan and the
tokenizer); nodes may hold every part, some, or none. When some node lacks parts, the
engine starts a `PartServer` (mesh/stage/part_service.py) on as few holders as cover the
model's layers (most layers first), once, and hands each stage actor a `PartSource`: the
head's manifest, the part files the stage reads, and those servers' addresses. The stage
finds its parts on its node or fetches them there before it loads (mesh/stage/stage_parts.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from skippy.stages.runtime import StageSpec
from skippy.stages.weights import owned_tensor_names
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import MANIFEST, SHARED, ModelPackage, PackageError
from skippy.topology.planner import NodeSpec

from ..stage.part_service import PartServer
from ..stage.security import ClusterCredentials
from ..stage.stage_parts import PartSource

log = logging.getLogger(__name__)

SERVER_START_S = 60   # a part server listens within this


class PartSources:
    def __init__(self, path: Path, credentials: ClusterCredentials, host: str | None,
                 nodes: Callable[[], list[NodeSpec]]):
        """`nodes()`: the alive nodes, each with the layers whose parts it holds;
        `host`: where part servers listen (None: their node's address)."""
        self.path, self._credentials, self._host, self._nodes = path, credentials, host, nodes
        self.manifest = (path / MANIFEST).read_text()
        self._package = ModelPackage(path)
        self._cfg = ModelConfig.from_gguf(self._package)
        self.servers: list = []   # PartServer actors, kept while the engine runs
        self.holders: tuple[str, ...] | None = None

    def for_stage(self, spec: StageSpec) -> PartSource:
        """The stage's parts, with servers to fetch them from when some node lacks parts."""
        names = owned_tensor_names(self._package, self._cfg, spec.layer_start, spec.layer_end,
                                   spec.is_first, spec.is_last)
        files = [self._package.manifest.part(SHARED).file]
        files += [p.file for p in self._package.parts_for(names) if p.file not in files]
        if self.holders is None:
            self.holders = self._start()
        return PartSource(str(self.path), self.manifest, tuple(files), self.holders)

    def _start(self) -> tuple[str, ...]:
        """Part servers on the fewest holders covering every layer; none if every node
        holds them all."""
        n_layers = self._package.manifest.n_layers
        nodes = sorted(self._nodes(), key=lambda n: -len(n.layers))
        if all(len(n.layers) == n_layers for n in nodes):
            return ()
        chosen, covered = [], set()
        for node in nodes:
            if node.layers - covered:
                chosen.append(node)
                covered |= node.layers
        if len(covered) < n_layers:
            missing = sorted(set(range(n_layers)) - covered)
            raise PackageError(f"{self.path}: the parts of layer(s) {_spans(missing)} are on "
                               "no node of the cluster")
        for node in chosen:
            self.servers.append(PartServer.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.name, soft=False),
            ).remote(str(self.path), self._package.model_digest, self._host,
                     credentials=self._credentials.issue()))
        addresses = tuple(ray.get([s.address.remote() for s in self.servers],
                                  timeout=SERVER_START_S))
        log.info("nodes without their stages' parts fetch them from %s", ", ".join(addresses))
        return addresses

    def close(self) -> None:
        self._package.close()


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 5] as '0-2, 5'."""
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)
