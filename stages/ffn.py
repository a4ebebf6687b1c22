"""Feed-forward blocks of a decoder layer; `make_ffn` picks the one a layer's family uses."""

from __future__ import annotations

import torch

from skippy.topology.gguf_file import ModelConfigError
from skippy.topology.model_config import ModelConfig

from .layers import gated_activation
from .linear import fuse_linear, make_linear
from .moe import MoeFfn
from .weights import StageTensors


class GatedFfn:
    """down(act(gate(h)) * up(h)): the dense FFN of every family so far."""

    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}."
        self.activation = cfg.family.activation
        self.gate_up, self.gate_up_split = fuse_linear(
            [t.matrix(p + "ffn_gate.weight"), t.matrix(p + "ffn_up.weight")], fmt)
        self.down = make_linear(t.matrix(p + "ffn_down.weight"), fmt)

    def __call__(self, h: torch.Tensor, segments) -> torch.Tensor:
        gate, up = self.gate_up(h).split(self.gate_up_split, dim=-1)
        return self.down(gated_activation(gate, up, self.activation))

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this block."""
        return self.gate_up.nbytes + self.down.nbytes


class FusedUpFfn:
    """GLM-4's gated FFN: one ffn_up matrix holds the gate rows, then the up rows
    (llama.cpp's swiglu of the halves: act(first) * second)."""

    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}."
        self.activation = cfg.family.activation
        self.gate_up = make_linear(t.matrix(p + "ffn_up.weight"), fmt)
        if self.gate_up.out_features != 2 * cfg.ff:
            raise ModelConfigError(f"{p}ffn_up.weight has {self.gate_up.out_features} rows, "
                                   f"expected 2 * {cfg.ff}")
        self.down = make_linear(t.matrix(p + "ffn_down.weight"), fmt)

    def __call__(self, h: torch.Tensor, segments) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(gated_activation(gate, up, self.activation))

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def make_ffn(index: int, cfg: ModelConfig, t: StageTensors, fmt: str):
    """Layer `index`'s feed-forward block: a mixture of experts where the layer has a
    router (stages/moe.py), else the dense gated FFN."""
    if f"blk.{index}.ffn_gate_inp.weight" in t.names:
        return MoeFfn(index, cfg, t, fmt)
    if cfg.family.ffn_up_fused:
        return FusedUpFfn(index, cfg, t, fmt)
    return GatedFfn(index, cfg, t, fmt)
