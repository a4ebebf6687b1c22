"""Shape-invariant execution (DESIGN.md §5.3), the ground of cache exactness.

A lane resumed from state saved at any chunk boundary, then run through the same
remaining chunks and decode steps, must give bitwise what a cold run gives.
"""

from __future__ import annotations

import pytest
import torch

from skippy.evals.numerics import decode_vs_recompute, greedy_logits
from skippy.stages.runtime import StageError, StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

CHUNK = 32
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]  # boundaries 32, 64, 96, 128


def runtime(path, **kw) -> TorchStageRuntime:
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    return TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=512, chunk=CHUNK, **kw))


@pytest.fixture(scope="module", params=["qwen3_f32", "smollm2"])
def model(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("name, fmt", [("qwen3_f32", "fp32"), ("smollm2", "fp32"),
                                       ("qwen3_f32", "bf16"), ("qwen3_f32", "int8"),
                                       ("qwen3_f32", "int4"), ("smollm2_q4_0", "int8"),
                                       ("smollm2_q4_0", "int4")])
def test_resume_at_every_chunk_boundary_is_bitwise_cold(name, fmt, request):
    rt = runtime(request.getfixturevalue(name), weight_format=fmt)
    cold = rt.alloc_lane()
    all_cold = rt.prefill(cold, torch.tensor(PROMPT), logits="all").logits
    cold_run = greedy_logits(rt, cold, all_cold[-1], 4)
    for b in range(CHUNK, len(PROMPT), CHUNK):
        # the saved state comes from another prompt that only shares the first b tokens
        other = rt.alloc_lane()
        rt.prefill(other, torch.tensor(PROMPT[:b] + [5] * 40), logits="none")
        state = rt.export_state(other, b)
        rt.free_lane(other)
        lane = rt.alloc_lane()
        rt.import_state(lane, state)
        rows = rt.prefill(lane, torch.tensor(PROMPT[b:]), start=b, logits="all").logits
        assert torch.equal(rows, all_cold[b:]), f"{fmt}: prefill rows differ after resuming at {b}"
        assert torch.equal(greedy_logits(rt, lane, rows[-1], 4), cold_run), \
            f"{fmt}: decode differs after resuming at {b}"
        rt.free_lane(lane)


def test_lane_logits_do_not_depend_on_other_active_lanes(model):
    rt = runtime(model, lane_batch=4)
    lanes = [rt.alloc_lane() for _ in range(4)]
    for i, lane in enumerate(lanes):
        rt.prefill(lane, torch.tensor(PROMPT[: 40 + 10 * i]), logits="none")
    alone = rt.alloc_lane()
    rt.prefill(alone, torch.tensor(PROMPT[:40]), logits="none")
    together = rt.decode([(lane, torch.tensor(42)) for lane in lanes])
    solo = rt.decode([(alone, torch.tensor(42))])
    assert torch.equal(together[0].logits, solo[0].logits)


def test_on_a_chunked_stage_decode_rows_are_never_reused_by_prefill(model):
    rt = runtime(model)
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT[:40]), logits="none")
    for t in (1, 2, 3):
        rt.decode([(lane, torch.tensor(t))])
    assert rt.lane_length(lane) == 43
    assert rt.prefill_boundary(lane) == CHUNK
    with pytest.raises(StageError):
        rt.prefill(lane, torch.tensor([1]), start=2 * CHUNK)


def test_decode_close_to_full_recompute(model):
    """Decode rows run at another shape than prefill rows: not bitwise, but close."""
    r = decode_vs_recompute(model, PROMPT)
    print(f"\ndecode vs recompute: {r}")
    assert r["top1"] == 1.0
    assert r["max_abs_delta"] < 1e-2


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("stage", [(0, 15, 0, 2), (15, 30, 1, 2)])
def test_integer_formats_decode_any_number_of_lanes_in_one_unpadded_step(smollm2, fmt,
                                                                          stage):
    # 17 lanes: one step of 16 rows and one of 1; each row bitwise the lane's row alone.
    from skippy.stages.frame import Frame
    a, b, i, n = stage
    rt = TorchStageRuntime(StageSpec(str(smollm2), a, b, i, n, n_ctx=1024, weight_format=fmt))
    assert rt.free_groups == (fmt != "bf16")
    if not rt.free_groups:
        return
    gen = torch.Generator().manual_seed(0)

    def rows(k, length):  # stage 0 takes token ids, stage 1 the frames of stage 0
        if i == 0:
            return torch.tensor(PROMPT * 4)[k:k + length]
        return Frame(start=0, rows=torch.randn(length, rt.cfg.hidden, generator=gen))
    lengths = [40 + 27 * k for k in range(17)]
    lanes = [rt.alloc_lane() for _ in lengths]
    for k, lane in enumerate(lanes):
        rt.prefill(lane, rows(k, lengths[k]), logits="none")
    step = [rows(k, lengths[k] + 1)[-1:] if i == 0 else
            Frame(start=lengths[k], rows=torch.randn(1, rt.cfg.hidden, generator=gen))
            for k in range(17)]

    def out(o):
        return o.logits if o.logits is not None else o.frame.rows
    alone = []
    for k, lane in enumerate(lanes):
        alone.append(out(rt.decode([(lane, step[k])])[0]))
        rt.copy_lane(lane, lane, lengths[k])  # undo the step
    together = rt.decode([(lane, step[k]) for k, lane in enumerate(lanes)])
    for k in range(17):
        assert torch.equal(out(together[k]), alone[k]), f"lane {k}"
