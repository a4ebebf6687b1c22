"""LFM2, the short-convolution + attention hybrid, on the registry's synthetic GGUF: what
only this family has (its file, its f16 conv kernels, its conv state). The family bar
(tests/test_family_bar.py) runs llama.cpp agreement, resume and export checks on the same
file; tests/test_certify.py its split equivalence at 3 stages in every weight format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family_checks import case_file
from skippy.evals.reference import LlamaCppReference
from skippy.stages.layers import rms_norm
from skippy.stages.runtime import StageSpec
from skippy.stages.synth import write_synthetic
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.families import family_for
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 6  # conv, conv, attention, conv, conv, attention
CHUNK = 32
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]  # boundaries 32, 64, 96, 128


@pytest.fixture(scope="module")
def lfm2_f32(smollm2, tmp_path_factory):
    return case_file("lfm2", tmp_path_factory)


def runtime(path, **kw) -> TorchStageRuntime:
    return TorchStageRuntime(StageSpec(str(path), 0, LAYERS, n_ctx=512, **kw))


# -- the family and its file ------------------------------------------------------------------
def test_lfm2_is_a_kv_recurrent_family():
    assert family_for("lfm2").cache_policy == "KvRecurrent"


def test_synthetic_file_marks_conv_layers_by_zero_kv_heads(lfm2_f32, smollm2, tmp_path):
    f = GGUFFile(lfm2_f32)
    assert f.arch_key("attention.head_count_kv") == [0, 0, 2, 0, 0, 2]
    assert f.arch_key("shortconv.l_cache") == 3
    assert f.tensors["blk.0.shortconv.conv.weight"].shape == (3, 256)  # ggml {l_cache, n_embd}
    assert f.tensors["blk.0.shortconv.in_proj.weight"].shape == (256, 768)
    assert "token_embd_norm.weight" in f.tensors and "output_norm.weight" not in f.tensors
    assert "blk.2.attn_q_norm.weight" in f.tensors and "blk.2.shortconv.conv.weight" not in f.tensors
    cfg = ModelConfig.from_gguf(f)
    assert cfg.conv_layers == {0, 1, 3, 4} and cfg.conv_l_cache == 3 and cfg.n_kv_heads == 2
    f.close()
    again = write_synthetic("lfm2", layers=LAYERS, seed=3, out=tmp_path / "again.gguf",
                            tokenizer_from=smollm2)
    assert again.read_bytes() == lfm2_f32.read_bytes()


# -- llama.cpp as the reference ---------------------------------------------------------------
def test_f16_file_keeps_conv_kernels_f32_and_matches_llama_cpp(smollm2, tmp_path):
    """llama.cpp's ssm_conv reads only f32 kernels; its f16 matmuls round activations to
    f16, so the bar is top-1, not 1e-3."""
    path = write_synthetic("lfm2", layers=3, seed=7, out=tmp_path / "f16.gguf",
                           tokenizer_from=smollm2, dtype="f16")
    f = GGUFFile(path)
    assert f.tensors["blk.0.shortconv.conv.weight"].qtype.name == "F32"
    assert f.tensors["blk.0.shortconv.in_proj.weight"].qtype.name == "F16"
    f.close()
    expected = LlamaCppReference(path, n_ctx=256).logits(PROMPT)
    rt = TorchStageRuntime(StageSpec(str(path), 0, 3, n_ctx=256))
    got = rt.prefill(rt.alloc_lane(), torch.tensor(PROMPT), logits="all").logits.numpy()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.99
    assert np.abs(got - expected).max() < 0.05


# -- recurrent state -------------------------------------------------------------------------
def test_a_snapshot_holds_the_conv_state_of_every_conv_layer(lfm2_f32):
    rt = runtime(lfm2_f32, chunk=CHUNK)
    snaps = rt.prefill(rt.alloc_lane(), torch.tensor(PROMPT), logits="none",
                       snapshots=(32, 64)).snapshots
    for b, snap in snaps.items():
        assert snap.n_tokens == b and snap.prefilled == b
        assert sorted(snap.fixed) == ["conv.0", "conv.1", "conv.3", "conv.4"]
        assert all(t.shape == (2, 256) for t in snap.fixed.values())


def test_padding_rows_never_enter_the_conv_state(lfm2_f32):
    """After a 40-row prefill (chunk 32: 8 real rows + 24 padding in the second chunk)
    layer 0's conv state is exactly B*x of real rows 38 and 39, computed at the chunk shape."""
    rt = runtime(lfm2_f32, chunk=CHUNK)
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT[:40]), logits="none")
    state = rt.export_state(lane, 40).fixed["conv.0"]
    ids = torch.tensor(PROMPT[32:40] + [0] * 24)
    layer = rt.layers[0]
    h = rms_norm(rt.embed(ids), layer.attn_norm.weight, rt.cfg.rms_eps)
    b, _, x = layer.mixer.in_proj(h).split(rt.cfg.hidden, dim=-1)
    assert torch.equal(state, (b * x)[6:8])


def test_a_lane_restarts_from_its_own_snapshot_bitwise(lfm2_f32):
    rt = runtime(lfm2_f32, chunk=CHUNK)
    cold = rt.alloc_lane()
    expected = rt.prefill(cold, torch.tensor(PROMPT), logits="all").logits
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT[:64] + [9] * 50), logits="none", snapshots=(64,))
    for t in (1, 2, 3):
        rt.decode([(lane, torch.tensor(t))])
    assert rt.prefill_boundary(lane) == 64
    rows = rt.prefill(lane, torch.tensor(PROMPT[64:]), start=64, logits="all").logits
    assert torch.equal(rows, expected[64:])
