"""The prefix-cache lookup benchmark (evals/bench_cache.py): a small real run, its JSON
and table, and argument checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from skippy.evals import bench_cache as bench

TIMING_KEYS = {"p50_us", "p99_us", "mean_us", "min_us", "samples"}


def test_small_run_reports_every_case_and_writes_json(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    result = bench.main(["--entries", "16,64", "--repeats", "20", "--json", str(path)])
    out = capsys.readouterr().out
    assert json.loads(path.read_text()) == result

    c = result["config"]
    assert c["entries"] == [16, 64] and c["tokens"] == 2048 and c["block"] == 64
    assert c["system"] == 512 and c["repeats"] == 20 and c["warmup"] == 5
    assert c["timer_overhead_ns"] >= 0
    assert [s["entries"] for s in result["sizes"]] == [16, 64]
    for size in result["sizes"]:
        assert set(size["cases"]) == set(bench.CASES)
        for case, v in size["cases"].items():
            for part in ("hash", "match", "lookup"):
                t = v[part]
                assert TIMING_KEYS <= set(t) and t["samples"] == 20
                assert 0 < t["min_us"] <= t["p50_us"] <= t["p99_us"]
                assert t["mean_us"] > 0
            assert v["hash"]["tokens"] > 0
            assert v["hash"]["us_per_token"] == pytest.approx(
                v["hash"]["p50_us"] / v["hash"]["tokens"])
            assert v["candidates"] >= (0 if case == "miss" else 1)
        want = {"miss": 0, "early": 64, "system": 512, "middle": 1024, "late": 1984,
                "exact": 2048}
        assert {k: v["matched_tokens"] for k, v in size["cases"].items()} == want
        # every prompt shares the system prefix: those queries must rank all entries
        assert size["cases"]["early"]["candidates"] == size["entries"]
        assert size["cases"]["system"]["candidates"] == size["entries"]
        for op in ("insert", "evict"):
            assert TIMING_KEYS <= set(size[op]) and size[op]["p50_us"] > 0

    v = result["verdict"]
    assert v["match_p50"]["at_entries"] == 64
    assert v["match_p50"]["target_us"] == bench.MATCH_P50_TARGET_US
    assert isinstance(v["match_p50"]["pass"], bool)
    assert v["match_p50"]["pass"] == (not v["match_p50"]["failing_cases"])
    assert v["hash_per_token"]["worst_us_per_token"] > 0
    assert isinstance(v["hash_per_token"]["pass"], bool)
    for needle in ("match p50/p99", "lookup p50/p99", "reserve+commit",
                   "target matching p50", "target hashing"):
        assert needle in out
    assert ("PASS" in out) or ("FAIL" in out)


def test_json_on_stdout_keeps_the_table_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    result = bench.main(["--entries", "8", "--tokens", "256", "--block", "16",
                         "--repeats", "5", "--json", "-"])
    out, err = capsys.readouterr()
    assert json.loads(out) == result  # stdout holds the JSON and nothing else
    assert "target hashing" in err
    assert result["config"]["system"] == 64
    assert result["sizes"][0]["cases"]["late"]["matched_tokens"] == 240


@pytest.mark.parametrize("argv", [["--block", "100"], ["--tokens", "128"],
                                  ["--system", "1024"], ["--entries", "0"],
                                  ["--repeats", "0"]])
def test_rejects_impossible_shapes(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
