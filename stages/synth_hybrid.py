"""Synthetic tensor tables of the hybrid families (recurrent state beside attention):
lfm2 (short convolution), falcon-h1 (Mamba2 in parallel) and qwen3next (gated DeltaNet)."""

from __future__ import annotations


from .synth_table import SMALL, Dims, SynthError, SynthTable, TensorSpec

from .synth_dense import _qwen3_hparams
from .synth_moe import _expert_tensors, _moe_hparams

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



def _lfm2_describe(d: Dims) -> str:
    n_attn = sum(lfm2_is_attention_layer(i) for i in range(d.layers))
    return f"{d.layers - n_attn} short-conv + {n_attn} attention layers"


def _falcon_h1_describe(d: Dims) -> str:
    s = FALCON_H1_SSM
    return (f"Mamba2 d_inner {s['d_inner']}, {s['heads']} SSM heads, d_state {s['d_state']}, "
            f"{s['groups']} groups (fixed by the table)")


def _qwen3next_describe(d: Dims) -> str:
    s = QWEN3NEXT
    n_attn = sum(qwen3next_is_attention_layer(i) for i in range(d.layers))
    return (f"{d.layers - n_attn} gated DeltaNet + {n_attn} gated attention layers, "
            f"{s['experts']} experts ({s['used']} used) + a shared one")


LFM2_TABLE = SynthTable(sizes={**SMALL, "rms_eps": 1e-5}, hparams=_lfm2_hparams,
                        tensors=_lfm2_tensors, describe=_lfm2_describe)
FALCON_H1_TABLE = SynthTable(sizes={**SMALL, "ff": 512, "rms_eps": 1e-5},
                             hparams=_falcon_h1_hparams, tensors=_falcon_h1_tensors,
                             describe=_falcon_h1_describe)
QWEN3NEXT_TABLE = SynthTable(sizes={**SMALL, "ff": 128}, hparams=_qwen3next_hparams,
                             tensors=_qwen3next_tensors, describe=_qwen3next_describe)
