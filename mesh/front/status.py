"""The status page (`/`) and its data (`/status.json`): the plan, each stage's live
figures, the caches, the requests in flight and recent errors.

Every counter and gauge in /status.json is read from the metric families /metrics
exports (`GatewayMetrics.families`, fed one `engine.stats()` reading), and carries the
series name /metrics shows it under, so the page's numbers are /metrics' numbers by
construction (tests/test_status_page.py compares them). Rates are taken from counters:
two readings of a stage's row counters and the times they were read, as Prometheus'
rate() would; nothing is counted a second time here.

The page is one HTML file with its script and style inline (no build step, no CDN);
it is public, while /status.json follows the API's key rule (mesh/front/edge.py). Once
the server has keys, what spans tenants (plan, stages, caches, nodes, the gateway's
totals, errors) is the operator's: a tenant's key reads its own runs and totals only.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import threading
import time
from collections import deque
from collections.abc import Iterable
from functools import cache
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client.core import Metric

from ..control.model_set import ModelSet
from .edge import OPERATOR, TENANT
from .in_flight import InFlight
from .metrics import GatewayMetrics, stage_label

RATE_WINDOW_S = 5.0      # rows per second: over about the last this many seconds
RECENT_WINDOW_S = 300.0  # "recent" errors: within about the last this many seconds
_HISTORY = 1000          # readings kept at most
_EVERY_S = 0.5           # a reading is kept at most this often (several pages may poll)
# The series rates and recent counts are taken from: all a reading keeps.
_TRACKED = ("skippy_stage_prefill_rows_total", "skippy_stage_decode_rows_total",
            "skippy_requests_total")
# Answers the page lists: the API's, and any endpoint's errors (not the 200s of its own
# polling or of scrapes, which move every second).
_API = ("/v1/",)
SPECULATION = ("verify_steps", "proposed_tokens", "accepted_tokens")
_CACHE_COUNTERS = ("lookups", "hits", "misses", "hit_tokens", "evictions")
_NODE_BYTES = ("resident_bytes", "logical_bytes", "physical_bytes", "saved_bytes",
               "disk_bytes", "fetched_bytes")


class _Series:
    """One reading of every sample /metrics would export, looked up by name and labels;
    a figure is {"v": value, "m": the series as /metrics writes it}."""

    def __init__(self, families: Iterable[Metric]):
        self.values: dict[str, float] = {}
        self._keys: dict[tuple[str, frozenset], str] = {}
        self.samples = []
        for family in families:
            for s in family.samples:
                key = _series_key(s.name, s.labels)
                self.values[key] = s.value
                self._keys[s.name, frozenset(s.labels.items())] = key
                self.samples.append(s)

    def fig(self, name: str, **labels: str) -> dict | None:
        key = self._keys.get((name, frozenset(labels.items())))
        return None if key is None else {"v": self.values[key], "m": key}


def _series_key(name: str, labels: dict) -> str:
    """A sample's series as the Prometheus text format writes it."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _History:
    """Readings (time, series values) kept to take rates and recent deltas from."""

    def __init__(self):
        self._readings: deque[tuple[float, dict[str, float]]] = deque(maxlen=_HISTORY)
        self._lock = threading.Lock()

    def add(self, t: float, values: dict[str, float]) -> None:
        kept = {k: v for k, v in values.items() if k.startswith(_TRACKED)}
        with self._lock:
            if self._readings and t - self._readings[-1][0] < _EVERY_S:
                return
            self._readings.append((t, kept))
            # keep one reading older than the longest window: the baseline for it
            while len(self._readings) > 2 and self._readings[1][0] <= t - RECENT_WINDOW_S:
                self._readings.popleft()

    def baseline(self, t: float, window: float) -> tuple[float, dict[str, float]] | None:
        """The newest reading at least `window` old, else the oldest one; None when the
        only reading is the one at `t`."""
        with self._lock:
            older = [r for r in self._readings if r[0] < t]
        if not older:
            return None
        aged = [r for r in older if r[0] <= t - window]
        return aged[-1] if aged else older[0]


