"""The gateway bench's parts: scenario builders, statistics, the speedup/targets table,
server process handling, and the HTTP runners against our gateway in-process."""

from __future__ import annotations

import math
import os
import sys
import time

import pytest

from skippy.evals import bench_gateway as bg
from skippy.evals import plots, rounds
from skippy.evals.ceiling import ceiling_line, concurrent_ceiling

pytestmark = pytest.mark.timeout(300)


def records(counts: dict[str, int]) -> list[dict]:
    """Fake corpus records in file order: each use case's records together."""
    return [{"use_case": uc, "id": f"{uc}-{i}",
             "messages": [{"role": "user", "content": f"{uc} question {i}"}]}
            for uc, n in counts.items() for i in range(n)]


# -- scenarios -----------------------------------------------------------------------------------
def test_interleave_takes_record_i_of_each_use_case_in_turn():
    got = [r["id"] for r in bg.interleave(records({"a": 3, "b": 1, "c": 2}))]
    assert got == ["a-0", "b-0", "c-0", "a-1", "c-1", "a-2"]


def test_interleave_keeps_first_seen_use_case_order():
    rs = records({"z": 2, "a": 2})
    assert [r["id"] for r in bg.interleave(rs)] == ["z-0", "a-0", "z-1", "a-1"]


def test_records_over_the_context_are_split_off():
    rs = records({"a": 4})
    sizes = {"a-0": 10, "a-1": 100, "a-2": 83, "a-3": 84}
    count = lambda messages: sizes[messages[0]["content"].replace(" question ", "-")]  # noqa: E731
    fit, over = bg.split_by_context(rs, count, n_ctx=100, max_tokens=1, margin=16)
    assert [r["id"] for r in fit] == ["a-0", "a-2"]
    assert [r["id"] for r in over] == ["a-1", "a-3"]


def test_concurrent_prompts_are_all_different():
    msgs = bg.concurrent_messages(8, 5)
    assert len(msgs) == 8 and all(len(m) == 5 for m in msgs)
    texts = [m[0]["content"] for client in msgs for m in client]
    assert len(set(texts)) == 40


def test_repeat_prompt_encodes_to_the_asked_length_with_a_toy_vocabulary():
    encode = lambda text: ["<s>"] + text.split()  # noqa: E731  a BOS, then words
    decode = lambda ids: " ".join(ids)  # noqa: E731
    text, n = bg.repeat_prompt("one two three four five", encode, decode, n=12)
    assert n == 12 and len(encode(text)) == 12


def test_repeat_prompt_with_the_real_vocabulary(smollm2):
    from skippy.mesh.tokenizer import Tokenizer
    tok = Tokenizer(smollm2)
    text, n = bg.repeat_prompt("The harbour town woke slowly; gulls argued. " * 3,
                               tok.encode, tok.decode)
    assert n == len(tok.encode(text))
    assert abs(n - bg.REPEAT_PROMPT_TOKENS) <= 2


# -- statistics and the table ------------------------------------------------------------------------
def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert bg.percentile(values, 95) == 95
    assert bg.percentile(values, 50) == 50
    assert bg.percentile([7.0], 95) == 7.0
    assert bg.percentile([3, 1, 2], 100) == 3
    assert math.isnan(bg.percentile([], 95))


def test_summarize_gives_median_p95_and_total():
    s = bg.summarize([10.0, 20.0, 30.0, 1000.0])
    assert s["n"] == 4 and s["median_ms"] == 25.0 and s["p95_ms"] == 1000.0
    assert s["total_s"] == pytest.approx(1.06)


def test_speedup_is_latency_reference_over_ours_and_throughput_ours_over_reference():
    assert bg.speedup("repeat", {"median_ms": 2.0}, {"median_ms": 6.0}) == 3.0
    assert bg.speedup("concurrent", {"tokens_per_s": 90.0}, {"tokens_per_s": 30.0}) == 3.0
    assert math.isnan(bg.speedup("file_order", {}, {"median_ms": 1.0}))


