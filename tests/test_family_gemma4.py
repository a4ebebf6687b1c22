"""Gemma 4 (llama.cpp arch `gemma4`) through the family bar, and what is its own: the
shared-KV cut rule, per-layer embeddings reaching later stages, per-layer head sizes.

The E4B-like file (stages/synth.py, gemma4_layout): 6 layers s s s G | s G, the last two
reading the KV of layers 2 (sliding window) and 3 (global); per-layer embeddings of 64;
head size 64 on sliding-window layers and 128 on global ones.
"""

from __future__ import annotations

import pytest
import torch

from family_checks import check_agreement, check_certify
from skippy.stages.gemma4 import gelu
from skippy.stages.runtime import StageError, StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig
from skippy.topology.planner import ModelFacts, NodeSpec, PlanError, even_ranges, plan

GiB = 2**30
LAYERS = 6
GROUP = (2, 6)  # layers 4 and 5 read 2 and 3: one stage from layer 2 on


@pytest.fixture(scope="module")
def gemma4_e4b(smollm2, tmp_path_factory):
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("synth") / "gemma4-e4b-L6.gguf"
    return write_synthetic("gemma4", layers=LAYERS, seed=5, out=out, tokenizer_from=smollm2)


def test_e4b_follows_llama_cpp(gemma4_e4b):
    check_agreement(gemma4_e4b, "gemma4-e4b")


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_e4b_certifies_at_two_stages(gemma4_e4b, fmt):
    check_certify(gemma4_e4b, 2, fmt)


def test_e4b_certifies_at_three_stages_though_the_even_cut_splits_a_group(gemma4_e4b):
    assert even_ranges(LAYERS, 3) == [(0, 2), (2, 4), (4, 6)]  # 4 would cut (2, 6)
    check_certify(gemma4_e4b, 3, "fp32")


def test_config_reads_the_layer_pattern_and_shared_kv(gemma4_e4b):
    cfg = ModelConfig.from_gguf(GGUFFile(gemma4_e4b))
    assert [cfg.is_swa_layer(i) for i in range(LAYERS)] == [1, 1, 1, 0, 1, 0]
    assert [cfg.has_kv(i) for i in range(LAYERS)] == [1, 1, 1, 1, 0, 0]
    assert [cfg.kv_source(i) for i in range(LAYERS)] == [0, 1, 2, 3, 2, 3]
    assert [cfg.head_dim_for(i) for i in range(LAYERS)] == [64, 64, 64, 128, 64, 128]
    assert cfg.rope_base_for(0) == 10000.0 and cfg.rope_base_for(3) == cfg.rope_base
    assert cfg.cut_groups() == (GROUP,)
    assert cfg.frame_width == 2 * cfg.hidden


@pytest.mark.parametrize("stages", [2, 3])
def test_no_cut_falls_inside_a_shared_kv_group(gemma4_e4b, stages):
    cfg = ModelConfig.from_gguf(GGUFFile(gemma4_e4b))
    even = even_ranges(LAYERS, stages, cfg.cut_groups())
    model = ModelFacts.from_gguf(gemma4_e4b)
    assert model.keep_together == (GROUP,)
    planned = plan(model, [NodeSpec(f"n{i}", 4 * GiB) for i in range(stages)],
                   stages=stages).ranges
    for ranges in (even, planned):
        assert len(ranges) == stages
        assert all(not GROUP[0] < end < GROUP[1] for _, end in ranges[:-1]), ranges
    with pytest.raises(PlanError):
        even_ranges(LAYERS, 4, cfg.cut_groups())  # 2 layers before the group: 3 stages


def test_a_stage_that_splits_the_group_says_so(gemma4_e4b):
    with pytest.raises(StageError, match="reads layer 2's KV"):
        TorchStageRuntime(StageSpec(str(gemma4_e4b), 3, 6, 1, 2))


def test_planner_counts_per_layer_tables_and_shared_layers_kv(gemma4_e4b):
    model = ModelFacts.from_gguf(gemma4_e4b)
    f = GGUFFile(gemma4_e4b)
    table = f.tensors["per_layer_token_embd.weight"].nbytes
    assert model.shared_bytes < table // LAYERS  # the table is counted with the layers
    kv = model.kv_bytes_per_token
    assert kv[4] == kv[5] == 0 and kv[3] == 2 * kv[2]


def test_later_stages_take_x0_and_token_ids_with_the_frame(gemma4_e4b):
    first = TorchStageRuntime(StageSpec(str(gemma4_e4b), 0, 2, 0, 2, wire_dtype="f32"))
    last = TorchStageRuntime(StageSpec(str(gemma4_e4b), 2, 6, 1, 2, wire_dtype="f32"))
    ids = torch.arange(100, 140)
    frame = first.prefill(first.alloc_lane(), ids).frame
    assert frame.rows.shape == (40, 2 * first.cfg.hidden)
    assert torch.equal(frame.tokens, ids)
    lane = last.alloc_lane()
    with pytest.raises(StageError, match="token ids"):
        last.prefill(lane, type(frame)(frame.start, frame.rows))
    assert last.prefill(lane, frame).logits is not None
    state = last.export_state(lane, 40)  # KV of layers 2 and 3 only, at their head sizes
    assert [tuple(k.shape) for k in state.keys] == [(40, 2, 64), (40, 2, 128)]


def test_lanes_decoding_together_equal_each_alone(gemma4_e4b):
    rt = TorchStageRuntime(StageSpec(str(gemma4_e4b), 0, LAYERS, n_ctx=512, chunk=32,
                                     lane_batch=4))
    prompt = [(i * 7919) % 40000 + 100 for i in range(150)]
    lanes = [rt.alloc_lane() for _ in range(3)]
    for i, lane in enumerate(lanes):
        rt.prefill(lane, torch.tensor(prompt[:40 + 10 * i]), logits="none")
    alone = rt.alloc_lane()
    rt.prefill(alone, torch.tensor(prompt[:40]), logits="none")
    together = rt.decode([(lane, torch.tensor(42)) for lane in lanes])
    assert torch.equal(together[0].logits, rt.decode([(alone, torch.tensor(42))])[0].logits)


def test_mesh_stages_attach_token_ids_to_frames(gemma4_e4b):
    from skippy.cache.config import CacheConfig
    from skippy.mesh.control.local import InProcessEngine
    prompt = [(i * 7919) % 40000 + 100 for i in range(70)]
    tokens = []
    for n in (1, 2):
        engine = InProcessEngine(gemma4_e4b, n, cache=CacheConfig(enabled=False),
                                 wire_dtype="f32")
        tokens.append([s.token for s in engine.complete(prompt, 6)])
    assert tokens[0] == tokens[1]


def test_gelu_goes_through_f16_as_llama_cpp_does():
    x = torch.tensor([-10.5, -10.0, -1.2345678, 0.3333333, 9.99, 10.0, 12.5])
    y = gelu(x)
    assert y[0] == 0 and y[1] == 0 and y[5] == 10.0 and y[6] == 12.5
    mid = y[2:5]
    assert torch.equal(mid, mid.to(torch.float16).to(torch.float32))  # f16 table values
    assert torch.allclose(mid, torch.nn.functional.gelu(x[2:5], approximate="tanh"),
                          rtol=2e-3)
