"""Weight formats (stages/linear.py): the file's blocks kept as they are, every format
exact by construction (cache on = cache off, resume = cold), the format in the identity."""

from __future__ import annotations


import pytest
import torch

from skippy.cache.config import CacheConfig
from skippy.evals.cache_exactness import cache_pair, run_one
from skippy.stages import qkernel
from skippy.stages.linear import (WEIGHT_FORMATS, BlockLinear, Embeddings, Int4Blocks,
                                 Int4Linear, Int8Blocks, Int8Linear, Linear, Matrix,
                                 RescoredHead, TransposedLinear, make_head, make_linear)
from skippy.stages.runtime import StageSpec
from skippy.stages.stage_cache import stage_key_for
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.stages.weights import dequantize_tensor, int4_blocks, int8_blocks
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

CHUNK = 32
PROMPT = [(i * 7919) % 40000 + 100 for i in range(110)]
FAST = ["bf16", "int8", "int4", "int8-lean", "int4-lean"]


def runtime(path, fmt, **kw) -> TorchStageRuntime:
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    return TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=512, chunk=CHUNK,
                                       weight_format=fmt, **kw))


def test_q4_blocks_and_q8_pairs_hold_the_files_exact_values(smollm2, smollm2_q4_0):
    for path, name in ((smollm2, "blk.2.ffn_up.weight"), (smollm2_q4_0, "blk.2.attn_q.weight")):
        f = GGUFFile(path)  # Q4_1 as shipped, Q4_0 requantized
        assert torch.equal(int4_blocks(f, name).dequantize(), dequantize_tensor(f, name))
    f = GGUFFile(smollm2_q4_0)
    q8 = int8_blocks(f, "token_embd.weight")
    pair = q8.as_int4_pair().dequantize()
    k = pair.shape[1] // 2
    assert torch.equal(pair[:, :k] + pair[:, k:], dequantize_tensor(f, "token_embd.weight"))


def test_int4_uses_the_files_blocks_and_never_fewer_bits(smollm2_q4_0):
    rt = runtime(smollm2_q4_0, "int4")
    qkv = rt.layers[0].mixer.qkv.linear
    if qkernel.library() is not None:  # our kernel on the file's 4-bit blocks
        assert isinstance(qkv, BlockLinear) and qkv.kind == 4 and qkv.z is None  # Q4_0
    else:
        assert isinstance(qkv, Int4Linear)
    assert isinstance(rt.head, RescoredHead)  # a Q8_0 head, its top logits in fp32
    assert make_linear(torch.randn(64, 64), "int4").fmt == "int8"  # no blocks: int8


def test_lean_formats_are_the_full_ones_on_our_kernel_and_hold_no_bf16_copy_on_torchs():
    w = torch.randn(96, 128)
    full, lean = make_linear(w, "int8"), make_linear(w, "int8-lean")
    if qkernel.library() is not None:  # no bf16 copy on our kernel: one arithmetic
        assert isinstance(full, BlockLinear) and isinstance(lean, BlockLinear)
        for rows in (1, 16, 17, 64):
            x = torch.randn(rows, 128)
            assert torch.equal(full(x), lean(x))
    b = Int4Blocks.from_float(w)
    assert Int4Linear(b, dense=False).dense is None and Int4Linear(b).dense is not None
    assert Int8Linear(w, dense=False).dense is None and Int8Linear(w).dense is not None


def test_lean_runtime_keeps_only_integer_weights(smollm2_q4_0):
    rt = runtime(smollm2_q4_0, "int4-lean")
    for layer in rt.layers:
        for lin in (layer.mixer.qkv.linear, layer.mixer.out, layer.ffn.gate_up, layer.ffn.down):
            assert getattr(lin, "dense", None) is None
    lane = rt.alloc_lane()
    assert rt.prefill(lane, torch.tensor(PROMPT)).logits.isfinite().all()