def fake_servers() -> dict:
    def seq(ms):
        return {"median_ms": ms, "p95_ms": ms * 2}
    ref = {"repeat": seq(6.0), "file_order": seq(120.0), "interleaved": seq(500.0),
           "concurrent": {"tokens_per_s": 40.0, "median_ms": 1.0, "p95_ms": 1.0}}
    one = {"repeat": seq(2.0), "file_order": seq(110.0), "interleaved": seq(50.0),
           "concurrent": {"tokens_per_s": 100.0, "median_ms": 1.0, "p95_ms": 1.0}}
    two = {"repeat": seq(3.0), "file_order": seq(100.0)}
    return {"reference": {"scenarios": ref}, "ours_1_llama.cpp": {"scenarios": one},
            "ours_2_torch": {"scenarios": two}}


def test_each_configuration_meets_its_own_targets():
    rows = bg.comparisons(fake_servers())
    by = {(r["scenario"], r["config"]): r for r in rows}
    assert set(by) == {("repeat", "ours_1_llama.cpp"), ("file_order", "ours_1_llama.cpp"),
                       ("interleaved", "ours_1_llama.cpp"), ("concurrent", "ours_1_llama.cpp"),
                       ("repeat", "ours_2_torch"), ("file_order", "ours_2_torch")}
    assert by["file_order", "ours_2_torch"]["met"] is True  # split path: 1.2x >= 1.0x
    assert by["repeat", "ours_1_llama.cpp"]["met"] is True          # 3.0x >= 1.5x
    assert by["file_order", "ours_1_llama.cpp"]["met"] is False     # 1.09x < 1.2x
    assert by["interleaved", "ours_1_llama.cpp"]["met"] is True     # 10x >= 5x
    assert by["concurrent", "ours_1_llama.cpp"]["met"] is True      # 2.5x >= 2x
    two = by["repeat", "ours_2_torch"]
    assert two["target"] is None and two["met"] is None and two["speedup"] == 2.0


def test_table_shows_every_row_with_target_and_verdict():
    servers = fake_servers()
    servers["ours_2_torch"]["error"] = "the server was not ready"
    result = {"settings": {"model": "smollm2", "file": "/x/m.gguf", "n_ctx": 4096,
                           "records": 10, "over_context": 2, "repeats": 5, "clients": 8,
                           "requests_per_client": 2},
              "servers": servers, "comparisons": bg.comparisons(servers),
              "loadavg_before": "0.1", "loadavg_after": "0.2"}
    text = bg.table(result)
    assert "2 over the context skipped" in text
    assert text.count("ours 1 stage llama.cpp") == 4
    assert " NO" in text and "yes" in text and "5.0x" in text
    assert "100.0/s" in text and "40.0/s" in text
    assert "ours_2_torch: the server was not ready" in text
    assert "machine speed" not in text  # a result from before the readings existed
    servers["reference"].update(label="llama.cpp server", machine_ms=9.0)
    servers["ours_1_llama.cpp"].update(label="ours 1 stage llama.cpp", machine_ms=13.5)
    result["machine_ms_after"] = 10.0
    assert bg.table(result).endswith(
        "before each server: llama.cpp server 9.0 · ours 1 stage llama.cpp 13.5 · "
        "at the end 10.0; spread 1.50x")


def test_rounds_merge_pooling_samples_and_taking_rates_by_their_median():
    a = {"concurrent": {"tokens_per_s": 100.0, "clients": 8, "errors": 1, "first_error": None,
                        "samples_ms": [1.0, 2.0], "sweep": [{"clients": 1, "tokens_per_s": 10.0}]}}
    b = {"concurrent": {"tokens_per_s": 140.0, "clients": 8, "errors": 0, "first_error": "x",
                        "samples_ms": [3.0], "sweep": [{"clients": 1, "tokens_per_s": 12.0}]}}
    c = {"concurrent": {"tokens_per_s": 90.0, "clients": 8, "errors": 2, "first_error": "y",
                        "samples_ms": [4.0], "sweep": [{"clients": 1, "tokens_per_s": 20.0}]}}
    m = rounds.merge([a, b, c], bg.summarize)["concurrent"]
    assert m["tokens_per_s"] == 100.0 and m["clients"] == 8  # a rate's median; a shared count
    assert m["errors"] == 3 and m["first_error"] == "x"      # errors over every round
    assert m["samples_ms"] == [1.0, 2.0, 3.0, 4.0] and m["n"] == 4 and m["median_ms"] == 2.5
    assert m["sweep"] == [{"clients": 1, "tokens_per_s": 12.0}]  # item by item


