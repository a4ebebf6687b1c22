"""Synthetic tensor tables of the mixture-of-experts families: qwen3moe, minimax-m2 and
deepseek2 (multi-head latent attention)."""

from __future__ import annotations

import dataclasses

from .synth_table import SMALL, Dims, SynthError, SynthTable, TensorSpec

from .synth_dense import _dense_tensors, _qwen3_hparams

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
    "nextn": 0,             # multi-token-prediction (NextN) layers after the trunk
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
        # the NextN layers come after the trunk's, as GLM-4.7-Flash's converter writes them
        "block_count": d.layers + _nextn(d),
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
    if _nextn(d):
        out["nextn_predict_layers"] = _nextn(d)
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


def _nextn(d: Dims) -> int:
    return int(d.options.get("nextn") or 0)


def _deepseek2_tensors(d: Dims) -> list[TensorSpec]:
    out = [TensorSpec("token_embd.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers + _nextn(d)):
        b = f"blk.{i}"
        out += [TensorSpec(f"{b}.attn_norm.weight", (d.hidden,), "norm"),
                *_deepseek2_attention(d, b),
                TensorSpec(f"{b}.ffn_norm.weight", (d.hidden,), "norm"),
                *_deepseek2_ffn(d, b, i)]
        if i >= d.layers:  # a NextN layer's own parts (it shares the trunk's embeddings
            # and head, which the converter leaves out of the block)
            out += [TensorSpec(f"{b}.nextn.eh_proj.weight", (d.hidden, 2 * d.hidden), "proj"),
                    TensorSpec(f"{b}.nextn.enorm.weight", (d.hidden,), "norm"),
                    TensorSpec(f"{b}.nextn.hnorm.weight", (d.hidden,), "norm"),
                    TensorSpec(f"{b}.nextn.shared_head_norm.weight", (d.hidden,), "norm")]
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



# head_dim 32 (hidden / 8 heads): kv_lora 128, q_lora 384, rope 16; DeepSeek's eps and
# rope base
DEEPSEEK2_TABLE = SynthTable(sizes={**SMALL, "ff": 512, "heads": 8, "kv_heads": 1,
                                    "rope_base": 10000.0},
                             hparams=_deepseek2_hparams, tensors=_deepseek2_tensors,
                             options=DEEPSEEK2_OPTIONS)
QWEN3MOE_TABLE = SynthTable(sizes={**SMALL, "ff": 128}, hparams=_qwen3moe_hparams,
                            tensors=_qwen3moe_tensors)
MINIMAX_M2_TABLE = SynthTable(sizes={**SMALL, "ff": 128}, hparams=_minimax_m2_hparams,
                              tensors=_minimax_m2_tensors)
