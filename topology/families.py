"""Model families: every per-family quirk lives in this one table.

The torch runtime has one decoder layer; a family only switches its options (and, for
hybrid families, which token mixer a layer uses). Constants that llama.cpp hard-codes
instead of reading from the GGUF (Gemma 3's local rope base and its 5-local:1-global
pattern) are recorded here, next to the family they belong to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .gguf_file import GGUFFile
    from .model_config import ModelConfig


@dataclass(frozen=True)
class MoeRules:
    """How llama.cpp parameterises a family's mixture-of-experts call (build_moe_ffn):
    a constant where the family's graph hard-codes one, None where it reads the GGUF key
    (model_config.moe_fields resolves them)."""

    norm_weights: bool | None = True   # None: `expert_weights_norm`
    gating: str | None = "softmax"     # None: `expert_gating_func` (stages/moe.py GATINGS)
    # what a missing gating key means (None: an error), or how the file decides it
    gating_default: str | Callable[[GGUFFile], str] | None = None
    reads_scale: bool = False          # `expert_weights_scale` read (else no scale)


@dataclass(frozen=True)
class Family:
    name: str
    rope_style: str            # "norm": rotate adjacent pairs (llama GGUFs, Q/K permuted by
                               # the converter); "neox": rotate the two halves
    activation: str            # gated FFN activation: "silu" or "gelu_tanh"
    qk_norm: bool = False      # per-head RMSNorm of Q and K before rope
    qk_norm_whole: bool = False  # one RMSNorm over all Q heads, one over all K heads
    post_norms: bool = False   # RMSNorm after attention and after the FFN (Gemma)
    embed_scale: bool = False  # token embeddings multiplied by sqrt(hidden) (Gemma)
    swa_pattern: int = 0       # n > 0: layer i is sliding-window unless i % n == n - 1
    rope_base_swa: float | None = None  # rope base of sliding-window layers
    cache_policy: str = "ResidentKv"  # "KvRecurrent": state = attention KV + recurrent state
    # "shortconv": layers whose per-layer KV head count is 0 mix tokens by a short causal
    # convolution (LFM2) instead of attention. "mamba2_parallel": every layer runs attention
    # and a Mamba2 SSM side by side on the same normed rows and sums them (Falcon-H1).
    # "gated_deltanet": the layers ModelConfig.deltanet_layers lists mix tokens by a gated
    # DeltaNet (Qwen3-Next), the others by attention.
    # None: every layer is attention.
    recurrent_mixer: str | None = None
    # "mla": DeepSeek2's multi-head latent attention (stages/mla.py): a lane keeps one
    # compressed latent row per token and layer instead of per-head K and V.
    attention: str = "gqa"
    # Attention's Q projection carries a per-head output gate: out = attn * sigmoid(gate)
    # before the output projection (Qwen3-Next).
    attn_output_gate: bool = False
    output_norm: str = "output_norm.weight"  # GGUF name of the final norm
    ffn_norm: str = "ffn_norm.weight"  # GGUF name (after "blk.N.") of the pre-FFN norm
    # Cut rule: layer groups [a, b) that must stay in one stage, from the model's config
    # (e.g. a shared-KV producer and the layers that read its KV). The planner never puts a
    # stage boundary inside a group. None: any cut between layers is allowed.
    keep_together: Callable[[ModelConfig], Iterable[tuple[int, int]]] | None = None
    # Mixture-of-experts layers (those with a `ffn_gate_inp` router; stages/moe.py).
    moe: MoeRules | None = None

    def is_swa_layer(self, layer: int, sliding_window: int) -> bool:
        if self.swa_pattern <= 0 or sliding_window <= 0:
            return False
        return layer % self.swa_pattern < self.swa_pattern - 1


def _deepseek2_gating(f: GGUFFile) -> str:
    """llama.cpp's routing for deepseek2 files that predate the gating key."""
    trunk = int(f.arch_key("block_count")) - int(f.arch_key("nextn_predict_layers", 0) or 0)
    vocab = int(f.tensors["token_embd.weight"].shape[1])
    return "sigmoid" if trunk in (47, 48) and vocab == 154880 else "softmax"


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", rope_style="norm", activation="silu"),
    "qwen3": Family("qwen3", rope_style="neox", activation="silu", qk_norm=True),
    # llama.cpp: swa pattern 6, local rope base 10000 (llama-model.cpp, LLM_ARCH_GEMMA3).
    "gemma3": Family("gemma3", rope_style="neox", activation="gelu_tanh", qk_norm=True,
                     post_norms=True, embed_scale=True, swa_pattern=6, rope_base_swa=10000.0),
    # llama.cpp: a layer is recurrent iff its head_count_kv is 0; the final norm is stored
    # as token_embd_norm (LLM_TENSOR_OUTPUT_NORM_LFM2); NEOX rope (llama_model_rope_type).
    "lfm2": Family("lfm2", rope_style="neox", activation="silu", qk_norm=True,
                   cache_policy="KvRecurrent", recurrent_mixer="shortconv",
                   output_norm="token_embd_norm.weight"),
    # llama.cpp (models/falcon-h1.cpp): attention and build_mamba2_layer both read
    # rms_norm(x, attn_norm); attn_out + ssm_out + x, then the FFN. llama.cpp reads no muP
    # multiplier keys and applies none at runtime (a converter must fold them). NEOX rope
    # (llama_model_rope_type); the pre-FFN norm is loaded as "blk.N.ffn_norm" (no ".weight").
    "falcon-h1": Family("falcon-h1", rope_style="neox", activation="silu",
                        cache_policy="KvRecurrent", recurrent_mixer="mamba2_parallel",
                        ffn_norm="ffn_norm"),
    # llama.cpp (models/deepseek2.cpp): DeepSeek-V2/V3/R1 and GLM-4.7-Flash GGUFs; NORM rope
    # (llama_model_rope_type) on the rotated tails of queries and of the shared key.
    # MoE: gating, weight norm and scale from their keys; a file without a gating key is
    # softmax-routed, but sigmoid for GLM-4.7-Flash (47 trunk layers, or 48, and its vocab).
    "deepseek2": Family("deepseek2", rope_style="norm", activation="silu", attention="mla",
                        moe=MoeRules(norm_weights=None, gating=None, reads_scale=True,
                                     gating_default=_deepseek2_gating)),
    # llama.cpp (models/qwen3moe.cpp): softmax routing, chosen weights normalised, no scale
    # key read; NEOX rope.
    "qwen3moe": Family("qwen3moe", rope_style="neox", activation="silu", qk_norm=True,
                       moe=MoeRules(norm_weights=True, gating="softmax")),
    # llama.cpp (models/minimax-m2.cpp): Q and K normed over the whole projection before
    # rope, partial rope (rope.dimension_count of the head), sigmoid routing from
    # expert_gating_func with exp_probs_b choosing, chosen weights normalised; NEOX rope.
    "minimax-m2": Family("minimax-m2", rope_style="neox", activation="silu",
                         qk_norm_whole=True,
                         moe=MoeRules(norm_weights=True, gating=None)),
    # llama.cpp (models/qwen3next.cpp): DeltaNet or gated attention by layer
    # (ModelConfig.deltanet_layers); the pre-FFN norm is post_attention_norm; NEOX rope
    # (llama_model_rope_type), partial where rope.dimension_count < key_length. MoE:
    # softmax routing, chosen weights normalised, no scale key read; the shared expert is
    # gated by sigmoid(h . ffn_gate_inp_shexp) (stages/moe.py).
    "qwen3next": Family("qwen3next", rope_style="neox", activation="silu", qk_norm=True,
                        attn_output_gate=True, cache_policy="KvRecurrent",
                        recurrent_mixer="gated_deltanet",
                        ffn_norm="post_attention_norm.weight",
                        moe=MoeRules(norm_weights=True, gating="softmax")),
}


class UnsupportedFamily(ValueError):
    """The GGUF's architecture has no torch implementation here."""


def family_for(architecture: str) -> Family:
    try:
        return FAMILIES[architecture]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedFamily(
            f"architecture '{architecture}' is not supported (supported: {known})") from None
