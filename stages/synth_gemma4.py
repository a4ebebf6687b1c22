"""Synthetic tensor table of gemma4, in its two shapes (variants e4b and a4b)."""

from __future__ import annotations

import numpy as np

from .synth_table import SMALL, Dims, SynthTable, TensorSpec

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


def rope_divisors(n: int) -> np.ndarray:
    """Rope frequency divisors: 1 for the first quarter of the pairs, growing ones for the
    next, and 1e30 (no rotation at all) for the last half, as proportional rope leaves the
    pairs past its partial rotary factor unrotated."""
    out = np.ones(n, dtype=np.float32)
    q = n // 4
    out[q:2 * q] = np.linspace(1.5, 8.0, 2 * q - q, dtype=np.float32)
    out[2 * q:] = np.float32(1e30)
    return out



GEMMA4_TABLE = SynthTable(sizes={**SMALL, "ff": 512}, hparams=_gemma4_hparams,
                          tensors=_gemma4_tensors, variants=GEMMA4_VARIANTS)
