"""The decoder layers in one kernel call (stages/decoder.py) compute the bits of the layers'
own path: prefill rows, decode rows of lanes sharing a step, every family of the plain form,
both integer formats; and the layers that have another form keep their own path."""

from __future__ import annotations

import pytest
import torch

from family_checks import case_file
from skippy.stages.linear import row_invariant
from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.stages.transformer import Segment
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not row_invariant("int4"), reason="no kernels of ours")

PROMPTS = [[(i * 37) % 900 + 40 for i in range(70)], [(i * 53) % 700 + 90 for i in range(23)]]
# the plain form (pre-norm or post-norm RMS or OLMo's LayerNorm, bias or none, clamp, per-head
# or whole-projection norms, softcap, latent attention, gate and up in one matrix, experts)
# and the forms it leaves to the layers' path
FUSED = {"llama3", "qwen3", "gemma2", "glm4", "olmo", "olmo2", "qwen3moe", "minimax-m2",
         "deepseek2", "gemma4", "gemma4-a4b"}
# Gemma 4's own form (stages/gemma4_run.py): per-head norms, shared KV, V as K, per-layer
# embeddings, experts beside the dense FFN
GEMMA4 = ("gemma4", "gemma4-a4b")
NOT_FUSED = {"lfm2": "short conv layers"}


def run(rt: TorchStageRuntime) -> list[torch.Tensor]:
    """Every logit of two prefills (the second in two calls, resuming at 16), then 4 decode
    steps of both lanes together and one of the first alone."""
    a, b = rt.alloc_lane(), rt.alloc_lane()
    out = [rt.prefill(a, torch.tensor(PROMPTS[0]), logits="all").logits,
           rt.prefill(b, torch.tensor(PROMPTS[1][:16]), logits="all").logits,
           rt.prefill(b, torch.tensor(PROMPTS[1][16:]), start=16, logits="all").logits]
    for step in range(4):
        out += [o.logits for o in rt.decode([(a, torch.tensor(5 + step)),
                                             (b, torch.tensor(9 + step))])]
    out.append(rt.decode([(a, torch.tensor(77))])[0].logits)
    rt.free_lane(a)
    rt.free_lane(b)
    return out


def both_ways(path, weight_format: str) -> tuple[bool, list[torch.Tensor], list[torch.Tensor]]:
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    rt = TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=256, weight_format=weight_format))
    fused = rt.decoder_run is not None
    one_call = run(rt)
    rt.decoder_run = None
    return fused, one_call, run(rt)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs by {(x - y).abs().max().item()}"


def test_smollm2_in_one_call_is_bitwise_the_layers_path(smollm2):
    """The file's 4-bit blocks with offsets (Q4_1); the synthetic families' f32 weights
    reach the kernel as 8-bit blocks."""
    fused, one_call, layers = both_ways(smollm2, "int4")
    assert fused
    assert_same(one_call, layers)


def test_gemma3_in_one_call_is_bitwise_the_layers_path(gemma3):
    """Post-norms, GELU, sliding-window layers with their own rope base."""
    fused, one_call, layers = both_ways(gemma3, "int4")
    assert fused
    assert_same(one_call, layers)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_each_plain_family_in_one_call_is_bitwise_the_layers_path(name, smollm2,
                                                                 tmp_path_factory):
    fused, one_call, layers = both_ways(case_file(name, tmp_path_factory), "int4")
    assert fused
    assert_same(one_call, layers)


@pytest.mark.parametrize("name", sorted(NOT_FUSED))
def test_other_forms_keep_the_layers_path(name, smollm2, tmp_path_factory):
    path = case_file(name, tmp_path_factory)
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    rt = TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=256, weight_format="int4"))
    assert rt.decoder_run is None, NOT_FUSED[name]


def test_fp32_keeps_the_layers_path(smollm2):
    rt = TorchStageRuntime(StageSpec(str(smollm2), 0, 4, n_ctx=256, weight_format="fp32"))
    assert rt.decoder_run is None


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_in_fp32_keeps_the_layers_path(name, smollm2, tmp_path_factory):
    """Matrices decoder.c cannot run (float32) leave every layer to gemma4.py."""
    path = case_file(name, tmp_path_factory)
    rt = TorchStageRuntime(StageSpec(str(path), 0, 6, n_ctx=256, weight_format="fp32"))
    assert rt.decoder_run is None


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_in_one_call_is_bitwise_the_layers_path_in_int8(name, smollm2,
                                                               tmp_path_factory):
    fused, one_call, layers = both_ways(case_file(name, tmp_path_factory), "int8")
    assert fused
    assert_same(one_call, layers)


def _layers_on(rt: TorchStageRuntime, kvs: list, x: torch.Tensor, tokens: torch.Tensor):
    """The stage's layers over x: a prefill segment of 3 rows with 1 of padding on the
    first lane, a decode row of the second (the lanes' KV as given, copied first)."""
    copies = []
    for kv in kvs:
        k, v = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
        copies.append((kv, kv.k, kv.v))
        kv.k, kv.v = k, v
    segments = [Segment(kvs[0], 0, 3, 40, n_real=2), Segment(kvs[1], 3, 1, 23)]
    out = rt._run_layers(x.clone(), torch.tensor([40, 41, 42, 23]), segments, tokens)
    written = [(kv.k, kv.v) for kv in kvs]
    for kv, k, v in copies:
        kv.k, kv.v = k, v
    return out, written


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_rows_with_padding_in_one_call_are_the_layers_path(name, smollm2,
                                                                  tmp_path_factory):
    path = case_file(name, tmp_path_factory)
    rt = TorchStageRuntime(StageSpec(str(path), 0, 6, n_ctx=256, weight_format="int4"))
    assert rt.decoder_run is not None
    lanes = [rt.alloc_lane(), rt.alloc_lane()]
    rt.prefill(lanes[0], torch.tensor(PROMPTS[0][:40]), logits="none")
    rt.prefill(lanes[1], torch.tensor(PROMPTS[1]), logits="none")
    kvs = [rt._lane(lane).kv for lane in lanes]
    for kv in kvs:
        kv.ensure(64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, rt.cfg.frame_width, generator=g)
    tokens = torch.tensor([11, 12, 13, 14])
    one_call = _layers_on(rt, kvs, x, tokens)
    rt.decoder_run = None
    layers = _layers_on(rt, kvs, x, tokens)
    assert torch.equal(one_call[0], layers[0])
    for (k1, v1), (k2, v2) in zip(one_call[1], layers[1]):
        assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k2 + v2))
