"""Synthetic tensor tables of the dense attention families: qwen3, llama (with Llama 3
rope factors as a knob), gemma2, olmo, olmo2 and glm4 (their registry entries in
topology/families.py name these tables)."""

from __future__ import annotations

import numpy as np

from .synth_table import SMALL, Dims, SynthTable, TensorSpec, need_square_attention

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
    need_square_attention(d)
    return [t for t in _dense_tensors(d, qk_norm=False) if t.init != "norm"]


# -- olmo2 (post-norms only, Q/K norms over the whole projections) ----------------------------
def _olmo2_tensors(d: Dims) -> list[TensorSpec]:
    need_square_attention(d)
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



QWEN3_TABLE = SynthTable(sizes=SMALL, hparams=_qwen3_hparams, tensors=_qwen3_tensors)
# SmolLM2's rope base and eps; a context long enough for 4096-token bench prompts.
LLAMA_TABLE = SynthTable(sizes={**SMALL, "context_length": 8192, "rope_base": 1e5,
                          "rms_eps": 1e-5},
                         hparams=_llama_hparams, tensors=_llama_tensors,
                         rope_freqs_base=LLAMA3_ROPE["base"])
GEMMA2_TABLE = SynthTable(sizes=SMALL, hparams=_gemma2_hparams, tensors=_gemma2_tensors)
OLMO_TABLE = SynthTable(sizes={**SMALL, "rms_eps": 1e-5}, hparams=_olmo_hparams,
                        tensors=_olmo_tensors)
OLMO2_TABLE = SynthTable(sizes=SMALL, hparams=_qwen3_hparams, tensors=_olmo2_tensors)
GLM4_TABLE = SynthTable(sizes={**SMALL, "rms_eps": 1e-5}, hparams=_glm4_hparams,
                        tensors=_glm4_tensors)
