"""An embedding request's answer at the last stage (Prefill.embed)."""

from __future__ import annotations

import torch

from skippy.stages.runtime import StageError
from skippy.topology.errors import RequestError


def pooled(hidden: torch.Tensor | None, pooling: str) -> bytes:
    """An embedding request's answer: its rows' final hidden states pooled (the mean of
    every row, or the last row), f32 little-endian."""
    if hidden is None:
        raise StageError("this stage's runtime gives no hidden rows: embeddings need the "
                         "torch runtime")
    if pooling not in ("mean", "last"):
        raise RequestError(f"pooling must be mean or last, not {pooling!r}", "pooling")
    row = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
    return row.to(torch.float32).contiguous().numpy().tobytes()
