"""The runtime benchmark (evals/bench_runtime.py): one real short run on SmolLM2 Q4_0, short
runs on tiny synthetic models for the newer options (prompt lengths, decode steps, a .gguf
path, the synthesized `llama-1.5b` route at a tiny shape, --restrict avx2), the plot from
stored JSON, and the cheap parts (prompt fallback, JSON to a file) without models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skippy.evals import bench_runtime as bench

STEP_KEYS = {"ours_ms", "reference_ms", "ratio", "ratio_range", "ours_samples_ms",
             "reference_samples_ms"}
PREFILL_KEYS = STEP_KEYS | {"tokens", "top1_match"}
DECODE_KEYS = STEP_KEYS | {"after_tokens", "steps"}
FLOOR_KEYS = {"ours_weight_format", "ours_bytes", "reference_bytes", "ours_floor_ms",
              "reference_floor_ms", "ours_of_floor", "reference_of_floor"}
ENV_KEYS = {"cpu", "torch_cpu_capability", "restrict", "restrictions", "ours_kernels",
            "llama_cpp_system_info", "llama_cpp_restricted", "llama_cpp_path"}
# A llama-shaped model small enough to synthesize, requantize and bench in seconds.
TINY = bench.SynthModel("llama", layers=2, hidden=256, ff=512, heads=4, kv_heads=2, seed=3)


@pytest.fixture
def tmp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A SKIPPY_HOME of the test's own (derived files and synthesized models land there),
    sharing the machine's built kernels so none is compiled again."""
    from skippy.mesh.models import model_home, resolve_model
    tokenizer = resolve_model("smollm2")  # pulled into the real home (the fixture's job)
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / tokenizer.name).symlink_to(tokenizer)
    kernels = model_home() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (home / "kernels").symlink_to(kernels)
    monkeypatch.setenv("SKIPPY_HOME", str(home))
    return home


def _check_decode(d: dict, steps: int, repeats: int, after: int) -> None:
    assert set(d) == DECODE_KEYS and d["steps"] == steps and d["after_tokens"] == after
    for side in ("ours", "reference"):
        samples = d[f"{side}_samples_ms"]
        assert len(samples) == repeats and all(len(rep) == steps for rep in samples)
        flat = sorted(t for rep in samples for t in rep)
        assert flat[0] > 0 and flat[0] <= d[f"{side}_ms"] <= flat[-1]
    assert d["ratio"] == pytest.approx(d["ours_ms"] / d["reference_ms"], rel=1e-12)
    lo, hi = d["ratio_range"]
    assert 0 < lo <= hi  # the spread of the per-repeat ratios


def test_real_run_json_on_stdout(smollm2, capfd: pytest.CaptureFixture[str]) -> None:
    result = bench.main(["--model", "smollm2", "--format", "q4_0", "--repeats", "1",
                         "--lanes", "4", "--decode-steps", "4", "--json", "-"])
    out, err = capfd.readouterr()
    assert json.loads(out) == result  # stdout holds the JSON and nothing else
    assert "ours/llama.cpp" in err and "bandwidth floor" in err  # the table went to stderr
    assert "batched decode" in err
    env = result["environment"]
    assert set(env) == ENV_KEYS and env["cpu"] in err and env["torch_cpu_capability"] in err
    assert env["ours_kernels"]["int4"] in err and env["restrict"] is None

    assert result["threads"] == 2 and result["repeats"] == 1 and result["warmup"] == 1
    assert result["bandwidth_gb_s"] > 0 and result["tokens"] == [bench.PROMPT_TOKENS]
    (run,) = result["runs"]
    assert run["model"] == "smollm2" and run["format"] == "q4_0"
    assert run["file"].endswith(".Q4_0.gguf") and run["file_bytes"] > 0
    assert run["tokens"] == [bench.PROMPT_TOKENS] and len(run["decode_tokens"]) == 4
    assert run["ours_kernels"] == env["ours_kernels"]["int4"]
    assert run["ours_n_ctx"] >= bench.PROMPT_TOKENS + 4 <= run["reference_n_ctx"]
    assert isinstance(run["prefill_top1_match"], bool)
    (p,) = run["prefill"]
    assert set(p) == PREFILL_KEYS and p["tokens"] == bench.PROMPT_TOKENS
    assert len(p["ours_samples_ms"]) == len(p["reference_samples_ms"]) == 1
    assert p["ours_ms"] > 0 and p["reference_ms"] > 0
    assert p["ratio"] == pytest.approx(p["ours_ms"] / p["reference_ms"], rel=1e-12)
    _check_decode(run["decode"], steps=4, repeats=1, after=bench.PROMPT_TOKENS)
    f = run["decode_bandwidth_floor"]
    assert set(f) == FLOOR_KEYS and f["ours_weight_format"] == "int4"  # serving default
    # the file's 4-bit and 8-bit blocks, scales kept as the file's halves: its bytes
    # exactly (the head's 64 rescored float32 rows aside)
    assert f["ours_bytes"] == f["reference_bytes"] > 0
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


