"""Making a stage runtime from its descriptor (stages/runtime_kind.py)."""

from __future__ import annotations

from .runtime import StageRuntime, StageSpec
from .runtime_kind import TORCH, RuntimeKind


def make_runtime(spec: StageSpec, kind: RuntimeKind = TORCH) -> StageRuntime:
    """A runtime of `kind` for `spec`. llama.cpp serves only a whole model (one stage)."""
    return kind.make(spec)
