"""The gateway's Prometheus metrics: one registry per app, so several apps (tests, one
process serving two models) never share or clash over the global default registry.

Gateway figures are recorded as requests go (requests by endpoint and status, time to
first token, tokens, decode speed); its admission (requests running, waiting, refused)
is read at scrape time. Stage figures are read from `engine.stats()` at
scrape time: each stage's cache counters, bytes and hits by kind (the shape
`StageCache.stats()` gives), its block store, the counts its loop and cache only ever
add to (rows computed, seconds and steps by kind, failed restores) as counters, and any
other number a stage reports (e.g. latencies from the Ray engine) as a gauge named after
its key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from skippy.cache.telemetry import CacheStats

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
_CACHE_BYTES = ("entries", "resident_bytes", "reserved_bytes", "evictable_bytes")
# A stage's counts that only ever grow (the loop's rows, the cache's failed restores...):
# typed as counters (with _total), as Prometheus tooling expects of what rate() reads.
_STAGE_COUNTS = ("prefill_rows", "decode_rows", "restore_failures", "restores_declined",
                 "leases_expired", "exports", "adopted", "streams_reused",
                 "direct_replies", "local_streams", "turn_wait_seconds")
_BY_KIND = {"seconds": ("skippy_stage_compute_seconds", "Seconds a stage spent computing"),
            "steps": ("skippy_stage_steps", "Runtime calls a stage made")}
_KNOWN = {"counters", "hits_by_kind", "blocks", "prefix", "results", "policy", "index",
          "speculation",
          *_CACHE_BYTES,
          *_STAGE_COUNTS, *_BY_KIND}


class GatewayMetrics:
    def __init__(self, stage_stats: Callable[[], dict], memo_stats: Callable[[], CacheStats],
                 admission_stats: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry()
        self.requests = Counter("skippy_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("skippy_time_to_first_token_seconds",
                              "From the request's arrival to its first generated token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tokens = Counter("skippy_tokens_generated",
                              "Completion tokens, by where they came from (engine, or the "
                              "gateway's exact results)", ["source"], registry=self.registry)
        self.tokens_per_second = Histogram(
            "skippy_decode_tokens_per_second",
            "Per request: tokens after the first / seconds after the first",
            buckets=_RATE_BUCKETS, registry=self.registry)
        self._memo_stats, self._admission_stats = memo_stats, admission_stats
        self.registry.register(_StageCollector(stage_stats, memo_stats))
        if admission_stats is not None:
            self.registry.register(_AdmissionCollector(admission_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def families(self, stats: dict) -> list[Metric]:
        """Every family /metrics exports, the engine's built from `stats` (one
        `engine.stats()` reading): what the status page shows is read from these, so its
        numbers are /metrics' numbers by construction."""
        own = [m for c in (self.requests, self.ttft, self.tokens, self.tokens_per_second)
               for m in c.collect()]
        engine = list(stage_families(stats, self._memo_stats()))
        admission = [] if self._admission_stats is None else \
            list(admission_families(self._admission_stats()))
        return own + engine + admission


class _StageCollector:
    """Reads the engine's per-stage figures at scrape time."""

    def __init__(self, stage_stats, memo_stats):
        self._stage_stats, self._memo_stats = stage_stats, memo_stats

    def describe(self) -> list:
        return []  # names depend on what the engine reports: not known up front

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stage_stats()
        except Exception as e:  # noqa: BLE001 (a scrape must not fail with one engine call)
            log.warning("engine.stats() failed: %s", " ".join(str(e).split()))
            stats = {}
        yield from stage_families(stats, self._memo_stats())


def stage_families(stats: dict, memo: CacheStats) -> Iterator[Metric]:
    """The engine's figures (`engine.stats()`) and the gateway's exact results as
    metric families."""
    families: dict[str, Metric] = {}

    def family(kind, name, doc, labels):
        if name not in families:
            families[name] = kind(name, doc, labels=labels)
        return families[name]

    _engine_figures(stats, family)
    for i, stage in enumerate(stats.get("stages", [])):
        _stage_figures(stage_label(i, stage), stage, family)
    for k, v in memo.counters.items():
        family(CounterMetricFamily, f"skippy_gateway_results_{k}",
               f"Gateway exact results event count: {k}", []).add_metric([], v)
    for k in _CACHE_BYTES:
        family(GaugeMetricFamily, f"skippy_gateway_results_{k}",
               f"Gateway exact results {k.replace('_', ' ')}", []
               ).add_metric([], getattr(memo, k))
    yield from families.values()


def stage_label(i: int, stage: dict) -> str:
    """A stage's `stage` label: its index, or "model/index" where a gateway serves
    several models (their stages are listed together: mesh/control/model_set.py)."""
    return str(stage.get("label") or i)


