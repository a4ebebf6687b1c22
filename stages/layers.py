"""Shared transformer pieces, written once for every family: norm, rope, attention, FFN."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from skippy.topology.gguf_file import ModelConfigError

from . import qkernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One call of our kernel (rowops.c: the mean summed in double, as llama.cpp sums it)
    where it is built, else torch's ops."""
    lib = qkernel.library()
    if lib is not None:
        return qkernel.rms_norm(lib, x, weight, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def conv_taps(kernel: torch.Tensor, name: str, channels: int, width: int) -> list[torch.Tensor]:
    """A depthwise causal conv kernel [channels, width] as one [channels] vector per tap;
    tap 0 weighs the oldest row."""
    if tuple(kernel.shape) != (channels, width):
        raise ModelConfigError(f"{name} has shape {tuple(kernel.shape)}, expected "
                               f"{(channels, width)}")
    return [kernel[:, j].contiguous() for j in range(width)]


def causal_conv(full: torch.Tensor, taps: list[torch.Tensor], n: int) -> torch.Tensor:
    """The n output rows of a depthwise causal conv over [state; rows] (`full`), the taps
    summed oldest first from the first product, as ggml_ssm_conv sums them."""
    out = full[0:n] * taps[0]
    for j in range(1, len(taps)):
        out = out + full[j:j + n] * taps[j]
    return out


def gated_activation(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate) * up: through our kernel where it is built (torch's elementwise kernels
    round a vector's tail through libm and its body through Sleef, so an element's bits
    would depend on where the call's rows put it), else torch's ops."""
    lib = qkernel.library()
    if lib is not None and kind in qkernel.GATED and gate.ndim == 2:
        return qkernel.gated(lib, gate, up, kind)
    if kind == "silu":
        return F.silu(gate) * up
    if kind == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if kind == "gelu_f16":
        return gelu_f16(gate) * up
    raise ValueError(f"unknown activation '{kind}'")


def gelu_f16(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh form) as llama.cpp's CPU kernels compute it, gated or not: the input
    rounded to f16 and looked up in a table of f16 results (GGML_GELU_FP16), 0 at or
    below -10 and x itself at or above 10. Exact GELU differs from it by up to an f16
    rounding, ~5e-4 of each value (tests/test_family_gemma4.py). A lookup gives an
    element the same bits wherever the call's rows put it (torch's gelu would not); our
    kernel's gated form (rowops.c, act 2) looks up the same table."""
    bits = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    y = qkernel.gelu_f16_table()[bits]
    y = torch.where(x >= 10.0, x, y)
    return torch.where(x <= -10.0, torch.zeros_like(x), y)


class Rope:
    """Rotary embedding tables for one (base, scale), grown on demand.

    Angles are built the way llama.cpp builds its rope cache, a float32 running product
    pos * s * s * ... with s = base^(-2/n_dims), so both sides rotate by the same floats;
    frequency factors (rope_freqs: Llama 3's, Gemma 4's global layers'), where given,
    divide pair i's angle by factors[i] before the scale, as ggml's rope does.
    """

    def __init__(self, dim: int, base: float, scale: float, style: str,
                 factors: torch.Tensor | None = None):
        if style not in ("norm", "neox"):
            raise ValueError(f"unknown rope style '{style}'")
        if factors is not None and factors.numel() < dim // 2:
            raise ModelConfigError(f"{factors.numel()} rope frequency factors for {dim // 2} pairs")
        self.dim, self.base, self.scale, self.style = dim, base, scale, style
        self.factors = factors.to(torch.float32).reshape(-1) if factors is not None else None
        self.cos = torch.empty(0, dim // 2)
        self.sin = torch.empty(0, dim // 2)
        self._positions: torch.Tensor | None = None  # the last positions looked up
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        step = torch.tensor(math.pow(self.base, -2.0 / self.dim), dtype=torch.float32)
        theta = torch.arange(n, dtype=torch.float32)
        cols = []
        for i in range(self.dim // 2):
            angle = theta if self.factors is None else theta / self.factors[i]
            cols.append(angle * self.scale)
            theta = theta * step
        angles = torch.stack(cols, dim=1)
        self.cos, self.sin = torch.cos(angles), torch.sin(angles)

    def ensure(self, n: int) -> None:
        """Tables for positions [0, n)."""
        if n > self.cos.shape[0]:
            self._grow(n)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rotation rows for `positions` in the form `apply` uses ([T, 1, ...]).
        Every layer of a forward asks for the same positions tensor: the rows are looked
        up once per forward."""
        if positions is not self._positions:
            self.ensure(int(positions.max()) + 1)
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
            if self.style == "norm":  # pairs (2i, 2i+1) turn as complex numbers
                self._rows = (torch.complex(cos, sin), None)
            else:  # halves: x * [cos, cos] + [x1, x0] * [-sin, sin]
                self._rows = (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
            self._positions = positions
        return self._rows

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T] int64. Per pair the floats of
        (x0 cos - x1 sin, x0 sin + x1 cos), in two or four ops instead of ten (tested
        bitwise against that formula)."""
        a, b = self.tables(positions)
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        if self.style == "norm":
            pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], -1, 2))
            out = torch.view_as_real(pairs * a).flatten(-2)
        else:
            half = self.dim // 2
            out = rot * a + torch.cat([rot[..., half:], rot[..., :half]], -1) * b
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Grouped-query attention of T queries over L keys.

    q: [T, H, D]; k: [L, KVH, D]; v: [L, KVH, Dv]; mask: additive [T, L] or None.
    Returns [T, H * Dv]. torch's fused CPU kernel (tiled, online softmax: faster than
    scores, softmax and values in three passes; evals/README.md, torch runtime) splits its
    work by (T, L) only, so the arithmetic depends on (T, L) and never on the
    cache capacity behind k and v (token-major slices: the same strides however large
    the buffer has grown).
    """
    T, H, _ = q.shape
    KVH = k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.permute(1, 0, 2).unsqueeze(0),
        v.permute(1, 0, 2).unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=H != KVH)
    return out[0].transpose(0, 1).reshape(T, -1)


def causal_mask(q_start: int, n_q: int, k_start: int, n_k: int, window: int = 0) -> torch.Tensor:
    """Additive mask: query at position i sees key j iff j <= i (and i - j < window)."""
    qi = torch.arange(q_start, q_start + n_q).unsqueeze(1)
    kj = torch.arange(k_start, k_start + n_k).unsqueeze(0)
    visible = kj <= qi
    if window > 0:
        visible &= (qi - kj) < window
    return torch.zeros(n_q, n_k).masked_fill_(~visible, float("-inf"))
