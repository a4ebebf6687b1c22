"""The status page's data without a server: the figures a stage's compute loop reports,
per-node bytes, and /status.json's assembly (mesh/front/status.py) over a scripted engine
whose figures the test sets, read beside the /metrics text the same figures make."""

from __future__ import annotations

import threading
import time

from skippy.cache.telemetry import CacheStats
from skippy.mesh.control.engine import EngineInfo
from skippy.mesh.control.model_set import ModelSet
from skippy.mesh.control.pipelines import node_figures
from skippy.mesh.front.in_flight import InFlight
from skippy.mesh.front.metrics import GatewayMetrics
from skippy.mesh.front.status import RECENT_WINDOW_S, StatusBoard
from skippy.mesh.stage.loop import StageLoop


# -- the stage loop ---------------------------------------------------------------------------
def test_the_loop_reports_queued_prefills_and_rows_computed_without_queueing_itself():
    loop = StageLoop(lambda rows: [None] * len(rows))
    try:
        hold, held = threading.Event(), threading.Event()

        def busy():
            held.set()
            hold.wait(10)
        blocker = threading.Thread(target=loop.call, args=(busy,))
        blocker.start()
        held.wait(10)
        prefill = threading.Thread(target=loop.compute, args=("prefill", lambda: None),
                                   kwargs={"rows": 64})
        prefill.start()
        deadline = time.monotonic() + 10
        while loop.figures()["queue_prefills"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        waiting = loop.figures()
        hold.set()
        blocker.join(10)
        prefill.join(10)
        done = loop.figures()
    finally:
        loop.stop()
    assert waiting["queue_prefills"] == 1 and waiting["prefill_rows"] == 0
    assert done["queue_prefills"] == 0 and done["queue_rows"] == 0
    assert done["prefill_rows"] == 64 and done["steps"]["prefill"] == 1


def test_node_bytes_count_resident_state_and_a_shared_disk_tier_once():
    a = {"resident_bytes": 100, "blocks": {"logical_bytes": 50, "physical_bytes": 30},
         "cold_blocks": {"physical_bytes": 7, "node_physical_bytes": 9}}
    b = {"resident_bytes": 20, "blocks": {"logical_bytes": 10, "physical_bytes": 10},
         "cold_blocks": {"physical_bytes": 2, "node_physical_bytes": 9}}
    n = node_figures([("x", a), ("x", b)])["x"]
    assert (n["resident_bytes"], n["logical_bytes"], n["physical_bytes"]) == (120, 60, 40)
    assert n["saved_bytes"] == 20 and n["disk_bytes"] == 9


# -- /status.json -----------------------------------------------------------------------------
class ScriptedEngine:
    """Figures the test sets, in the shape the engines report them."""

    def __init__(self, pipelines: int = 1):
        self.info = EngineInfo(model="m", path="m.gguf", n_ctx=64, n_stages=2,
                               topology_digest="d" * 64, lanes=4,
                               extra={"runtime": "torch", "pipelines": pipelines})
        self.rows = [0, 0]
        self.pipelines = pipelines

    def stats(self) -> dict:
        stages = [{"counters": {"lookups": 3, "hits": 1, "misses": 2, "hit_tokens": 64,
                                "evictions": 0}, "entries": 1, "resident_bytes": 1024,
                   "layers": [i * 2, i * 2 + 2], "weight_format": "int4",
                   "lanes_busy": 1, "lanes_free": 3, "lanes_warm": 0, "sessions": 1,
                   "queue_rows": 0, "queue_prefills": 0, "prefill_rows": 64,
                   "decode_rows": self.rows[i], "seconds": {"prefill": 0.5, "decode": 0.25},
                   "steps": {"prefill": 1, "decode": 3}, "restore_failures": 0}
                  for i in range(2)]
        # figures are summed over pipelines stage by stage; the plan has a row per stage
        # of every pipeline, each on a node of its own
        plan = {"nodes": [{"name": f"n{r}", "memory": 2**30, "cpus": 2}
                          for r in range(self.pipelines)],
                "stages": [{"pipeline": r, "stage": i, "node": f"n{r}",
                            "layers": [i * 2, i * 2 + 2], "weight_bytes": 10, "kv_bytes": 5,
                            "overhead_bytes": 0, "total_bytes": 15}
                           for r in range(self.pipelines) for i in range(2)]}
        return {"stages": stages, "plan": plan, "rebuilds": {"fault": 0, "evicted": 0},
                "nodes": {f"n{r}": {"resident_bytes": 2048, "physical_bytes": 0}
                          for r in range(self.pipelines)},
                "admission": {"lanes": 4, "in_use": 1, "waiting": 0, "refused": 0}}

    def status(self) -> dict:
        return {"serving": True, "detail": ""}


def board(clock, pipelines: int = 1):
    engine = ScriptedEngine(pipelines)
    memo = CacheStats("results", 0, 0, 0, 0, 0, {"hits": 0, "misses": 0})
    metrics = GatewayMetrics(engine.stats, lambda: memo,
                             lambda: {"in_use": 0, "waiting": 0, "refused": 0})
    return engine, metrics, StatusBoard(ModelSet.of(engine), metrics, InFlight(), clock=clock)


def exported(metrics: GatewayMetrics) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.render().decode().splitlines()
            if line and not line.startswith("#")}


