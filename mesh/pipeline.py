"""An in-process pipeline: a model's stages as plain objects, frames handed along.

The Ray mesh replaces the hand-off with actors and gRPC streams; the request's path
(prefill through every stage, then one decode step per token) stays the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from skippy.stages.runtime import StageOutput, StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig
from skippy.topology.planner import even_ranges

from .sampler import Sampler


class LocalPipeline:
    def __init__(self, model_path: str | Path, n_stages: int, *, wire_dtype: str = "f16",
                 **spec_options):
        f = GGUFFile(model_path)
        self.config = ModelConfig.from_gguf(f)
        f.close()
        ranges = even_ranges(self.config.n_layers, n_stages)
        self.stages = [
            TorchStageRuntime(StageSpec(str(model_path), a, b, i, n_stages, wire_dtype,
                                        **spec_options))
            for i, (a, b) in enumerate(ranges)
        ]
        self.n_ctx = self.stages[0].n_ctx

    def alloc(self) -> list[int]:
        """One lane in every stage for one request."""
        return [s.alloc_lane() for s in self.stages]

    def free(self, lanes: list[int]) -> None:
        for stage, lane in zip(self.stages, lanes):
            stage.free_lane(lane)

    def prefill(self, lanes: list[int], ids: list[int] | torch.Tensor, start: int = 0,
                logits: str = "last") -> torch.Tensor | None:
        """Positions [start, start + len(ids)); returns the last stage's logits."""
        out: StageOutput | None = None
        x = torch.as_tensor(ids, dtype=torch.long)
        for stage, lane in zip(self.stages, lanes):
            out = stage.prefill(lane, x, start, logits)
            x = out.frame
        return out.logits

    def decode(self, lanes: list[int], token: int) -> torch.Tensor:
        x = torch.tensor(token)
        for stage, lane in zip(self.stages, lanes):
            out = stage.decode([(lane, x)])[0]
            x = out.frame
        return out.logits

    def generate(self, ids: list[int], max_tokens: int, sampler: Sampler,
                 stop_ids: set[int] = frozenset()) -> Iterator[int]:
        """Token ids of the continuation, one at a time; a stop id ends it (not yielded)."""
        if not ids:
            raise ValueError("the prompt has no tokens")
        if len(ids) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(ids)} tokens) + max tokens ({max_tokens}) "
                             f"exceed the context of {self.n_ctx}")
        lanes = self.alloc()
        try:
            logits = self.prefill(lanes, ids)
            for i in range(max_tokens):
                token = sampler(logits)
                if token in stop_ids:
                    return
                yield token
                if i + 1 < max_tokens:
                    logits = self.decode(lanes, token)
        finally:
            self.free(lanes)