def test_in_rounds_a_speedup_is_the_median_of_the_rounds_ratios():
    """Each round's pair ran back to back: the median of the rounds' ratios, not the ratio
    of the pooled figures (which a drifting machine skews)."""
    def lat(ms):
        return {"file_order": {"median_ms": ms, "p95_ms": ms}}
    ours = [lat(10.0), lat(20.0), lat(30.0)]   # the machine slowed down round by round,
    ref = [lat(12.0), lat(30.0), lat(33.0)]    # both servers alike: 1.2x, 1.5x, 1.1x
    servers = {"reference": {"rounds": ref, "scenarios": rounds.merge(ref, bg.summarize)},
               "ours_2_torch": {"rounds": ours, "scenarios": rounds.merge(ours, bg.summarize)}}
    row, = bg.comparisons(servers)
    assert row["round_speedups"] == pytest.approx([1.2, 1.5, 1.1])
    assert row["speedup"] == pytest.approx(1.2)
    result = {"settings": {"model": "smollm2", "file": "/x/m.gguf", "n_ctx": 4096, "records": 3,
                           "over_context": 0, "repeats": 5, "clients": 8, "rounds": 3,
                           "requests_per_client": 2},
              "servers": servers, "comparisons": [row], "loadavg_before": "0.1",
              "loadavg_after": "0.2"}
    text = bg.table(result)
    assert ", in turn for 3 rounds" in text and "1.20 / 1.50 / 1.10" in text


def test_the_concurrent_ceiling_from_bench_runtimes_figures():
    """The 2026-12-06 AVX2 sitting (evals/README.md): 32 chats, 1,466 prompt and 508
    completion tokens; 8-row steps of 26.6 ms; prefills of 128 rows in 168.1 / 214.2 ms;
    llama.cpp's decode 7.26 ms."""
    runtime = {"runs": [{"prefill": [{"tokens": 128, "ours_ms": 168.1, "reference_ms": 214.2}],
                         "decode": {"ours_ms": 6.19, "reference_ms": 7.26},
                         "batched_decode": {"lanes": 8, "step_ms": 26.6}}]}
    scenario = {"requests": 32, "prompt_tokens": 1466, "completion_tokens": 508}
    c = concurrent_ceiling(runtime, scenario)
    ours_s = (1466 * 168.1 / 128 + 60 * 26.6) / 1e3      # 476 decoded tokens: 60 steps
    ref_s = (1466 * 214.2 / 128 + 476 * 7.26) / 1e3
    assert c["ceiling"] == pytest.approx(ref_s / ours_s) and 1.6 < c["ceiling"] < 1.75
    assert c["ours_tok_s"] == pytest.approx(508 / ours_s) and "ceiling_vs_measured" not in c
    servers = {"reference": {"scenarios": {"concurrent": {"tokens_per_s": 73.0}}},
               "ours_2_torch": {"scenarios": {"concurrent": scenario}}}
    c = bg.ceiling_of(servers, runtime)
    assert c["ceiling_vs_measured"] == pytest.approx(508 / ours_s / 73.0)
    assert ceiling_line(c).startswith("(d) ceiling on this CPU (bench_runtime): ours at most "
                                      "144 tok/s (8-row steps of 26.6 ms")
    assert bg.ceiling_of({"reference": servers["reference"]}, runtime) is None


def test_machine_speed_times_llama_cpp_decodes(smollm2):
    ms = bg.machine_speed(smollm2, tokens=4)
    assert 0.1 < ms < 1000


