"""A stage's decoder layers in one call of our kernel (stages/decoder.c), where each layer
has the plain form: pre-norms (RMS, or none), a QKV projection with a bias or none,
attention on our row kernel, optional post-norms, a gated FFN, every matrix on our integer
kernel. decoder.c runs the same C functions the layers' Python path runs, in the same
order, so it computes the same bits (tests/test_decoder.py); a one-row decode step then
pays one Python call for the stage instead of about fifteen per layer."""

from __future__ import annotations

import ctypes

import torch

from . import qkernel
from .ffn import FusedUpFfn, GatedFfn
from .linear import BlockLinear
from .norms import Norm
from .transformer import Attention, DecoderLayer, Segment, _in_order, _positions


class _Layer(ctypes.Structure):
    _fields_ = [(n, qkernel.QMat) for n in ("qkv", "out", "gate_up", "down")] \
        + [(n, ctypes.c_void_p) for n in ("qkv_bias", "attn_norm", "post_attn_norm",
                                          "ffn_norm", "post_ffn_norm", "attn")] \
        + [("act", ctypes.c_int), ("eps", ctypes.c_float)]


def _norm(norm: Norm | None) -> tuple[bool, int | None]:
    """(fits, the weight's address or None for no norm)."""
    if norm is None:
        return True, None
    if norm.kind != "rms" or norm.weight is None or norm.weight.dtype != torch.float32 \
            or not norm.weight.is_contiguous():
        return False, None
    return True, norm.weight.data_ptr()


def _layer(layer: DecoderLayer) -> _Layer | None:
    """decoder.c's description of `layer`, or None where it has another form."""
    mixer, ffn = layer.mixer, layer.ffn
    if type(layer) is not DecoderLayer or type(mixer) is not Attention or mixer.lib is None:
        return None
    qkv = mixer.qkv
    if qkv.clamp > 0 or qkv.q_norm is not None or type(ffn) not in (GatedFfn, FusedUpFfn):
        return None
    if isinstance(ffn, GatedFfn) and ffn.gate_up_split[0] != ffn.gate_up_split[1]:
        return None
    lins = (qkv.linear, mixer.out, ffn.gate_up, ffn.down)
    if not all(isinstance(lin, BlockLinear) for lin in lins) \
            or ffn.activation not in qkernel.GATED:
        return None
    norms = [_norm(n) for n in (layer.attn_norm, layer.post_attn_norm, layer.ffn_norm,
                                layer.post_ffn_norm)]
    if not all(fits for fits, _ in norms):
        return None
    eps = {n.eps for n in (layer.attn_norm, layer.post_attn_norm, layer.ffn_norm,
                           layer.post_ffn_norm) if n is not None}
    if len(eps) > 1:
        return None
    bias = qkv.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    return _Layer(*map(qkernel.qmat, lins), bias.data_ptr() if bias is not None else None,
                  *(ptr for _, ptr in norms), ctypes.addressof(mixer.shape),
                  qkernel.GATED[ffn.activation], eps.pop() if eps else 0.0)


class DecoderRun:
    """The stage's layers through decoder.c; `of` gives None unless every layer fits."""

    def __init__(self, lib: ctypes.CDLL, layers: list[DecoderLayer], described: list[_Layer]):
        self.lib, self.layers = lib, layers  # the layers own every tensor `described` points at
        self.table = (_Layer * len(described))(*described)
        self.slots = [layer.mixer.slot for layer in layers]
        self.ropes: dict[int, tuple] = {}  # id -> (rope, its layers' shapes)
        for layer in layers:
            rope = layer.mixer.rope
            self.ropes.setdefault(id(rope), (rope, []))[1].append(layer.mixer.shape)

    @classmethod
    def of(cls, layers: list[DecoderLayer]) -> "DecoderRun | None":
        lib = qkernel.library()
        if lib is None or not layers:
            return None
        described = [_layer(layer) for layer in layers]
        if any(d is None for d in described):
            return None
        return cls(lib, layers, described)

    def __call__(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor | None:
        """The rows after every layer, or None where the rows are not the segments' in
        order (the layers' own path then runs)."""
        rows = x.shape[0]
        if not _in_order(segments) or sum(s.n for s in segments) != rows:
            return None
        pos = _positions(segments)
        top = max(pos) + 1
        for rope, shapes in self.ropes.values():
            rope.ensure(top)  # may grow the tables: their addresses are set each call
            cos, sin = rope.cos.data_ptr(), rope.sin.data_ptr()
            for shape in shapes:
                shape.cos, shape.sin = cos, sin
        per_row = [s for s in segments for _ in range(s.n)]
        keys = (ctypes.c_void_p * (len(self.slots) * rows))(
            *[s.kv.k[slot].data_ptr() for slot in self.slots for s in per_row])
        values = (ctypes.c_void_p * (len(self.slots) * rows))(
            *[s.kv.v[slot].data_ptr() for slot in self.slots for s in per_row])
        out = x.to(torch.float32, copy=True).contiguous()
        rc = self.lib.skd_layers(self.table, len(self.slots), out.data_ptr(), rows,
                                 out.shape[1], (ctypes.c_int64 * rows)(*pos), keys, values,
                                 torch.get_num_threads())
        if rc:
            raise MemoryError("decoder layers: no scratch memory")
        return out
