"""Gemma 4's decoder layers, ported from llama.cpp's graph (models/gemma4.cpp).

Where a Gemma 4 layer differs from the shared DecoderLayer:
- attention: Q and K get per-head RMS norms with weights, V one without; the scores are
  not scaled (the norms keep them in range); global layers rotate with rope frequency
  divisors (rope_freqs.weight) and may use another head size than sliding-window layers;
  when a layer has no V projection, V comes from the K projection (before K's norm).
- shared KV: the last `shared_kv_layers` layers compute only Q and attend over the KV an
  earlier layer stored (ModelConfig.kv_source); the planner keeps them in one stage with
  it (families.gemma4_shared_kv_groups).
- per-layer embeddings (E2B / E4B): after the FFN's residual, a gated projection of the
  row times the layer's own per-layer input is added (PerLayerInputs says where those
  come from), then the whole row is scaled by layer_output_scale when the file has one.
- mixture-of-experts layers (26B-A4B) add a routed expert block to the dense FFN, each
  with its own norms (Gemma4MoeFfn).
- GELU goes through llama.cpp's f16 table (layers.gelu_f16), here and in the experts.
Where every matrix is on our integer kernel, a stage runs these layers in one call of
decoder.c (stages/gemma4_run.py), bitwise this path.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from skippy.topology.model_config import ModelConfig

from . import qkernel
from .layers import Rope, attend, gated_activation, rms_norm
from .linear import Int4Blocks, Int8Blocks, Matrix, fuse_linear, make_linear
from .moe import MoeFfn
from .runtime import StageError
from .transformer import Segment
from .weights import ROPE_FREQS, StageTensors


class PerLayerInputs:
    """The per-layer embedding inputs of one stage's layers.

    For a row with token id t and scaled token embedding x0 (stage 0's input row), layer
    i's input is (rms_norm(W_i x0 / sqrt(hidden), norm) + T_i[t] * sqrt(P)) / sqrt(2):
    W_i = layer i's P rows of per_layer_model_proj, T_i = its P columns of
    per_layer_token_embd. llama.cpp computes all layers in one product; here each layer's
    piece is its own product, so a row's values are the same wherever the model is cut.
    A later stage gets x0 beside the hidden rows of its frame and t with the frame's
    tokens (TorchStageRuntime: frame rows [hidden | x0]).
    """

    def __init__(self, cfg: ModelConfig, t: StageTensors, start: int, end: int, fmt: str):
        P, self.hidden = cfg.per_layer_dim, cfg.hidden
        self.eps = cfg.rms_eps
        self.norm = t["per_layer_proj_norm.weight"]
        proj = t.matrix("per_layer_model_proj.weight")
        self.proj = {i: make_linear(_rows(proj, i * P, (i + 1) * P), fmt)
                     for i in range(start, end)}
        del proj
        # the stage's layers' columns, looked up once per forward (a lookup dequantizes
        # whole blocks: one per layer cost ~0.2 ms each at one row)
        self.table = TableColumns(t, "per_layer_token_embd.weight", start * P, end * P)
        self.start, self.P = start, P
        self.proj_scale = 1.0 / math.sqrt(cfg.hidden)
        self.table_scale = math.sqrt(P)
        self.mix_scale = 1.0 / math.sqrt(2.0)
        self._x0: torch.Tensor | None = None
        self._looked: torch.Tensor | None = None

    def set(self, x0: torch.Tensor, ids: torch.Tensor) -> None:
        """The rows of the forward about to run: their x0 and token ids."""
        self._x0, self._looked = x0, self.table(ids) * self.table_scale

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's x0 and looked-up table rows (scaled), float32 and contiguous."""
        return self._x0.to(torch.float32).contiguous(), self._looked.contiguous()

    def __call__(self, layer: int) -> torch.Tensor:
        p = self.proj[layer](self._x0) * self.proj_scale
        p = rms_norm(p, self.norm, self.eps)
        a = (layer - self.start) * self.P
        return (p + self._looked[:, a:a + self.P]) * self.mix_scale

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.proj.values()) + self.table.nbytes


def _rows(m: Matrix, a: int, b: int) -> Matrix:
    """Output rows [a, b) of a matrix, its file blocks included."""
    int4 = int8 = None
    if m.int4 is not None:
        int4 = Int4Blocks(m.int4.codes[a:b], m.int4.scale[a:b], m.int4.offset[a:b])
    if m.int8 is not None:
        int8 = Int8Blocks(m.int8.codes[a:b], m.int8.scale[a:b])
    return Matrix(m.values[a:b].contiguous(), int4, int8)


