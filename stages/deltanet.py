"""The gated DeltaNet mixer of Qwen3-Next's linear-attention layers, as llama.cpp runs it.

The input projections give q, k, v (the conv input, key heads first), the output gate z,
and per value head a beta and an alpha. A depthwise causal convolution (d_conv taps, no
bias) runs over q|k|v along time, then SiLU; q and k are L2-normalised per head and
repeated to the value heads (value head h reads key head h // (n_v / n_k)). Per token
and value head, with the state held transposed (state[j, i] = S[i][j]):

    g      = softplus(alpha + dt_bias) * ssm_a          # ssm_a = -exp(A_log), stored so
    state  = state * exp(g)
    delta  = (v - state · k) * sigmoid(beta)
    state  = state + delta ⊗ k
    out    = (state · q) / sqrt(head_dim)

`out` is RMS-normed per head (ssm_norm), gated by silu(z) and mapped back by ssm_out.
This mirrors llama_model_qwen3next::graph::build_layer_attn_linear and, for the
recurrence, ggml_compute_forward_gated_delta_net_f32: on CPU llama.cpp runs that fused
op token by token for prefill and decode alike (its chunked and autoregressive graphs are
the fallbacks where the op is missing), so one sequential recurrence matches both.

A lane carries two recurrent tensors per layer: the last d_conv - 1 conv inputs and the
state [n_v, head_dim, head_dim], both as they stand after the lane's last real row: rows
that pad a short prefill chunk are computed but never enter the state. Every per-token op
has one fixed shape, so a row's bits do not depend on how many rows ran with it
(DESIGN.md §5.3). Where our kernels are built the conv, the gates and the recurrence are
scan.c (sigmoid, softplus, exp and SiLU by its own polynomials: torch's round a vector's
body and its tail differently, so an element's bits would depend on where the call's rows
put it) and the output gate is layers.gated_activation: the mixer is then row-invariant;
torch's ops serve where they are not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from skippy.topology.model_config import ModelConfig

from . import qkernel
from .layers import causal_conv, conv_taps, gated_activation, rms_norm
from .linear import Int4Blocks, Int8Blocks, Matrix, fuse_linear, make_linear
from .shortconv import conv_state
from .weights import StageTensors


def deltanet_state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one DeltaNet layer's (conv state, delta state)."""
    d = cfg.ssm_d_state
    conv_dim = 2 * cfg.ssm_groups * d + cfg.ssm_heads * d
    return (cfg.ssm_d_conv - 1, conv_dim), (cfg.ssm_heads, d, d)


def _rows(m: Matrix, idx: torch.Tensor) -> Matrix:
    """Rows `idx` of a matrix, with its file blocks where it has them."""
    int4 = None if m.int4 is None else Int4Blocks(m.int4.codes[idx], m.int4.scale[idx],
                                                  m.int4.offset[idx])
    int8 = None if m.int8 is None else Int8Blocks(m.int8.codes[idx], m.int8.scale[idx])
    return Matrix(m.values[idx], int4, int8)


