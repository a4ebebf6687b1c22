"""Qwen3-Next: gated DeltaNet layers beside gated attention layers, a MoE FFN with a
sigmoid-gated shared expert, on a synthetic GGUF: the family's own checks (layer pattern,
state layout, the older ssm_in layout) beside the family bar (tests/test_family_bar.py)."""

from __future__ import annotations

import pytest
import torch

from family_checks import CHUNK, PROMPT, case_file
from skippy.evals.numerics import margin_agreement, whole_model
from skippy.evals.reference import LlamaCppReference
from skippy.stages import synth_hybrid
from skippy.stages.runtime import StageSpec
from skippy.stages.synth import write_synthetic
from skippy.stages.synth_hybrid import QWEN3NEXT
from skippy.stages.synth_table import TensorSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.families import family_for
from skippy.topology.gguf_file import GGUFFile, ModelConfigError
from skippy.topology.model_config import ModelConfig, deltanet_fields, deltanet_layer_pattern
from skippy.topology.planner import ModelFacts

LAYERS = 6  # d d a d d a
DELTANET = {0, 1, 3, 4}
S = QWEN3NEXT
CONV_DIM = (2 * S["k_heads"] + S["v_heads"]) * S["head"]


@pytest.fixture(scope="module")
def qwen3next_f32(smollm2, tmp_path_factory):
    return case_file("qwen3next", tmp_path_factory)


# -- the family and its file ------------------------------------------------------------------
def test_qwen3next_is_a_kv_recurrent_family_with_gated_attention():
    fam = family_for("qwen3next")
    assert fam.cache_policy == "KvRecurrent" and fam.recurrent_mixer == "gated_deltanet"
    assert fam.attn_output_gate and fam.qk_norm and fam.rope_style == "neox"
    assert fam.ffn_norm == "post_attention_norm.weight"


def test_layer_pattern_defaults_to_every_fourth_layer_attention():
    """llama.cpp without attention.recurrent_layers: layer i is DeltaNet iff (i + 1) % n."""
    assert sorted(set(range(8)) - deltanet_layer_pattern(8, 4)) == [3, 7]
    assert sorted(set(range(LAYERS)) - deltanet_layer_pattern(LAYERS, 3)) == [2, 5]


class _Keys:
    """The metadata a config reads, without a file."""
    architecture = "qwen3next"

    def __init__(self, **keys):
        self.keys = {k.replace("__", "."): v for k, v in keys.items()}

    def arch_key(self, key, default=None):
        return self.keys.get(key, default)


def test_an_explicit_recurrent_layer_list_wins_over_the_interval():
    sizes = dict(ssm__conv_kernel=4, ssm__inner_size=128, ssm__state_size=32,
                 ssm__time_step_rank=4, ssm__group_count=2)
    listed = deltanet_fields(_Keys(attention__recurrent_layers=[True, False, True, True],
                                     full_attention_interval=2, **sizes), 4)
    assert listed["deltanet_layers"] == {0, 2, 3}
    assert deltanet_fields(_Keys(**sizes), 8)["deltanet_layers"] == {0, 1, 2, 4, 5, 6}
    with pytest.raises(ModelConfigError, match="inner size"):
        deltanet_fields(_Keys(**{**sizes, "ssm__inner_size": 96}), 4)


def test_synthetic_file_layout_and_config(qwen3next_f32):
    f = GGUFFile(qwen3next_f32)
    t = f.tensors
    assert t["blk.0.attn_qkv.weight"].shape == (256, CONV_DIM)  # ggml order: inputs first
    assert t["blk.0.ssm_conv1d.weight"].shape == (S["d_conv"], CONV_DIM)
    assert t["blk.0.ssm_ba.weight"].shape == (256, 2 * S["v_heads"])
    assert t["blk.2.attn_q.weight"].shape == (256, 2 * 4 * 64)  # query and gate per head
    assert "blk.2.attn_qkv.weight" not in t and "blk.0.attn_q.weight" not in t
    assert t["blk.0.ffn_gate_exps.weight"].shape == (256, 128, S["experts"])
    cfg = ModelConfig.from_gguf(f)
    f.close()
    assert cfg.deltanet_layers == DELTANET and cfg.is_recurrent
    assert (cfg.ssm_d_conv, cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_d_state) == \
        (S["d_conv"], S["k_heads"], S["v_heads"], S["head"])
    assert cfg.rope_dim == 16 and cfg.head_dim == 64  # partial rope: a quarter of each head


def test_a_stage_exports_conv_and_delta_state_of_its_deltanet_layers(qwen3next_f32):
    rt = TorchStageRuntime(StageSpec(str(qwen3next_f32), 2, 5, n_ctx=256, chunk=CHUNK))
    assert rt.attn_layers == [2]
    lane = rt.alloc_lane()
    rt.prefill(lane, _frame(rt, 40), logits="none")  # a middle stage takes rows
    fixed = rt.export_state(lane, 40).fixed
    assert sorted(fixed) == ["conv.3", "conv.4", "ssm.3", "ssm.4"]
    assert fixed["conv.3"].shape == (S["d_conv"] - 1, CONV_DIM)
    assert fixed["ssm.3"].shape == (S["v_heads"], S["head"], S["head"])
    assert rt.identity()["recurrent_state"].startswith("gated-deltanet")
    # the planner's per-lane bytes for these layers: KV for the attention layer only
    facts = ModelFacts.from_gguf(qwen3next_f32)
    assert sum(facts.state_bytes[2:5]) == sum(4 * v.numel() for v in fixed.values())
    assert [b > 0 for b in facts.kv_bytes_per_token] == [i not in DELTANET for i in range(6)]


def _frame(rt: TorchStageRuntime, n: int):
    from skippy.stages.frame import to_wire
    rows = torch.randn(n, 256, generator=torch.Generator().manual_seed(0))
    return to_wire(0, rows, rt.spec.wire_dtype)


# -- llama.cpp as the reference ---------------------------------------------------------------
def _legacy_deltanet(b: str, d) -> list:
    """A DeltaNet layer as older converters wrote it: one ssm_in for q, k, v and z."""
    s = QWEN3NEXT
    specs = [x for x in _MODERN(b, d) if not x.name.endswith(("attn_qkv.weight",
                                                               "attn_gate.weight"))]
    rows = 2 * (s["k_heads"] + s["v_heads"]) * s["head"]
    return [TensorSpec(f"{b}.ssm_in.weight", (rows, d.hidden), "proj"), *specs]


_MODERN = synth_hybrid._qwen3next_deltanet


def test_older_files_with_one_ssm_in_projection_follow_llama_cpp(smollm2, tmp_path,
                                                                  monkeypatch):
    """ssm_in's rows run per key head [q, k, v, z]; we reorder them once at load."""
    monkeypatch.setattr(synth_hybrid, "_qwen3next_deltanet", _legacy_deltanet)
    path = write_synthetic("qwen3next", layers=3, seed=11, out=tmp_path / "legacy.gguf",
                           tokenizer_from=smollm2)
    assert "blk.0.ssm_in.weight" in GGUFFile(path).tensors
    r = margin_agreement(whole_model(path, chunk=CHUNK), LlamaCppReference(path, n_ctx=256),
                         [PROMPT])
    print(f"\nqwen3next ssm_in layout: {r}")
    assert r["top1_where_clear"] and r["max_abs_delta"] <= 1e-3
