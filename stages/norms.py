"""The norms a family puts around its blocks: RMSNorm with a weight (most families) or
OLMo's LayerNorm with neither weight nor bias."""

from __future__ import annotations

import torch

from skippy.topology.model_config import ModelConfig

from . import qkernel
from .layers import rms_norm
from .weights import StageTensors


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the last dimension, summed in double and rounded
    where ggml_norm rounds (the mean and the variance to float), so that a row's bits are
    its own whatever rows come with it: our kernel's (rowops.c, the sums in input order)
    where it is built, else torch's ops."""
    lib = qkernel.library()
    if lib is not None and x.dtype == torch.float32:
        return qkernel.layer_norm(lib, x, eps)
    n = x.shape[-1]
    mean = x.sum(-1, keepdim=True, dtype=torch.float64).to(torch.float32) / n
    y = x - mean
    var = ((y * y).sum(-1, keepdim=True, dtype=torch.float64) / n).to(torch.float32)
    return y * (1.0 / torch.sqrt(var + eps))


class Norm:
    """One norm of a layer (or the final one): called on rows, returns normed rows."""

    def __init__(self, kind: str, weight: torch.Tensor | None, eps: float):
        if kind not in ("rms", "layer"):
            raise ValueError(f"unknown norm '{kind}'")
        self.kind, self.weight, self.eps = kind, weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return layer_norm(x, self.eps)
        return rms_norm(x, self.weight, self.eps)

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this norm."""
        return self.weight.nbytes if self.weight is not None else 0


def make_norm(cfg: ModelConfig, t: StageTensors, name: str | None) -> Norm:
    """The family's norm; `name` is its weight's GGUF name (unread by weightless norms)."""
    kind = cfg.family.norm
    return Norm(kind, t[name] if kind == "rms" else None, cfg.rms_eps)
