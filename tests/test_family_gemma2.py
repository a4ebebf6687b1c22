"""Gemma 2 on a synthetic GGUF: soft-capped attention scores (our decode kernel and the
explicit prefill path) and logits, every even layer sliding, post norms, embedding scale."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from family_checks import PROMPT, case_file, runtime
from skippy.stages.layers import attend, causal_mask
from skippy.stages.linear import Int8Blocks, RescoredHead
from skippy.stages.softcap import attend_capped, soft_cap
from skippy.stages.synth_dense import GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP, GEMMA2_WINDOW
from skippy.topology.families import family_for
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4


@pytest.fixture(scope="module")
def gemma2_f32(smollm2, tmp_path_factory):
    return case_file("gemma2", tmp_path_factory)


def test_config_reads_caps_window_and_the_sliding_layers(gemma2_f32):
    f = GGUFFile(gemma2_f32)
    cfg = ModelConfig.from_gguf(f)
    assert "output.weight" not in f.tensors and cfg.tied_head  # llama.cpp reads token_embd
    f.close()
    assert (cfg.attn_softcap, cfg.final_softcap) == (GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP)
    assert cfg.sliding_window == GEMMA2_WINDOW
    assert [cfg.is_swa_layer(i) for i in range(LAYERS)] == [True, False, True, False]
    assert cfg.attention_scale() == 1.0 / math.sqrt(cfg.head_dim)
    # sliding layers keep the global rope scale, and take rope.freq_base_swa when given
    local = dataclasses.replace(cfg, rope_scale=0.5, rope_base_swa=1e4)
    assert (local.rope_base_for(0), local.rope_scale_for(0)) == (1e4, 0.5)
    assert (local.rope_base_for(1), local.rope_scale_for(1)) == (cfg.rope_base, 0.5)


def test_the_27b_scales_queries_by_hidden_over_heads():
    fam = family_for("gemma2")
    big = types.SimpleNamespace(n_layers=46, hidden=4608, n_heads=32, head_dim=128)
    assert fam.query_scale(big) == 1.0 / math.sqrt(4608 // 32)
    assert fam.query_scale(types.SimpleNamespace(**{**vars(big), "n_layers": 42})) \
        == 1.0 / math.sqrt(128)


def test_capped_attention_equals_the_formula_and_a_huge_cap_is_no_cap():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((5, 4), (9, 2), (9, 2)))
    mask = causal_mask(4, 5, 0, 9, window=6)
    got = attend_capped(q, k, v, mask, 0.25, 2.0)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double() * 0.25, kk.double())
    p = torch.softmax(2.0 * torch.tanh(scores / 2.0) + mask.double(), dim=-1)
    want = torch.einsum("htl,lhd->thd", p, vv.double()).reshape(5, -1)
    assert torch.allclose(got.double(), want, atol=1e-5)
    plain = attend(q, k, v, mask, 0.25)
    assert torch.allclose(attend_capped(q, k, v, mask, 0.25, 1e6), plain, atol=1e-5)


def test_capping_a_rescored_head_keeps_its_top_logits_exact():
    """The cap is monotonic and elementwise: a rescored head's float32 candidates stay
    its top logits, and capped they equal the capped float32 head's."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (300, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(300, 2, generator=g) * 0.01
    head = RescoredHead(Int8Blocks(codes, scale))
    x = torch.randn(3, 64, generator=g)
    capped = soft_cap(head(x), GEMMA2_FINAL_CAP)
    exact = soft_cap(x @ Int8Blocks(codes, scale).rows(torch.arange(300)).T, GEMMA2_FINAL_CAP)
    top = capped.topk(head.top, dim=1).indices
    assert torch.equal(top.sort(1).values, exact.topk(head.top, dim=1).indices.sort(1).values)
    assert torch.allclose(capped.gather(1, top), exact.gather(1, top), rtol=0, atol=1e-6)


def test_capped_decode_in_the_kernel_follows_the_torch_path(gemma2_f32):
    """Decode rows through rowops.c (capped in C) and through attend_capped (what runs
    where the kernel is off) differ by rounding only."""
    rt = runtime(gemma2_f32)
    lanes = [rt.alloc_lane() for _ in range(2)]
    for lane in lanes:
        rt.prefill(lane, torch.tensor(PROMPT[:100]), logits="none")
    kernel = rt.decode([(lanes[0], torch.tensor(42))])[0].logits
    for layer in rt.layers:
        layer.mixer.lib = None
    torch_path = rt.decode([(lanes[1], torch.tensor(42))])[0].logits
    assert torch.allclose(kernel, torch_path, rtol=0, atol=2e-5)
