"""A stage reads only what it owns from the GGUF."""

from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.stages.weights import owned_tensor_names
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
