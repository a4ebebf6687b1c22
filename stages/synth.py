"""Random-weight GGUFs of model families we have no real checkpoint for.

llama.cpp loads and runs these files, so they give an independent numeric reference for
our torch port of each family (DESIGN.md §7). Each architecture is one entry of a table:
its default sizes, its hyperparameter keys and its tensor list with shapes. One shared
writer turns an entry into a file; the vocabulary (all `tokenizer.*` keys) is borrowed
from a real GGUF such as SmolLM2's.

The writer streams: the header, metadata and tensor index go out first, then each tensor
is generated just before it is written, so peak memory is about one tensor even for a
multi-GiB file. Every tensor's values come from an RNG seeded by (seed, tensor name), so
the same arguments always give a byte-identical file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import blake3
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

# Bumped whenever the values a given (arch, sizes, seed) produce change, so a file's
# provenance says which generator made it.
SYNTH_VERSION = 1

_DTYPES = {"f32": (np.float32, 0), "f16": (np.float16, 1)}  # -> (numpy dtype, general.file_type)

# Rows of scratch generated at a time (in float32) before casting into the output tensor,
# so an f16 tensor never needs a full-size float32 twin.
_CHUNK_ELEMENTS = 1 << 22


class SynthError(ValueError):
    """Bad arguments for a synthetic model (unknown arch, inconsistent sizes, no tokenizer)."""


@dataclass(frozen=True)
class Dims:
    """Resolved sizes of one synthetic model."""

    layers: int
    hidden: int
    ff: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rope_base: float
    rms_eps: float
    rope_freqs: bool = False  # llama: Llama 3 rope frequency factors (rope_freqs.weight)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: GGUF name, numpy shape (out_features, in_features) and how to fill it.

    `init` is "embed" (N(0, 1): token rows are looked up, not summed, so they need no
    fan-in scaling), "proj" (N(0, 1/sqrt(fan_in)): keeps each projection's output at the
    scale of its input), "norm" (1 + N(0, 0.1): near identity, but not exactly, so a port
    that forgets a norm weight is caught), "bias" (N(0, 0.1)) or "ssm_a" (-exp(N(0, 0.5)):
    Mamba2's negative per-head decay rate A) or "rope_freqs" (Llama 3's frequency
    factors, computed, not drawn) or "tied_embed" (N(0, 1/(16 fan_in)): Gemma 2's
    embeddings, which are also its head).
    """

    name: str
    shape: tuple[int, ...]
    init: str
    always_f32: bool = False  # stored as f32 whatever the file's dtype (like the 1-D norms)


@dataclass(frozen=True)
class ArchSpec:
    defaults: dict[str, int | float]
    hparams: Callable[[Dims], dict[str, int | float | list[int]]]  # keys without "{arch}."
    tensors: Callable[[Dims], list[TensorSpec]]


# -- qwen3 ------------------------------------------------------------------------------------
def _qwen3_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    return {
        "context_length": d.context_length,
        "embedding_length": d.hidden,
        "block_count": d.layers,
        "feed_forward_length": d.ff,
        "attention.head_count": d.heads,
        "attention.head_count_kv": d.kv_heads,
        # Written explicitly: qwen3's head_dim is not tied to hidden / heads.
        "attention.key_length": d.head_dim,
        "attention.value_length": d.head_dim,
        "attention.layer_norm_rms_epsilon": d.rms_eps,
        "rope.freq_base": d.rope_base,
    }


def _qwen3_tensors(d: Dims) -> list[TensorSpec]:
    return _dense_tensors(d, qk_norm=True)


