"""A Gemma 4 stage's layers in one call of our kernel (stages/decoder.c, skd_gemma4_layers):
attention with its per-head norms, rope and shared KV, the dense FFN and the experts beside
it, the per-layer embedding block and the output scale, each step the function or float
operation gemma4.py's path runs, in its order, so the rows are that path's bits
(tests/test_decoder.py). A one-row prefill then pays one Python call for the stage, not
the ~40 calls, tensors and ctypes conversions per layer that made up most of its time."""

from __future__ import annotations

import ctypes

import torch

from . import qkernel
from .decoder import DecoderRun, _f32
from .gemma4 import Gemma4Ffn, Gemma4Layer, Gemma4MoeFfn, PerLayerInputs
from .linear import BlockLinear

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Experts(ctypes.Structure):  # decoder.c's g4_experts
    _fields_ = [(n, P) for n in ("moe", "router", "router_scale", "post_dense",
                                 "pre_experts", "post_experts")] \
        + [("n_expert", I64), ("inv_sqrt_hidden", F32)]


class _PerLayer(ctypes.Structure):  # decoder.c's g4_per_layer
    _fields_ = [(n, qkernel.QMat) for n in ("proj", "gate", "up")] \
        + [("norm", P), ("post_norm", P), ("at", I64), ("proj_scale", F32),
           ("mix_scale", F32)]


class _Layer(ctypes.Structure):  # decoder.c's g4_layer
    _fields_ = [(n, qkernel.QMat) for n in ("qkv", "out", "gate_up", "down")] \
        + [(n, P) for n in ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm",
                            "q_norm", "k_norm", "unit", "attn")] \
        + [("kv", ctypes.c_int), ("eps", F32), ("experts", P), ("per_layer", P),
           ("out_scale", P)]


def _blocks(*linears) -> bool:
    return all(isinstance(lin, BlockLinear) for lin in linears)


def _dense(ffn: Gemma4Ffn) -> tuple[qkernel.QMat, qkernel.QMat] | None:
    """gate_up and down as qmats, or None where they are not gate and up in equal halves
    on our integer kernel."""
    if not _blocks(ffn.gate_up, ffn.down) or ffn.split[0] != ffn.split[1] \
            or not _f32(ffn.norm):
        return None
    return qkernel.qmat(ffn.gate_up), qkernel.qmat(ffn.down)


def _experts(ffn: Gemma4MoeFfn) -> _Experts | None:
    """The expert block beside the dense FFN, or None where moe.c cannot run it alone."""
    block = ffn.experts.block
    vectors = (ffn.router_scale, ffn.post_dense, ffn.pre_experts, ffn.post_experts)
    if block is None or ffn.experts.shared is not None or not all(map(_f32, vectors)):
        return None
    router = ffn.experts.router.weight
    return _Experts(ctypes.addressof(block.desc), router.data_ptr(),
                    *[v.data_ptr() for v in vectors], router.shape[0], ffn.inv_sqrt_hidden)


def _per_layer(layer: Gemma4Layer) -> _PerLayer | None:
    """The layer's per-layer embedding block, or None where it has another form."""
    inputs: PerLayerInputs = layer.per_layer
    proj = inputs.proj[layer.index]
    if not _blocks(proj, layer.inp_gate, layer.inp_proj) \
            or not all(map(_f32, (inputs.norm, layer.inp_norm))):
        return None
    return _PerLayer(qkernel.qmat(proj), qkernel.qmat(layer.inp_gate),
                     qkernel.qmat(layer.inp_proj), inputs.norm.data_ptr(),
                     layer.inp_norm.data_ptr(), (layer.index - inputs.start) * inputs.P,
                     inputs.proj_scale, inputs.mix_scale)


def _layer(layer: Gemma4Layer, unit: torch.Tensor, keep: list) -> _Layer | None:
    """decoder.c's description of `layer` (what no tensor holds goes into `keep`), or None
    where it has another form."""
    mixer, ffn = layer.mixer, layer.ffn
    moe = isinstance(ffn, Gemma4MoeFfn)
    dense = _dense(ffn.dense if moe else ffn)
    experts = _experts(ffn) if moe else None
    per_layer = _per_layer(layer) if layer.per_layer is not None else None
    norms = (layer.attn_norm, layer.post_attn_norm, (ffn.dense if moe else ffn).norm,
             layer.post_ffn_norm, mixer.q_norm)
    if type(layer) is not Gemma4Layer or mixer.lib is None or dense is None \
            or not _blocks(mixer.qkv, mixer.out) or (moe and experts is None) \
            or (layer.per_layer is not None and per_layer is None) \
            or not all(map(_f32, norms + ((mixer.k_norm,) if mixer.own_kv else ()))) \
            or (layer.out_scale is not None and not _f32(layer.out_scale)):
        return None
    keep += [d for d in (experts, per_layer) if d is not None]
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    kv = 0 if not mixer.own_kv else (2 if mixer.k_is_v else 1)
    return _Layer(qkernel.qmat(mixer.qkv), qkernel.qmat(mixer.out), *dense,
                  *[n.data_ptr() for n in norms], ptr(mixer.k_norm), unit.data_ptr(),
                  ctypes.addressof(mixer.shape), kv, layer.eps,
                  ctypes.addressof(experts) if experts is not None else None,
                  ctypes.addressof(per_layer) if per_layer is not None else None,
                  ptr(layer.out_scale))


class Gemma4Run(DecoderRun):
    """A Gemma 4 stage's layers through decoder.c; `of` gives None unless every layer
    fits."""

    description = _Layer

    @classmethod
    def of(cls, layers: list[Gemma4Layer], per_layer: PerLayerInputs | None = None
           ) -> "Gemma4Run | None":
        lib = qkernel.library()
        if lib is None or not layers or not all(type(x) is Gemma4Layer for x in layers):
            return None
        qkernel.gated_act(lib, "gelu_f16")  # hands decoder.c's GELU its table
        widest = max(max(x.mixer.hd for x in layers), layers[0].attn_norm.numel())
        unit = torch.ones(widest)  # the weightless norms' weight: x * 1 is x
        keep: list = [unit]
        described = [_layer(layer, unit, keep) for layer in layers]
        if any(d is None for d in described):
            return None
        run = cls(lib, layers, described)
        run.keep, run.per_layer = keep, per_layer
        return run

    def _run(self, out: torch.Tensor, pos, keys, values, real) -> int:
        x0 = looked = None
        width = 0
        if self.per_layer is not None:  # set for this forward (PerLayerInputs.set)
            x0, looked = self.per_layer.rows()
            width = looked.shape[1]
        ptr = (lambda t: t.data_ptr() if t is not None else None)
        return self.lib.skd_gemma4_layers(self.table, len(self.slots), out.data_ptr(),
                                          out.shape[0], out.shape[1], ptr(x0), ptr(looked),
                                          width, pos, keys, values, real,
                                          torch.get_num_threads())
