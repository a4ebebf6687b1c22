"""A stage reads only what it owns from the GGUF, and reads it as gguf-py would."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.stages.weights import dequantize_raw, dequantize_tensor, owned_tensor_names
from skippy.topology.gguf_file import GGUFFile, LazyArray
from skippy.topology.model_config import ModelConfig


def test_middle_stage_owns_only_its_layers(smollm2):
    f = GGUFFile(smollm2)
    cfg = ModelConfig.from_gguf(f)
    names = owned_tensor_names(f, cfg, 10, 20, first=False, last=False)
    assert names and all(n.startswith("blk.") for n in names)
    assert {int(n.split(".")[1]) for n in names} == set(range(10, 20))


def test_tied_head_last_stage_loads_token_embd_as_head(smollm2):
    f = GGUFFile(smollm2)
    cfg = ModelConfig.from_gguf(f)
    assert cfg.tied_head
    names = owned_tensor_names(f, cfg, 20, 30, first=False, last=True)
    assert "token_embd.weight" in names and "output_norm.weight" in names


def test_stage_load_never_parses_the_vocabulary(smollm2, monkeypatch):
    def refuse(self, arr):
        raise AssertionError("a stage decoded a metadata array it does not need")
    monkeypatch.setattr(GGUFFile, "_decode_array", refuse)
    rt = TorchStageRuntime(StageSpec(str(smollm2), 10, 20, 1, 3))
    f = GGUFFile(smollm2)
    assert isinstance(f.metadata["tokenizer.ggml.tokens"], LazyArray)
    layer_bytes = sum(i.nbytes for n, i in f.tensors.items()
                      if n.startswith(tuple(f"blk.{k}." for k in range(10, 20))))
    assert rt.weights_source_bytes == layer_bytes
    assert rt.embed is None


def test_weights_digest_is_content_not_name(smollm2, tmp_path):
    import shutil
    copy = tmp_path / "renamed.gguf"
    shutil.copy(smollm2, copy)
    a = TorchStageRuntime(StageSpec(str(smollm2), 0, 3, 0, 10)).identity()
    b = TorchStageRuntime(StageSpec(str(copy), 0, 3, 0, 10)).identity()
    c = TorchStageRuntime(StageSpec(str(smollm2), 3, 6, 1, 10)).identity()
    assert a == b
    assert a["weights_digest"] != c["weights_digest"]


def _gguf_py(raw: np.ndarray, qtype, shape) -> np.ndarray:
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return dequantize(raw.reshape(rows, -1), qtype).astype(np.float32).reshape(shape)


def test_every_tensor_of_smollm2_dequantizes_to_gguf_pys_bits(smollm2):
    f = GGUFFile(smollm2)  # Q8_0, Q4_1, F32 (the other types: random blocks, below)
    for name, info in f.tensors.items():
        shape = tuple(int(d) for d in reversed(info.shape))
        expected = _gguf_py(np.asarray(f.raw(name)), info.qtype, shape)
        got = dequantize_tensor(f, name).numpy()
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), (name, info.qtype)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_the_types_torch_reads_give_gguf_pys_bits_on_any_codes(qtype):
    """Random blocks, finite scales of both signs: every code of every type meets its scale
    (and Q4_1's offset) the way gguf-py's numpy computes it."""
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal(4096).astype(np.float32)
        raw = {Q.F32: x.view(np.uint8), Q.F16: x.astype(np.float16).view(np.uint8),
               Q.BF16: x.view(np.uint16)[1::2].copy().view(np.uint8)}[qtype]
    else:
        width, scales = {Q.Q8_0: (34, 1), Q.Q4_0: (18, 1), Q.Q4_1: (20, 2)}[qtype]
        blocks = rng.integers(0, 256, size=(512, width), dtype=np.uint8)
        blocks[:, :2 * scales] = rng.standard_normal((512, scales)).astype(np.float16).view(np.uint8)
        raw = blocks.reshape(-1)
    expected = dequantize(raw.reshape(1, -1), qtype).astype(np.float32).reshape(-1)
    got = dequantize_raw(raw, qtype, (expected.size,)).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
