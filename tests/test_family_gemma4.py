"""Gemma 4 (llama.cpp arch `gemma4`) in both shapes, on the registry's files (the family
bar, tests/test_family_bar.py, runs llama.cpp agreement and 2-stage certify on them), and
what is its own: the shared-KV cut rule, per-layer embeddings reaching later stages, per-layer
head sizes, the expert block beside the dense FFN.

Both files (stages/synth.py, gemma4_layout) have 6 layers s s s G s G, head size 64 on
sliding-window layers and 128 on global ones. E4B-like ("e4b"): the last two layers read
the KV of layers 2 (sliding window) and 3 (global); per-layer embeddings of 64.
A4B-like ("a4b"): every layer adds 8 experts (2 used) to its dense FFN; global layers
have no V projection (V is K's projection).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from family_checks import case_file, check_certify
from moe_checks import check_lanes_alone_equal_together, check_threads_do_not_change_bits
from skippy.stages.layers import gelu_f16 as gelu
from skippy.stages.gemma4 import Gemma4MoeFfn
from skippy.stages.runtime import StageError, StageSpec
from skippy.stages.synth import SynthError, write_synthetic
from skippy.stages.synth_gemma4 import GEMMA4
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig
from skippy.topology.planner import ModelFacts, NodeSpec, PlanError, even_ranges, plan

GiB = 2**30
LAYERS = 6
GROUP = (2, 6)  # layers 4 and 5 read 2 and 3: one stage from layer 2 on


@pytest.fixture(scope="module")
def gemma4_e4b(smollm2, tmp_path_factory):
    return case_file("gemma4", tmp_path_factory)


@pytest.fixture(scope="module")
def gemma4_a4b(smollm2, tmp_path_factory):
    return case_file("gemma4-a4b", tmp_path_factory)


@pytest.fixture(params=["gemma4_e4b", "gemma4_a4b"])
def either(request):
    return request.getfixturevalue(request.param)


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


def test_config_reads_cap_and_sliding_base_else_llama_cpps_defaults(gemma4_e4b):
    f = GGUFFile(gemma4_e4b)
    cfg = ModelConfig.from_gguf(f)
    assert cfg.final_softcap == GEMMA4["softcap"]
    read = f.arch_key

    def keys(given):  # the file as if its keys were `given` (None: absent)
        def arch_key(key, default=None):
            if key not in given:
                return read(key, default)
            return default if given[key] is None else given[key]
        f.arch_key = arch_key
        return ModelConfig.from_gguf(f)

    cfg = keys({"final_logit_softcapping": None, "rope.freq_base_swa": None})
    assert cfg.final_softcap == 30.0 and cfg.rope_base_for(0) == 10000.0  # gemma4's defaults
    cfg = keys({"rope.freq_base_swa": 5e5})  # the file's base wins over the default
    assert cfg.rope_base_for(0) == 5e5 and cfg.rope_base_for(3) == cfg.rope_base


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
    # a table lookup: an element's bits never depend on where the call's rows put it
    rows = torch.randn(33, 50) * 4
    assert torch.equal(torch.cat([gelu(r[None]) for r in rows]), gelu(rows))


# -- A4B: experts beside the dense FFN ----------------------------------------------------------
def test_a4b_config_has_experts_and_no_per_layer_embeddings(gemma4_a4b):
    cfg = ModelConfig.from_gguf(GGUFFile(gemma4_a4b))
    assert (cfg.n_expert, cfg.n_expert_used, cfg.expert_ff) == (8, 2, 128)
    assert cfg.expert_weights_norm and cfg.expert_gating == "softmax"
    assert cfg.per_layer_dim == 0 and cfg.shared_kv_layers == 0 and cfg.cut_groups() == ()
    assert cfg.frame_width == cfg.hidden
    rt = TorchStageRuntime(StageSpec(str(gemma4_a4b), 0, LAYERS))
    assert all(isinstance(layer.ffn, Gemma4MoeFfn) for layer in rt.layers)
    assert [layer.mixer.k_is_v for layer in rt.layers] == [0, 0, 0, 1, 0, 1]


def test_a4b_padding_rows_are_not_routed(gemma4_a4b):
    from skippy.stages.transformer import Segment
    rt = TorchStageRuntime(StageSpec(str(gemma4_a4b), 0, LAYERS))
    gen = torch.Generator().manual_seed(1)
    seg = Segment(None, 0, 32, 0, n_real=20)
    for layer in rt.layers:
        h = torch.randn(32, rt.cfg.hidden, generator=gen)
        h2 = h.clone()
        h2[20:] = torch.randn(12, rt.cfg.hidden, generator=gen)
        assert torch.equal(layer.ffn(h, [seg])[:20], layer.ffn(h2, [seg])[:20])
        assert not layer.ffn.experts.routed(h2, [seg], decode=False)[20:].any()


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_decode_lanes_alone_equal_together(either, fmt):
    check_lanes_alone_equal_together(either, fmt)


def test_integer_formats_do_not_depend_on_threads(either):
    check_threads_do_not_change_bits(either, "int4")


def test_synth_variants_are_checked(smollm2, tmp_path):
    with pytest.raises(SynthError, match="no variant 'b2b'"):
        write_synthetic("gemma4", layers=2, seed=0, out=tmp_path / "x.gguf",
                        tokenizer_from=smollm2, variant="b2b")
    with pytest.raises(SynthError, match="qwen3 has no knob variant"):
        write_synthetic("qwen3", layers=1, seed=0, out=tmp_path / "x.gguf",
                        tokenizer_from=smollm2, variant="a4b")


def test_per_layer_table_columns_are_the_dequantized_tables(gemma4_e4b):
    from skippy.stages.gemma4 import TableColumns
    from skippy.stages.weights import StageTensors, dequantize_tensor
    f = GGUFFile(gemma4_e4b)
    name = "per_layer_token_embd.weight"
    full = dequantize_tensor(f, name)
    ids = torch.tensor([0, 7, 49151, 7])
    for a, b in ((0, 64), (320, 384), (16, 48)):
        got = TableColumns(StageTensors(f, [name]), name, a, b)(ids)
        assert torch.equal(got, full[ids][:, a:b])


class _Table:
    """A quantized [rows, width] table as TableColumns reads a file's (names, the tensor's
    type and shape, its bytes)."""

    def __init__(self, qtype, raw: np.ndarray, width: int):
        self.names = {"t"}
        self.f = SimpleNamespace(tensors={"t": SimpleNamespace(qtype=qtype,
                                                               shape=(width, raw.shape[0]))},
                                 raw=lambda name: raw)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q8_0"])
def test_quantized_per_layer_tables_are_looked_up_as_gguf_dequantizes_them(qtype):
    """Our kernel's lookup (rowops.c) gives gguf's floats for every code and scale: random
    blocks (finite f16 d), at any columns."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    from skippy.stages.gemma4 import TableColumns
    qt = GGMLQuantizationType[qtype]
    block, nbytes = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (50, 3 * nbytes), dtype=np.uint8)
    d_at = 0 if qtype == "Q8_0" else nbytes - 2  # each block's f16 d
    d = rng.uniform(-2, 2, (50, 3)).astype(np.float16)
    d[0, 0] = np.float16(6e-8)  # a subnormal
    for i in range(3):
        raw[:, i * nbytes + d_at:i * nbytes + d_at + 2] = d[:, i:i + 1].view(np.uint8)
    full = torch.from_numpy(dequantize(raw, qt).reshape(50, -1).astype(np.float32))
    ids = torch.tensor([0, 7, 49, 7, 30])
    for a, b in ((0, 3 * block), (block - 16, block + 16), (5, 9)):
        got = TableColumns(_Table(qt, raw, 3 * block), "t", a, b)(ids)
        assert torch.equal(got, full[ids][:, a:b])


def test_planner_holds_the_per_layer_table_as_stored(gemma4_e4b):
    import functools
    from skippy.stages.linear import held_bytes
    f = GGUFFile(gemma4_e4b)
    table = f.tensors["per_layer_token_embd.weight"]
    assert held_bytes("int4", table.name, table.qtype.name, table.shape) == table.nbytes
    model = ModelFacts.from_gguf(gemma4_e4b, tensor_bytes=functools.partial(held_bytes, "int4"))
    assert min(model.layer_bytes) >= table.nbytes // LAYERS