class StatusBoard:
    """Assembles /status.json for one gateway."""

    def __init__(self, models: ModelSet, metrics: GatewayMetrics, in_flight: InFlight,
                 clock=time.monotonic):
        self.models, self.metrics, self.in_flight = models, metrics, in_flight
        self._clock = clock  # when each reading was taken: rates divide by it
        self._history = _History()

    def snapshot(self) -> dict:
        """The page's data now but the requests in flight (blocking: the engine's
        figures may come from Ray); `in_flight.snapshot()` adds those on the event loop."""
        try:
            stats = self.models.stats()
        except Exception:  # noqa: BLE001 (the page shows what it can; /metrics logs it)
            stats = {}
        serving = self._serving()
        t = self._clock()
        series = _Series(self.metrics.families(stats))
        self._history.add(t, series.values)
        return {
            **self._model(), "models": self.models.figures(),
            "serving": serving, "updated": time.time(),
            "plan": _plan(stats),
            "stages": self._stages(stats, series, t),
            "nodes": [_node(node, series) for node in stats.get("nodes") or {}],
            "gateway": _gateway(series),
            "requests": [],
            "errors": self._errors(stats, series, t),
        }

    def tenant_view(self) -> dict:
        """What any tenant may read (blocking, as `snapshot`): the model and whether it
        is served; no engine figures, which are every tenant's together."""
        model = self._model()
        return {**{k: model[k] for k in ("model", "n_ctx", "lanes")},
                "models": [{k: m[k] for k in ("model", "loaded")}
                           for m in self.models.figures()],
                "serving": self._serving(), "updated": time.time()}

    def _model(self) -> dict:
        """The default model's facts (with several models, the names of them all)."""
        info = self.models.info()
        names = ", ".join(self.models.names)
        if info is None:
            return {"model": names, "topology": None, "n_ctx": None, "lanes": None,
                    "runtime": None, "policy": None, "pipelines": None}
        return {"model": names, "topology": info.topology_digest, "n_ctx": info.n_ctx,
                "lanes": info.lanes, "runtime": info.extra.get("runtime"),
                "policy": info.extra.get("policy"),
                "pipelines": info.extra.get("pipelines", 1)}

    def _serving(self) -> bool:
        try:
            return bool(self.models.status()["serving"])
        except Exception:  # noqa: BLE001 (the page shows what it can; /metrics logs it)
            return False

    def _stages(self, stats: dict, series: _Series, t: float) -> list[dict]:
        before = self._history.baseline(t, RATE_WINDOW_S)
        out = []
        for i, stage in enumerate(stats.get("stages") or []):
            label = stage_label(i, stage)

            def own(key: str) -> dict | None:
                return series.fig(f"skippy_stage_{key}", stage=label)

            row = {"stage": stage.get("index", i), "model": stage.get("model"),
                   "layers": stage.get("layers"),
                   "weight_format": stage.get("weight_format"),
                   **{k: own(k) for k in ("lanes_busy", "lanes_free", "lanes_warm",
                                          "sessions", "queue_rows", "queue_prefills")},
                   **{k: own(f"{k}_total") for k in ("prefill_rows", "decode_rows")},
                   "cache": _stage_cache(label, series),
                   "speculation": {k: series.fig(f"skippy_speculation_{k}_total",
                                                 stage=label)
                                   for k in SPECULATION} if "speculation" in stage else None}
            for kind in ("prefill", "decode"):
                row[f"{kind}_rows_per_s"] = _rate(row[f"{kind}_rows"], before, t)
            out.append(row)
        return out

    def _errors(self, stats: dict, series: _Series, t: float) -> dict:
        """HTTP answers (the API's, and every error), each with its count in about the
        last RECENT_WINDOW_S; requests rebuilt after a fault, and other failures."""
        before = self._history.baseline(t, RECENT_WINDOW_S)
        answers = []
        for s in series.samples:
            if s.name != "skippy_requests_total":
                continue
            endpoint, status = s.labels["endpoint"], s.labels["status"]
            if not (endpoint.startswith(_API) or int(status) >= 400):
                continue
            fig = series.fig(s.name, endpoint=endpoint, status=status)
            answers.append({"endpoint": endpoint, "status": int(status), "total": fig,
                            "recent": _delta(fig, before)})
        answers.sort(key=lambda a: (a["endpoint"], a["status"]))
        other = {f"rebuilds_{cause}": series.fig("skippy_engine_rebuilds_total", cause=cause)
                 for cause in (stats.get("rebuilds") or {})}
        other["refused"] = series.fig("skippy_gateway_requests_refused_total")
        for i, stage in enumerate(stats.get("stages") or []):
            label = stage_label(i, stage)
            for k in ("restore_failures", "restores_declined", "leases_expired"):
                other[f"stage{label}_{k}"] = series.fig(f"skippy_stage_{k}_total",
                                                        stage=label)
        return {"window_s": None if before is None else round(t - before[0], 1),
                "answers": answers, "other": other}


