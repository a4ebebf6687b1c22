"""Activation frames: the hidden-state rows a non-final stage hands to the next one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIRE_DTYPES = {"f32": torch.float32, "f16": torch.float16}

# f16 tops out at 65504, and Gemma's residual stream passes 98,000 on a BOS row. Rows
# whose magnitude would overflow are sent divided by a power of two: exact, and rows
# already in range (scale 1) are bit-for-bit plain f16.
_F16_SAFE_EXPONENT = 14  # |row| / 2^k < 2^15 after scaling


@dataclass(frozen=True)
class Frame:
    """Rows for token positions [start, start + len(rows)) of one lane, in the wire dtype."""

    start: int
    rows: torch.Tensor                  # [n, hidden]
    scale: torch.Tensor | None = None   # [n] float32 powers of two (f16 wire), else None

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_rows


def to_wire(start: int, rows: torch.Tensor, wire_dtype: str) -> Frame:
    if wire_dtype == "f32":
        return Frame(start, rows.to(torch.float32))
    if wire_dtype != "f16":
        raise ValueError(f"wire dtype '{wire_dtype}' is not supported (supported: f32, f16)")
    peak = rows.abs().amax(dim=-1).nan_to_num(0.0, 0.0, 0.0).clamp_min(1.0)
    exponent = (torch.floor(torch.log2(peak)) - _F16_SAFE_EXPONENT).clamp_min(0)
    scale = torch.exp2(exponent)
    return Frame(start, (rows / scale.unsqueeze(1)).to(torch.float16), scale)


def from_wire(frame: Frame) -> torch.Tensor:
    """Receiving side: compute always runs in float32."""
    rows = frame.rows.to(torch.float32)
    return rows * frame.scale.unsqueeze(1) if frame.scale is not None else rows