def test_synth_model_is_written_requantized_and_cached(
        tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench.SYNTH_MODELS, "llama-1.5b", TINY)
    said: list[str] = []
    files = bench.model_files("llama-1.5b", ["q4_0", "q8_0"], said.append)
    stem = TINY.stem("llama-1.5b")
    assert files == {f: tmp_home / "derived" / f"{stem}.{f.upper()}.gguf"
                     for f in ("q4_0", "q8_0")}
    assert not list((tmp_home / "synth").glob("*.gguf"))  # the F16 stepping stone is gone
    from skippy.topology.gguf_file import GGUFFile
    for fmt, path in files.items():
        f = GGUFFile(path)
        assert f.architecture == "llama" and f.arch_key("block_count") == TINY.layers
        assert f.tensors["blk.0.ffn_up.weight"].qtype.name == fmt.upper()
        f.close()
    assert any("synthesizing llama" in s for s in said)

    # a second call reuses the derived files: nothing is synthesized or requantized
    def refuse(*a, **kw):
        raise AssertionError("synthesized again")
    monkeypatch.setattr("skippy.stages.synth.write_synthetic", refuse)
    monkeypatch.setattr("skippy.mesh.models.requantize", refuse)
    mtimes = {f: p.stat().st_mtime_ns for f, p in files.items()}
    assert bench.model_files("llama-1.5b", ["q4_0", "q8_0"], said.append) == files
    assert {f: p.stat().st_mtime_ns for f, p in files.items()} == mtimes


def test_lengths_and_decode_steps_on_synthetic_llama(
        tmp_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(bench.SYNTH_MODELS, "llama-1.5b", TINY)
    path = tmp_path / "out" / "bench.json"
    path.parent.mkdir()
    # 200 is no multiple of the 64-row chunk; the longest prompt is not the first
    result = bench.main(["--model", "llama-1.5b", "--tokens", "64,200,100", "--decode-steps",
                         "3", "--repeats", "2", "--warmup", "0", "--lanes", "0",
                         "--json", str(path)])
    assert json.loads(path.read_text()) == result
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run,) = result["runs"]
    assert run["tokens"] == [64, 200, 100] == [p["tokens"] for p in run["prefill"]]
    for p in run["prefill"]:
        assert set(p) == PREFILL_KEYS and len(p["ours_samples_ms"]) == 2
    _check_decode(run["decode"], steps=3, repeats=2, after=64)
    # both sides hold the longest prompt (and the decode after the first); ours in chunks
    assert run["reference_n_ctx"] == run["reference_n_batch"] == 200
    assert run["ours_n_ctx"] == 256
    assert run["batched_decode"] is None
    out = capsys.readouterr().out
    for label in ("prefill 64 tok", "prefill 200 tok", "prefill 100 tok", "decode / step"):
        assert f"llama-1.5b   Q4_0  int4      {label}" in out
    assert "3 steps one token at a time after the 64-token prefill" in out