def _dense_tensors(d: Dims, *, qk_norm: bool) -> list[TensorSpec]:
    """Attention + SwiGLU blocks (qwen3 adds per-head q/k norms; llama has none)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers):
        b = f"blk.{i}"
        out += [
            TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"),
            TensorSpec(f"{b}.attn_q.weight", (q, d.hidden), "proj"),
            TensorSpec(f"{b}.attn_k.weight", (kv, d.hidden), "proj"),
            TensorSpec(f"{b}.attn_v.weight", (kv, d.hidden), "proj"),
            TensorSpec(f"{b}.attn_output.weight", (d.hidden, q), "proj"),
        ]
        if qk_norm:
            out += [
                TensorSpec(f"{b}.attn_q_norm.weight", (d.head_dim,), "norm"),
                TensorSpec(f"{b}.attn_k_norm.weight", (d.head_dim,), "norm"),
            ]
        out += [
            TensorSpec(f"{b}.ffn_norm.weight", (d.hidden,), "norm"),
            TensorSpec(f"{b}.ffn_gate.weight", (d.ff, d.hidden), "proj"),
            TensorSpec(f"{b}.ffn_up.weight", (d.ff, d.hidden), "proj"),
            TensorSpec(f"{b}.ffn_down.weight", (d.hidden, d.ff), "proj"),
        ]
    # An untied head, so a port that silently reuses token_embd is caught.
    out += [
        TensorSpec("output_norm.weight", (d.hidden,), "norm"),
        TensorSpec("output.weight", (d.vocab, d.hidden), "proj"),
    ]
    return out


# -- llama --------------------------------------------------------------------------------------
# The qwen3 layout without q/k norms. Random Q/K weights need none of the row permutation
# the llama converter applies to real checkpoints: both runtimes read the rows as stored.
def _llama_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    return {**_qwen3_hparams(d), "rope.dimension_count": d.head_dim}


def _llama_tensors(d: Dims) -> list[TensorSpec]:
    out = _dense_tensors(d, qk_norm=False)
    if d.rope_freqs:  # one global tensor, as the Llama 3 converter writes it
        out.insert(1, TensorSpec("rope_freqs.weight", (d.head_dim // 2,), "rope_freqs"))
    return out


# Llama 3.1's rope scaling constants (its config.json: factor 8, low / high frequency
# factors 1 / 4, original context 8192), with the base the --rope-freqs file uses.
LLAMA3_ROPE = {"base": 500000.0, "factor": 8.0, "low": 1.0, "high": 4.0, "context": 8192}


def llama3_rope_factors(n_pairs: int) -> np.ndarray:
    """Per rotated pair: 1 for short wavelengths, `factor` for long ones, and a smooth
    blend between, as the Llama 3 converter computes rope_freqs (angles are divided by it)."""
    c = LLAMA3_ROPE
    freqs = c["base"] ** (-np.arange(n_pairs, dtype=np.float64) * 2 / (2 * n_pairs))
    wavelen = 2 * np.pi / freqs
    smooth = (c["context"] / wavelen - c["low"]) / (c["high"] - c["low"])
    out = 1.0 / ((1 - smooth) / c["factor"] + smooth)
    out = np.where(wavelen < c["context"] / c["high"], 1.0, out)
    out = np.where(wavelen > c["context"] / c["low"], c["factor"], out)
    return out.astype(np.float32)


# -- lfm2 (short convolution + attention hybrid) ----------------------------------------------
# Each short-conv layer keeps the last LFM2_L_CACHE - 1 conv inputs as recurrent state;
# 3 is what the released LFM2 checkpoints use.
LFM2_L_CACHE = 3


def lfm2_is_attention_layer(layer: int) -> bool:
    """The synthetic layer pattern: conv, conv, attention, repeated (6 layers: c c a c c a)."""
    return layer % 3 == 2


def _lfm2_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    return {
        "context_length": d.context_length,
        "embedding_length": d.hidden,
        "block_count": d.layers,
        "feed_forward_length": d.ff,
        "attention.head_count": d.heads,
        # Per layer; llama.cpp reads a 0 as "this layer is a short convolution".
        "attention.head_count_kv": [d.kv_heads if lfm2_is_attention_layer(i) else 0
                                    for i in range(d.layers)],
        "attention.layer_norm_rms_epsilon": d.rms_eps,
        "rope.freq_base": d.rope_base,
        "shortconv.l_cache": LFM2_L_CACHE,
    }


def _lfm2_tensors(d: Dims) -> list[TensorSpec]:
    if d.heads * d.head_dim != d.hidden:
        # llama.cpp creates LFM2's Q and output projections as n_embd x n_embd.
        raise SynthError(f"lfm2 needs heads * head_dim == hidden ({d.heads} * {d.head_dim} "
                         f"!= {d.hidden})")
    kv = d.kv_heads * d.head_dim
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers):
        b = f"blk.{i}"
        out.append(TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"))
        if lfm2_is_attention_layer(i):
            out += [
                TensorSpec(f"{b}.attn_q.weight", (d.hidden, d.hidden), "proj"),
                TensorSpec(f"{b}.attn_k.weight", (kv, d.hidden), "proj"),
                TensorSpec(f"{b}.attn_v.weight", (kv, d.hidden), "proj"),
                TensorSpec(f"{b}.attn_output.weight", (d.hidden, d.hidden), "proj"),
                TensorSpec(f"{b}.attn_q_norm.weight", (d.head_dim,), "norm"),
                TensorSpec(f"{b}.attn_k_norm.weight", (d.head_dim,), "norm"),
            ]
        else:
            out += [
                # numpy (n_embd, l_cache) = ggml {l_cache, n_embd}: one kernel row per channel
                # f32 always: llama.cpp's ssm_conv kernel reads only f32 weights
                TensorSpec(f"{b}.shortconv.conv.weight", (d.hidden, LFM2_L_CACHE), "proj",
                           always_f32=True),
                TensorSpec(f"{b}.shortconv.in_proj.weight", (3 * d.hidden, d.hidden), "proj"),
                TensorSpec(f"{b}.shortconv.out_proj.weight", (d.hidden, d.hidden), "proj"),
            ]
        out += [
            TensorSpec(f"{b}.ffn_norm.weight", (d.hidden,), "norm"),
            TensorSpec(f"{b}.ffn_gate.weight", (d.ff, d.hidden), "proj"),
            TensorSpec(f"{b}.ffn_up.weight", (d.ff, d.hidden), "proj"),
            TensorSpec(f"{b}.ffn_down.weight", (d.hidden, d.ff), "proj"),
        ]
    # LFM2 names its final norm token_embd_norm (llama.cpp: LLM_TENSOR_OUTPUT_NORM_LFM2).
    # The head is untied (llama.cpp loads output.weight when present), so a port that
    # silently reuses token_embd is caught.
    out += [
        TensorSpec("token_embd_norm.weight", (d.hidden,), "norm"),
        TensorSpec("output.weight", (d.vocab, d.hidden), "proj"),
    ]
    return out


# -- falcon-h1 (Mamba2 SSM and attention in parallel in every layer) ---------------------------
# SSM sizes are fixed for the synthetic family (Falcon-H1 keeps them apart from the attention
# sizes): 8 SSM heads of 32 channels, 2 groups of B/C (so the grouped norm and the head ->
# group mapping are exercised), a 4-tap conv, a 16-wide state.
FALCON_H1_SSM = {"d_inner": 256, "heads": 8, "d_state": 16, "groups": 2, "d_conv": 4}


def falcon_h1_conv_dim() -> int:
    s = FALCON_H1_SSM
    return s["d_inner"] + 2 * s["groups"] * s["d_state"]


def _falcon_h1_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    s = FALCON_H1_SSM
    return {
        "context_length": d.context_length,
        "embedding_length": d.hidden,
        "block_count": d.layers,
        "feed_forward_length": d.ff,
        "attention.head_count": d.heads,
        "attention.head_count_kv": d.kv_heads,
        "attention.key_length": d.head_dim,
        "attention.value_length": d.head_dim,
        "attention.layer_norm_rms_epsilon": d.rms_eps,
        "rope.freq_base": d.rope_base,
        "ssm.conv_kernel": s["d_conv"],
        "ssm.inner_size": s["d_inner"],
        "ssm.state_size": s["d_state"],
        "ssm.time_step_rank": s["heads"],  # llama.cpp: the number of SSM heads
        "ssm.group_count": s["groups"],
    }


def _falcon_h1_tensors(d: Dims) -> list[TensorSpec]:
    s = FALCON_H1_SSM
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    conv_dim = falcon_h1_conv_dim()
    in_proj = s["d_inner"] + conv_dim + s["heads"]  # z, xBC, dt
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers):
        b = f"blk.{i}"
        out += [
            TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"),
            TensorSpec(f"{b}.attn_q.weight", (q, d.hidden), "proj"),
            TensorSpec(f"{b}.attn_k.weight", (kv, d.hidden), "proj"),
            TensorSpec(f"{b}.attn_v.weight", (kv, d.hidden), "proj"),
            TensorSpec(f"{b}.attn_output.weight", (d.hidden, q), "proj"),
            TensorSpec(f"{b}.ssm_in.weight", (in_proj, d.hidden), "proj"),
            # numpy (conv_dim, d_conv) = ggml {d_conv, conv_dim}; ssm_conv reads only f32
            TensorSpec(f"{b}.ssm_conv1d.weight", (conv_dim, s["d_conv"]), "proj",
                       always_f32=True),
            TensorSpec(f"{b}.ssm_conv1d.bias", (conv_dim,), "bias"),
            TensorSpec(f"{b}.ssm_dt.bias", (s["heads"],), "bias"),
            # A is stored negated (the converter writes -exp(A_log)); ggml {1, n_head}
            TensorSpec(f"{b}.ssm_a", (s["heads"], 1), "ssm_a", always_f32=True),
            TensorSpec(f"{b}.ssm_d", (s["heads"], 1), "norm", always_f32=True),
            # grouped RMSNorm weight: ggml {d_inner / groups, groups}
            TensorSpec(f"{b}.ssm_norm.weight", (s["groups"], s["d_inner"] // s["groups"]),
                       "norm", always_f32=True),
            TensorSpec(f"{b}.ssm_out.weight", (d.hidden, s["d_inner"]), "proj"),
            # no ".weight": llama.cpp loads Falcon-H1's pre-FFN norm as tn(FFN_NORM, i)
            TensorSpec(f"{b}.ffn_norm", (d.hidden,), "norm"),
            TensorSpec(f"{b}.ffn_gate.weight", (d.ff, d.hidden), "proj"),
            TensorSpec(f"{b}.ffn_up.weight", (d.ff, d.hidden), "proj"),
            TensorSpec(f"{b}.ffn_down.weight", (d.hidden, d.ff), "proj"),
        ]
    out += [
        TensorSpec("output_norm.weight", (d.hidden,), "norm"),
        TensorSpec("output.weight", (d.vocab, d.hidden), "proj"),
    ]
    return out


# -- gemma2 (soft-capped attention and logits, every even layer sliding) ----------------------
# A window far shorter than the test prompts, so sliding layers really slide; caps near
# the scores' size (about 1) and the logits' (about 0.25, below), so tanh bends them
# (Gemma 2 ships 50 and 30, far above its trained values too).
GEMMA2_WINDOW, GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP = 48, 2.0, 0.75


def _gemma2_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    return {**_qwen3_hparams(d), "attention.sliding_window": GEMMA2_WINDOW,
            "attn_logit_softcapping": GEMMA2_ATTN_CAP,
            "final_logit_softcapping": GEMMA2_FINAL_CAP}


def _gemma2_tensors(d: Dims) -> list[TensorSpec]:
    out = []
    for spec in _dense_tensors(d, qk_norm=False):
        if spec.name == "output.weight":
            continue  # llama.cpp's gemma2 always reads its head from token_embd
        if spec.name == "token_embd.weight":
            # Small rows: the tied head's logits come out about 0.25 (N(0, 1) rows would
            # give about 16). llama.cpp's CPU GELU rounds through an fp16 table, so a gate
            # value a float apart from ours can land on the next fp16 step: an error floor
            # near 1e-3 of the logits' size that the 1e-3 bar must stay above.
            spec = TensorSpec(spec.name, spec.shape, "tied_embed")
        out.append(spec)
        block = spec.name.rsplit(".", 2)[0]
        if spec.name.endswith("attn_output.weight"):
            out.append(TensorSpec(f"{block}.post_attention_norm.weight", (d.hidden,), "norm"))
        elif spec.name.endswith("ffn_down.weight"):
            out.append(TensorSpec(f"{block}.post_ffw_norm.weight", (d.hidden,), "norm"))
    return out


# -- olmo (weightless LayerNorms, clamped Q/K/V) ----------------------------------------------
OLMO_CLAMP_KQV = 1.5  # below the projections' largest values, so the clamp is exercised


def _olmo_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    out = {k: v for k, v in _qwen3_hparams(d).items()
           if k != "attention.layer_norm_rms_epsilon"}
    return {**out, "attention.layer_norm_epsilon": d.rms_eps,
            "attention.clamp_kqv": OLMO_CLAMP_KQV}


def _olmo_tensors(d: Dims) -> list[TensorSpec]:
    _need_square_attention("olmo", d)
    return [t for t in _dense_tensors(d, qk_norm=False) if t.init != "norm"]


def _need_square_attention(arch: str, d: Dims) -> None:
    if d.heads * d.head_dim != d.hidden:
        # llama.cpp creates these families' Q and output projections as n_embd x n_embd.
        raise SynthError(f"{arch} needs heads * head_dim == hidden ({d.heads} * {d.head_dim} "
                         f"!= {d.hidden})")


# -- olmo2 (post-norms only, Q/K norms over the whole projections) ----------------------------
def _olmo2_tensors(d: Dims) -> list[TensorSpec]:
    _need_square_attention("olmo2", d)
    out = []
    for spec in _dense_tensors(d, qk_norm=False):
        block = spec.name.rsplit(".", 2)[0]
        if spec.name.endswith(("attn_norm.weight", "ffn_norm.weight")):
            continue
        out.append(spec)
        if spec.name.endswith("attn_v.weight"):
            out += [TensorSpec(f"{block}.attn_q_norm.weight", (d.hidden,), "norm"),
                    TensorSpec(f"{block}.attn_k_norm.weight", (d.kv_heads * d.head_dim,), "norm")]
        elif spec.name.endswith("attn_output.weight"):
            out.append(TensorSpec(f"{block}.post_attention_norm.weight", (d.hidden,), "norm"))
        elif spec.name.endswith("ffn_down.weight"):
            out.append(TensorSpec(f"{block}.post_ffw_norm.weight", (d.hidden,), "norm"))
    return out


# -- glm4 (biased Q/K/V, partial rope, four norms, fused gate-up FFN) -------------------------
def glm4_fused_qkv(layer: int) -> bool:
    """The synthetic file's odd layers store one attn_qkv matrix and bias, the even ones
    three of each: llama.cpp loads either per layer, so one file checks both."""
    return layer % 2 == 1


def _glm4_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    # GLM-4 rotates the first half of each head (rope.dimension_count = head_dim / 2)
    return {**_qwen3_hparams(d), "rope.dimension_count": d.head_dim // 2}


def _glm4_tensors(d: Dims) -> list[TensorSpec]:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers):
        b = f"blk.{i}"
        out.append(TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"))
        if glm4_fused_qkv(i):
            out += [TensorSpec(f"{b}.attn_qkv.weight", (q + 2 * kv, d.hidden), "proj"),
                    TensorSpec(f"{b}.attn_qkv.bias", (q + 2 * kv,), "bias")]
        else:
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                out += [TensorSpec(f"{b}.attn_{name}.weight", (rows, d.hidden), "proj"),
                        TensorSpec(f"{b}.attn_{name}.bias", (rows,), "bias")]
        out += [
            TensorSpec(f"{b}.attn_output.weight", (d.hidden, q), "proj"),
            TensorSpec(f"{b}.post_attention_norm.weight", (d.hidden,), "norm"),
            TensorSpec(f"{b}.ffn_norm.weight", (d.hidden,), "norm"),
            TensorSpec(f"{b}.ffn_up.weight", (2 * d.ff, d.hidden), "proj"),  # gate, then up
            TensorSpec(f"{b}.ffn_down.weight", (d.hidden, d.ff), "proj"),
            TensorSpec(f"{b}.post_ffw_norm.weight", (d.hidden,), "norm"),
        ]
    out += [
        TensorSpec("output_norm.weight", (d.hidden,), "norm"),
        TensorSpec("output.weight", (d.vocab, d.hidden), "proj"),
    ]
    return out


_SMALL = {"hidden": 256, "ff": 768, "heads": 4, "kv_heads": 2, "head_dim": 64,
          "context_length": 4096, "rope_base": 1e6, "rms_eps": 1e-6}

_ARCHS: dict[str, ArchSpec] = {
    "qwen3": ArchSpec(defaults=_SMALL, hparams=_qwen3_hparams, tensors=_qwen3_tensors),
    # SmolLM2's rope base and eps; a context long enough for 4096-token bench prompts.
    "llama": ArchSpec(defaults={**_SMALL, "context_length": 8192, "rope_base": 1e5,
                                "rms_eps": 1e-5},
                      hparams=_llama_hparams, tensors=_llama_tensors),
    "lfm2": ArchSpec(defaults={**_SMALL, "rms_eps": 1e-5}, hparams=_lfm2_hparams,
                     tensors=_lfm2_tensors),
    "falcon-h1": ArchSpec(defaults={**_SMALL, "ff": 512, "rms_eps": 1e-5},
                          hparams=_falcon_h1_hparams, tensors=_falcon_h1_tensors),
    "gemma2": ArchSpec(defaults=_SMALL, hparams=_gemma2_hparams, tensors=_gemma2_tensors),
    "olmo": ArchSpec(defaults={**_SMALL, "rms_eps": 1e-5}, hparams=_olmo_hparams,
                     tensors=_olmo_tensors),
    "olmo2": ArchSpec(defaults=_SMALL, hparams=_qwen3_hparams, tensors=_olmo2_tensors),
    "glm4": ArchSpec(defaults={**_SMALL, "rms_eps": 1e-5}, hparams=_glm4_hparams,
                     tensors=_glm4_tensors),
}

SYNTH_ARCHS: tuple[str, ...] = tuple(sorted(_ARCHS))


def synth_defaults(arch: str) -> dict[str, int | float]:
    """Default sizes of `arch` (hidden, ff, heads, kv_heads, head_dim, context, rope, eps)."""
    return dict(_spec(arch).defaults)


def _spec(arch: str) -> ArchSpec:
    if arch not in _ARCHS:
        raise SynthError(f"unknown synthetic arch {arch!r}; known: {', '.join(SYNTH_ARCHS)}")
    return _ARCHS[arch]


# -- the shared writer ------------------------------------------------------------------------
def write_synthetic(
    arch: str,
    *,
    layers: int,
    seed: int,
    out: Path,
    tokenizer_from: Path,
    hidden: int | None = None,
    ff: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str = "f32",
    progress: Callable[[str], None] | None = None,
    rope_freqs: bool = False,
) -> Path:
    """Write a random-weight `arch` GGUF with `layers` blocks to `out`; return `out`.

    2-D weights are stored as `dtype` ("f32" or "f16"); 1-D norm weights (and tensors
    marked always_f32, such as LFM2's conv kernels) are always f32.
    `head_dim` defaults to hidden // heads. `rope_freqs` (llama only) makes a Llama 3
    style file: rope base 500000 and a rope_freqs.weight of frequency factors. The file
    appears atomically (written under a temporary name, then renamed), so an interrupted
    write never leaves a loadable stub.
    """
    spec = _spec(arch)
    if dtype not in _DTYPES:
        raise SynthError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise SynthError(f"seed must be an integer in [0, 2**63), not {seed!r}")
    if rope_freqs and arch != "llama":
        raise SynthError(f"rope_freqs is a llama option, not one of {arch}")
    tok = _tokenizer_kv(Path(tokenizer_from))
    dims = _resolve_dims(spec, layers=layers, hidden=hidden, ff=ff, heads=heads,
                         kv_heads=kv_heads, head_dim=head_dim,
                         vocab=len(tok["tokenizer.ggml.tokens"][0]))
    if rope_freqs:
        dims = replace(dims, rope_freqs=True, rope_base=LLAMA3_ROPE["base"])
    np_dtype, file_type = _DTYPES[dtype]
    out = Path(out)
    tensors = spec.tensors(dims)

    tmp = out.with_name(out.name + ".partial")
    writer = GGUFWriter(tmp, arch)
    try:
        _add_metadata(writer, arch, layers, seed, file_type, spec.hparams(dims), tok)
        _add_tensors(writer, tensors, seed, np_dtype, progress)
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def _add_metadata(writer: GGUFWriter, arch: str, layers: int, seed: int, file_type: int,
                  hparams: dict, tok: dict) -> None:
    """The file's name, type, the architecture's hyperparameters, our synth keys and the
    borrowed tokenizer."""
    writer.add_name(f"synthetic {arch} L{layers} seed {seed}")
    writer.add_file_type(file_type)
    for key, value in hparams.items():
        _add_typed(writer, f"{arch}.{key}", value)
    writer.add_uint64("skippy.synth.seed", seed)
    writer.add_string("skippy.synth.arch", arch)
    writer.add_uint32("skippy.synth.version", SYNTH_VERSION)
    for key, (value, vtype, sub_type) in tok.items():
        writer.add_key_value(key, value, vtype, sub_type)


def _add_tensors(writer: GGUFWriter, tensors: list[TensorSpec], seed: int, np_dtype,
                 progress: Callable[[str], None] | None) -> None:
    """Header, metadata and tensor infos, then each tensor's random data in turn."""
    stored = [np.float32 if len(t.shape) == 1 or t.always_f32 else np_dtype for t in tensors]
    for t, dt in zip(tensors, stored):
        nbytes = int(np.prod(t.shape)) * np.dtype(dt).itemsize
        writer.add_tensor_info(t.name, t.shape, np.dtype(dt), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (t, dt) in enumerate(zip(tensors, stored)):
        if progress is not None:
            progress(f"[{i + 1}/{len(tensors)}] {t.name} {'x'.join(map(str, t.shape))}")
        writer.write_tensor_data(_generate(t, seed, dt))


def _resolve_dims(spec: ArchSpec, *, layers: int, vocab: int, **given: int | None) -> Dims:
    d = {k: (spec.defaults[k] if v is None else v) for k, v in given.items() if k != "head_dim"}
    for name, value in [("layers", layers), *d.items()]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SynthError(f"{name} must be a positive integer, not {value!r}")
    if d["heads"] % d["kv_heads"]:
        raise SynthError(f"heads ({d['heads']}) must be a multiple of kv_heads ({d['kv_heads']})")
    head_dim = given["head_dim"]
    if head_dim is None:
        if d["hidden"] % d["heads"]:
            raise SynthError(f"hidden ({d['hidden']}) is not divisible by heads ({d['heads']}); "
                             "pass head_dim explicitly")
        head_dim = d["hidden"] // d["heads"]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise SynthError(f"head_dim must be a positive even integer (rope rotates pairs), "
                         f"not {head_dim!r}")
    return Dims(layers=layers, hidden=d["hidden"], ff=d["ff"], heads=d["heads"],
                kv_heads=d["kv_heads"], head_dim=head_dim, vocab=vocab,
                context_length=int(spec.defaults["context_length"]),
                rope_base=float(spec.defaults["rope_base"]),
                rms_eps=float(spec.defaults["rms_eps"]))


def _add_typed(writer: GGUFWriter, key: str, value: int | float | list[int]) -> None:
    # llama.cpp reads hparams as u32 / f32 (arrays of i32); Python ints and floats
    # would otherwise be guessed as 64-bit by gguf-py.
    if isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY, GGUFValueType.INT32)


