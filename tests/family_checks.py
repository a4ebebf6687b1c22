"""What every family must pass, written once: tests/test_families.py runs these over the
registry's synthetic files (topology/families.py, SynthCase), and a family's own test file
reads the same file through `case_file`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from skippy.evals import certify_matrix
from skippy.evals.numerics import family_agreement, greedy_logits, whole_model
from skippy.evals.reference import LlamaCppReference
from skippy.stages.certify import certify
from skippy.stages.runtime import StageSpec
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
    """Teacher-forced against llama.cpp: 2 prompts of 320 tokens, 16 decode steps; an
    expert choice that is a near-tie in our run (margin under 1e-3) is made llama.cpp's
    way where the rows say llama.cpp made it the other way (evals/numerics.py
    teacher_forced), and every row is then held to the bar."""
    r = family_agreement(path, **spec)
    print(f"\n{name} f32 vs llama.cpp: max |dlogit| {r['max_abs_delta']:.2e} over "
          f"{r['positions']} rows ({r['decided']} with a clear top-1); near-ties made "
          f"the other way (prompt, row, layer, margin): {r['flipped']}")
    assert r["top1_where_clear"], r
    assert r["max_abs_delta"] <= 1e-3, r
    return r


def check_certify(path, stages: int, weight_format: str) -> None:
    report = certify(path, stages, weight_format=weight_format)
    assert report.passed, report.table()
    assert all(c.max_abs_diff == 0.0 for c in report.checks if c.passed is not None)


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


def check_resume_is_bitwise_cold(path, weight_format: str = "fp32") -> None:
    """State saved at every chunk boundary by another prompt that shares only that
    prefix, restored, and run on: the same prefill rows and decode logits as cold."""
    rt = runtime(path, weight_format=weight_format)
    cold = rt.alloc_lane()
    all_cold = rt.prefill(cold, torch.tensor(PROMPT), logits="all").logits
    cold_steps = [rt.decode([(cold, torch.tensor(t))])[0].logits for t in (7, 8, 9)]
    for b in range(CHUNK, len(PROMPT), CHUNK):
        other = rt.alloc_lane()
        rt.prefill(other, torch.tensor(PROMPT[:b] + [5] * 40), logits="none")
        state = rt.export_state(other, b)
        rt.free_lane(other)
        lane = rt.alloc_lane()
        rt.import_state(lane, state)
        rows = rt.prefill(lane, torch.tensor(PROMPT[b:]), start=b, logits="all").logits
        assert torch.equal(rows, all_cold[b:]), f"prefill rows differ after resuming at {b}"
        for t, want in zip((7, 8, 9), cold_steps):
            assert torch.equal(rt.decode([(lane, torch.tensor(t))])[0].logits, want)
        rt.free_lane(lane)


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
