"""What an engine serves: a model on a runtime, cut by the one planner, and each stage's spec.

Both engines build from this — the in-process engine (mesh/control/local.py) with its
stages as objects in this process, the Ray engine (mesh/control/ray_engine.py) with them as
actors on the planned nodes — so for the same model, runtime, nodes and options they serve
the same plan: the same split, the same topology digest, the same stage specs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from skippy.stages.runtime import StageSpec
from skippy.stages.runtime_kind import REFERENCE_FORMAT, RuntimeKind
from skippy.topology.capabilities import capability_for
from skippy.topology.model_package import is_package, open_model
from skippy.topology.planner import DEFAULT_LANES, DEFAULT_N_CTX, STAGE_OVERHEAD_BYTES, \
    ModelFacts, NodeSpec, Plan, plan

from .engine import EngineInfo


@dataclass(frozen=True)
class ServedModel:
    path: Path
    runtime: RuntimeKind
    policy: str          # the cache policy its stages keep (the family's, unless overridden)
    weight_format: str   # what the runtime holds weights in (stages/linear.py)
    plan: Plan

    @classmethod
    def open(cls, path: str | Path, runtime: RuntimeKind,
             nodes: Callable[[str], Sequence[NodeSpec]], *, stages: int | None = None,
             ranges: Sequence[tuple[int, int]] | None = None, wire_dtype: str = "f16",
             n_ctx: int = DEFAULT_N_CTX, lanes: int = DEFAULT_LANES,
             weight_format: str = REFERENCE_FORMAT, policy: str | None = None,
             overhead_bytes: int = STAGE_OVERHEAD_BYTES,
             cache_bytes: int | None = None) -> ServedModel:
        """The model at `path` planned onto `nodes(model digest)`: `stages` of them (None:
        the fewest that fit), or exactly `ranges`; `lanes` is the lane budget of every
        pipeline together; `cache_bytes`: each stage's cache budget, which the plan caps
        at the room its node leaves. StageError where the runtime cannot serve it so,
        PlanError where it does not fit."""
        path = Path(path)
        runtime.check_model(is_package(path))
        runtime.check_weight_format(weight_format)
        stages = runtime.stages(len(ranges) if ranges is not None else stages)
        f = open_model(path)
        try:
            policy = policy or capability_for(f).policy
        finally:
            f.close()
        facts = ModelFacts.from_gguf(path, tensor_bytes=runtime.tensor_bytes(weight_format))
        planned = plan(facts, nodes(facts.model_digest), wire_dtype=wire_dtype, n_ctx=n_ctx,
                       lanes=lanes, stages=stages, ranges=ranges,
                       overhead_bytes=overhead_bytes, cache_bytes=cache_bytes)
        return cls(path, runtime, policy, weight_format, planned)

    def spec(self, i: int, **options) -> StageSpec:
        """Stage i's spec: its planned layers, context and split; `options` the rest
        (chunk, threads, lane_batch)."""
        st = self.plan.stages[i]
        return StageSpec(str(self.path), st.start, st.end, i, len(self.plan.stages),
                         self.plan.wire_dtype, n_ctx=self.plan.n_ctx,
                         weight_format=self.weight_format,
                         topology_digest=self.plan.digest, **options)

    def info(self, name: str | None, lanes: int, **extra) -> EngineInfo:
        """What the gateway says about it (`lanes`: one pipeline's budget)."""
        return EngineInfo(model=name or self.path.stem, path=str(self.path),
                          n_ctx=self.plan.n_ctx, n_stages=len(self.plan.stages),
                          topology_digest=self.plan.digest, lanes=lanes,
                          extra={"runtime": self.runtime.name, "policy": self.policy,
                                 **extra})

    def figures(self, pipelines: Sequence[int], where: Callable[[int, int], str]) -> dict:
        """The plan as the status page shows it: each of these pipelines' stages on the
        node `where(pipeline, stage)` names (a lost node's stages move), with the bytes
        the plan reserves for them, and those nodes with their memory and cores."""
        planned = {st.node.name[:12]: st.node for st in self.plan.stages}
        rows = [(r, st, where(r, st.index)[:12]) for r in pipelines
                for st in self.plan.stages]
        names = dict.fromkeys(node for _, _, node in rows)
        return {"nodes": [{"name": n, "memory": planned[n].memory if n in planned else None,
                           "cpus": planned[n].cpus if n in planned else None}
                          for n in names],
                "stages": [{"pipeline": r, "stage": st.index, "node": node,
                            "layers": [st.start, st.end], "weight_bytes": st.weight_bytes,
                            "kv_bytes": st.kv_bytes, "overhead_bytes": st.overhead_bytes,
                            "total_bytes": st.total_bytes, "cache_bytes": st.cache_bytes}
                           for r, st, node in rows]}
