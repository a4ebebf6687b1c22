"""What every hybrid family (recurrent state + attention) must do, for each one:
decode that follows llama.cpp, and a lane's state untouched by the lanes decoding beside it.
Family-specific layout and state checks stay in test_lfm2.py / test_falcon_h1.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skippy.evals.numerics import greedy_logits, whole_model
from skippy.evals.reference import LlamaCppReference

PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]  # 128 + a padded last chunk of 22
CHUNK = 32


@pytest.fixture(params=["lfm2_f32", "falcon_h1_f32"])
def hybrid(request):
    return request.param, request.getfixturevalue(request.param)


def test_decode_after_prefill_matches_llama_cpp(hybrid):
    """The padded last chunk must leave the recurrent state of its real rows only."""
    name, path = hybrid
    rt = whole_model(path)
    lane = rt.alloc_lane()
    ours = greedy_logits(rt, lane, rt.prefill(lane, torch.tensor(PROMPT)).logits, 16)
    theirs = LlamaCppReference(path, n_ctx=512).greedy_logits(PROMPT, 16)
    delta = float(np.abs(ours.numpy() - theirs).max())
    print(f"\n{name} decode: max |dlogit| {delta:.2e} over 17 steps")
    assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()
    assert delta <= 1e-3


def test_decode_state_of_a_lane_does_not_depend_on_other_lanes(hybrid):
    _, path = hybrid
    rt = whole_model(path, chunk=CHUNK, lane_batch=4)
    lanes = [rt.alloc_lane() for _ in range(3)]
    for i, lane in enumerate(lanes):
        rt.prefill(lane, torch.tensor(PROMPT[: 40 + 10 * i]), logits="none")
    alone = rt.alloc_lane()
    rt.prefill(alone, torch.tensor(PROMPT[:40]), logits="none")
    for step in range(3):  # the batch is padded to 4 rows: padding must touch no lane
        together = rt.decode([(lane, torch.tensor(42 + step)) for lane in lanes])
        solo = rt.decode([(alone, torch.tensor(42 + step))])
        assert torch.equal(together[0].logits, solo[0].logits)
    a, b = rt.export_state(lanes[0], 43).fixed, rt.export_state(alone, 43).fixed
    assert all(torch.equal(a[k], b[k]) for k in a)