# the table types our kernel looks up (rowops.c), 1-row lookups ~10x numpy's dequantize
_LOOKUPS = {GGMLQuantizationType.Q6_K: "skr_q6k_rows", GGMLQuantizationType.Q8_0: "skr_q8_0_rows"}


class TableColumns:
    """Columns [a, b) of a [rows, width] table, looked up by row: held as the file's bytes
    of the blocks that cover them (quantized as stored; a real E4B's per-layer table has
    2.8 billion entries) and dequantized a looked-up row at a time, which gives the values
    a whole dequantized table would."""

    def __init__(self, t: StageTensors, name: str, a: int, b: int):
        if name not in t.names:
            raise KeyError(name)
        info = t.f.tensors[name]
        block, block_bytes = GGML_QUANT_SIZES[info.qtype]
        width, rows = info.shape[0], int(np.prod(info.shape[1:]))
        first, last = a // block, -(-b // block)  # the blocks covering [a, b)
        raw = np.asarray(t.f.raw(name)).reshape(rows, width // block * block_bytes)
        self.raw = np.ascontiguousarray(raw[:, first * block_bytes:last * block_bytes])
        self.qtype, self.cols = info.qtype, slice(a - first * block, b - first * block)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        lib = qkernel.library()
        if lib is not None and self.qtype in _LOOKUPS:  # gguf's floats without its numpy
            ids = ids.to(torch.int64).contiguous()
            block, block_bytes = GGML_QUANT_SIZES[self.qtype]
            values = torch.empty(len(ids), self.raw.shape[1] // block_bytes * block)
            getattr(lib, _LOOKUPS[self.qtype])(self.raw.ctypes.data, self.raw.shape[1],
                                               ids.data_ptr(), len(ids), values.data_ptr())
            return values[:, self.cols].contiguous()
        rows = self.raw[ids.numpy()]
        values = dequantize(rows, self.qtype).astype(np.float32, copy=False)
        return torch.from_numpy(values.reshape(len(rows), -1)[:, self.cols].copy())

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes


class Gemma4Attention:
    """Self-attention of one Gemma 4 layer over its own KV slot or, for a shared-KV
    layer, over the slot of the layer it reads (both in this stage: the cut rule)."""

    def __init__(self, index: int, slot: int, cfg: ModelConfig, t: StageTensors, fmt: str,
                 rope: Rope):
        p = f"blk.{index}."
        self.cfg, self.rope, self.slot = cfg, rope, slot
        self.own_kv = cfg.has_kv(index)
        self.heads, self.kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.hd = cfg.head_dim_for(index)
        self.window = cfg.sliding_window if cfg.is_swa_layer(index) else 0
        parts = [t.matrix(p + "attn_q.weight")]
        self.k_is_v = False
        if self.own_kv:
            parts.append(t.matrix(p + "attn_k.weight"))
            if p + "attn_v.weight" in t.names:
                parts.append(t.matrix(p + "attn_v.weight"))
            else:  # llama.cpp: no V projection, V is the K projection's output
                self.k_is_v = True
        self.qkv, self.split = fuse_linear(parts, fmt)
        self.out = make_linear(t.matrix(p + "attn_output.weight"), fmt)
        self.q_norm = t[p + "attn_q_norm.weight"]
        self.k_norm = t[p + "attn_k_norm.weight"] if self.own_kv else None
        self.v_norm = torch.ones(self.hd)  # an unweighted RMS norm: weight 1 is exact
        self.scale = cfg.attention_scale()  # 1: the normed q and k keep scores in range
        self.lib = qkernel.library()
        # rows come to our kernel's attention normed and rotated (skr_attend_cached reads
        # no norm and no rope); decoder.c's Gemma 4 layers rotate by the rope given here
        self.shape = qkernel.AttnShape(self.heads, self.kv_heads, self.hd, self.hd, rope.dim,
                                       int(rope.style == "neox"), self.window, cfg.rms_eps,
                                       self.scale, None)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor,
                 segments: list[Segment]) -> torch.Tensor:
        n, eps = h.shape[0], self.cfg.rms_eps
        y = self.qkv(h).split(self.split, dim=-1)
        q = rms_norm(y[0].reshape(n, self.heads, self.hd), self.q_norm, eps)
        q = self.rope.apply(q, positions)
        k = v = None
        if self.own_kv:
            k_raw = y[1].reshape(n, self.kv_heads, self.hd)
            v_raw = k_raw if self.k_is_v else y[2].reshape(n, self.kv_heads, self.hd)
            k = self.rope.apply(rms_norm(k_raw, self.k_norm, eps), positions)
            v = rms_norm(v_raw, self.v_norm, eps)
        if self.lib is not None:
            attn = self._attend_rows(segments, q, k, v)
        elif len(segments) == 1 and segments[0].n == n:
            attn = self._attend(segments[0], q, k, v)
        else:  # decode batch: padding rows belong to no lane and stay zero
            attn = h.new_zeros(n, self.heads * self.hd)
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                attn[rows] = self._attend(seg, q[rows], None if k is None else k[rows],
                                          None if v is None else v[rows])
        return self.out(attn)

    def _attend_rows(self, segments: list[Segment], q, k, v) -> torch.Tensor:
        """Every segment's rows, prefill and decode alike (rows past the segments, a
        decode batch's padding, stay zero): k and v written here, the attention in our
        kernel (attention.c), whose bits per row depend on the row's position alone, not
        on the rows beside it or the thread count (torch's fused attention blocks its
        sums by the call's shape and threads)."""
        if k is not None:
            for seg in segments:
                rows = slice(seg.row0, seg.row0 + seg.n)
                seg.kv.write(self.slot, seg.pos, k[rows], v[rows])
        rows = torch.cat([torch.arange(s.row0, s.row0 + s.n) for s in segments])
        pos = [s.pos + i for s in segments for i in range(s.n)]
        keys = [s.kv.k[self.slot] for s in segments for _ in range(s.n)]
        values = [s.kv.v[self.slot] for s in segments for _ in range(s.n)]
        mine = torch.empty(len(pos), self.heads * self.hd)
        qkernel.attend_cached(self.lib, self.shape, q[rows].reshape(len(pos), -1).contiguous(),
                              pos, keys, values, mine)
        out = q.new_zeros(q.shape[0], self.heads * self.hd)
        out[rows] = mine
        return out

    def _attend(self, seg: Segment, q, k, v) -> torch.Tensor:
        """Torch's attention, where our kernel cannot be built (the chunked contract)."""
        if k is not None:
            seg.kv.write(self.slot, seg.pos, k, v)
        lo, hi, mask = seg.window(self.window)
        return attend(q, seg.kv.keys(self.slot, lo, hi), seg.kv.values(self.slot, lo, hi),
                      mask, self.scale)

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.out.nbytes


class Gemma4Ffn:
    """The dense feed-forward block: down(gelu(gate(h)) * up(h)) of the normed row."""

    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}."
        self.eps = cfg.rms_eps
        self.norm = t[p + "ffn_norm.weight"]
        self.gate_up, self.split = fuse_linear(
            [t.matrix(p + "ffn_gate.weight"), t.matrix(p + "ffn_up.weight")], fmt)
        self.down = make_linear(t.matrix(p + "ffn_down.weight"), fmt)

    def __call__(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        gate, up = self.gate_up(rms_norm(x, self.norm, self.eps)).split(self.split, dim=-1)
        return self.down(gated_activation(gate, up, "gelu_f16"))

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


class Gemma4MoeFfn:
    """26B-A4B's FFN block: the dense FFN and a routed expert block side by side on the
    same row, each normed before and after on its own, summed. The router reads the row
    RMS-normed without weight, scaled by 1/sqrt(hidden) and by ffn_gate_inp.scale; the
    experts read it normed by pre_ffw_norm_2 (stages/moe.py runs them)."""

    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, fmt: str):
        p = f"blk.{index}."
        self.eps = cfg.rms_eps
        self.dense = Gemma4Ffn(index, cfg, t, fmt)
        self.post_dense = t[p + "post_ffw_norm_1.weight"]
        self.pre_experts = t[p + "pre_ffw_norm_2.weight"]
        self.post_experts = t[p + "post_ffw_norm_2.weight"]
        self.router_scale = t[p + "ffn_gate_inp.scale"]
        self.inv_sqrt_hidden = 1.0 / math.sqrt(cfg.hidden)
        self.unit = torch.ones(cfg.hidden)  # an unweighted RMS norm
        self.experts = MoeFfn(index, cfg, t, fmt)  # the family's activation: gelu_f16

    def __call__(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        eps = self.eps
        dense = rms_norm(self.dense(x, segments), self.post_dense, eps)
        decode = all(s.n == 1 for s in segments)

        r = rms_norm(x, self.unit, eps) * self.inv_sqrt_hidden * self.router_scale
        logits = self.experts.router(r)  # each row alone, as MoeFfn routes
        h = rms_norm(x, self.pre_experts, eps)
        one_call = self.experts.block
        if one_call is not None and self.experts.shared is None:
            routed = one_call(h, segments, logits)  # the same bits (stages/moe.c)
        else:
            routed = self.experts.routed(h, segments, decode, logits=logits)
        return dense + rms_norm(routed, self.post_experts, eps)

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes + self.experts.nbytes


class Gemma4Layer:
    """One layer: attention, the FFN block (dense, or dense plus experts), and the
    per-layer embedding block, each with Gemma's norms after it."""

    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, mixer, ffn,
                 per_layer: PerLayerInputs | None, fmt: str):
        p = f"blk.{index}."
        self.index, self.eps, self.mixer, self.ffn = index, cfg.rms_eps, mixer, ffn
        self.attn_norm = t[p + "attn_norm.weight"]
        self.post_attn_norm = t[p + "post_attention_norm.weight"]
        self.post_ffn_norm = t[p + "post_ffw_norm.weight"]
        self.per_layer = per_layer
        if per_layer is not None:
            self.inp_gate = make_linear(t.matrix(p + "inp_gate.weight"), fmt)
            self.inp_proj = make_linear(t.matrix(p + "proj.weight"), fmt)
            self.inp_norm = t[p + "post_norm.weight"]
        scale = t.get(p + "layer_output_scale.weight")
        self.out_scale = None if scale is None else scale.reshape(())

    @property
    def row_invariant(self) -> bool:
        """Does the layer compute each row alone (attention in our kernel; GELU by table;
        experts, where the layer has them, row-invariant)? Its matrices' format decides
        the rest (linear.row_invariant)."""
        experts = self.ffn.experts if isinstance(self.ffn, Gemma4MoeFfn) else None
        return self.mixer.lib is not None and (experts is None or experts.row_invariant)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                segments: list[Segment]) -> torch.Tensor:
        eps = self.eps
        h = self.mixer(rms_norm(x, self.attn_norm, eps), positions, segments)
        x = x + rms_norm(h, self.post_attn_norm, eps)
        x = x + rms_norm(self.ffn(x, segments), self.post_ffn_norm, eps)
        if self.per_layer is not None:
            g = gated_activation(self.inp_gate(x), self.per_layer(self.index), "gelu_f16")
            x = x + rms_norm(self.inp_proj(g), self.inp_norm, eps)
        if self.out_scale is not None:
            x = x * self.out_scale
        return x