def _stage_figures(i: str, stage: dict, family) -> None:
    """One stage's figures: cache counters, hits by kind, cache bytes, its counts (rows,
    seconds and steps by kind, failed restores), its block store, and any other number it
    reports as a gauge named after its key."""
    label = [i]
    for k, v in (stage.get("counters") or {}).items():
        family(CounterMetricFamily, f"skippy_stage_cache_{k}",
               f"Stage cache event count: {k}", ["stage"]).add_metric(label, v)
    for kind, v in (stage.get("hits_by_kind") or {}).items():
        family(CounterMetricFamily, "skippy_stage_cache_hits_by_kind",
               "Stage cache hits by cache kind", ["stage", "kind"]
               ).add_metric([i, str(kind)], v)
    for k in _CACHE_BYTES:
        if isinstance(stage.get(k), (int, float)):
            family(GaugeMetricFamily, f"skippy_stage_cache_{k}",
                   f"Stage cache {k.replace('_', ' ')}", ["stage"]
                   ).add_metric(label, stage[k])
    for k in _STAGE_COUNTS:
        if isinstance(stage.get(k), (int, float)):
            family(CounterMetricFamily, f"skippy_stage_{k}",
                   f"Stage count: {k.replace('_', ' ')}", ["stage"]).add_metric(label, stage[k])
    for key, (name, doc) in _BY_KIND.items():
        for kind, v in (stage.get(key) or {}).items():
            family(CounterMetricFamily, name, f"{doc}, by kind (prefill, decode)",
                   ["stage", "kind"]).add_metric([i, str(kind)], v)
    for k, v in (stage.get("speculation") or {}).items():
        family(CounterMetricFamily, f"skippy_speculation_{k}",
               f"Speculative decoding at the last stage: {k.replace('_', ' ')}", ["stage"]
               ).add_metric(label, v)
    for k, v in _numbers(stage.get("blocks") or {}):
        family(GaugeMetricFamily, f"skippy_stage_block_store_{k}",
               f"Stage block store: {k}", ["stage"]).add_metric(label, v)
    other = {k: v for k, v in stage.items() if k not in _KNOWN}
    for k, v in _numbers(other):
        family(GaugeMetricFamily, f"skippy_stage_{k}",
               f"Stage figure reported by the engine: {k}", ["stage"]
               ).add_metric(label, v)


def _engine_figures(stats: dict, family) -> None:
    """The engine's own figures: requests rebuilt after a fault (by cause: a stage fault,
    or cached state evicted between plan and restore), its lane budget, state bytes per
    node (held, deduplicated, fetched from peers), and stage actors re-created after Ray
    gave up on them."""
    for cause, n in (stats.get("rebuilds") or {}).items():
        family(CounterMetricFamily, "skippy_engine_rebuilds",
               "Requests rebuilt on a repaired pipeline, by cause", ["cause"]
               ).add_metric([str(cause)], n)
    for k, v in (stats.get("admission") or {}).items():
        family(GaugeMetricFamily, f"skippy_engine_lanes_{k}",
               f"Engine lane budget: {k}", []).add_metric([], v)
    for node, figures in (stats.get("nodes") or {}).items():
        for k, v in _numbers(figures):
            family(GaugeMetricFamily, f"skippy_node_{k}",
                   f"Per node, its stages' state: {k.replace('_', ' ')}", ["node"]
                   ).add_metric([str(node)], v)
    scaling = stats.get("scaling") or {}
    if scaling:
        family(GaugeMetricFamily, "skippy_engine_pipelines",
               "Pipelines serving (scaling with the load)", []).add_metric(
            [], scaling["pipelines"])
        for k in ("added", "released"):
            family(CounterMetricFamily, f"skippy_engine_pipelines_{k}",
                   f"Pipelines {k} as the load changed", []).add_metric([], scaling[k])
    if "recreated" in stats:
        family(CounterMetricFamily, "skippy_engine_stages_recreated",
               "Stage actors the engine created again", []).add_metric([], stats["recreated"])


class _AdmissionCollector:
    """The gateway's concurrent-request slots: {"in_use", "waiting", "refused"}."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from admission_families(self._stats())


def admission_families(s: dict) -> Iterator[Metric]:
    yield GaugeMetricFamily("skippy_gateway_requests_running",
                            "Requests holding one of the gateway's slots", value=s["in_use"])
    yield GaugeMetricFamily("skippy_gateway_requests_waiting",
                            "Requests waiting for a slot", value=s["waiting"])
    yield CounterMetricFamily("skippy_gateway_requests_refused",
                              "Requests refused for want of a slot (503)",
                              value=s["refused"])


def _numbers(d: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Numeric leaves of nested dicts as (metric-safe flattened name, value)."""
    for k, v in d.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", f"{prefix}{k}")
        if isinstance(v, bool):
            yield name, float(v)
        elif isinstance(v, (int, float)):
            yield name, v
        elif isinstance(v, dict):
            yield from _numbers(v, name + "_")
