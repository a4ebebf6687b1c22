"""The lazy GGUF reader against gguf-py's own reader."""

import time

import pytest
from gguf import GGUFReader

from skippy.topology.gguf_file import GGUFError, GGUFFile
from skippy.topology.model_config import ModelConfig


def test_metadata_and_tensors_match_gguf_py(smollm2):
    ours, theirs = GGUFFile(smollm2), GGUFReader(smollm2)
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors[:12]:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
    assert ours.get("tokenizer.ggml.tokens") == list(theirs.fields["tokenizer.ggml.tokens"].contents())
    assert ours.arch_key("block_count") == 30


def test_opening_skips_the_tokenizer_cost(gemma3):
    start = time.perf_counter()
    f = GGUFFile(gemma3)
    assert time.perf_counter() - start < 1.0  # GGUFReader spends ~10 s here
    cfg = ModelConfig.from_gguf(f)
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.tied_head and cfg.sliding_window == 512
    assert [cfg.is_swa_layer(i) for i in range(6)] == [True] * 5 + [False]
    assert cfg.rope_base_for(0) == 10000.0 and cfg.rope_base_for(5) == 1e6


def test_not_a_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFError, match="bad magic"):
        GGUFFile(bad)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(6))
    with pytest.raises(GGUFError):
        GGUFFile(truncated)