def build_layers(cfg: ModelConfig, t: StageTensors, start: int, end: int, fmt: str
                 ) -> tuple[list[Gemma4Layer], list[int], PerLayerInputs | None]:
    """Layers [start, end) of a Gemma 4 stage, the model layer of each KV slot, and the
    stage's per-layer inputs (None without per-layer embeddings)."""
    ropes: dict[tuple, Rope] = {}
    factors = t.get(ROPE_FREQS)
    per_layer = PerLayerInputs(cfg, t, start, end, fmt) if cfg.per_layer_dim else None
    layers, kv_layers = [], []
    for i in range(start, end):
        swa = cfg.is_swa_layer(i)
        key = (cfg.rope_dim_for(i), cfg.rope_base_for(i), cfg.rope_scale_for(i), swa)
        if key not in ropes:
            ropes[key] = Rope(*key[:3], cfg.family.rope_style,
                              factors=None if swa else factors)
        if cfg.has_kv(i):
            slot = len(kv_layers)
            kv_layers.append(i)
        elif cfg.kv_source(i) in kv_layers:  # the cut rule keeps the source here
            slot = kv_layers.index(cfg.kv_source(i))
        else:
            raise StageError(f"layer {i} reads layer {cfg.kv_source(i)}'s KV, which is not "
                             f"in this stage's layers [{start}, {end}): the cut splits "
                             f"layers {cfg.cut_groups()} that Gemma 4 keeps in one stage")
        mixer = Gemma4Attention(i, slot, cfg, t, fmt, ropes[key])
        moe = f"blk.{i}.ffn_gate_inp.weight" in t.names
        ffn = Gemma4MoeFfn(i, cfg, t, fmt) if moe else Gemma4Ffn(i, cfg, t, fmt)
        layers.append(Gemma4Layer(i, cfg, t, mixer, ffn, per_layer, fmt))
    return layers, kv_layers, per_layer