# -- servers ----------------------------------------------------------------------------------------
SPAWNING_SERVER = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_a_server_and_everything_it_started_are_killed_at_the_end():
    port = bg.free_port()
    server = bg.ServerProcess([sys.executable, "-c", SPAWNING_SERVER, str(port)],
                              f"http://127.0.0.1:{port}", "/health")
    with server:
        pid = server.proc.pid
        deadline = time.monotonic() + 10
        while not bg.descendants(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        children = bg.descendants(pid)
        assert children
    assert server.proc is None
    assert not bg._running(pid) and not any(bg._running(c) for c in children)


def test_a_server_that_exits_early_reports_its_log():
    server = bg.ServerProcess([sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                              "http://127.0.0.1:9", "/health")
    with pytest.raises(RuntimeError, match="code 3(.|\n)*no model here"):
        server.start(timeout=30)
    server.stop()


# -- the HTTP runners against our gateway -------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(smollm2):
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    from skippy.mesh.front.gateway import BackgroundServer, create_app
    engine = InProcessEngine(smollm2, 1, n_ctx=1024, cache=CacheConfig(enabled=False),
                             weight_format="int4",
                             model_name="smollm2")
    with BackgroundServer(create_app(engine, api_keys=())) as srv:
        yield srv


def test_every_scenario_runs_against_our_gateway(gateway, smollm2, tmp_path):
    rs = records({"a": 2, "b": 2})
    work = bg.Workload("smollm2", "The harbour town woke slowly.", repeats=3,
                       file_order=rs, interleaved=bg.interleave(rs),
                       concurrent=bg.concurrent_messages(2, 2), sweep=(1,),
                       next_turn=tuple(rs[:2]), streams=2)
    out = bg.run_scenarios(gateway.url, work, ours=True, say=lambda m: None)
    assert set(out) == set(bg.SCENARIOS)
    for name, s in out.items():
        assert s["errors"] == 0, (name, s["first_error"])
    assert out["repeat"]["n"] == 3 and out["repeat"]["completion_tokens"] == 3
    assert out["file_order"]["ids"] == ["a-0", "a-1", "b-0", "b-1"]
    assert out["interleaved"]["ids"] == ["a-0", "b-0", "a-1", "b-1"]
    assert out["interleaved"]["tags"] == ["a", "b", "a", "b"]  # each sample's use case
    assert out["next_turn"]["n"] == 2 and len(out["next_turn"]["cached_tokens"]) == 2
    assert out["stream"]["n"] == 2  # the warm-up untimed
    assert set(out["long_stream"]["by_use_case"]) == set(bg.LONG_USE_CASES)
    c = out["concurrent"]
    assert c["requests"] == 4 and c["n"] == 4
    assert 0 < c["completion_tokens"] <= 4 * 16 and c["tokens_per_s"] > 0
    one, = c["sweep"]  # 1 client first, then the 2 of the scenario
    assert one["clients"] == 1 and one["requests"] == 2 and one["tokens_per_s"] > 0
    # the figures as the bench keeps them draw (this server standing in for both sides)
    servers = {key: {"label": key, "scenarios": out} for key in ("reference",
                                                                  "ours_1_llama.cpp")}
    result = {"settings": {"model": "smollm2", "file": str(smollm2),
                           "requests_per_client": 2}, "servers": servers,
              "comparisons": bg.comparisons(servers)}
    png = plots.render(result, tmp_path / "gateway.png", "bench_gateway")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # a second round (`--rounds`), in cache namespaces of its own, merges with the first
    again = bg.run_scenarios(gateway.url, work, ours=True, say=lambda m: None,
                             scenarios=("repeat", "concurrent"), round_tag="-r1")
    merged = rounds.merge([{k: out[k] for k in again}, again], bg.summarize)
    assert merged["repeat"]["n"] == 6 and merged["repeat"]["errors"] == 0
    assert merged["concurrent"]["requests"] == 4 and len(merged["concurrent"]["sweep"]) == 1


def test_failed_requests_are_counted_not_timed(gateway):
    body = bg.chat_body("no-such-model", [{"role": "user", "content": "hi"}], 1)
    out = bg.run_sequential(gateway.url, "/v1/chat/completions", [body, body])
    assert out["errors"] == 2 and out["n"] == 0 and "HTTP 404" in out["first_error"]
