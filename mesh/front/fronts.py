"""Each served model's side of the gateway: a request names its model, and gets that
model's engine, view (name, context, tokenizer, chat template), runs' context, readiness
and answers' fingerprint, loaded first where the model set had unloaded it
(mesh/control/model_set.py). What spans models is the gateway's and shared: its limits,
its concurrent-request slots, the exact-results memo (keyed by each split's topology), the
metrics and the runs in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from skippy.topology.errors import OverCapacity

from ..control.admission import LaneAdmission
from ..control.engine import Engine
from ..control.model_set import ModelSet, UnknownModel
from ..tokenizer import Tokenizer
from . import embeddings_api
from .admission import RequestAdmission
from .built_memo import BuiltMemo
from .generation import RunContext
from .in_flight import InFlight
from .limits import GatewayLimits
from .metrics import GatewayMetrics
from .openai_api import ApiError
from .request_building import ModelView, not_served
from .result_memo import ResultMemo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFront:
    """What a request reads of the model it names."""

    engine: Engine
    view: ModelView
    runs: RunContext
    admission: RequestAdmission
    pooling: str       # /v1/embeddings' default: the GGUF's, else mean
    fingerprint: str   # the split and weights served (a new one: seeded answers may change)
    built: BuiltMemo   # requests built from bodies seen before (this load's view)


@dataclass(frozen=True)
class Shared:
    """What every model's front shares: the gateway's own parts."""

    limits: GatewayLimits
    memo: ResultMemo
    metrics: GatewayMetrics
    slots: LaneAdmission
    in_flight: InFlight
    control_text: bool


class Fronts:
    """The models' fronts: built once per load of a model, dropped with its engine."""

    def __init__(self, models: ModelSet, shared: Shared):
        self.models, self.shared = models, shared
        self._built: dict[str, tuple[Engine, ModelFront]] = {}

    async def hold(self, name: str | None) -> tuple[ModelFront, Callable[[], None]]:
        """The front of the model `name` names (None: the default), loading it where it
        is not loaded, and what ends the hold (the model may be unloaded after). A 404
        for a model not served; a 503 where it cannot be loaded now."""
        try:
            engine, release = await self.models.hold(name)
        except UnknownModel as e:
            raise not_served(e.asked, e.served) from None
        except OverCapacity as e:
            raise ApiError(503, str(e), code="model_unavailable") from None
        try:
            return await self._front(self.models.slot(name).name, engine), release
        except BaseException:
            release()
            raise

    async def _front(self, name: str, engine: Engine) -> ModelFront:
        built = self._built.get(name)
        if built is None or built[0] is not engine:
            # the tokenizer and template read the GGUF: off the event loop
            built = engine, await asyncio.to_thread(self._build, engine)
            self._built[name] = built
        return built[1]

    def _build(self, engine: Engine) -> ModelFront:
        s = self.shared
        tokenizer = Tokenizer(engine.info.path)
        admission = RequestAdmission(engine, s.limits, tuple(tokenizer.encode("Hello") or [0]),
                                     slots=s.slots)
        view = ModelView.of(engine.info, tokenizer, s.control_text)
        return ModelFront(engine, view, RunContext(engine, s.memo, s.metrics, tokenizer,
                                                   s.in_flight), admission,
                          embeddings_api.model_pooling(tokenizer.path),  # a package too
                          "fp_" + engine.info.topology_digest[:12], BuiltMemo())

    def loaded(self) -> list[ModelFront]:
        """The fronts of the models loaded now (built where not yet)."""
        out = []
        for slot in self.models.loaded():
            built = self._built.get(slot.name)
            if built is None or built[0] is not slot.engine:
                built = slot.engine, self._build(slot.engine)
                self._built[slot.name] = built
            out.append(built[1])
        return out

    def serving(self) -> bool:
        return all(f.admission.serving() for f in self.loaded())

    def health(self) -> dict:
        return {"status": "ok" if self.serving() else "degraded"}

    async def ready(self) -> bool:
        """Ready while every loaded model is (one unloaded loads on its first request)."""
        fronts = await asyncio.to_thread(self.loaded)
        return bool(fronts) and all([await f.admission.ready() for f in fronts])
