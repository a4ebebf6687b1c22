"""The Mamba2 selective state-space mixer (Falcon-H1's SSM half), as llama.cpp runs it.

in_proj splits into the gate z, the conv input xBC and the per-head time step dt. A
depthwise causal convolution (d_conv taps, plus bias) runs over xBC along time, then SiLU;
its output splits into x (n_head heads of head_dim channels), B and C (n_group groups of
d_state; head h reads group h // (n_head / n_group)). Per token and head:

    dt    = softplus(dt_raw + dt_bias)
    state = state * exp(dt * A) + (x * dt) ⊗ B        # [head_dim, d_state]
    y     = state · C + D * x

A is stored already negated (-exp(A_log)), one value per head. y is gated by silu(z),
RMS-normed per group (ssm_norm, {d_inner / n_group, n_group}) and mapped back by out_proj.
This mirrors llm_build_mamba_base::build_mamba2_layer and ggml_compute_forward_ssm_scan_f32.

A lane carries two recurrent tensors per layer: the last d_conv - 1 conv inputs and the
SSM state [n_head, head_dim, d_state]. Both end at the lane's last real row: rows that pad
a short prefill chunk are computed but never enter the state. The scan is sequential over
tokens with per-token ops of a fixed shape, so a row's bits do not depend on how many rows
ran with it (DESIGN.md §5.3). Where our kernels are built the conv and the scan are one
call each of scan.c (softplus, exp and SiLU by its own polynomials: torch's round a
vector's body and its tail differently, so an element's bits would depend on where the
call's rows put it) and the gate is layers.gated_activation: the mixer is then
row-invariant; torch's ops serve where they are not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from skippy.topology.gguf_file import ModelConfigError
from skippy.topology.model_config import ModelConfig

from . import qkernel
from .layers import causal_conv, conv_taps, gated_activation, rms_norm
from .linear import make_linear
from .shortconv import conv_state
from .weights import StageTensors


def mamba2_state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's (conv state, SSM state)."""
    conv_dim = cfg.ssm_d_inner + 2 * cfg.ssm_groups * cfg.ssm_d_state
    return ((cfg.ssm_d_conv - 1, conv_dim),
            (cfg.ssm_heads, cfg.ssm_d_inner // cfg.ssm_heads, cfg.ssm_d_state))


class Mamba2:
    def __init__(self, index: int, slot: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}."
        # slot: this layer's conv state in LaneKv.conv; slot + 1: its SSM state
        self.slot = slot
        self.d_inner, self.n_head = cfg.ssm_d_inner, cfg.ssm_heads
        self.d_state, self.n_group = cfg.ssm_d_state, cfg.ssm_groups
        if self.d_inner % self.n_head or self.n_head % self.n_group:
            raise ModelConfigError(f"{p}: d_inner {self.d_inner}, heads {self.n_head} and groups "
                                   f"{self.n_group} do not divide")
        self.head_dim = self.d_inner // self.n_head
        self.conv_dim = self.d_inner + 2 * self.n_group * self.d_state
        self.d_conv = cfg.ssm_d_conv - 1  # rows of conv state
        self.eps = cfg.rms_eps
        self.in_proj = make_linear(t.matrix(p + "ssm_in.weight"), fmt)
        self.out_proj = make_linear(t.matrix(p + "ssm_out.weight"), fmt)
        self.taps = conv_taps(t[p + "ssm_conv1d.weight"], p + "ssm_conv1d.weight",
                              self.conv_dim, cfg.ssm_d_conv)
        self.conv_bias = t.get(p + "ssm_conv1d.bias")
        self.dt_bias = t[p + "ssm_dt.bias"].reshape(self.n_head)
        self.A = t[p + "ssm_a"].reshape(self.n_head)
        self.D = t[p + "ssm_d"].reshape(self.n_head)
        norm = t.get(p + "ssm_norm.weight")
        self.norm = None if norm is None else norm.reshape(self.n_group, -1)
        self.lib = qkernel.library()
        if self.lib is not None:  # scan.c's operands: float32, contiguous
            self.tap_rows = torch.stack(self.taps).float().contiguous()
            self.dt_bias, self.A, self.D = (v.float().contiguous()
                                            for v in (self.dt_bias, self.A, self.D))
            if self.conv_bias is not None:
                self.conv_bias = self.conv_bias.float().contiguous()

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, segments) -> torch.Tensor:
        n = h.shape[0]
        z, xbc, dt = self.in_proj(h).split([self.d_inner, self.conv_dim, self.n_head], dim=-1)
        if len(segments) == 1 and segments[0].n == n:
            y = self._mix(segments[0], xbc, dt)
        else:  # decode batch: padding rows belong to no lane, stay zero, touch no state
            y = h.new_zeros(n, self.d_inner)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                y[rows] = self._mix(seg, xbc[rows], dt[rows])
        y = gated_activation(z, y, "silu")
        if self.norm is not None:  # grouped RMSNorm
            y = rms_norm(y.view(n, self.n_group, -1), self.norm, self.eps).view(n, self.d_inner)
        return self.out_proj(y)

    @property
    def row_invariant(self) -> bool:
        """Through scan.c (and rowops.c's gate and norm): where our kernels are built."""
        return self.lib is not None

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this mixer."""
        small = [*self.taps, self.dt_bias, self.A, self.D]
        small += [t for t in (self.conv_bias, self.norm) if t is not None]
        return self.in_proj.nbytes + self.out_proj.nbytes + sum(t.nbytes for t in small)

    def _mix(self, seg, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        n, end = xbc.shape[0], seg.n_real
        kv = seg.kv
        if self.lib is not None:
            state = kv.conv[self.slot]
            conv = qkernel.scan_conv(self.lib, state, xbc, self.tap_rows, self.conv_bias,
                                     silu=True)
            kv.conv[self.slot] = conv_state(state, xbc, end)  # replaced, never in place
            y, kv.conv[self.slot + 1] = qkernel.scan_mamba2(
                self.lib, conv, end, dt, self.dt_bias, self.A, self.D, self.n_group,
                kv.conv[self.slot + 1])
            return y
        full = torch.cat([kv.conv[self.slot], xbc])  # [d_conv + n, conv_dim]
        conv = causal_conv(full, self.taps, n)
        kv.conv[self.slot] = full[end:end + self.d_conv].clone()  # replaced, never in place
        if self.conv_bias is not None:
            conv = conv + self.conv_bias
        conv = F.silu(conv)
        x, b, c = conv.split([self.d_inner, self.n_group * self.d_state,
                              self.n_group * self.d_state], dim=-1)
        rep = self.n_head // self.n_group
        x = x.reshape(n, self.n_head, self.head_dim)
        b = b.reshape(n, self.n_group, self.d_state).repeat_interleave(rep, dim=1)
        c = c.reshape(n, self.n_group, self.d_state).repeat_interleave(rep, dim=1)
        dt = F.softplus(dt + self.dt_bias)        # [n, n_head]; ggml: x > 20 ? x : log1p(exp x)
        decay = torch.exp(dt * self.A)[:, :, None, None]     # [n, n_head, 1, 1]
        x_dt = (x * dt[:, :, None])[:, :, :, None]          # [n, n_head, head_dim, 1]
        b, c = b[:, :, None, :], c[:, :, None, :]            # [n, n_head, 1, d_state]
        state = kv.conv[self.slot + 1]
        kept = state
        ys = []
        for i in range(n):
            state = state * decay[i] + b[i] * x_dt[i]
            ys.append((state * c[i]).sum(-1))
            if i == end - 1:
                kept = state
        kv.conv[self.slot + 1] = kept
        y = torch.stack(ys) + x * self.D[:, None]
        return y.reshape(n, self.d_inner)


class ParallelMixer:
    """Falcon-H1: attention and Mamba2 read the same normed rows; their outputs are summed."""

    def __init__(self, attention, ssm: Mamba2):
        self.attention, self.ssm = attention, ssm

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, segments) -> torch.Tensor:
        return self.attention(h, positions, segments) + self.ssm(h, positions, segments)

    @property
    def nbytes(self) -> int:
        return self.attention.nbytes + self.ssm.nbytes

    @property
    def row_invariant(self) -> bool:
        """Attention is (attention.c); the sum is elementwise; so as the SSM half is."""
        return self.ssm.row_invariant
