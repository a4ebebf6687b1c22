"""Capability registry: which cache policy a file may be served with."""

import numpy as np
from gguf import GGUFWriter

from skippy.topology.capabilities import capability_for
from skippy.topology.gguf_file import GGUFFile


def tiny_gguf(path, arch: str, tensor_names: list[str], kv_heads=None):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if kv_heads is not None:
        w.add_head_count_kv(kv_heads)
    for name in tensor_names:
        w.add_tensor(name, np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def test_shipped_dense_models_are_resident_kv(smollm2, gemma3):
    assert capability_for(GGUFFile(smollm2)).policy == "ResidentKv"
    assert capability_for(GGUFFile(gemma3)).policy == "ResidentKv"


def test_hybrid_family_is_kv_recurrent(lfm2_f32):
    cap = capability_for(GGUFFile(lfm2_f32))
    assert cap.policy == "KvRecurrent" and cap.hybrid


def test_unknown_architecture_is_disabled_with_a_reason(tmp_path):
    cap = capability_for(tiny_gguf(tmp_path / "m.gguf", "mystery", ["blk.0.attn_q.weight"]))
    assert cap.policy == "disabled" and "mystery" in cap.reason


def test_recurrent_tensors_under_a_dense_name_never_reuse_kv_alone(tmp_path):
    f = tiny_gguf(tmp_path / "h.gguf", "llama", ["blk.0.ssm_conv1d.weight"])
    cap = capability_for(f)
    assert cap.policy == "disabled" and "ssm_conv1d" in cap.reason


def test_per_layer_kv_heads_with_zeros_count_as_recurrent(tmp_path):
    f = tiny_gguf(tmp_path / "k.gguf", "llama", ["blk.0.attn_q.weight"], kv_heads=[0, 2])
    assert capability_for(f).policy == "disabled"
