"""An in-process pipeline: a model's stages as plain objects, frames handed along.

The Ray mesh replaces the hand-off with actors and gRPC streams; the request's path
(agree on a reuse start, restore, prefill through every stage, then one decode step
per token) stays the same.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from skippy.cache.config import CacheConfig
from skippy.stages.factory import make_runtime
from skippy.stages.runtime import StageOutput, StageSpec
from skippy.stages.stage_cache import StageCache
from skippy.topology.capabilities import capability_for
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model
from skippy.topology.planner import even_ranges

from .sampler import Sampler

log = logging.getLogger(__name__)

class LocalPipeline:
    def __init__(self, model_path: str | Path, n_stages: int, *, wire_dtype: str = "f16",
                 cache: CacheConfig | None = None, runtime: str = "torch", **spec_options):
        f = open_model(model_path)
        self.config = ModelConfig.from_gguf(f)
        capability = capability_for(f)
        f.close()
        if cache is not None:
            spec_options.setdefault("chunk", cache.chunk)
        ranges = even_ranges(self.config.n_layers, n_stages)
        self.stages = [
            make_runtime(StageSpec(str(model_path), a, b, i, n_stages, wire_dtype,
                                   **spec_options), runtime)
            for i, (a, b) in enumerate(ranges)
        ]
        self.n_ctx = self.stages[0].n_ctx
        self.caches: list[StageCache] | None = None
        if cache is not None:
            log.info("cache policy: %s", capability.reason)
            self.caches = [StageCache(rt, cache, policy=capability.policy) for rt in self.stages]

    # -- lanes -----------------------------------------------------------------------------
    def alloc(self, ids: Sequence[int] = (), namespace: str = "") -> list[int]:
        """One lane in every stage for one request: with the prompt, each stage's warm
        lane that holds most of it (StageCache.alloc_lane)."""
        if self.caches is not None:
            return [c.alloc_lane(ids, namespace) for c in self.caches]
        return [s.alloc_lane() for s in self.stages]

    def free(self, lanes: list[int], *, probe: bool = False) -> None:
        """The request is over: with caches, its lanes stay warm for a follow-up."""
        if self.caches is not None:
            for c, lane in zip(self.caches, lanes):
                c.free_lane(lane, keep_warm=not probe)
            return
        for stage, lane in zip(self.stages, lanes):
            stage.free_lane(lane)

    def drop_warm_lanes(self, keep: int = 0) -> None:
        """Free the lanes kept warm for follow-ups (0: later hits must come from the
        cache entries)."""
        for c in self.caches or ():
            c.drop_warm_lanes(keep)

    # -- uncached steps (certification and tests drive these directly) --------------------
    def prefill(self, lanes: list[int], ids: list[int] | torch.Tensor, start: int = 0,
                logits: str = "last") -> torch.Tensor | None:
        """Positions [start, start + len(ids)); returns the last stage's logits."""
        out: StageOutput | None = None
        x = torch.as_tensor(ids, dtype=torch.long)
        for stage, lane in zip(self.stages, lanes):
            out = stage.prefill(lane, x, start, logits)
            x = out.frame
        return out.logits

    def decode(self, lanes: list[int], token: int) -> torch.Tensor:
        x = torch.tensor(token)
        for i, (stage, lane) in enumerate(zip(self.stages, lanes)):
            out = stage.decode([(lane, x)])[0]
            if self.caches is not None:
                self.caches[i].note_decoded(lane, token)
            x = out.frame
        return out.logits

    # -- cached prefill ----------------------------------------------------------------------
    def plan(self, lanes: list[int], ids: list[int], *, probe: bool = False,
             namespace: str = "") -> list[int]:
        """Each stage's prefill start, planned from the last stage back: a stage starts
        where it can restore, unless the next one needs earlier rows that its frame cache
        lacks. Never past the last prompt row: that row is always computed."""
        limit = len(ids) - 1
        starts, downstream = [0] * len(self.caches), None
        for i in reversed(range(len(self.caches))):
            starts[i] = downstream = self.caches[i].plan(lanes[i], ids, limit, downstream,
                                                         probe=probe, namespace=namespace)
        return starts

    def prefill_cached(self, lanes: list[int], ids: list[int], *, probe: bool = False,
                       namespace: str = "") -> tuple[torch.Tensor, int]:
        """Next-token logits for the prompt and how many prompt tokens no stage had to
        compute. Bitwise the same logits as an uncached prefill."""
        if self.caches is None:
            return self.prefill(lanes, ids), 0
        starts = self.plan(lanes, ids, probe=probe, namespace=namespace)
        if not all(c.restore(lane, ids, s, namespace=namespace)
                   for c, lane, s in zip(self.caches, lanes, starts)):
            starts = [0] * len(starts)   # evicted or corrupt meanwhile: recompute
        out: StageOutput | None = None
        x = torch.as_tensor(ids[starts[0]:], dtype=torch.long)
        for i, (c, lane) in enumerate(zip(self.caches, lanes)):
            downstream = starts[i + 1] if i + 1 < len(starts) else None
            out = c.prefill(lane, ids, x, starts[i], probe=probe, namespace=namespace,
                            downstream=downstream)
            x = out.frame
        return out.logits, min(starts)

    def first_logits(self, lanes: list[int], ids: list[int], *, probe: bool = False,
                     namespace: str = "") -> tuple[torch.Tensor, int, bool]:
        """(logits, reused tokens, prefilled): an exact repeat of a whole prompt is
        answered from the last stage's result cache without running anything; the lanes
        are then prefilled only if decoding continues."""
        if self.caches is not None:
            cached = self.caches[-1].cached_result(ids, probe=probe, namespace=namespace)
            if cached is not None:
                return cached, len(ids), False
        logits, reused = self.prefill_cached(lanes, ids, probe=probe, namespace=namespace)
        if self.caches is not None:
            self.caches[-1].remember_result(ids, logits, probe=probe, namespace=namespace)
        return logits, reused, True

    def generate(self, ids: list[int], max_tokens: int, sampler: Sampler,
                 stop_ids: set[int] = frozenset(), *, probe: bool = False) -> Iterator[int]:
        """Token ids of the continuation, one at a time; a stop id ends it (not yielded)."""
        if not ids:
            raise ValueError("the prompt has no tokens")
        if len(ids) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(ids)} tokens) + max tokens ({max_tokens}) "
                             f"exceed the context of {self.n_ctx}")
        lanes = self.alloc([] if probe else ids)  # a probe gets a fresh lane
        try:
            logits, _, prefilled = self.first_logits(lanes, ids, probe=probe)
            for i in range(max_tokens):
                token = sampler(logits)
                if token in stop_ids:
                    return
                yield token
                if i + 1 < max_tokens:
                    if not prefilled:
                        self.prefill_cached(lanes, ids, probe=probe)
                        prefilled = True
                    logits = self.decode(lanes, token)
        finally:
            self.free(lanes, probe=probe)

    def cache_stats(self) -> list[dict]:
        return [c.stats() for c in self.caches] if self.caches else []