def in_projections(p: str, t: StageTensors, n_k: int, rep: int,
                   d: int) -> tuple[Matrix, Matrix]:
    """The (q|k|v, z) projections. Newer files store them apart (attn_qkv, attn_gate);
    older ones as one ssm_in whose rows run per key head [q, k, v of its rep value heads,
    z of them], which llama.cpp splits at run time and we reorder once here."""
    if p + "attn_qkv.weight" in t.names:
        return t.matrix(p + "attn_qkv.weight"), t.matrix(p + "attn_gate.weight")
    m = t.matrix(p + "ssm_in.weight")
    per_head = torch.arange(2 * d + 2 * rep * d).expand(n_k, -1)
    base = (torch.arange(n_k) * per_head.shape[1])[:, None] + per_head
    q, k = base[:, :d], base[:, d:2 * d]
    v, z = base[:, 2 * d:2 * d + rep * d], base[:, 2 * d + rep * d:]
    return (_rows(m, torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])),
            _rows(m, z.reshape(-1)))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / |x| over the last dim as llama.cpp forms it: an RMS norm with eps / n, scaled by
    1 / sqrt(n)."""
    n = x.shape[-1]
    return rms_norm(x, x.new_ones(n), eps / n) * (1.0 / math.sqrt(n))


class GatedDeltaNet:
    def __init__(self, index: int, slot: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}."
        # slot: this layer's conv state in LaneKv.conv; slot + 1: its delta state
        self.slot = slot
        self.n_k, self.n_v, self.d = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_d_state
        self.rep = self.n_v // self.n_k
        self.key_dim, self.value_dim = self.n_k * self.d, self.n_v * self.d
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.d_conv = cfg.ssm_d_conv - 1  # rows of conv state
        self.eps = cfg.rms_eps
        self.scale = 1.0 / math.sqrt(self.d)
        qkv, z = in_projections(p, t, self.n_k, self.rep, self.d)
        self.in_proj, self.in_split = fuse_linear([qkv, z, t.matrix(p + "ssm_ba.weight")], fmt)
        self.out_proj = make_linear(t.matrix(p + "ssm_out.weight"), fmt)
        self.taps = conv_taps(t[p + "ssm_conv1d.weight"], p + "ssm_conv1d.weight",
                              self.conv_dim, cfg.ssm_d_conv)
        self.dt_bias = t[p + "ssm_dt.bias"].reshape(self.n_v)
        self.A = t[p + "ssm_a"].reshape(self.n_v)
        self.norm = t[p + "ssm_norm.weight"].reshape(self.d)
        self.lib = qkernel.library()
        if self.lib is not None:  # scan.c's operands: float32, contiguous
            self.tap_rows = torch.stack(self.taps).float().contiguous()
            self.dt_bias, self.A = (v.float().contiguous() for v in (self.dt_bias, self.A))

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, segments) -> torch.Tensor:
        n = h.shape[0]
        qkv, z, ba = self.in_proj(h).split(self.in_split, dim=-1)
        if self.lib is not None:
            return self._scanned(h, qkv, z, ba, segments)
        # per key head: its rep value heads' betas, then their alphas
        ba = ba.reshape(n, self.n_k, 2, self.rep)
        beta = torch.sigmoid(ba[:, :, 0].reshape(n, self.n_v))
        g = F.softplus(ba[:, :, 1].reshape(n, self.n_v) + self.dt_bias) * self.A
        if len(segments) == 1 and segments[0].n == n:
            out = self._mix(segments[0], qkv, beta, g)
        else:  # decode batch: padding rows belong to no lane, stay zero, touch no state
            out = h.new_zeros(n, self.n_v, self.d)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                out[rows] = self._mix(seg, qkv[rows], beta[rows], g[rows])
        out = rms_norm(out, self.norm, self.eps) * F.silu(z.reshape(n, self.n_v, self.d))
        return self.out_proj(out.reshape(n, self.value_dim))

    @property
    def row_invariant(self) -> bool:
        """Through scan.c (and rowops.c's gate and norms): where our kernels are built."""
        return self.lib is not None

    def _scanned(self, h: torch.Tensor, qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor,
                 segments) -> torch.Tensor:
        """__call__ through scan.c: the gates are computed there, token by token."""
        n = h.shape[0]
        if len(segments) == 1 and segments[0].n == n:
            out = self._scan(segments[0], qkv, ba)
        else:  # decode batch: padding rows belong to no lane, stay zero, touch no state
            out = h.new_zeros(n, self.n_v, self.d)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                out[rows] = self._scan(seg, qkv[rows], ba[rows])
        out = rms_norm(out, self.norm, self.eps).view(n, self.value_dim)
        return self.out_proj(gated_activation(z, out, "silu"))

    def _scan(self, seg, qkv: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
        """One lane's rows through scan.c: [n, n_v, d], the lane's state left at its last
        real row."""
        n, end, kv = qkv.shape[0], seg.n_real, seg.kv
        state = kv.conv[self.slot]
        conv = qkernel.scan_conv(self.lib, state, qkv, self.tap_rows, silu=True)
        kv.conv[self.slot] = conv_state(state, qkv, end)  # replaced, never in place
        # q and k L2-normed in one call: [n, 2 * n_k, d], q heads first
        qk = l2_norm(conv[:, :2 * self.key_dim].reshape(n, 2 * self.n_k, self.d), self.eps)
        out, kv.conv[self.slot + 1] = qkernel.scan_deltanet(
            self.lib, qk, conv[:, 2 * self.key_dim:], ba, end, self.dt_bias, self.A,
            self.scale, kv.conv[self.slot + 1])
        return out

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this mixer."""
        small = [*self.taps, self.dt_bias, self.A, self.norm]
        return self.in_proj.nbytes + self.out_proj.nbytes + sum(t.nbytes for t in small)

    def _mix(self, seg, qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """One lane's rows: conv, norms, the delta rule; returns [n, n_v, d] (unscaled by
        the output norm) and leaves the lane's state at its last real row."""
        n, end, kv = qkv.shape[0], seg.n_real, seg.kv
        full = torch.cat([kv.conv[self.slot], qkv])  # [d_conv + n, conv_dim]
        conv = F.silu(causal_conv(full, self.taps, n))
        kv.conv[self.slot] = full[end:end + self.d_conv].clone()  # replaced, never in place
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_norm(q.reshape(n, self.n_k, self.d), self.eps)
        k = l2_norm(k.reshape(n, self.n_k, self.d), self.eps)
        if self.rep > 1:
            q = q.repeat_interleave(self.rep, dim=1)
            k = k.repeat_interleave(self.rep, dim=1)
        v = v.reshape(n, self.n_v, self.d)
        decay = torch.exp(g)[:, :, None, None]   # [n, n_v, 1, 1]
        beta = beta[:, :, None]                  # [n, n_v, 1]
        q, k = q[:, :, None, :], k[:, :, None, :]  # [n, n_v, 1, d]: along i
        state = kept = kv.conv[self.slot + 1]    # [n_v, d (j), d (i)]
        outs = []
        for r in range(n):
            state = state * decay[r]
            delta = (v[r] - (state * k[r]).sum(-1)) * beta[r]
            state = state + delta[:, :, None] * k[r]
            outs.append((state * q[r]).sum(-1))
            if r == end - 1:
                kept = state
        kv.conv[self.slot + 1] = kept
        return torch.stack(outs) * self.scale
