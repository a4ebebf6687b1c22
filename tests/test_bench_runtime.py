"""The runtime benchmark (evals/bench_runtime.py): one real short run on SmolLM2 Q4_0, and
the cheap parts (prompt fallback, JSON to a file) without models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skippy.evals import bench_runtime as bench

STEP_KEYS = {"ours_ms", "reference_ms", "ratio", "ours_samples_ms", "reference_samples_ms"}
FLOOR_KEYS = {"ours_weight_format", "ours_bytes", "reference_bytes", "ours_floor_ms",
              "reference_floor_ms", "ours_of_floor", "reference_of_floor"}


def test_real_run_json_on_stdout(smollm2, capfd: pytest.CaptureFixture[str]) -> None:
    result = bench.main(["--model", "smollm2", "--format", "q4_0", "--repeats", "1",
                         "--lanes", "4", "--json", "-"])
    out, err = capfd.readouterr()
    assert json.loads(out) == result  # stdout holds the JSON and nothing else
    assert "ours/llama.cpp" in err and "bandwidth floor" in err  # the table went to stderr
    assert "batched decode" in err

    assert result["threads"] == 2 and result["repeats"] == 1 and result["warmup"] == 1
    assert result["bandwidth_gb_s"] > 0
    (run,) = result["runs"]
    assert run["model"] == "smollm2" and run["format"] == "q4_0"
    assert run["file"].endswith(".Q4_0.gguf") and run["file_bytes"] > 0
    assert run["prompt_tokens"] == bench.PROMPT_TOKENS
    assert isinstance(run["prefill_top1_match"], bool)
    for step in ("prefill", "decode"):
        s = run[step]
        assert set(s) == STEP_KEYS
        assert len(s["ours_samples_ms"]) == len(s["reference_samples_ms"]) == 1
        assert s["ours_ms"] > 0 and s["reference_ms"] > 0
        assert s["ratio"] == pytest.approx(s["ours_ms"] / s["reference_ms"], rel=1e-12)
    f = run["decode_bandwidth_floor"]
    assert set(f) == FLOOR_KEYS and f["ours_weight_format"] == "int4"  # serving default
    # the file's 4-bit blocks, but an fp32 head: more bytes than the file's
    assert f["ours_bytes"] > f["reference_bytes"] > 0
    assert f["reference_bytes"] <= run["file_bytes"]
    b = run["batched_decode"]
    assert b["lanes"] == 4 and len(b["step_samples_ms"]) == 10 and b["step_ms"] > 0
    assert b["bitwise_alone_vs_together"] is True  # a lane ignores its neighbours
    assert b["single_lane_tok_s"] == pytest.approx(1e3 / run["decode"]["ours_ms"])
    assert b["ratio"] == pytest.approx(b["aggregate_tok_s"] / b["single_lane_tok_s"])
    for side in ("ours", "reference"):
        assert f[f"{side}_floor_ms"] == pytest.approx(
            f[f"{side}_bytes"] / (result["bandwidth_gb_s"] * 1e9) * 1e3)
        assert f[f"{side}_of_floor"] == pytest.approx(
            run["decode"][f"{side}_ms"] / f[f"{side}_floor_ms"])


def test_prompt_falls_back_to_builtin_text_and_says_so(tmp_path: Path) -> None:
    text, source = bench.prompt_text(tmp_path / "absent.jsonl")
    assert text == bench.FALLBACK_TEXT and "not found" in source

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "r1", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
        + "\n" + json.dumps({"id": "r2", "messages": []}) + "\n")
    text, source = bench.prompt_text(corpus)
    assert text == "Be brief.\n\nHi" and "r1" in source


def test_json_path_writes_file_and_table_on_stdout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def fake_run(model, fmt, **kw):
        step = {"ours_ms": 30.0, "reference_ms": 10.0, "ratio": 3.0,
                "ours_samples_ms": [30.0], "reference_samples_ms": [10.0]}
        return {"model": model, "format": fmt, "prompt_source": "test", "prompt_tokens": 128,
                "prefill_top1_match": True, "prefill": step, "decode": step,
                "decode_bandwidth_floor": {
                    "ours_weight_format": "fp32", "ours_bytes": 27_000_000,
                    "reference_bytes": 2_700_000, "ours_floor_ms": 1.0,
                    "reference_floor_ms": 0.1, "ours_of_floor": 30.0,
                    "reference_of_floor": 100.0}}

    monkeypatch.setattr(bench, "bench_one", fake_run)
    path = tmp_path / "bench.json"
    result = bench.main(["--model", "smollm2", "--model", "gemma3-270m", "--format", "q4_0",
                         "--format", "q8_0", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    assert [(r["model"], r["format"]) for r in result["runs"]] == [
        ("smollm2", "q4_0"), ("smollm2", "q8_0"), ("gemma3-270m", "q4_0"),
        ("gemma3-270m", "q8_0")]
    out = capsys.readouterr().out
    assert "gemma3-270m  Q8_0  fp32  decode 1 tok" in out and "3.00x" in out
