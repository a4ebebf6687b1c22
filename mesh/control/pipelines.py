"""What both engines share: admission, the router over pipelines, the one driver, and the
figures about them. Both build from one plan (mesh/control/served_model.py) and differ only
in where its stages live: objects in this process (mesh/control/local.py) or actors on Ray
(mesh/control/ray_engine.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import torch

from .engine import EngineInfo, GenerationRequest, Step, check_fits
from .router import Router
from .admission import LaneAdmission
from .draft import DraftModel
from .driver import Pipeline, drive, embed
from .speculation import StepCosts


class PipelinesEngine:
    info: EngineInfo

    def _serve(self, pipelines: list[Pipeline], lanes: int, stride: int,
               speculate: bool = True, draft: Path | None = None) -> None:
        """`speculate`: requests that do not say verify proposed tokens where every stage
        can (mesh/control/speculation.py); `draft`: a draft model's GGUF proposes them
        (mesh/control/draft.py; default: prompt lookup)."""
        self.pipes = pipelines
        self.speculate = speculate
        self.draft = None if draft is None else DraftModel(
            draft, self.model.path, n_ctx=self.model.plan.n_ctx,
            weight_format=self.model.weight_format if self.model.weight_format != "fp32"
            else "int4")
        # each pipeline's decode step costs, which choose how many tokens to propose
        self.step_costs = [StepCosts() for _ in pipelines]
        self.router = Router(len(pipelines), stride)
        self.admission = LaneAdmission(lanes * len(pipelines))
        # requests rebuilt, by cause: a stage fault, or state evicted before its restore
        self.rebuilds: Counter[str] = Counter({"fault": 0, "evicted": 0})
        self.rebuilds_by_pipeline = [0] * len(pipelines)

    async def reserve(self, lanes: int) -> Callable[[], None]:
        return await self.admission.hold(lanes)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        check_fits(request, self.info.n_ctx)
        if not request.admitted:
            await self.admission.acquire()
        try:
            route = self.router.route(request.tokens, request.namespace, self._usable(),
                                      pinned=request.pipeline)
            p = route.pipeline
            try:
                def peers(rebuilding: bool) -> list[str]:
                    # a rebuild looks again: the pipeline's own state may be what was lost
                    return self._peers(self.router.holder(
                        request.tokens, request.namespace, exclude=p)
                        if rebuilding else route.holder)

                wanted = self.speculate if request.speculate is None \
                    else request.speculate
                # verify steps only while this request (its choices together) decodes
                # alone on its pipeline: others' rows batch into every step already
                speculate = wanted and (lambda: self.router.load[p] <= request.siblings)
                async for step in drive(self.pipes[p], request,
                                        lambda reason: self._rebuilt(p, reason), peers,
                                        speculate, self.draft, self.step_costs[p]):
                    yield step
            finally:
                self.router.finished(p)
        finally:
            if not request.admitted:
                self.admission.release()

    async def embed(self, tokens: tuple[int, ...], pooling: str = "mean",
                    namespace: str = "") -> torch.Tensor:
        """The pooled final hidden state of `tokens` (driver.embed), in a lane of its
        own on the least loaded pipeline."""
        check_fits(GenerationRequest(tokens, 1), self.info.n_ctx)
        await self.admission.acquire()
        try:
            route = self.router.route(tokens, namespace, self._usable())
            try:
                return await embed(self.pipes[route.pipeline], tokens, pooling, namespace)
            finally:
                self.router.finished(route.pipeline)
        finally:
            self.admission.release()

    def _usable(self) -> list[int]:
        """The pipelines a new request may go to: serving, and not retired."""
        return [i for i, pipe in enumerate(self.pipes)
                if pipe.healthy and i not in self.router.retired]

    def live(self) -> list[int]:
        """The pipelines not retired (a retired one ends the requests it has)."""
        return [i for i in range(len(self.pipes)) if i not in self.router.retired]

    def _add_pipeline(self, pipe: Pipeline, lanes: int) -> int:
        """A pipeline more, with `lanes` more lanes: new requests may go there at once."""
        self.pipes.append(pipe)
        self.rebuilds_by_pipeline.append(0)
        self.step_costs.append(StepCosts())
        p = self.router.add()
        self.admission.resize(self.admission.lanes + lanes)
        return p

    def _retire_pipeline(self, p: int, lanes: int) -> None:
        """No new request goes to pipeline p; its lanes leave the budget."""
        self.router.retire(p)
        self.admission.resize(self.admission.lanes - lanes)

    def _peers(self, holder: int | None) -> list[str]:
        """Where the holder pipeline's stages listen, for this request's stages to pull
        its prefix from (none while it is being repaired)."""
        if holder is None or not self.pipes[holder].healthy:
            return []
        return list(self.pipes[holder].addresses)

    def _rebuilt(self, p: int, reason: str) -> None:
        self.rebuilds["evicted" if "went away" in reason else "fault"] += 1
        self.rebuilds_by_pipeline[p] += 1

    def _with_free_lanes(self, stages: list[dict]) -> list[dict]:
        """Each stage's figures with its free lanes: the engine's lane budget (a
        pipeline's, times the pipelines whose figures are added up stage by stage) less
        the lanes requests hold there now."""
        for s in stages:
            s["lanes_free"] = max(0, self.admission.lanes - s.get("lanes_busy", 0))
        return stages

    def _figures(self) -> dict:
        return {"admission": self.admission.stats(), "rebuilds": dict(self.rebuilds),
                "rebuilds_by_pipeline": list(self.rebuilds_by_pipeline),
                "in_flight": list(self.router.load)}

    def status(self) -> dict:
        live = self.live()
        up = sum(self.pipes[p].healthy for p in live)
        return {"serving": up > 0, "detail": f"{up} of {len(live)} pipeline(s) serving"}


def node_figures(stages: Iterable[tuple[str, dict]]) -> dict[str, dict]:
    """State bytes per node from (node, stage figures) pairs: what its stages' caches
    hold resident in their runtimes, the logical bytes its stages reference, the
    physical bytes held (once for the node where its stages share a store, else each
    stage's own added up), what deduplication saves, the disk tier's bytes (counted the
    same way), what pulls fetched from peers and what they found held here already, and
    exports to peers."""
    nodes: dict[str, dict] = {}
    shared: dict[tuple[str, str], int] = {}  # (node, store) -> bytes its shared store holds
    for node, s in stages:
        blocks, pulls = s.get("blocks") or {}, s.get("pulls") or {}
        figures = nodes.setdefault(node, dict.fromkeys(
            ("resident_bytes", "logical_bytes", "physical_bytes", "saved_bytes",
             "disk_bytes", "fetched_bytes", "fetch_saved_bytes", "pulls", "exports"), 0))
        figures["resident_bytes"] += s.get("resident_bytes", 0)
        figures["logical_bytes"] += blocks.get("logical_bytes", 0)
        for store, key in (("blocks", "physical_bytes"), ("cold_blocks", "disk_bytes")):
            held = s.get(store) or {}
            figures[key] += held.get("physical_bytes", 0)
            if "node_physical_bytes" in held:
                shared[node, key] = max(shared.get((node, key), 0),
                                        held["node_physical_bytes"])
        figures["fetched_bytes"] += pulls.get("fetched_bytes", 0)
        figures["fetch_saved_bytes"] += pulls.get("held_bytes", 0)
        figures["pulls"] += pulls.get("pulls", 0)
        figures["exports"] += s.get("exports", 0)
    for (node, key), held in shared.items():
        nodes[node][key] = held
    for figures in nodes.values():
        figures["saved_bytes"] = figures["logical_bytes"] - figures["physical_bytes"]
    return nodes