def test_head_and_embeddings_keep_the_files_float32_values(smollm2_q4_0, qwen3_f32):
    f = GGUFFile(smollm2_q4_0)
    name = "token_embd.weight"  # Q8_0, tied: SmolLM2's embeddings and head
    table = dequantize_tensor(f, name)
    m = Matrix(table, None, int8_blocks(f, name))
    ids = torch.tensor([0, 7, 49151, 7])
    assert torch.equal(Embeddings(m)(ids), table[ids])  # rows made on demand, same bits
    head = make_head(m, "int4", 1)
    assert isinstance(head, RescoredHead)
    torch.manual_seed(0)
    x = torch.randn(4, 576)
    want, got = x @ table.t(), head(x)
    assert torch.equal(got.argmax(1), want.argmax(1))
    top = want.topk(RescoredHead.TOP // 2, dim=1).indices  # float32 where sampling looks
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-4)
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # the rest: quantized rows
    assert torch.equal(head(x), got) and torch.equal(head(x[:1]), head(x[:1]))  # repeatable
    # the reference format keeps the whole float32 head
    assert isinstance(make_head(m, "fp32", 1), TransposedLinear)
    assert type(make_head(m, "fp32", 8)) is Linear
    # a head without Q8_0 blocks (F32 here, Q6_K in most 4-bit files): candidates from our
    # Q8_0 of it, rescored from its float32 values, a row's bits the same alone
    values = dequantize_tensor(GGUFFile(qwen3_f32), "token_embd.weight")  # F32
    head = make_head(values, "int4", 1)
    assert isinstance(head, RescoredHead) and head.exact is values
    x = torch.randn(4, values.shape[1])
    want, got = x @ values.t(), head(x)
    assert torch.equal(got.argmax(1), want.argmax(1))
    top = want.topk(RescoredHead.TOP // 2, dim=1).indices
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-4)
    assert torch.equal(head(x[2:3]), got[2:3])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_a_table_kept_as_the_files_bytes_gives_the_dequantized_rows(qtype):
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from skippy.stages.weights import QuantizedRows, dequantize_raw
    kind = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((50, 256)).astype(np.float32)
    raw = quantize(values, kind)
    whole = dequantize_raw(raw, kind, (50, 256))
    table = Embeddings(whole, QuantizedRows(raw, kind, 50, 256))
    assert table.table is None and table.stored.data.numel() == raw.nbytes  # file size
    ids = torch.tensor([[3, 49, 0], [3, 7, 7]])
    assert torch.equal(table(ids), whole[ids]) and table(ids[0, :0]).shape == (0, 256)
    with pytest.raises(IndexError):
        table(torch.tensor([50]))


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        make_linear(torch.randn(4, 4), "int3")


def test_format_is_part_of_the_stage_identity(qwen3_f32):
    keys = {fmt: stage_key_for(runtime(qwen3_f32, fmt)).digest for fmt in WEIGHT_FORMATS}
    assert len(set(keys.values())) == len(WEIGHT_FORMATS)


# Resuming at every chunk boundary in every format: tests/test_shape_invariance.py.


@pytest.mark.parametrize("model, stages, fmt", [("qwen3_f32", 2, "int4"),
                                                ("smollm2_q4_0", 2, "int4")])
def test_cache_on_equals_cache_off(model, stages, fmt, request):
    path = request.getfixturevalue(model)
    cfg = CacheConfig(chunk=32, stride=32, min_prefix=32, admit_after=1)
    off, on = cache_pair(path, stages, cfg, wire_dtype="f32", n_ctx=1024, weight_format=fmt)
    stem = PROMPT[:100]
    reused = 0
    for ids in (stem + [5, 6, 7], stem + [8, 9] * 10, stem + [5, 6, 7]):
        want_logits, want_tokens, _ = run_one(off, ids)
        got_logits, got_tokens, r = run_one(on, ids)
        assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
        reused += r
    assert reused > 0


def test_formats_stay_close_to_fp32(smollm2_q4_0):
    ref = runtime(smollm2_q4_0, "fp32")
    want = ref.prefill(ref.alloc_lane(), torch.tensor(PROMPT)).logits
    for fmt in FAST:
        rt = runtime(smollm2_q4_0, fmt)
        got = rt.prefill(rt.alloc_lane(), torch.tensor(PROMPT)).logits
        assert torch.cosine_similarity(got, want, dim=0) > 0.999, fmt


def _held(lin) -> int:
    parts = [getattr(lin, k, None)
             for k in ("weight", "scale", "scale_zero", "dense", "w", "s", "z")]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


@pytest.mark.parametrize("fmt", ["fp32", "int4", "int4-lean"])
def test_planner_bytes_match_what_a_layer_holds(smollm2_q4_0, fmt):
    from skippy.stages.linear import held_bytes
    layer = runtime(smollm2_q4_0, fmt).layers[3]
    held = sum(_held(lin) for lin in (layer.mixer.qkv.linear, layer.mixer.out,
                                      layer.ffn.gate_up, layer.ffn.down))
    f = GGUFFile(smollm2_q4_0)
    planned = sum(held_bytes(fmt, n, i.qtype.name, tuple(i.shape))
                  for n, i in f.tensors.items() if n.startswith("blk.3.") and len(i.shape) == 2)
    assert planned == pytest.approx(held, rel=0.01)


def test_q8_0_of_a_float_matrix_is_the_same_made_in_row_blocks():
    w = torch.randn(1000, 64)
    whole, blocks = Int8Blocks.from_float(w, rows=10**6), Int8Blocks.from_float(w, rows=7)
    assert torch.equal(whole.codes, blocks.codes) and torch.equal(whole.scale, blocks.scale)
    assert (whole.rows(torch.arange(1000)) - w).abs().max() <= w.abs().max() / 127
