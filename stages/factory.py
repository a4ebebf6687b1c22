"""Choosing a stage runtime by name: the one place that knows both."""

from __future__ import annotations

from .runtime import StageError, StageRuntime, StageSpec

RUNTIMES = ("torch", "llama.cpp")


def make_runtime(spec: StageSpec, kind: str = "torch") -> StageRuntime:
    """A runtime for `spec`. llama.cpp serves only a whole model (one stage)."""
    if kind == "torch":
        from .torch_runtime import TorchStageRuntime
        return TorchStageRuntime(spec)
    if kind == "llama.cpp":
        from .llamacpp_runtime import LlamaCppStageRuntime
        return LlamaCppStageRuntime(spec)
    raise StageError(f"unknown runtime {kind!r} (choose from {', '.join(RUNTIMES)})")
