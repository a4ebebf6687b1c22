"""The warm-hit benchmark (evals/bench_stage_cache.py): a short real run on a tiny
synthesized LFM2, both of our runtimes against llama.cpp, and the cheap parts without
models."""

from __future__ import annotations

import pytest

from skippy.evals import bench_stage_cache as bench
from skippy.evals import plots

TINY = bench.Family("lfm2-tiny", "hybrid",
                    shape=bench.Shape("lfm2", layers=3, hidden=256, heads=4, kv_heads=2,
                                      ff=512))


def test_tiny_hybrid_run_has_every_row_and_exact_answers(smollm2, tmp_path) -> None:
    lines: list[str] = []
    result = bench.bench(TINY, repeats=1, prefix=64, long_prefix=128, synth_dir=tmp_path,
                         say=lines.append)
    assert (tmp_path / TINY.shape.file_name()).is_file()  # synthesized where asked
    assert "3 layers, hidden 256" in lines[0] and result["shape"]["hidden"] == 256
    assert result["llama_cpp_recurrent"] is True  # llama.cpp sees LFM2 as a hybrid
    assert result["skipped_runtimes"] == {}
    rows = {(r["row"], r["runtime"]): r for r in result["rows"]}
    assert set(rows) == {(row, rt) for row in ("exact_repeat", "changed_tail", "changed_tail_128")
                         for rt in bench.RUNTIMES}
    for (row, _), r in rows.items():
        assert r["ours"]["next_token_exact"] is True
        assert r["ours_ms"] > 0 and r["llama_cpp_ms"] > 0
        assert r["speedup"] == pytest.approx(r["llama_cpp_ms"] / r["ours_ms"])
        assert len(r["ours"]["samples_ms"]) == len(r["llama_cpp"]["samples_ms"]) == 1
        # a warm hit: the whole prompt (exact) or the whole prefix (tail) was reused
        assert r["ours"]["reused_tokens"] == r["prefix_tokens"]
        want = 8.0 if row == "changed_tail" else None
        assert r["target"] == want and (r["met"] is None) == (want is None)
        # llama.cpp's own tail-only cost bounds a tail row's speedup (a hybrid model)
        if row == "exact_repeat":
            assert r["ceiling"] is None
        else:
            tail_only = r["llama_cpp"]["tail_only_ms"]  # timings: no order asserted
            assert tail_only > 0
            assert r["ceiling"] == pytest.approx(r["llama_cpp_ms"] / tail_only)
    assert rows[("changed_tail", "torch")]["ours"]["logits_bitwise"] is True
    summary = bench.summary([result], repeats=1)
    assert summary["targets_met"] == all(r["met"] for r in result["rows"]
                                         if r["met"] is not None)
    png = plots.render(summary, tmp_path / "stage_cache.png", "bench_stage_cache")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_rows_and_targets_per_family_kind() -> None:
    dense = bench.rows_for("dense")
    assert [(r.name, r.prefix, r.tail, r.target) for r in dense] == [
        ("exact_repeat", 128, 0, 1.2), ("changed_tail", 128, 16, None)]
    hybrid = bench.rows_for("hybrid")
    assert [(r.name, r.prefix, r.target) for r in hybrid] == [
        ("exact_repeat", 128, None), ("changed_tail", 128, 8.0),
        ("changed_tail_1024", 1024, None)]
    prompts = hybrid[1].prompts(3)
    assert len(prompts) == 4 and len({tuple(p) for p in prompts}) == 4
    assert all(p[:128] == prompts[0][:128] and len(p) == 144 for p in prompts)
    assert hybrid[0].prompts(2) == [prompts[0][:128]] * 3


def test_bench_shapes_are_realistic_and_named() -> None:
    for name in ("lfm2", "falcon-h1"):
        s = bench.FAMILIES[name].shape
        assert s.hidden >= 1024 and s.layers >= 16 and s.dtype == "f16"
        assert name in s.file_name() and "h1024" in s.file_name()
    assert "Mamba2 d_inner" in bench.FAMILIES["falcon-h1"].describe()
    assert bench.FAMILIES["smollm2"].shape is None


def test_format_row_marks_targets() -> None:
    r = {"row": "exact_repeat", "runtime": "torch", "ours_ms": 1.0, "llama_cpp_ms": 3.0,
         "speedup": 3.0, "target": 1.2, "met": True,
         "ours": {"logits_bitwise": True, "reused_tokens": 128}}
    line = bench.format_row("smollm2", r)
    assert "3.00x" in line and "4.00x" in bench.format_row("lfm2", {**r, "ceiling": 4.0})
    assert "3.00x" in line and "1.2x" in line and "yes" in line and "bitwise" in line
    line = bench.format_row("lfm2", {**r, "target": None, "met": None})
    assert " - " in line