def _rate(fig: dict | None, before, t: float) -> float | None:
    if fig is None or before is None or fig["m"] not in before[1] or t <= before[0]:
        return None
    return (fig["v"] - before[1][fig["m"]]) / (t - before[0])


def _delta(fig: dict | None, before) -> float | None:
    if fig is None or before is None:
        return None
    return fig["v"] - before[1].get(fig["m"], 0.0)


def _stage_cache(label: str, series: _Series) -> dict:
    c = {k: series.fig(f"skippy_stage_cache_{k}_total", stage=label) for k in _CACHE_COUNTERS}
    c["entries"] = series.fig("skippy_stage_cache_entries", stage=label)
    c["resident_bytes"] = series.fig("skippy_stage_cache_resident_bytes", stage=label)
    hits, misses = (c[k]["v"] if c[k] else 0 for k in ("hits", "misses"))
    c["reuse"] = hits / (hits + misses) if hits + misses else None
    return c


def _node(node: str, series: _Series) -> dict:
    return {"node": node,
            **{k: series.fig(f"skippy_node_{k}", node=node) for k in _NODE_BYTES}}


def _gateway(series: _Series) -> dict:
    return {
        "running": series.fig("skippy_gateway_requests_running"),
        "waiting": series.fig("skippy_gateway_requests_waiting"),
        "lanes": series.fig("skippy_engine_lanes_lanes"),
        "lanes_in_use": series.fig("skippy_engine_lanes_in_use"),
        "ttft_count": series.fig("skippy_time_to_first_token_seconds_count"),
        "ttft_sum": series.fig("skippy_time_to_first_token_seconds_sum"),
        "rate_count": series.fig("skippy_decode_tokens_per_second_count"),
        "rate_sum": series.fig("skippy_decode_tokens_per_second_sum"),
        "tokens_engine": series.fig("skippy_tokens_generated_total", source="engine"),
        "tokens_memo": series.fig("skippy_tokens_generated_total", source="memo"),
        "results_hits": series.fig("skippy_gateway_results_hits_total"),
        "results_misses": series.fig("skippy_gateway_results_misses_total"),
    }


def _plan(stats: dict) -> dict:
    plan = stats.get("plan") or {"nodes": [], "stages": []}
    formats = {(s.get("model"), s.get("index", i)): s.get("weight_format")
               for i, s in enumerate(stats.get("stages") or [])}
    stages = [{**row, "weight_format": formats.get((row.get("model"), row["stage"]))}
              for row in plan["stages"]]
    return {"nodes": plan["nodes"], "stages": stages}


# -- the page ---------------------------------------------------------------------------------
@cache
def page() -> tuple[str, str]:
    """The page's HTML and its Content-Security-Policy: only its own inline script and
    style (by hash) run, and it may only talk to this server."""
    html = (resources.files(__package__) / "static" / "status.html").read_text("utf-8")
    hashes = {kind: [_sha256(body) for body in re.findall(
        rf"<{kind}>(.*?)</{kind}>", html, flags=re.S)] for kind in ("script", "style")}
    policy = "; ".join([
        "default-src 'none'", "connect-src 'self'", "img-src data:",
        "script-src " + " ".join(hashes["script"]),
        "style-src " + " ".join(hashes["style"]),
        "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"])
    return html, policy


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def add_status_routes(app: FastAPI, board: StatusBoard) -> None:
    """`/`: the page (public, like /health); `/status.json`: its data, behind the key."""

    @app.get("/")
    async def status_page():
        html, policy = page()
        return HTMLResponse(html, headers={
            "Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})

    @app.get("/status.json")
    async def status_json(request: Request):
        tenant = request.scope.get(TENANT, "")
        if request.scope.get(OPERATOR):
            body = {"view": "operator", **await asyncio.to_thread(board.snapshot)}
        else:
            body = {"view": "tenant", **await asyncio.to_thread(board.tenant_view)}
        # read on the event loop, where runs change; after the counters, so a first token
        # they count is in this list too. The caller's own runs only (mesh/front/in_flight.py)
        body["requests"] = board.in_flight.snapshot(tenant)
        body["usage"] = board.in_flight.usage(tenant)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})
