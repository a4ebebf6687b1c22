"""Activation frames: the hidden-state rows a non-final stage hands to the next one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import qkernel

# q8 is opt-in: lossy (~0.4 % of a row's peak per value), a quarter of f32's bytes.
WIRE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "q8": torch.int8}

# f16 tops out at 65504, and Gemma's residual stream passes 98,000 on a BOS row. Rows
# whose magnitude would overflow are sent divided by a power of two: exact, and rows
# already in range (scale 1) are bit-for-bit plain f16.
_F16_SAFE_EXPONENT = 14  # |row| / 2^k < 2^15 after scaling

_Q8_MAX = 127  # symmetric: -128 is never used, so negating a row never overflows

_UNIT_ROWS = 64
_UNITS = [torch.ones(n) for n in range(_UNIT_ROWS + 1)]


def unit_scale(n: int) -> torch.Tensor:
    """An f16 frame's scales of n rows all in range: shared up to _UNIT_ROWS rows (never
    written: a decode row's frame takes no op for them, and wire.py knows them by identity)."""
    return _UNITS[n] if n <= _UNIT_ROWS else torch.ones(n)


def is_unit_scale(scale: torch.Tensor | None) -> bool:
    """Whether `scale` is one of unit_scale's shared tensors (no op: by identity)."""
    return scale is not None and scale.shape[0] <= _UNIT_ROWS and scale is _UNITS[scale.shape[0]]


@dataclass(frozen=True)
class Frame:
    """Rows for token positions [start, start + len(rows)) of one lane, in the wire dtype.

    The wire dtype is the rows' dtype: float32 (f32), float16 (f16) or int8 (q8). The
    values a stage computes with are rows * scale per row (from_wire)."""

    start: int
    rows: torch.Tensor                  # [n, hidden]
    # [n] float32 per row: powers of two (f16), max-abs / 127 (q8); None for f32
    scale: torch.Tensor | None = None
    # [n] int64: the rows' token ids, for families whose later layers look rows up by token
    # (Gemma 4's per-layer embeddings). Not part of the wire bytes: the data plane already
    # sends every stage the tokens (Prefill.tokens, Decode.token) and attaches them.
    tokens: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_rows

    @property
    def wire_dtype(self) -> str:
        for name, dtype in WIRE_DTYPES.items():
            if self.rows.dtype == dtype:
                return name
        raise ValueError(f"frame rows of dtype {self.rows.dtype} are no wire dtype")


def to_wire(start: int, rows: torch.Tensor, wire_dtype: str,
            tokens: torch.Tensor | None = None) -> Frame:
    if wire_dtype == "f32":
        return Frame(start, rows.to(torch.float32), tokens=tokens)
    if wire_dtype == "f16":
        lib = qkernel.library() if rows.dtype == torch.float32 and rows.is_contiguous() \
            else None
        if lib is not None:  # one call where a decode row's frame took five cold ops
            half = qkernel.f16_rows(lib, rows, 2.0 ** (_F16_SAFE_EXPONENT + 1))
            if half is not None:
                return Frame(start, half, unit_scale(rows.shape[0]), tokens)
        elif float(rows.abs().max()) < 2.0 ** (_F16_SAFE_EXPONENT + 1):
            # every row in range (the usual case): scale 1, the rows as they are. Three
            # ops, not ten: a decode row's frame took 0.3 ms of its stage's step that way.
            return Frame(start, rows.to(torch.float16), unit_scale(rows.shape[0]), tokens)
        peak = rows.abs().amax(dim=-1).nan_to_num(0.0, 0.0, 0.0).clamp_min(1.0)
        exponent = (torch.floor(torch.log2(peak)) - _F16_SAFE_EXPONENT).clamp_min(0)
        scale = torch.exp2(exponent)
        return Frame(start, (rows / scale.unsqueeze(1)).to(torch.float16), scale, tokens)
    if wire_dtype == "q8":
        rows = rows.to(torch.float32)
        scale = rows.abs().amax(dim=-1) / _Q8_MAX
        # An all-zero row would divide 0 by 0; scale 1 sends it as zeros all the same.
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / scale.unsqueeze(1)).clamp_(-_Q8_MAX, _Q8_MAX)
        return Frame(start, q.to(torch.int8), scale, tokens)
    raise ValueError(f"wire dtype '{wire_dtype}' is not supported "
                     f"(supported: {', '.join(WIRE_DTYPES)})")


def from_wire(frame: Frame) -> torch.Tensor:
    """Receiving side: compute always runs in float32."""
    lib = qkernel.library()
    if lib is not None and frame.rows.dtype == torch.float16 and frame.rows.ndim == 2 and \
            frame.rows.is_contiguous() and frame.scale is not None and \
            frame.scale.dtype == torch.float32 and frame.scale.is_contiguous():
        return qkernel.f16_values(lib, frame.rows, frame.scale)
    rows = frame.rows.to(torch.float32)
    return rows * frame.scale.unsqueeze(1) if frame.scale is not None else rows
