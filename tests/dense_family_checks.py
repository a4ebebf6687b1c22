"""Exactness checks for the dense families of issue 19 (gemma2, olmo, olmo2, glm4, llama3
rope factors), each family's test file calls them on its own synthetic file: a lane's
rows never depend on the lanes beside it, and a lane resumed at a chunk boundary computes
bitwise what a cold run computes (DESIGN.md §5.3)."""

from __future__ import annotations

import torch

from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

CHUNK = 32
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]  # boundaries 32, 64, 96, 128


def runtime(path, **kw) -> TorchStageRuntime:
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    return TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=512, chunk=CHUNK, **kw))


def check_lanes_independent(path, weight_format: str = "fp32") -> None:
    """Decode rows of a padded batch of lanes equal the same lane decoded alone."""
    rt = runtime(path, lane_batch=4, weight_format=weight_format)
    lanes = [rt.alloc_lane() for _ in range(3)]
    for i, lane in enumerate(lanes):
        rt.prefill(lane, torch.tensor(PROMPT[: 40 + 30 * i]), logits="none")
    alone = rt.alloc_lane()
    rt.prefill(alone, torch.tensor(PROMPT[:40]), logits="none")
    for step in range(3):
        together = rt.decode([(lane, torch.tensor(42 + step)) for lane in lanes])
        solo = rt.decode([(alone, torch.tensor(42 + step))])
        assert torch.equal(together[0].logits, solo[0].logits)


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


def check_matrix_makes_this_file(name: str, path, tmp_path) -> None:
    """evals/certify_matrix.py's default model `name` is byte for byte the test's file."""
    from skippy.evals import certify_matrix
    made = certify_matrix.model_path(name, synth_dir=tmp_path)
    assert made.read_bytes() == path.read_bytes()
