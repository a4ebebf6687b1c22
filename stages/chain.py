"""A model's stages as plain runtimes in this process, each hand-off a frame, no caches:
the uncached arithmetic that numerics, wire and split checks compare against. Requests
(caches, sampling, batching) go through the engines instead (mesh/control/)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model
from skippy.topology.planner import even_ranges

from .runtime import StageOutput, StageSpec
from .runtime_kind import TORCH, RuntimeKind


class StageChain:
    def __init__(self, model_path: str | Path, n_stages: int, *, wire_dtype: str = "f16",
                 runtime: RuntimeKind = TORCH, **spec_options):
        f = open_model(model_path)
        self.config = ModelConfig.from_gguf(f)
        f.close()
        ranges = even_ranges(self.config.n_layers, n_stages, self.config.cut_groups())
        self.stages = [
            runtime.make(StageSpec(str(model_path), a, b, i, n_stages, wire_dtype,
                                   **spec_options))
            for i, (a, b) in enumerate(ranges)
        ]
        self.n_ctx = self.stages[0].n_ctx

    def alloc(self) -> list[int]:
        """One fresh lane in every stage."""
        return [s.alloc_lane() for s in self.stages]

    def free(self, lanes: Sequence[int]) -> None:
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
