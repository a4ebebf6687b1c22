"""Split equivalence: cutting a model into stages changes nothing but the hand-off."""

from __future__ import annotations

import pytest
import torch

from skippy.stages.chain import StageChain
from skippy.mesh.control.local import InProcessEngine

PROMPT = list(range(1000, 1150))  # 150 ids: two full chunks of 64 and a padded one


def run(path, n_stages: int, wire: str, decode_steps: int = 4):
    pipe = StageChain(path, n_stages, wire_dtype=wire, n_ctx=512)
    lanes = pipe.alloc()
    all_logits = pipe.prefill(lanes, PROMPT, logits="all")
    steps = []
    token = int(all_logits[-1].argmax())
    for _ in range(decode_steps):
        logits = pipe.decode(lanes, token)
        steps.append(logits)
        token = int(logits.argmax())
    return all_logits, torch.stack(steps)


@pytest.mark.parametrize("model", ["qwen3_f32", "smollm2"])
def test_stages_give_bitwise_equal_logits_with_f32_wire(model, request):
    path = request.getfixturevalue(model)
    prefill1, decode1 = run(path, 1, "f32")
    for n in (2, 3, 5):
        prefill_n, decode_n = run(path, n, "f32")
        assert torch.equal(prefill1, prefill_n), f"prefill logits differ at {n} stages"
        assert torch.equal(decode1, decode_n), f"decode logits differ at {n} stages"


@pytest.mark.parametrize("model", ["qwen3_f32", "smollm2"])
def test_stages_give_identical_greedy_tokens_with_f16_wire(model, request):
    path = request.getfixturevalue(model)

    def tokens(n):
        engine = InProcessEngine(path, n, wire_dtype="f16", n_ctx=512)
        return [s.token for s in engine.complete(PROMPT, 16)]

    one = tokens(1)
    assert len(one) == 16
    for n in (2, 3, 5):
        assert tokens(n) == one, f"greedy tokens differ at {n} stages"


@pytest.mark.slow
def test_gemma3_stages_bitwise_equal_with_f32_wire(gemma3):
    prefill1, decode1 = run(gemma3, 1, "f32", decode_steps=2)
    prefill3, decode3 = run(gemma3, 3, "f32", decode_steps=2)
    assert torch.equal(prefill1, prefill3)
    assert torch.equal(decode1, decode3)
