"""Activation frames: the hidden-state rows a non-final stage hands to the next one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIRE_DTYPES = {"f32": torch.float32, "f16": torch.float16}


@dataclass(frozen=True)
class Frame:
    """Rows for token positions [start, start + len(rows)) of one lane, in the wire dtype."""

    start: int
    rows: torch.Tensor  # [n, hidden]

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_rows


def to_wire(rows: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    try:
        return rows.to(WIRE_DTYPES[wire_dtype])
    except KeyError:
        raise ValueError(f"wire dtype '{wire_dtype}' is not supported (supported: f32, f16)") from None


def from_wire(rows: torch.Tensor) -> torch.Tensor:
    """Receiving side: compute always runs in float32."""
    return rows.to(torch.float32)
