"""Multi-head latent attention (DeepSeek2's MLA), as llama.cpp runs it with absorbed
key/value up-projections (models/deepseek2.cpp, is_mla).

Per token, attn_kv_a_mqa gives a compressed latent c (kv_lora_rank, then RMS-normed) and
one shared key part k_pe (rope.dimension_count, rotated). The lane keeps exactly the row
[c, k_pe] per layer: one "head" of kv_lora_rank + n_rot floats, the smallest state a
later token needs. Per-head keys and values are never expanded:

    q_h            = [q_nope_h, q_pe_h]                (attn_q, or attn_q_a -> norm -> attn_q_b)
    score_h(t, s)  = (W_kb_h q_nope_h(t)) . c(s) + rope(q_pe_h(t)) . k_pe(s)
    out_h(t)       = W_vb_h sum_s softmax(score_h(t, .) * kq_scale)(s) c(s)

so attention is multi-query attention of [W_kb q_nope, q_pe] over [c, k_pe] with values c,
followed by the per-head W_vb. Files with the older unsplit attn_kv_b (per-head
[k_nope; v] = W c) are read into the same two per-head matrices.

W_kb and W_vb are held in f32 in every weight format. Where our kernels are built, every
row, prefill and decode alike, computes alone (DESIGN.md §5.3, row-invariant): W_kb and W_vb
a head at a time by rowops.c's fixed-order dots (qkernel.linear_f32), and the rope, the
latent row's cache write and the attention in attention.c, as multi-query attention whose
values are the first kv_lora_rank floats of each key row. Without them, torch: one batched
matmul over the heads for each of W_kb and W_vb and plain matmuls for the attention, whose
bits depend on the call's shape and threads (the chunked contract).
"""

from __future__ import annotations

import torch

from skippy.topology.mla_config import MlaConfig, RopeScaling
from skippy.topology.model_config import ModelConfig

from . import qkernel
from .layers import Rope, rms_norm
from .linear import fuse_linear, make_linear
from .transformer import Segment, _in_order, _positions
from .weights import StageTensors


