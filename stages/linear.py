"""The one linear-layer abstraction: every weight matrix of a stage goes through it.

A format is chosen per model at load and is part of the cache identity (it changes the
arithmetic). Faster formats (bf16, int8/int4 weight-only) drop in here as new classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("fp32",)


class Linear:
    """y = x @ W.T with W stored as (out_features, in_features) float32."""

    fmt = "fp32"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(torch.float32).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def make_linear(weight: torch.Tensor, fmt: str = "fp32") -> Linear:
    if fmt != "fp32":
        raise ValueError(f"weight format '{fmt}' is not supported (supported: {', '.join(WEIGHT_FORMATS)})")
    return Linear(weight)


def fuse_linear(weights: list[torch.Tensor], fmt: str = "fp32") -> tuple[Linear, list[int]]:
    """One Linear for several projections of the same input (QKV, gate/up): fewer calls
    per token; returns the split sizes of its output."""
    return make_linear(torch.cat(weights, dim=0), fmt), [w.shape[0] for w in weights]
