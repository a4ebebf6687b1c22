"""A stage's decoder layers in one call of our kernel (stages/decoder.c), where each layer
has the plain form: pre-norms (RMS, weightless LayerNorm, or none), a QKV projection with
a bias or none, a clamp or none, whole-Q / whole-K norms or none, attention on our row
kernel (or latent attention, DeepSeek2's), optional post-norms, a gated FFN or a mixture of experts that moe.c runs, every
matrix on our integer kernel. decoder.c runs the same C functions the layers' Python path runs, in the same
order, so it computes the same bits (tests/test_decoder.py); a one-row decode step then
pays one Python call for the stage instead of about fifteen per layer. Gemma 4's layers,
of a form of their own, go through decoder.c's sibling call (stages/gemma4_run.py)."""

from __future__ import annotations

import ctypes

import torch

from . import qkernel
from .ffn import FusedUpFfn, GatedFfn
from .linear import BlockLinear
from .mla import MlaAttention
from .moe import MoeFfn
from .norms import Norm
from .transformer import Attention, DecoderLayer, Segment, _in_order, _positions


class _Norm(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("w", ctypes.c_void_p)]  # decoder.c's dec_norm


class _Mla(ctypes.Structure):
    _fields_ = [("first", qkernel.QMat), ("q_b", qkernel.QMat)] \
        + [(n, ctypes.c_void_p) for n in ("q_a_norm", "kv_a_norm", "k_b", "v_b")] \
        + [(n, ctypes.c_int64) for n in ("q_cols", "heads", "nope", "rope", "lora", "v_head")]


class _Layer(ctypes.Structure):
    _fields_ = [(n, qkernel.QMat) for n in ("qkv", "out", "gate_up", "down")] \
        + [("qkv_bias", ctypes.c_void_p)] \
        + [(n, _Norm) for n in ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm")] \
        + [("attn", ctypes.c_void_p), ("act", ctypes.c_int), ("eps", ctypes.c_float),
           ("clamp", ctypes.c_float), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
           ("q_cols", ctypes.c_int64), ("k_cols", ctypes.c_int64), ("moe", ctypes.c_void_p),
           ("mla", ctypes.c_void_p)]


def _norm(norm: Norm | None) -> _Norm | None:
    """decoder.c's description of a norm, or None where it has another form."""
    if norm is None:
        return _Norm(0, None)
    if norm.kind == "layer":
        return _Norm(2, None)
    if not _f32(norm.weight):
        return None
    return _Norm(1, norm.weight.data_ptr())


