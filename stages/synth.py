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

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import blake3
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from skippy.topology.tally import Progress, Tally

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
    # The arch's own sizes and switches (ArchSpec.options, overridden by the caller's)
    options: Mapping[str, int | float | None] = dataclasses.field(default_factory=dict)
    variant: str = ""  # one of the arch's ArchSpec.variants ("" where it has none)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: GGUF name, numpy shape (out_features, in_features) and how to fill it.

    `init` is "embed" (N(0, 1): token rows are looked up, not summed, so they need no
    fan-in scaling), "proj" (N(0, 1/sqrt(fan_in)): keeps each projection's output at the
    scale of its input), "norm" (1 + N(0, 0.1): near identity, but not exactly, so a port
    that forgets a norm weight is caught), "bias" (N(0, 0.1)), "ssm_a" (-exp(N(0, 0.5)):
    Mamba2's negative per-head decay rate A), "qk_norm" ("norm" times head_dim^-1/4: for
    Q and K norms of a family that does not scale its scores, so that the scores are of
    unit scale), "head_norm" (0.3 + N(0, 0.03): a final norm that scales logits down),
    "rope_freqs" (Llama 3's frequency factors, computed, not drawn), "rope_divisors"
    (Gemma 4's proportional-rope divisors, fixed: _rope_divisors) or "tied_embed"
    (N(0, 1/(16 fan_in)): Gemma 2's embeddings, which are also its head).
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
    # Arch-specific options a caller may set (write_synthetic(options=...), the CLI's
    # --set KEY=VALUE) and their defaults; None: derived from the other sizes.
    options: Mapping[str, int | float | None] = dataclasses.field(default_factory=dict)
    # Shapes of one family the `variant` option picks between (the first is the default),
    # e.g. gemma4's "e4b" (per-layer embeddings, shared KV) and "a4b" (experts).
    variants: tuple[str, ...] = ()


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


def _dense_tensors(d: Dims, *, qk_norm: bool, whole: bool = False) -> list[TensorSpec]:
    """Attention + SwiGLU blocks (qwen3 adds per-head q/k norms; llama has none; `whole`:
    one norm over all of Q and one over all of K, as MiniMax-M2's)."""
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
                TensorSpec(f"{b}.attn_q_norm.weight", (q if whole else d.head_dim,), "norm"),
                TensorSpec(f"{b}.attn_k_norm.weight", (kv if whole else d.head_dim,), "norm"),
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


# -- gemma4 ---------------------------------------------------------------------------------
# Two shapes (variants): "e4b" (E2B / E4B: per-layer embeddings, the last layers reading
# earlier layers' KV) and "a4b" (26B-A4B: a routed expert block beside the dense FFN in
# every layer, global layers without a V projection). Fixed for the synthetic family:
# per-layer embedding width, window, logit soft cap (low enough that the cap bends the
# logits), rope bases, experts (8, 2 used, a quarter of --ff wide). Global layers have
# twice the sliding-window layers' head size (E4B: 512 and 256).
GEMMA4 = {"per_layer": 64, "window": 128, "softcap": 10.0, "rope_base_swa": 10000.0,
          "experts": 8, "used": 2}
GEMMA4_VARIANTS = ("e4b", "a4b")


def gemma4_layout(layers: int, variant: str = "e4b") -> tuple[list[bool], int]:
    """(sliding-window flag per layer, shared-KV layer count). Global layers: every fourth
    and the last. E4B from 6 layers on: the layers after the first global one are shared,
    so the last two KV layers are a sliding-window and a global one, as llama.cpp's KV
    reuse expects (6 layers: s s s G | s G, the last two reading layers 2 and 3)."""
    swa = [not (i % 4 == 3 or i == layers - 1) for i in range(layers)]
    return swa, (layers - 4 if layers >= 6 and variant == "e4b" else 0)


def _gemma4_head_dims(d: Dims) -> tuple[int, int]:
    return d.head_dim, 2 * d.head_dim  # sliding-window, global


def _gemma4_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    g, e4b = GEMMA4, d.variant == "e4b"
    swa, shared = gemma4_layout(d.layers, d.variant)
    hd_swa, hd = _gemma4_head_dims(d)
    out = {
        "context_length": d.context_length,
        "embedding_length": d.hidden,
        "block_count": d.layers,
        "feed_forward_length": d.ff,
        "attention.head_count": d.heads,
        "attention.head_count_kv": d.kv_heads,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "attention.key_length_swa": hd_swa,
        "attention.value_length_swa": hd_swa,
        "rope.dimension_count": hd,
        "rope.dimension_count_swa": hd_swa,
        "attention.layer_norm_rms_epsilon": d.rms_eps,
        "rope.freq_base": d.rope_base,
        "rope.freq_base_swa": g["rope_base_swa"],
        "attention.sliding_window": g["window"],
        "attention.sliding_window_pattern": swa,
        "attention.shared_kv_layers": shared,
        "embedding_length_per_layer_input": g["per_layer"] if e4b else 0,
        "final_logit_softcapping": g["softcap"],
    }
    if not e4b:
        out.update({"expert_count": g["experts"], "expert_used_count": g["used"],
                    "expert_feed_forward_length": d.ff // 4})
    return out


def _gemma4_tensors(d: Dims) -> list[TensorSpec]:
    P, L, e4b = GEMMA4["per_layer"], d.layers, d.variant == "e4b"
    swa, shared = gemma4_layout(L, d.variant)
    hd_swa, hd = _gemma4_head_dims(d)
    # Embedding rows at 1/sqrt(width), as Gemma's are: the graph scales them up by
    # sqrt(width), and the tied head then gives logits of unit scale (N(0, 1) rows
    # would give std 16 and pin every large logit to the soft cap).
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "proj")]
    if e4b:
        out += [TensorSpec("per_layer_token_embd.weight", (d.vocab, L * P), "proj"),
                TensorSpec("per_layer_model_proj.weight", (L * P, d.hidden), "proj"),
                TensorSpec("per_layer_proj_norm.weight", (P,), "norm")]
    # the global layers' rope frequency divisors (Gemma 4's proportional rope)
    out.append(TensorSpec("rope_freqs.weight", (hd // 2,), "rope_divisors"))
    for i in range(L):
        b = f"blk.{i}"
        out += _gemma4_attention(d, b, hd_swa if swa[i] else hd, i < L - shared,
                                 e4b or swa[i])
        out += _gemma4_ffn(d, b, e4b)
        out.append(TensorSpec(f"{b}.layer_output_scale.weight", (1,), "norm"))
    # Tied head (Gemma's): llama.cpp reads token_embd when output.weight is absent. The
    # final norm at 0.3 keeps logits at std ~0.3: llama.cpp's GELU rounds its input to f16
    # (a table), so an upstream difference in the last bit now and then flips a rounding,
    # and logits differ from any port by ~1e-3 of their scale (tests/test_family_gemma4.py).
    out.append(TensorSpec("output_norm.weight", (d.hidden,), "head_norm"))
    return out


def _gemma4_attention(d: Dims, b: str, h: int, has_kv: bool, has_v: bool) -> list[TensorSpec]:
    """A layer's attention; shared-KV layers have no K/V of their own, and without a V
    projection V is the K projection's output."""
    q, kv = d.heads * h, d.kv_heads * h
    out = [TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"),
           TensorSpec(f"{b}.attn_q.weight", (q, d.hidden), "proj"),
           TensorSpec(f"{b}.attn_q_norm.weight", (h,), "qk_norm")]
    if has_kv:
        out += [TensorSpec(f"{b}.attn_k.weight", (kv, d.hidden), "proj"),
                TensorSpec(f"{b}.attn_k_norm.weight", (h,), "qk_norm")]
        if has_v:
            out.append(TensorSpec(f"{b}.attn_v.weight", (kv, d.hidden), "proj"))
    return out + [TensorSpec(f"{b}.attn_output.weight", (d.hidden, q), "proj"),
                  TensorSpec(f"{b}.post_attention_norm.weight", (d.hidden,), "norm")]


def _gemma4_ffn(d: Dims, b: str, e4b: bool) -> list[TensorSpec]:
    """The dense FFN, then (e4b) the per-layer embedding block or (a4b) the experts."""
    out = [TensorSpec(f"{b}.ffn_norm.weight", (d.hidden,), "norm"),
           TensorSpec(f"{b}.ffn_gate.weight", (d.ff, d.hidden), "proj"),
           TensorSpec(f"{b}.ffn_up.weight", (d.ff, d.hidden), "proj"),
           TensorSpec(f"{b}.ffn_down.weight", (d.hidden, d.ff), "proj"),
           TensorSpec(f"{b}.post_ffw_norm.weight", (d.hidden,), "norm")]
    if e4b:
        P = GEMMA4["per_layer"]
        return out + [TensorSpec(f"{b}.inp_gate.weight", (P, d.hidden), "proj"),
                      TensorSpec(f"{b}.proj.weight", (d.hidden, P), "proj"),
                      TensorSpec(f"{b}.post_norm.weight", (d.hidden,), "norm")]
    n, ff = GEMMA4["experts"], d.ff // 4
    return out + [
        TensorSpec(f"{b}.post_ffw_norm_1.weight", (d.hidden,), "norm"),
        TensorSpec(f"{b}.pre_ffw_norm_2.weight", (d.hidden,), "norm"),
        TensorSpec(f"{b}.post_ffw_norm_2.weight", (d.hidden,), "norm"),
        # router rows N(0, 1): its input is a unit vector (rms-normed, / sqrt(hidden)),
        # so its logits are of unit scale and the top 2 of 8 are seldom near a tie
        TensorSpec(f"{b}.ffn_gate_inp.weight", (n, d.hidden), "embed", always_f32=True),
        TensorSpec(f"{b}.ffn_gate_inp.scale", (d.hidden,), "norm"),
        TensorSpec(f"{b}.ffn_gate_up_exps.weight", (n, 2 * ff, d.hidden), "proj"),
        TensorSpec(f"{b}.ffn_down_exps.weight", (n, d.hidden, ff), "proj"),
        TensorSpec(f"{b}.ffn_down_exps.scale", (n,), "norm"),
    ]


# -- deepseek2 (multi-head latent attention; DeepSeek-V2/V3, GLM-4.7-Flash) --------------------
# The MLA sizes follow head_dim (the unrotated query/key width) unless set: at head_dim 128
# they are DeepSeek-V3's (kv_lora 512, q_lora 1536, rope 64, v 128). Rope is YaRN as
# DeepSeek-V3 writes it (factor, original context, 0.1 * mscale_all_dim), so the scaled
# rope and the attention scale's mscale are both exercised. After `leading_dense` dense
# layers come DeepSeek-V3-style MoE layers: sigmoid routing with the exp_probs_b selection
# bias, grouped (the best groups_used of expert_groups compete), normalised and scaled
# weights, shared experts beside the routed ones. --ff is the dense layers' width.
DEEPSEEK2_OPTIONS: dict[str, int | float | None] = {
    "q_lora_rank": None,    # 12 * head_dim; 0: queries from attn_q (the "lite" layout)
    "kv_lora_rank": None,   # 4 * head_dim
    "rope_dim": None,       # head_dim // 2
    "v_head_dim": None,     # head_dim
    "kv_b": 0,              # 1: the unsplit attn_kv_b of older files, not attn_k_b / attn_v_b
    "yarn_factor": 4.0,     # 0: no rope scaling keys
    "yarn_log_multiplier": 0.0707,  # as stored: 0.1 * mscale_all_dim
    "leading_dense": 1,     # layers with a dense FFN before the MoE layers
    "experts": 16,          # routed experts per MoE layer (0: every layer dense)
    "experts_used": 4,
    "shared_experts": 1,
    "expert_ff": None,      # each expert's width: ff // 4
    "expert_groups": 4,     # 0 or 1: no grouped routing
    "groups_used": 2,
    "gating": 2,            # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
    "weights_norm": 1,
    "weights_scale": 2.5,
    "probs_bias": 1,        # 1: exp_probs_b, the selection bias
}


def deepseek2_sizes(d: Dims) -> dict[str, int]:
    """The resolved MLA and MoE sizes of a deepseek2 synth (nope = head_dim)."""
    o, hd = d.options, d.head_dim

    def size(key: str, default: int) -> int:
        return default if o.get(key) is None else int(o[key])

    experts = size("experts", 0)
    dense = d.layers if not experts else min(d.layers, size("leading_dense", d.layers))
    return {"nope": hd, "rope": size("rope_dim", hd // 2), "v": size("v_head_dim", hd),
            "kv_lora": size("kv_lora_rank", 4 * hd), "q_lora": size("q_lora_rank", 12 * hd),
            "leading_dense": dense, "experts": experts, "used": size("experts_used", 0),
            "shared": size("shared_experts", 0), "expert_ff": size("expert_ff", d.ff // 4),
            "groups": size("expert_groups", 0), "groups_used": size("groups_used", 0)}


def _deepseek2_hparams(d: Dims) -> dict[str, int | float | bool | list[int]]:
    z = deepseek2_sizes(d)
    if z["rope"] < 2 or z["rope"] % 2:
        raise SynthError(f"rope_dim must be a positive even integer, not {z['rope']}")
    out: dict[str, int | float | bool | list[int]] = {
        "context_length": d.context_length,
        "embedding_length": d.hidden,
        "block_count": d.layers,
        "feed_forward_length": d.ff,
        "attention.head_count": d.heads,
        "attention.layer_norm_rms_epsilon": d.rms_eps,
        "rope.freq_base": d.rope_base,
        "rope.dimension_count": z["rope"],
        "leading_dense_block_count": z["leading_dense"],
        "attention.q_lora_rank": z["q_lora"],
        "attention.kv_lora_rank": z["kv_lora"],
        # read by llama.cpp's loader even when every layer is dense
        "expert_feed_forward_length": z["expert_ff"],
        "expert_shared_count": z["shared"],
    }
    if d.options.get("kv_b"):  # per-head K and V as llama.cpp expands them: MHA
        out.update({"attention.head_count_kv": d.heads,
                    "attention.key_length": z["nope"] + z["rope"],
                    "attention.value_length": z["v"]})
    else:  # the converter's absorbed form: one latent "head" (MQA) of kv_lora + rope
        out.update({"attention.head_count_kv": 1,
                    "attention.key_length": z["kv_lora"] + z["rope"],
                    "attention.value_length": z["kv_lora"],
                    "attention.key_length_mla": z["nope"] + z["rope"],
                    "attention.value_length_mla": z["v"]})
    factor = float(d.options.get("yarn_factor") or 0.0)
    if factor:
        out.update({"rope.scaling.type": "yarn", "rope.scaling.factor": factor,
                    "rope.scaling.original_context_length": max(1, int(d.context_length / factor)),
                    "rope.scaling.yarn_log_multiplier":
                        float(d.options.get("yarn_log_multiplier") or 0.0)})
    if z["leading_dense"] < d.layers:
        out.update(_deepseek2_moe_hparams(d, z))
    return out


def _deepseek2_moe_hparams(d: Dims, z: dict[str, int]) -> dict[str, int | float | bool]:
    o = d.options
    if not 0 < z["used"] <= z["experts"] or z["shared"] < 1:
        raise SynthError(f"deepseek2 MoE layers need 0 < experts_used <= experts and a "
                         f"shared expert (llama.cpp always runs one), not {z}")
    out: dict[str, int | float | bool] = {
        "expert_count": z["experts"], "expert_used_count": z["used"],
        "expert_gating_func": int(o.get("gating") or 1),
        "expert_weights_norm": bool(o.get("weights_norm")),
        "expert_weights_scale": float(o.get("weights_scale") or 0.0)}
    if z["groups"] > 1:
        if z["experts"] % z["groups"] or not 0 < z["groups_used"] < z["groups"]:
            raise SynthError(f"{z['experts']} experts in {z['groups']} groups, "
                             f"{z['groups_used']} used: not a grouping llama.cpp takes")
        out.update({"expert_group_count": z["groups"],
                    "expert_group_used_count": z["groups_used"]})
    return out


def _deepseek2_attention(d: Dims, b: str) -> list[TensorSpec]:
    z = deepseek2_sizes(d)
    k_head, h = z["nope"] + z["rope"], d.heads
    if z["q_lora"]:
        out = [TensorSpec(f"{b}.attn_q_a.weight", (z["q_lora"], d.hidden), "proj"),
               TensorSpec(f"{b}.attn_q_a_norm.weight", (z["q_lora"],), "norm"),
               TensorSpec(f"{b}.attn_q_b.weight", (h * k_head, z["q_lora"]), "proj")]
    else:
        out = [TensorSpec(f"{b}.attn_q.weight", (h * k_head, d.hidden), "proj")]
    out += [TensorSpec(f"{b}.attn_kv_a_mqa.weight", (z["kv_lora"] + z["rope"], d.hidden), "proj"),
            TensorSpec(f"{b}.attn_kv_a_norm.weight", (z["kv_lora"],), "norm")]
    if d.options.get("kv_b"):
        out.append(TensorSpec(f"{b}.attn_kv_b.weight", (h * (z["nope"] + z["v"]), z["kv_lora"]),
                              "proj"))
    else:  # per head: ggml {nope, kv_lora, heads} and {kv_lora, v, heads}
        out += [TensorSpec(f"{b}.attn_k_b.weight", (h, z["kv_lora"], z["nope"]), "proj"),
                TensorSpec(f"{b}.attn_v_b.weight", (h, z["v"], z["kv_lora"]), "proj")]
    out.append(TensorSpec(f"{b}.attn_output.weight", (d.hidden, h * z["v"]), "proj"))
    return out


def _deepseek2_ffn(d: Dims, b: str, layer: int) -> list[TensorSpec]:
    z = deepseek2_sizes(d)
    if layer < z["leading_dense"]:
        return [TensorSpec(f"{b}.ffn_gate.weight", (d.ff, d.hidden), "proj"),
                TensorSpec(f"{b}.ffn_up.weight", (d.ff, d.hidden), "proj"),
                TensorSpec(f"{b}.ffn_down.weight", (d.hidden, d.ff), "proj")]
    shared = z["expert_ff"] * z["shared"]
    out = _expert_tensors(dataclasses.replace(d, ff=z["expert_ff"]), b, z["experts"])
    if d.options.get("probs_bias"):
        out.append(TensorSpec(f"{b}.exp_probs_b.bias", (z["experts"],), "bias"))
    return out + [TensorSpec(f"{b}.ffn_gate_shexp.weight", (shared, d.hidden), "proj"),
                  TensorSpec(f"{b}.ffn_up_shexp.weight", (shared, d.hidden), "proj"),
                  TensorSpec(f"{b}.ffn_down_shexp.weight", (d.hidden, shared), "proj")]


def _deepseek2_tensors(d: Dims) -> list[TensorSpec]:
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers):
        b = f"blk.{i}"
        out += [TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"),
                *_deepseek2_attention(d, b),
                TensorSpec(f"{b}.ffn_norm.weight", (d.hidden,), "norm"),
                *_deepseek2_ffn(d, b, i)]
    out += [TensorSpec("output_norm.weight", (d.hidden,), "norm"),
            TensorSpec("output.weight", (d.vocab, d.hidden), "proj")]
    return out


# -- qwen3moe (qwen3 attention, a mixture of experts in every layer) -------------------------
# The expert count and top-k are fixed for the synthetic family; --ff sets each expert's
# width (llama.cpp reads it as expert_feed_forward_length).
QWEN3MOE_EXPERTS = {"experts": 8, "used": 2}


def _moe_hparams(d: Dims, experts: dict[str, int]) -> dict[str, int | float | list[int]]:
    return {"expert_count": experts["experts"], "expert_used_count": experts["used"],
            "expert_feed_forward_length": d.ff}


def _expert_tensors(d: Dims, b: str, n_expert: int) -> list[TensorSpec]:
    """A router and the routed experts as 3-D stacks (numpy [n_expert, out, in])."""
    return [
        TensorSpec(f"{b}.ffn_gate_inp.weight", (n_expert, d.hidden), "proj", always_f32=True),
        TensorSpec(f"{b}.ffn_gate_exps.weight", (n_expert, d.ff, d.hidden), "proj"),
        TensorSpec(f"{b}.ffn_up_exps.weight", (n_expert, d.ff, d.hidden), "proj"),
        TensorSpec(f"{b}.ffn_down_exps.weight", (n_expert, d.hidden, d.ff), "proj"),
    ]


def _qwen3moe_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    return {**_qwen3_hparams(d), **_moe_hparams(d, QWEN3MOE_EXPERTS)}


def _qwen3moe_tensors(d: Dims) -> list[TensorSpec]:
    return _with_experts(_dense_tensors(d, qk_norm=True), d, QWEN3MOE_EXPERTS["experts"])


def _with_experts(dense: list[TensorSpec], d: Dims, n_expert: int,
                  probs_bias: bool = False) -> list[TensorSpec]:
    """Dense blocks with each layer's FFN replaced by a router and experts (and, with
    `probs_bias`, the exp_probs_b selection bias), after the layer's ffn_norm."""
    out = [t for t in dense if ".ffn_" not in t.name or t.name.endswith("ffn_norm.weight")]
    for i in range(d.layers):  # after each layer's ffn_norm, in layer order
        at = next(j for j, t in enumerate(out) if t.name == f"blk.{i}.ffn_norm.weight")
        extra = _expert_tensors(d, f"blk.{i}", n_expert)
        if probs_bias:  # shifts which experts a token picks, not their weights
            extra.append(TensorSpec(f"blk.{i}.exp_probs_b.bias", (n_expert,), "bias"))
        out[at + 1:at + 1] = extra
    return out


# -- minimax-m2 (whole-projection q/k norms, partial rope, sigmoid routing with a bias) --------
MINIMAX_M2_EXPERTS = {"experts": 8, "used": 2}


def _minimax_m2_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    return {**_qwen3_hparams(d), **_moe_hparams(d, MINIMAX_M2_EXPERTS),
            "rope.dimension_count": d.head_dim // 2,  # rope turns half of each head
            "expert_gating_func": 2}  # llama.cpp: sigmoid


def _minimax_m2_tensors(d: Dims) -> list[TensorSpec]:
    return _with_experts(_dense_tensors(d, qk_norm=True, whole=True), d,
                         MINIMAX_M2_EXPERTS["experts"], probs_bias=True)


# -- qwen3next (gated DeltaNet and gated attention layers, MoE FFN) ---------------------------
# Fixed for the synthetic family: every 3rd layer attention (6 layers: d d a d d a), rope on
# a quarter of each head (as the released 64 of 256), DeltaNet with 2 key heads and 4 value
# heads of 32 (so the key -> value head repeat is exercised) and a 4-tap conv, 8 experts of
# which 2 are used, a shared expert as wide as one expert (--ff sets both).
QWEN3NEXT = {"interval": 3, "rope_fraction": 4, "k_heads": 2, "v_heads": 4, "head": 32,
             "d_conv": 4, "experts": 8, "used": 2}


def qwen3next_is_attention_layer(layer: int) -> bool:
    return (layer + 1) % QWEN3NEXT["interval"] == 0


def _qwen3next_hparams(d: Dims) -> dict[str, int | float | list[int]]:
    s = QWEN3NEXT
    return {
        **_qwen3_hparams(d),
        "rope.dimension_count": d.head_dim // s["rope_fraction"],
        "full_attention_interval": s["interval"],
        **_moe_hparams(d, s),
        "expert_shared_feed_forward_length": d.ff,
        "ssm.conv_kernel": s["d_conv"],
        "ssm.inner_size": s["v_heads"] * s["head"],
        "ssm.state_size": s["head"],
        "ssm.time_step_rank": s["v_heads"],  # llama.cpp: value heads
        "ssm.group_count": s["k_heads"],     # llama.cpp: key heads
    }


def _qwen3next_deltanet(b: str, d: Dims) -> list[TensorSpec]:
    s = QWEN3NEXT
    key, value = s["k_heads"] * s["head"], s["v_heads"] * s["head"]
    return [
        TensorSpec(f"{b}.attn_qkv.weight", (2 * key + value, d.hidden), "proj"),
        TensorSpec(f"{b}.attn_gate.weight", (value, d.hidden), "proj"),
        # per key head: beta then alpha of its value heads
        TensorSpec(f"{b}.ssm_ba.weight", (2 * s["v_heads"], d.hidden), "proj"),
        # numpy (conv_dim, d_conv) = ggml {d_conv, conv_dim}; ssm_conv reads only f32
        TensorSpec(f"{b}.ssm_conv1d.weight", (2 * key + value, s["d_conv"]), "proj",
                   always_f32=True),
        TensorSpec(f"{b}.ssm_dt.bias", (s["v_heads"],), "bias"),
        TensorSpec(f"{b}.ssm_a", (s["v_heads"],), "ssm_a"),  # -exp(A_log)
        TensorSpec(f"{b}.ssm_norm.weight", (s["head"],), "norm"),
        TensorSpec(f"{b}.ssm_out.weight", (d.hidden, value), "proj"),
    ]


def _qwen3next_attention(b: str, d: Dims) -> list[TensorSpec]:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    return [
        # per head: its query, then its output gate
        TensorSpec(f"{b}.attn_q.weight", (2 * q, d.hidden), "proj"),
        TensorSpec(f"{b}.attn_k.weight", (kv, d.hidden), "proj"),
        TensorSpec(f"{b}.attn_v.weight", (kv, d.hidden), "proj"),
        TensorSpec(f"{b}.attn_output.weight", (d.hidden, q), "proj"),
        TensorSpec(f"{b}.attn_q_norm.weight", (d.head_dim,), "norm"),
        TensorSpec(f"{b}.attn_k_norm.weight", (d.head_dim,), "norm"),
    ]


def _qwen3next_moe(b: str, d: Dims) -> list[TensorSpec]:
    return [
        *_expert_tensors(d, b, QWEN3NEXT["experts"]),
        # the shared expert and its gate: one logit per row
        TensorSpec(f"{b}.ffn_gate_inp_shexp.weight", (d.hidden,), "proj"),
        TensorSpec(f"{b}.ffn_gate_shexp.weight", (d.ff, d.hidden), "proj"),
        TensorSpec(f"{b}.ffn_up_shexp.weight", (d.ff, d.hidden), "proj"),
        TensorSpec(f"{b}.ffn_down_shexp.weight", (d.hidden, d.ff), "proj"),
    ]


def _qwen3next_tensors(d: Dims) -> list[TensorSpec]:
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers):
        b = f"blk.{i}"
        out.append(TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"))
        if qwen3next_is_attention_layer(i):
            out += _qwen3next_attention(b, d)
        else:
            out += _qwen3next_deltanet(b, d)
        # the pre-FFN norm is named post_attention_norm
        out.append(TensorSpec(f"{b}.post_attention_norm.weight", (d.hidden,), "norm"))
        out += _qwen3next_moe(b, d)
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
    # head_dim 32 (hidden / 8 heads): kv_lora 128, q_lora 384, rope 16; DeepSeek's eps and
    # rope base
    "deepseek2": ArchSpec(defaults={**_SMALL, "ff": 512, "heads": 8, "kv_heads": 1,
                                    "rope_base": 10000.0},
                          hparams=_deepseek2_hparams, tensors=_deepseek2_tensors,
                          options=DEEPSEEK2_OPTIONS),
    "gemma4": ArchSpec(defaults={**_SMALL, "ff": 512}, hparams=_gemma4_hparams,
                       tensors=_gemma4_tensors, variants=GEMMA4_VARIANTS),
    "qwen3moe": ArchSpec(defaults={**_SMALL, "ff": 128}, hparams=_qwen3moe_hparams,
                         tensors=_qwen3moe_tensors),
    "minimax-m2": ArchSpec(defaults={**_SMALL, "ff": 128}, hparams=_minimax_m2_hparams,
                           tensors=_minimax_m2_tensors),
    "qwen3next": ArchSpec(defaults={**_SMALL, "ff": 128}, hparams=_qwen3next_hparams,
                          tensors=_qwen3next_tensors),
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
    progress: Progress | None = None,
    options: Mapping[str, int | float] | None = None,
    rope_freqs: bool = False,
    variant: str | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a random-weight `arch` GGUF with `layers` blocks to `out`; return `out`.

    2-D weights are stored as `dtype` ("f32" or "f16"); 1-D norm weights (and tensors
    marked always_f32, such as LFM2's conv kernels) are always f32.
    `head_dim` defaults to hidden // heads. `options` sets the arch's own sizes and
    switches (its ArchSpec.options; e.g. deepseek2's kv_lora_rank). `rope_freqs` (llama
    only) makes a Llama 3 style file: rope base 500000 and a rope_freqs.weight of frequency
    factors. `variant` picks one of the arch's shapes (ArchSpec.variants; default its
    first). `chat_template` replaces the borrowed tokenizer's chat template (Jinja text),
    e.g. to give a file a tool-aware template. `progress(done, total)` hears the tensor
    bytes written. The file appears atomically (written under a temporary name, then
    renamed), so an interrupted write never leaves a loadable stub."""
    spec = _spec(arch)
    if dtype not in _DTYPES:
        raise SynthError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise SynthError(f"seed must be an integer in [0, 2**63), not {seed!r}")
    if rope_freqs and arch != "llama":
        raise SynthError(f"rope_freqs is a llama option, not one of {arch}")
    tok = _tokenizer_kv(Path(tokenizer_from), chat_template)
    dims = _resolve_dims(spec, layers=layers, hidden=hidden, ff=ff, heads=heads,
                         kv_heads=kv_heads, head_dim=head_dim,
                         vocab=len(tok["tokenizer.ggml.tokens"][0]))
    dims = _shaped(arch, spec, dims, options, rope_freqs, variant)
    np_dtype, file_type = _DTYPES[dtype]
    out = Path(out)
    tensors = spec.tensors(dims)

    tmp = out.with_name(out.name + ".partial")
    writer = GGUFWriter(tmp, arch)
    try:
        _add_metadata(writer, arch, layers, seed, file_type, spec.hparams(dims), tok)
        if dims.variant:
            writer.add_string("skippy.synth.variant", dims.variant)
        _add_tensors(writer, tensors, seed, np_dtype, progress)
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def _shaped(arch: str, spec: ArchSpec, dims: Dims, options: Mapping[str, int | float] | None,
            rope_freqs: bool, variant: str | None) -> Dims:
    """dims with the caller's arch options, Llama 3 rope (llama) and variant applied."""
    dims = _with_options(arch, spec, dims, options or {})
    if rope_freqs:
        dims = replace(dims, rope_freqs=True, rope_base=LLAMA3_ROPE["base"])
    return replace(dims, variant=_variant(arch, spec, variant))


def _variant(arch: str, spec: ArchSpec, variant: str | None) -> str:
    if variant is None:
        return spec.variants[0] if spec.variants else ""
    if variant not in spec.variants:
        known = ", ".join(spec.variants) or "none"
        raise SynthError(f"{arch} has no variant {variant!r} (variants: {known})")
    return variant


def synth_bytes(arch: str, *, layers: int, vocab: int, dtype: str = "f32",
                options: Mapping[str, int | float] | None = None, variant: str | None = None,
                **sizes: int | None) -> int:
    """Tensor bytes of the file write_synthetic would write with these arguments (its
    metadata aside): lets a caller pick the layer count that reaches a size."""
    spec = _spec(arch)
    given = {k: sizes.get(k) for k in ("hidden", "ff", "heads", "kv_heads", "head_dim")}
    dims = _shaped(arch, spec, _resolve_dims(spec, layers=layers, vocab=vocab, **given),
                   options, False, variant)
    item = np.dtype(_DTYPES[dtype][0]).itemsize
    return sum(int(np.prod(t.shape)) * (4 if len(t.shape) == 1 or t.always_f32 else item)
               for t in spec.tensors(dims))
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
                 progress: Progress | None) -> None:
    """Header, metadata and tensor infos, then each tensor's random data in turn."""
    stored = [np.float32 if len(t.shape) == 1 or t.always_f32 else np_dtype for t in tensors]
    sizes = [int(np.prod(t.shape)) * np.dtype(dt).itemsize for t, dt in zip(tensors, stored)]
    for t, dt, nbytes in zip(tensors, stored, sizes):
        writer.add_tensor_info(t.name, t.shape, np.dtype(dt), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    written = Tally(sum(sizes), progress)
    for t, dt, nbytes in zip(tensors, stored, sizes):
        writer.write_tensor_data(_generate(t, seed, dt))
        written.add(nbytes)


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


def _with_options(arch: str, spec: ArchSpec, dims: Dims,
                  options: Mapping[str, int | float]) -> Dims:
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        known = ", ".join(sorted(spec.options)) or "none"
        raise SynthError(f"{arch} has no option {', '.join(unknown)} (options: {known})")
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise SynthError(f"option {key} must be a number >= 0, not {value!r}")
    return dataclasses.replace(dims, options={**spec.options, **options})


def _add_typed(writer: GGUFWriter, key: str,
               value: int | float | bool | str | list[int]) -> None:
    # llama.cpp reads hparams as u32 / f32 (arrays of i32); Python ints and floats
    # would otherwise be guessed as 64-bit by gguf-py.
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):  # before int: a bool is an int to Python
        writer.add_bool(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.BOOL)
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
    if t.init == "rope_divisors":
        return _rope_divisors(t.shape[0]).astype(dtype)
    rng = _rng(seed, t.name)
    out = np.empty(t.shape, dtype=dtype)
    if t.init == "norm":
        mean, std = 1.0, 0.1
    elif t.init == "head_norm":
        mean, std = 0.3, 0.03
    elif t.init == "qk_norm":  # norm weights that also carry the 1/sqrt(head_dim) scale
        mean = float(t.shape[0]) ** -0.25
        std = 0.1 * mean
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


def _rope_divisors(n: int) -> np.ndarray:
    """Rope frequency divisors: 1 for the first quarter of the pairs, growing ones for the
    next, and 1e30 (no rotation at all) for the last half, as proportional rope leaves the
    pairs past its partial rotary factor unrotated."""
    out = np.ones(n, dtype=np.float32)
    q = n // 4
    out[q:2 * q] = np.linspace(1.5, 8.0, 2 * q - q, dtype=np.float32)
    out[2 * q:] = np.float32(1e30)
    return out


# -- tokenizer borrowing ----------------------------------------------------------------------
TokenizerKv = dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]


def _tokenizer_kv(path: Path, chat_template: str | None = None) -> TokenizerKv:
    """The tokenizer keys of `path`, with `chat_template` instead of its own if given."""
    if not path.is_file():
        raise SynthError(f"tokenizer GGUF not found: {path}")
    st = path.stat()
    kv = _read_tokenizer_kv(path.resolve(), st.st_size, st.st_mtime_ns)
    if chat_template is None:
        return kv
    return {**kv, "tokenizer.chat_template": (chat_template, GGUFValueType.STRING, None)}


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