class YarnRope(Rope):
    """Rope tables as ggml builds them for deepseek2: per pair, the interpolated angle
    (freq_scale * theta) blended with the original one by YaRN's ramp over the pair
    index, and cos / sin scaled by mscale."""

    def __init__(self, dim: int, scaling: RopeScaling):
        super().__init__(dim, scaling.freq_base, scaling.freq_scale, "norm")
        self.scaling = scaling

    def _grow(self, n: int) -> None:
        s = self.scaling
        n = max(n, 2 * self.cos.shape[0], 256)
        step = torch.tensor(self.base ** (-2.0 / self.dim), dtype=torch.float32)
        extrap = torch.arange(n, dtype=torch.float32)
        low, high = s.corr_dims(self.dim)
        scale = torch.tensor(s.freq_scale, dtype=torch.float32)
        cols = []
        for i in range(self.dim // 2):
            interp = scale * extrap
            if s.ext_factor:
                y = (i - low) / max(0.001, high - low)
                mix = torch.tensor((1 - min(1.0, max(0.0, y))) * s.ext_factor,
                                   dtype=torch.float32)
                interp = interp * (1 - mix) + extrap * mix
            cols.append(interp)
            extrap = extrap * step
        angles = torch.stack(cols, dim=1)
        mscale = torch.tensor(s.mscale(), dtype=torch.float32)
        self.cos, self.sin = torch.cos(angles) * mscale, torch.sin(angles) * mscale


def latent_kv_shape(m: MlaConfig) -> tuple[int, int, int]:
    """(kv_heads, key width, value width) of a lane's per-layer rows: one latent row, no
    separate values (they are its first kv_lora_rank floats)."""
    return 1, m.latent, 0


def _up_projections(p: str, m: MlaConfig, n_heads: int, t: StageTensors,
                    per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, f32 and contiguous: W_kb (q_nope -> latent space) and W_vb (attended
    latent -> value), as [H, out, in] for qkernel.linear_f32_heads (per_head),
    else transposed, [H, nope, kv_lora] and [H, kv_lora, v], for bmm."""
    # read through matrix(): the stage keeps only the per-head tensors made here
    if m.absorbed:
        k_b = t.matrix(p + "attn_k_b.weight").values.reshape(n_heads, m.kv_lora_rank, m.nope)
        v_b = t.matrix(p + "attn_v_b.weight").values.reshape(n_heads, m.v_head, m.kv_lora_rank)
    else:  # attn_kv_b: per head, rows [k_nope (nope); v (v_head)] over the latent
        kv_b = t.matrix(p + "attn_kv_b.weight").values.reshape(
            n_heads, m.nope + m.v_head, m.kv_lora_rank)
        k_b = kv_b[:, :m.nope].transpose(1, 2)  # k_nope . q = c . (W_k^T q)
        v_b = kv_b[:, m.nope:]
    if per_head:
        return k_b.contiguous(), v_b.contiguous()
    return k_b.transpose(1, 2).contiguous(), v_b.transpose(1, 2).contiguous()


def latent_attend(query: torch.Tensor, keys: torch.Tensor, kv_lora: int,
                  mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Every query head [T, H, D] over one shared key row per token [L, D], whose first
    kv_lora floats are also the values: softmax(q k * scale + mask) v, as [T, H * kv_lora].
    Plain matmuls of all heads at once: torch's fused attention would take its slow
    generic path here (values narrower than keys, one key head), and the shapes, hence
    the bits, depend only on (T, L)."""
    T, H, D = query.shape
    scores = torch.mm(query.reshape(T * H, D), keys.t()).view(T, H, -1) * scale
    if mask is not None:
        scores = scores + mask[:, None, :]
    probs = torch.softmax(scores, dim=-1)
    return torch.mm(probs.view(T * H, -1), keys[:, :kv_lora]).view(T, H * kv_lora)


class MlaAttention:
    """The token mixer of deepseek2 layers; `slot` is this layer's rows in LaneKv."""

    def __init__(self, index: int, slot: int, cfg: ModelConfig, t: StageTensors,
                 fmt: str, rope: Rope):
        p, m = f"blk.{index}.", cfg.mla
        self.slot, self.m, self.rope, self.eps = slot, m, rope, cfg.rms_eps
        self.n_heads = cfg.n_heads
        q = p + ("attn_q_a.weight" if m.q_lora_rank else "attn_q.weight")
        # the query input and the latent read the same normed rows: one matmul
        self.first, self.first_split = fuse_linear(
            [t.matrix(q), t.matrix(p + "attn_kv_a_mqa.weight")], fmt)
        self.q_a_norm = t[p + "attn_q_a_norm.weight"] if m.q_lora_rank else None
        self.q_b = make_linear(t.matrix(p + "attn_q_b.weight"), fmt) if m.q_lora_rank else None
        self.kv_a_norm = t[p + "attn_kv_a_norm.weight"]
        self.lib = qkernel.library()
        self.k_b, self.v_b = _up_projections(p, m, cfg.n_heads, t, self.lib is not None)
        self.out = make_linear(t.matrix(p + "attn_output.weight"), fmt)
        # one kv head of [c, k_pe] whose first kv_lora_rank floats are the values; rope on
        # the k_pe / q_pe part at the end of each head; no q/k norms there (c is normed here)
        self.shape = qkernel.AttnShape(
            cfg.n_heads, 1, m.latent, m.kv_lora_rank, rope.dim, int(rope.style == "neox"),
            0, cfg.rms_eps, m.kq_scale, None, v_row=m.latent, rope_at=m.kv_lora_rank)

    @property
    def row_invariant(self) -> bool:
        """Does every row compute alone (our kernels built)? The matrices' format decides
        the rest (linear.row_invariant)."""
        return self.lib is not None

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, segments) -> torch.Tensor:
        m, n, H = self.m, h.shape[0], self.n_heads
        q, ckv = self.first(h).split(self.first_split, dim=-1)
        if self.q_b is not None:
            q = self.q_b(rms_norm(q, self.q_a_norm, self.eps))
        q = q.view(n, H, m.k_head)
        if self.lib is not None:  # each row alone (row-invariant)
            return self.out(self._rows(q, ckv, segments))
        c = rms_norm(ckv[:, :m.kv_lora_rank], self.kv_a_norm, self.eps)
        k_pe = self.rope.apply(ckv[:, None, m.kv_lora_rank:].contiguous(), positions)
        q_pe = self.rope.apply(q[..., m.nope:].contiguous(), positions)
        q_abs = torch.bmm(q[..., :m.nope].transpose(0, 1), self.k_b).transpose(0, 1)
        query = torch.cat([q_abs, q_pe], dim=-1)           # [n, H, kv_lora + rope]
        latent = torch.cat([c, k_pe[:, 0]], dim=-1)[:, None]  # [n, 1, kv_lora + rope]
        if len(segments) == 1 and segments[0].n == n:
            o = self._attend(segments[0], query, latent)
        else:  # decode batch: padding rows belong to no lane and stay zero
            o = h.new_zeros(n, H * m.kv_lora_rank)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                o[rows] = self._attend(seg, query[rows], latent[rows])
        o = torch.bmm(o.view(n, H, m.kv_lora_rank).transpose(0, 1), self.v_b)
        return self.out(o.transpose(0, 1).reshape(n, H * m.v_head))

    def _rows(self, q: torch.Tensor, ckv: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """[n, H * v_head] for the segments' rows (rows past them, a decode batch's padding,
        stay zero): per row, [W_kb q_nope, q_pe] per head and the latent row [norm(c), k_pe]
        side by side, then one attention.c call (rope of q_pe and k_pe at the row's
        position, the latent row into the lane's cache, attention), then W_vb per head."""
        m, lib, H, D, L = self.m, self.lib, self.n_heads, self.m.latent, self.m.kv_lora_rank
        n = q.shape[0]
        if _in_order(segments):  # rows 0, 1, ...: views, no copies
            pos = _positions(segments)
            mine = slice(0, len(pos))
        else:
            pos = [p for s in segments for p in range(s.pos, s.pos + s.n)]
            mine = torch.cat([torch.arange(s.row0, s.row0 + s.n) for s in segments])
        R = len(pos)
        q, ckv = q[mine], ckv[mine]
        rows = torch.empty(R, (H + 1) * D)
        heads = rows[:, :H * D].view(R, H, D)
        # every head in one kernel call (a call per head was a decode step's Python time)
        qkernel.linear_f32_heads(lib, q[..., :m.nope], self.k_b, heads[..., :L])
        heads[:, :, L:] = q[:, :, m.nope:]
        rows[:, H * D:H * D + L] = rms_norm(ckv[:, :L], self.kv_a_norm, self.eps)
        rows[:, H * D + L:] = ckv[:, L:]
        self.rope.ensure(max(pos) + 1)
        self.shape.cos, self.shape.sin = self.rope.cos.data_ptr(), self.rope.sin.data_ptr()
        caches = [s.kv.k[self.slot] for s in segments for _ in range(s.n)]
        attended = torch.empty(R, H * L)
        qkernel.attend_rows(lib, self.shape, rows, R, pos, caches, caches, attended)
        o = (torch.zeros if R < n else torch.empty)(n, H * m.v_head)
        got = o[mine] if isinstance(mine, slice) else torch.empty(R, H * m.v_head)
        qkernel.linear_f32_heads(lib, attended.view(R, H, L), self.v_b,
                                 got.view(R, H, m.v_head))
        if not isinstance(mine, slice):
            o[mine] = got
        return o

    def _attend(self, seg, query: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """[T, H * kv_lora]: each head's attention over the lane's latent rows."""
        seg.kv.write(self.slot, seg.pos, latent, latent[..., :0])
        lo, hi, mask = seg.window(0)
        return latent_attend(query, seg.kv.keys(self.slot, lo, hi)[:, 0],
                             self.m.kv_lora_rank, mask, self.m.kq_scale)

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode step reads through this mixer."""
        held = [self.kv_a_norm, self.k_b, self.v_b] + \
            ([self.q_a_norm] if self.q_a_norm is not None else [])
        linears = [self.first, self.out] + ([self.q_b] if self.q_b is not None else [])
        return sum(x.nbytes for x in linears) + sum(x.nbytes for x in held)