def figures(node) -> list[dict]:
    """Every {"v", "m"} figure in a /status.json body."""
    if isinstance(node, dict):
        if set(node) == {"v", "m"}:
            return [node]
        return [f for v in node.values() for f in figures(v)]
    if isinstance(node, list):
        return [f for v in node for f in figures(v)]
    return []


def test_every_figure_is_the_metric_it_names():
    engine, metrics, status = board(lambda: 100.0)
    metrics.requests.labels("/v1/completions", "200").inc(3)
    metrics.requests.labels("/v1/completions", "400").inc()
    body = status.snapshot()
    shown = figures(body)
    assert len(shown) > 30
    text = exported(metrics)
    for f in shown:
        assert text[f["m"]] == f["v"], f
    stage = body["stages"][1]
    assert stage["layers"] == [2, 4] and stage["lanes_free"]["v"] == 3
    assert stage["cache"]["reuse"] == 1 / 3
    assert [(a["status"], a["total"]["v"]) for a in body["errors"]["answers"]] == \
        [(200, 3.0), (400, 1.0)]
    assert body["plan"]["stages"][0]["weight_format"] == "int4"


def test_a_stages_growing_counts_are_counters_and_its_levels_gauges():
    _, metrics, _ = board(lambda: 100.0)
    text = metrics.render().decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    for name in ("skippy_stage_prefill_rows", "skippy_stage_decode_rows",
                 "skippy_stage_restore_failures", "skippy_stage_compute_seconds",
                 "skippy_stage_steps", "skippy_stage_cache_hits"):
        assert types[f"{name}_total"] == "counter", name
    for name in ("skippy_stage_lanes_busy", "skippy_stage_queue_rows",
                 "skippy_stage_cache_resident_bytes"):
        assert types[name] == "gauge", name
    values = exported(metrics)
    assert values['skippy_stage_compute_seconds_total{kind="decode",stage="1"}'] == 0.25
    assert values['skippy_stage_steps_total{kind="prefill",stage="0"}'] == 1


def test_two_pipelines_show_every_stage_of_each_in_the_plan():
    _, _, status = board(lambda: 100.0, pipelines=2)
    body = status.snapshot()
    assert body["pipelines"] == 2
    assert [(r["pipeline"], r["stage"], r["node"], r["weight_format"])
            for r in body["plan"]["stages"]] == [
        (0, 0, "n0", "int4"), (0, 1, "n0", "int4"), (1, 0, "n1", "int4"), (1, 1, "n1", "int4")]
    assert [n["name"] for n in body["plan"]["nodes"]] == ["n0", "n1"]
    assert [n["node"] for n in body["nodes"]] == ["n0", "n1"]
    assert len(body["stages"]) == 2  # live figures: per stage, over both pipelines


def test_rates_come_from_two_readings_of_the_row_counters():
    now = [100.0]
    engine, metrics, status = board(lambda: now[0])
    assert status.snapshot()["stages"][0]["decode_rows_per_s"] is None  # one reading
    engine.rows = [30, 60]
    now[0] = 102.0
    stages = status.snapshot()["stages"]
    assert [s["decode_rows_per_s"] for s in stages] == [15.0, 30.0]
    assert [s["prefill_rows_per_s"] for s in stages] == [0.0, 0.0]
    # later readings rate over about the last few seconds, not since the start
    engine.rows = [30, 60]
    now[0] = 110.0
    assert status.snapshot()["stages"][0]["decode_rows_per_s"] == 0.0


def test_recent_errors_count_only_the_window():
    now = [0.0]
    engine, metrics, status = board(lambda: now[0])
    errors = metrics.requests.labels("/v1/completions", "500")
    errors.inc(5)
    status.snapshot()
    now[0] = RECENT_WINDOW_S + 10
    errors.inc(2)
    answer, = status.snapshot()["errors"]["answers"]
    assert (answer["total"]["v"], answer["recent"]) == (7.0, 2.0)