def _f32(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.float32 and t.is_contiguous()


def _ffn(ffn) -> tuple[tuple, int, int | None] | None:
    """(gate_up and down as qmats, the activation, the experts' description) or None."""
    if type(ffn) is MoeFfn:
        if ffn.block is None:
            return None
        return (qkernel.QMat(), qkernel.QMat()), 0, ctypes.addressof(ffn.block.desc)
    if type(ffn) not in (GatedFfn, FusedUpFfn) or ffn.activation not in qkernel.GATED:
        return None
    if isinstance(ffn, GatedFfn) and ffn.gate_up_split[0] != ffn.gate_up_split[1]:
        return None
    if not all(isinstance(lin, BlockLinear) for lin in (ffn.gate_up, ffn.down)):
        return None
    act = qkernel.gated_act(qkernel.library(), ffn.activation)
    return (qkernel.qmat(ffn.gate_up), qkernel.qmat(ffn.down)), act, None


def _mla(mixer: MlaAttention) -> tuple[_Mla, float] | None:
    """decoder.c's description of latent attention and its norms' eps, or None."""
    lins = [mixer.first, mixer.out] + ([mixer.q_b] if mixer.q_b is not None else [])
    vectors = [mixer.kv_a_norm, mixer.k_b, mixer.v_b] + \
        ([mixer.q_a_norm] if mixer.q_b is not None else [])
    if not all(isinstance(lin, BlockLinear) for lin in lins) or not all(map(_f32, vectors)):
        return None
    m = mixer.m
    q_b = qkernel.qmat(mixer.q_b) if mixer.q_b is not None else qkernel.QMat()
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    return _Mla(qkernel.qmat(mixer.first), q_b, ptr(mixer.q_a_norm), ptr(mixer.kv_a_norm),
                ptr(mixer.k_b), ptr(mixer.v_b), mixer.first_split[0], mixer.n_heads, m.nope,
                m.rope_dim, m.kv_lora_rank, m.v_head), mixer.eps


def _mixer(mixer) -> tuple[tuple, _Mla | None, float | None] | None:
    """(qkv and out as qmats, the latent attention's description, its eps) or None."""
    if type(mixer) is MlaAttention and mixer.lib is not None:
        described = _mla(mixer)
        if described is None:
            return None
        return (qkernel.QMat(), qkernel.qmat(mixer.out)), *described
    if type(mixer) is not Attention or mixer.lib is None:
        return None
    if not all(isinstance(lin, BlockLinear) for lin in (mixer.qkv.linear, mixer.out)):
        return None
    return (qkernel.qmat(mixer.qkv.linear), qkernel.qmat(mixer.out)), None, None


def _layer(layer: DecoderLayer, keep: list) -> _Layer | None:
    """decoder.c's description of `layer`, or None where it has another form; what the
    description points to that no tensor holds goes into `keep`."""
    if type(layer) is not DecoderLayer:
        return None
    mixer, ffn = _mixer(layer.mixer), _ffn(layer.ffn)
    if mixer is None or ffn is None:
        return None
    (qkv_mat, out_mat), mla, mla_eps = mixer
    layer_norms = (layer.attn_norm, layer.post_attn_norm, layer.ffn_norm, layer.post_ffn_norm)
    norms = [_norm(n) for n in layer_norms]
    if any(n is None for n in norms):
        return None
    eps = {n.eps for n in layer_norms if n is not None} | ({mla_eps} if mla else set())
    qkv = layer.mixer.qkv if mla is None else None
    if qkv is not None and qkv.q_norm is not None:
        if not (_f32(qkv.q_norm) and _f32(qkv.k_norm)):
            return None
        eps.add(qkv.eps)
    bias = qkv.bias if qkv is not None else None
    if len(eps) > 1 or (bias is not None and not _f32(bias)):
        return None
    (gate_up, down), act, moe = ffn
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    if mla is not None:
        keep.append(mla)
    clamp = float(qkv.clamp) if qkv is not None and qkv.clamp > 0 else 0.0
    q_norm, k_norm = (qkv.q_norm, qkv.k_norm) if qkv is not None else (None, None)
    return _Layer(qkv_mat, out_mat, gate_up, down, ptr(bias), *norms,
                  ctypes.addressof(layer.mixer.shape), act, eps.pop() if eps else 0.0, clamp,
                  ptr(q_norm), ptr(k_norm), qkv.q_cols if qkv is not None else 0,
                  qkv.k_cols if qkv is not None else 0, moe,
                  ctypes.addressof(mla) if mla is not None else None)


class DecoderRun:
    """The stage's layers through decoder.c; `of` gives None unless every layer fits."""

    description = _Layer  # decoder.c's struct of one layer

    def __init__(self, lib: ctypes.CDLL, layers: list[DecoderLayer], described: list[_Layer]):
        self.lib, self.layers = lib, layers  # the layers own every tensor `described` points at
        self.table = (self.description * len(described))(*described)
        self.slots = [layer.mixer.slot for layer in layers]
        self.ropes: dict[int, tuple] = {}  # id -> (rope, its layers' shapes)
        for layer in layers:
            rope = layer.mixer.rope
            self.ropes.setdefault(id(rope), (rope, []))[1].append(layer.mixer.shape)
        self._tables: dict[int, torch.Tensor] = {}  # id(rope) -> the cos table last set
        # a one-row call's K and V address arrays by its lane's pointers (decode of a lone
        # stream: built once, not each step)
        self._one_row: dict[int, tuple] = {}

    @classmethod
    def of(cls, layers: list[DecoderLayer]) -> "DecoderRun | None":
        lib = qkernel.library()
        if lib is None or not layers:
            return None
        keep: list = []
        described = [_layer(layer, keep) for layer in layers]
        if any(d is None for d in described):
            return None
        run = cls(lib, layers, described)
        run.keep = keep  # the latent attentions' descriptions the table points at
        return run

    def __call__(self, x: torch.Tensor, segments: list[Segment],
                 owned: bool = False) -> torch.Tensor | None:
        """The rows after every layer, or None where the rows are not the segments' in
        order (the layers' own path then runs). `owned`: x is the caller's own fresh
        tensor, which the layers may then overwrite (no copy: a decode step's)."""
        rows = x.shape[0]
        if not _in_order(segments) or sum(s.n for s in segments) != rows:
            return None
        out = x if owned and x.dtype == torch.float32 and x.is_contiguous() else \
            x.to(torch.float32, copy=True).contiguous()
        if self._run(out, *self._lanes(segments, rows)):
            raise MemoryError("decoder layers: no scratch memory")
        return out

    def _lanes(self, segments: list[Segment], rows: int) -> tuple:
        """The call's per-row arguments: positions, each layer's K and V cache of the
        row's lane (layer-major), and which rows are real (None: all of them)."""
        pos = _positions(segments)
        top = max(pos) + 1
        for key, (rope, shapes) in self.ropes.items():
            rope.ensure(top)  # may grow the tables: their addresses set where they moved
            if self._tables.get(key) is not rope.cos:
                cos, sin = rope.cos.data_ptr(), rope.sin.data_ptr()
                for shape in shapes:
                    shape.cos, shape.sin = cos, sin
                self._tables[key] = rope.cos
        keys, values = self._addresses(segments, rows)
        real = None  # padding rows get no experts (moe.c)
        if any(s.n_real != s.n for s in segments):
            real = (ctypes.c_uint8 * rows)()
            for s in segments:
                for r in range(s.row0, s.row0 + s.n_real):
                    real[r] = 1
        return (ctypes.c_int64 * rows)(*pos), keys, values, real

    def _addresses(self, segments: list[Segment], rows: int) -> tuple:
        """Each layer's K and V cache address for each row (layer-major)."""
        if rows == 1:
            kv = segments[0].kv.pointers()
            hit = self._one_row.get(id(kv))
            if hit is None or hit[0] is not kv:  # (the entry keeps kv: its id stays its)
                if len(self._one_row) > 256:
                    self._one_row.clear()
                hit = self._one_row[id(kv)] = (kv, *(
                    (ctypes.c_void_p * len(self.slots))(*[p[slot] for slot in self.slots])
                    for p in kv))
            return hit[1], hit[2]
        per_row = [s.kv.pointers() for s in segments for _ in range(s.n)]
        return tuple((ctypes.c_void_p * (len(self.slots) * rows))(
            *[p[i][slot] for slot in self.slots for p in per_row]) for i in (0, 1))

    def _run(self, out: torch.Tensor, pos, keys, values, real) -> int:
        """decoder.c over `out` in place; its return code."""
        return self.lib.skd_layers(self.table, len(self.slots), out.data_ptr(), out.shape[0],
                                   out.shape[1], pos, keys, values, real,
                                   torch.get_num_threads())
