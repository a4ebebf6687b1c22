"""What every family must pass, written once: tests/test_family_bar.py runs these over the
registry's synthetic files (topology/families.py, SynthCase), and a family's own test file
reads the same file through `case_file`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from skippy.evals import certify_matrix
from skippy.evals.numerics import family_agreement, greedy_logits, whole_model
from skippy.evals.reference import LlamaCppReference
from skippy.stages.certify import certify
from skippy.stages.runtime import StageError, StageSpec
from skippy.stages.runtime_kind import Exactness
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

CHUNK = 32
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]  # boundaries 32, 64, 96, 128


def case_file(name: str, tmp_path_factory) -> Path:
    """The registry's synthetic file `name`, as evals/certify_matrix.py writes it, once per
    test session (so the matrices run the very file the tests read)."""
    return certify_matrix.model_path(name, synth_dir=tmp_path_factory.getbasetemp() / "registry")


def check_agreement(path, name: str, **spec) -> dict:
    """Teacher-forced against llama.cpp: a prompt of 320 tokens, 16 decode steps (the
    eval, evals/numerics.py, runs two); an expert choice that is a near-tie in our run
    (margin under 1e-3) is made llama.cpp's way where the rows say llama.cpp made it the
    other way (evals/numerics.py teacher_forced), and every row is then held to the bar."""
    r = family_agreement(path, **{"n_prompts": 1, **spec})
    print(f"\n{name} f32 vs llama.cpp: max |dlogit| {r['max_abs_delta']:.2e} over "
          f"{r['positions']} rows ({r['decided']} with a clear top-1); near-ties made "
          f"the other way (prompt, row, layer, margin): {r['flipped']}")
    assert r["top1_where_clear"], r
    assert r["max_abs_delta"] <= 1e-3, r
    return r


def check_certify(path, stages: int, weight_format: str):
    report = certify(path, stages, weight_format=weight_format)
    assert report.passed, report.table()
    assert all(c.max_abs_diff == 0.0 for c in report.checks if c.passed is not None)
    return report


def runtime(path, **kw) -> TorchStageRuntime:
    """The whole model in one torch stage (n_ctx 512, chunk CHUNK unless given)."""
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    return TorchStageRuntime(StageSpec(str(path), 0, n, **{"n_ctx": 512, "chunk": CHUNK, **kw}))


def check_lanes_independent(path, weight_format: str = "fp32") -> None:
    """Decode rows of a padded batch of lanes equal the same lane decoded alone, and (for a
    hybrid) so does the recurrent state the lane exports."""
    rt = runtime(path, lane_batch=4, weight_format=weight_format)
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
    assert sorted(a) == sorted(b) == sorted(rt.state_names)
    assert all(torch.equal(a[k], b[k]) for k in a)


def check_resume_is_bitwise_cold(path, weight_format: str = "fp32") -> dict:
    """State saved at every chunk boundary, by the prompt itself and by another prompt that
    shares only that prefix, restored and run on: the same prefill rows and decode logits
    as cold. A hybrid exports only at its snapshots, so each prefill asks for them. Returns
    the cold prompt's snapshots, for a family's own checks of what they hold."""
    rt = runtime(path, weight_format=weight_format)
    bounds = tuple(range(CHUNK, len(PROMPT), CHUNK))
    cold = rt.alloc_lane()
    out = rt.prefill(cold, torch.tensor(PROMPT), logits="all", snapshots=bounds)
    assert sorted(out.snapshots) == list(bounds)
    cold_run = greedy_logits(rt, cold, out.logits[-1], 4)
    for b in bounds:
        other = rt.alloc_lane()
        shared = rt.prefill(other, torch.tensor(PROMPT[:b] + [5] * 40), logits="none",
                            snapshots=(b,)).snapshots[b]
        rt.free_lane(other)
        for state in (out.snapshots[b], shared):
            assert state.n_tokens == b
            lane = rt.alloc_lane()
            rt.import_state(lane, state)
            assert rt.prefill_boundary(lane) == b
            rows = rt.prefill(lane, torch.tensor(PROMPT[b:]), start=b, logits="all").logits
            assert torch.equal(rows, out.logits[b:]), f"prefill rows differ after resuming at {b}"
            assert torch.equal(greedy_logits(rt, lane, rows[-1], 4), cold_run), \
                f"decode differs after resuming at {b}"
            rt.free_lane(lane)
    return out.snapshots


def check_export_only_at_snapshots(path) -> None:
    """A hybrid's state exists at its length, its snapshots and 0, nowhere else: no export,
    copy or restart between them."""
    rt = runtime(path)
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT), logits="none", snapshots=(64,))
    for n in (150, 64, 0):
        assert rt.export_state(lane, n).n_tokens == n
    for n in (32, 96, 100, 149):
        with pytest.raises(StageError):
            rt.export_state(lane, n)
    other = rt.alloc_lane()
    with pytest.raises(StageError):
        rt.copy_lane(lane, other, 96)
    rt.copy_lane(lane, other, 64)
    assert rt.lane_length(other) == 64
    # the lane cannot roll back to 32 or 96 (no state there), but it can restart at 64
    assert rt.prefill_boundary(lane) == 64
    with pytest.raises(StageError):
        rt.prefill(lane, torch.tensor(PROMPT[32:]), start=32)


def check_decode_after_padded_prefill(path, name: str) -> None:
    """150 prompt rows in chunks of 32 (22 real rows and 10 padding in the last), then 16
    greedy steps: llama.cpp ran no padding, so any padding row in the state would show."""
    rt = whole_model(path, chunk=CHUNK)
    lane = rt.alloc_lane()
    ours = greedy_logits(rt, lane, rt.prefill(lane, torch.tensor(PROMPT)).logits, 16)
    theirs = LlamaCppReference(path, n_ctx=512).greedy_logits(PROMPT, 16)
    delta = float(np.abs(ours.numpy() - theirs).max())
    print(f"\n{name} decode after a padded chunk: max |dlogit| {delta:.2e} over 17 steps")
    assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()
    assert delta <= 1e-3


def check_resume_at_any_token(path) -> None:
    """A row-invariant recurrent stage (int4 on our kernels): snapshots at any token (37:
    no chunk boundary), a lane continued from its own length wherever it ends; the rows
    after each bitwise a cold run's in calls of 17."""
    rt = runtime(path, weight_format="int4")
    assert rt.exactness is Exactness.ROW_INVARIANT
    expected = rt.prefill(rt.alloc_lane(), torch.tensor(PROMPT), logits="all",
                          rows_per_call=17).logits
    snaps = rt.prefill(rt.alloc_lane(), torch.tensor(PROMPT[:100] + [9] * 20), logits="none",
                       snapshots=(37, 100)).snapshots
    for b in (37, 100):
        lane = rt.alloc_lane()
        rt.import_state(lane, snaps[b])
        assert rt.prefill_boundary(lane) == b
        rows = rt.prefill(lane, torch.tensor(PROMPT[b:]), start=b, logits="all").logits
        assert torch.equal(rows, expected[b:]), b
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT[:41]), logits="none")
    assert rt.prefill_boundary(lane) == 41
    rows = rt.prefill(lane, torch.tensor(PROMPT[41:]), start=41, logits="all").logits
    assert torch.equal(rows, expected[41:])