def test_gguf_path_and_restrict_avx2(qwen3_f32: Path, tmp_home: Path) -> None:
    """A .gguf path as --model; --restrict avx2 runs the bench again under the restriction
    (a fresh process, as torch reads it at start-up) and says llama.cpp is not restricted.
    The child starts unrestricted even where this run is restricted (CI's AVX2 estimate)."""
    unrestricted = {k: v for k, v in os.environ.items()
                    if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    proc = subprocess.run(
        [sys.executable, "-m", "skippy.evals.bench_runtime", "--model", str(qwen3_f32),
         "--tokens", "64", "--decode-steps", "2", "--repeats", "1", "--warmup", "0",
         "--lanes", "0", "--restrict", "avx2", "--json", "-"],
        capture_output=True, text=True, timeout=300, env=unrestricted)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    env = result["environment"]
    assert env["restrict"] == "avx2" and env["torch_cpu_capability"] == "AVX2"
    assert env["restrictions"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "avx512" not in env["ours_kernels"]["int4"]
    assert env["llama_cpp_restricted"] is False and "AVX2 = 1" in env["llama_cpp_system_info"]
    assert "re-executing with ATEN_CPU_CAPABILITY=avx2" in proc.stderr
    assert "llama.cpp side is NOT restricted" in proc.stderr
    (run,) = result["runs"]
    assert run["model"] == str(qwen3_f32) and run["format"] == "q4_0"
    assert Path(run["file"]).parent == tmp_home / "derived"
    assert "qwen3-L6     Q4_0" in proc.stderr  # a path's row is labelled by its stem


def test_plot_from_stored_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps(_fake_result([("smollm2", "q4_0"), ("llama-1.5b", "q8_0")])))
    assert bench.main(["--plot", str(stored)]) == json.loads(stored.read_text())
    png = tmp_path / "stored.png"
    assert capsys.readouterr().out.strip() == str(png)
    import matplotlib.image
    image = matplotlib.image.imread(png)
    assert image.shape[0] > image.shape[1] / 2 and image.shape[2] in (3, 4)  # two rows


def test_bad_arguments_are_refused(tmp_path: Path, capsys) -> None:
    for argv in (["--tokens", "0"], ["--tokens", "12,x"], ["--decode-steps", "0"],
                 ["--model", "gpt17"], ["--model", str(tmp_path / "absent.gguf")],
                 ["--restrict", "sse2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    assert bench.parse_args(["--tokens", "128,2048,128"]).tokens == [128, 2048]


def test_prompt_falls_back_to_builtin_text_and_says_so(tmp_path: Path) -> None:
    text, source = bench.prompt_text(tmp_path / "absent.jsonl")
    assert text == bench.FALLBACK_TEXT and "not found" in source

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "r1", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
        + "\n" + json.dumps({"id": "r2", "messages": []}) + "\n")
    text, source = bench.prompt_text(corpus)
    assert text == "Be brief.\n\nHi" and "r1" in source


def _fake_run(model: str, fmt: str, tokens=(128, 2048)) -> dict:
    def step(ours, ref, **extra):
        return {**extra, "ours_ms": ours, "reference_ms": ref, "ratio": ours / ref,
                "ours_samples_ms": [ours], "reference_samples_ms": [ref]}
    decode = step(30.0, 10.0, after_tokens=tokens[0], steps=4)
    decode["ours_samples_ms"] = [[31.0, 30.0, 29.0, 30.0]]
    decode["reference_samples_ms"] = [[10.0, 11.0, 9.0, 10.0]]
    return {"model": model, "format": fmt, "prompt_source": "test", "tokens": list(tokens),
            "prefill_top1_match": True, "ours_lane_batch": 1, "other_cpu_share": 0.01,
            "prefill": [step(n / 4, n / 8, tokens=n, top1_match=True) for n in tokens],
            "decode": decode,
            "decode_bandwidth_floor": {
                "ours_weight_format": "fp32", "ours_bytes": 27_000_000,
                "reference_bytes": 2_700_000, "ours_floor_ms": 1.0,
                "reference_floor_ms": 0.1, "ours_of_floor": 30.0,
                "reference_of_floor": 100.0}}


def _fake_result(pairs) -> dict:
    return {"llama_cpp_version": "0.0", "threads": 2, "repeats": 1, "warmup": 1,
            "environment": {"cpu": "Test CPU", "torch_cpu_capability": "AVX2"},
            "runs": [_fake_run(m, f) for m, f in pairs]}


def test_json_path_writes_file_and_table_on_stdout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "model_files",
                        lambda model, formats, say: {f: Path(f"/m/{model}.{f}") for f in formats})
    monkeypatch.setattr(bench, "bench_one", lambda model, fmt, path, **kw: _fake_run(
        model, fmt, tuple(kw["tokens"])))
    path = tmp_path / "bench.json"
    result = bench.main(["--model", "smollm2", "--model", "gemma3-270m", "--format", "q4_0",
                         "--format", "q8_0", "--tokens", "128,2048", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    assert path.with_suffix(".png").is_file()
    assert [(r["model"], r["format"]) for r in result["runs"]] == [
        ("smollm2", "q4_0"), ("smollm2", "q8_0"), ("gemma3-270m", "q4_0"),
        ("gemma3-270m", "q8_0")]
    out = capsys.readouterr().out
    assert "gemma3-270m  Q8_0  fp32      decode / step" in out and "3.00x" in out
    assert "gemma3-270m  Q8_0  fp32      prefill 2048 tok" in out
    env = result["environment"]
    assert f"CPU: {env['cpu']}; torch CPU capability {env['torch_cpu_capability']}" in out