def _rng(seed: int, name: str) -> np.random.Generator:
    # Per-tensor streams: a tensor's values do not depend on which other tensors exist, so
    # a model with more layers shares its first layers' weights with a shorter one.
    digest = blake3.blake3(f"skippy.synth/{seed}/{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def _generate(t: TensorSpec, seed: int, dtype: type[np.generic]) -> np.ndarray:
    if t.init == "rope_freqs":
        return llama3_rope_factors(t.shape[0]).astype(dtype)
    rng = _rng(seed, t.name)
    out = np.empty(t.shape, dtype=dtype)
    if t.init == "norm":
        mean, std = 1.0, 0.1
    elif t.init in ("bias", "ssm_a"):  # ssm_a: -exp(N(0, 0.5)), negative decay rates
        mean, std = 0.0, (0.1 if t.init == "bias" else 0.5)
    elif t.init == "embed":
        mean, std = 0.0, 1.0
    elif t.init == "tied_embed":
        mean, std = 0.0, 0.25 / np.sqrt(t.shape[-1])
    else:
        mean, std = 0.0, 1.0 / np.sqrt(t.shape[-1])
    flat = out.reshape(t.shape[0], -1)
    rows = max(1, _CHUNK_ELEMENTS // flat.shape[1])
    for r in range(0, flat.shape[0], rows):
        block = rng.standard_normal((min(rows, flat.shape[0] - r), flat.shape[1]), dtype=np.float32)
        block *= np.float32(std)
        block += np.float32(mean)
        if t.init == "ssm_a":
            block = -np.exp(block)
        flat[r:r + rows] = block
    return out


# -- tokenizer borrowing ----------------------------------------------------------------------
TokenizerKv = dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]


def _tokenizer_kv(path: Path) -> TokenizerKv:
    if not path.is_file():
        raise SynthError(f"tokenizer GGUF not found: {path}")
    st = path.stat()
    return _read_tokenizer_kv(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_tokenizer_kv(path: Path, size: int, mtime_ns: int) -> TokenizerKv:
    # Cached on (path, size, mtime): GGUFReader takes seconds over a vocabulary's arrays
    # (evals/README.md, GGUF reading), and callers (tests, sweeps) write many models with
    # the same tokenizer.
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise SynthError(f"cannot read tokenizer GGUF {path}: {e}") from e
    kv: TokenizerKv = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        if vtype == GGUFValueType.ARRAY and len(field.types) != 2:
            raise SynthError(f"{path}: nested array {key} is not supported")
        kv[key] = (field.contents(), vtype, sub_type)
    if "tokenizer.ggml.tokens" not in kv:
        raise SynthError(f"{path} has no tokenizer.ggml.tokens; pick a GGUF with a vocabulary")
    return kv
