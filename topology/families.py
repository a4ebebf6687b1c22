"""The family registry: one entry per `general.architecture` we run, and the only place
that names one.

An entry carries everything about its family but the graph: the options of the shared
decoder layer (or, for a family with a graph of its own, the module that builds it,
imported lazily), its cache policy, its cut rules, the synthetic tensor table and knobs
stages/synth.py writes its files from, and the files the certify and family matrices run.
Constants that llama.cpp hard-codes instead of reading from the GGUF (Gemma 3's local rope
base and its 5-local:1-global pattern) are recorded here, next to the family they belong
to. Adding a family is one module (or none, where it composes the shared pieces) and one
entry; the CLI, the evals and the tests enumerate FAMILIES.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import UserError

if TYPE_CHECKING:
    from .gguf_file import GGUFFile

# A family's cut rule and query scale read the model's config (topology/model_config.py's
# ModelConfig, which reads its Family from here: typed loosely so neither imports the other).
Config = Any


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
class SynthCase:
    """One synthetic file of a family that the matrices run and the family tests read:
    evals/certify_matrix.py writes it at the table's sizes with these knobs,
    evals/family_matrix.py at its bench shape (changed by `bench`)."""

    name: str                  # the row's name (the family's, or the family and its knobs)
    label: str                 # the family as the specification's table names it
    layers: int
    seed: int
    settings: tuple[tuple[str, int | float | bool | str], ...] = ()  # synth knobs
    bench: tuple[tuple[str, int], ...] = ()  # family_matrix's sizes apart from its base


@dataclass(frozen=True)
class Family:
    name: str
    rope_style: str            # "norm": rotate adjacent pairs (llama GGUFs, Q/K permuted by
                               # the converter); "neox": rotate the two halves
    activation: str            # gated FFN activation: "silu", "gelu_tanh" or "gelu_f16"
    qk_norm: bool = False      # per-head RMSNorm of Q and K before rope
    post_norms: bool = False   # RMSNorm after attention and after the FFN (Gemma)
    embed_scale: bool = False  # token embeddings multiplied by sqrt(hidden) (Gemma)
    swa_pattern: int = 0       # n > 0: layer i is sliding-window unless i % n == n - 1
    # rope base of sliding-window layers (with swa_rope_base_key: when the file has none)
    rope_base_swa: float | None = None
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
    output_norm: str | None = "output_norm.weight"  # GGUF name of the final norm (None: none,
                                                    # a weightless norm)
    ffn_norm: str = "ffn_norm.weight"  # GGUF name (after "blk.N.") of the pre-FFN norm
    # Cut rule: layer groups [a, b) that must stay in one stage, from the model's config
    # (e.g. a shared-KV producer and the layers that read its KV). The planner never puts a
    # stage boundary inside a group. None: any cut between layers is allowed.
    keep_together: Callable[[Config], Iterable[tuple[int, int]]] | None = None
    # (module, function) that builds a stage's layers where the family has a graph of its
    # own (Gemma 4: value norm, shared KV, per-layer embeddings, its own MoE block); None:
    # stages/transformer.py's DecoderLayer with the options above.
    graph: tuple[str, str] | None = None
    # Per-layer window pattern, head sizes, shared-KV layers and per-layer embedding width
    # are read from the GGUF (Gemma 4's keys).
    per_layer_keys: bool = False
    # Tensors outside the layers that every stage loads when the file has them (beside
    # rope_freqs, which every family's stages load): per-layer embedding tables a stage
    # reads its layers' columns of.
    stage_tensors: tuple[str, ...] = ()
    # Of those, the tables whose columns belong to the layers in equal slices (layer i:
    # columns [i * w, (i + 1) * w)): the planner counts each slice with its layer.
    layer_sliced: tuple[str, ...] = ()
    # Mixture-of-experts layers (those with a `ffn_gate_inp` router; stages/moe.py).
    moe: MoeRules | None = None
    # Soft-capping, cap * tanh(x / cap), of the attention scores before the mask and
    # softmax, and of the head's logits (Gemma 2). The value is the cap llama.cpp uses when
    # the GGUF has no {arch}.attn_logit_softcapping / final_logit_softcapping key; 0: the
    # family never caps.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # The factor Q.K is scaled by, from the config; None: 1 / sqrt(head_dim).
    query_scale: Callable[[Config], float] | None = None
    sliding_window_default: int = 0  # the window when the GGUF names none (Gemma 2: 4096)
    swa_rope_scale: bool = False     # sliding-window layers keep the global rope scale
    # sliding-window layers take rope.freq_base_swa as base when given (Gemma 2, Gemma 4)
    swa_rope_base_key: bool = False
    # The norms: "rms" (RMSNorm with a weight) or "layer" (OLMo: mean-subtracted LayerNorm
    # with neither weight nor bias, eps from attention.layer_norm_epsilon). pre_norms:
    # the mixer and the FFN read normed rows (OLMo 2 norms only their outputs).
    norm: str = "rms"
    pre_norms: bool = True
    # "head": Q and K normed per head (qwen3); "projection": over all of Q and all of K,
    # one weight of n_heads * head_dim and one of n_kv_heads * head_dim (OLMo 2).
    qk_norm_span: str = "head"
    clamp_kqv: bool = False    # reads attention.clamp_kqv: Q, K, V clamped to [-c, c] (OLMo)
    ffn_up_fused: bool = False  # ffn_up holds gate then up rows, no ffn_gate (GLM-4)
    # (module, name) of the family's synthetic table (stages/synth_table.SynthTable), looked
    # up lazily; None: no synthetic files (a family we hold real checkpoints of).
    synth: tuple[str, str] | None = None
    # The synthetic files the matrices run and the family tests read.
    cases: tuple[SynthCase, ...] = ()

    def is_swa_layer(self, layer: int, sliding_window: int) -> bool:
        if self.swa_pattern <= 0 or sliding_window <= 0:
            return False
        return layer % self.swa_pattern < self.swa_pattern - 1


def gemma4_shared_kv_groups(cfg: Config) -> list[tuple[int, int]]:
    """Gemma 4's cut rule: a layer that reuses another layer's KV stays with it, so the
    layers from the first one read that way to the last layer are one group."""
    sources = [cfg.kv_source(i) for i in range(cfg.n_layers) if not cfg.has_kv(i)]
    return [(min(sources), cfg.n_layers)] if sources else []


def _deepseek2_gating(f: GGUFFile) -> str:
    """llama.cpp's routing for deepseek2 files that predate the gating key."""
    trunk = int(f.arch_key("block_count")) - int(f.arch_key("nextn_predict_layers", 0) or 0)
    vocab = int(f.tensors["token_embd.weight"].shape[1])
    return "sigmoid" if trunk in (47, 48) and vocab == 154880 else "softmax"


# The modules of the synthetic tables (stages/synth_*.py).
DENSE, MOE, HYBRID, GEMMA4 = ("skippy.stages.synth_dense", "skippy.stages.synth_moe",
                              "skippy.stages.synth_hybrid", "skippy.stages.synth_gemma4")

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", rope_style="norm", activation="silu",
                    synth=(DENSE, "LLAMA_TABLE"),
                    cases=(SynthCase("llama3", "Llama 3 (rope_freqs)", 4, 7,
                                     settings=(("rope_freqs", True),)),)),
    "qwen3": Family("qwen3", rope_style="neox", activation="silu", qk_norm=True,
                    synth=(DENSE, "QWEN3_TABLE"), cases=(SynthCase("qwen3", "Qwen3 dense", 6, 7),)),
    # llama.cpp: swa pattern 6, local rope base 10000 (llama-model.cpp, LLM_ARCH_GEMMA3).
    "gemma3": Family("gemma3", rope_style="neox", activation="gelu_tanh", qk_norm=True,
                     post_norms=True, embed_scale=True, swa_pattern=6, rope_base_swa=10000.0),
    # llama.cpp: a layer is recurrent iff its head_count_kv is 0; the final norm is stored
    # as token_embd_norm (LLM_TENSOR_OUTPUT_NORM_LFM2); NEOX rope (llama_model_rope_type).
    "lfm2": Family("lfm2", rope_style="neox", activation="silu", qk_norm=True,
                   cache_policy="KvRecurrent", recurrent_mixer="shortconv",
                   output_norm="token_embd_norm.weight",
                   synth=(HYBRID, "LFM2_TABLE"), cases=(SynthCase("lfm2", "LFM2", 6, 3),)),
    # llama.cpp (models/falcon-h1.cpp): attention and build_mamba2_layer both read
    # rms_norm(x, attn_norm); attn_out + ssm_out + x, then the FFN. llama.cpp reads no muP
    # multiplier keys and applies none at runtime (a converter must fold them). NEOX rope
    # (llama_model_rope_type); the pre-FFN norm is loaded as "blk.N.ffn_norm" (no ".weight").
    "falcon-h1": Family("falcon-h1", rope_style="neox", activation="silu",
                        cache_policy="KvRecurrent", recurrent_mixer="mamba2_parallel",
                        ffn_norm="ffn_norm", synth=(HYBRID, "FALCON_H1_TABLE"),
                        cases=(SynthCase("falcon-h1", "Falcon-H1", 4, 7),)),
    # llama.cpp (models/gemma4.cpp): the window pattern and SWA head size are GGUF keys
    # (ModelConfig reads them), as are the sliding layers' rope base (10000 when absent)
    # and the final soft cap (30 when absent); attention scale 1 (q and k are normed);
    # V gets an unweighted RMS norm; the last shared_kv_layers layers read an earlier
    # layer's KV.
    # GELU through llama.cpp's f16 table (layers.gelu_f16). MoE (26B-A4B): softmax over
    # the family's own router logits, chosen weights normalised, no scale (gemma4.cpp).
    "gemma4": Family("gemma4", rope_style="neox", activation="gelu_f16", qk_norm=True,
                     post_norms=True, embed_scale=True, rope_base_swa=10000.0,
                     swa_rope_base_key=True, final_softcap=30.0, query_scale=lambda c: 1.0,
                     moe=MoeRules(norm_weights=True, gating="softmax"),
                     keep_together=gemma4_shared_kv_groups,
                     graph=("skippy.stages.gemma4", "build_layers"), per_layer_keys=True,
                     stage_tensors=("per_layer_token_embd.weight",
                                    "per_layer_model_proj.weight",
                                    "per_layer_proj_norm.weight"),
                     layer_sliced=("per_layer_token_embd.weight",
                                   "per_layer_model_proj.weight"),
                     synth=(GEMMA4, "GEMMA4_TABLE"),
                     cases=(SynthCase("gemma4", "Gemma4 E4B", 6, 5),
                            SynthCase("gemma4-a4b", "Gemma4 A4B", 6, 9,
                                      settings=(("variant", "a4b"),)))),
    # llama.cpp (models/deepseek2.cpp): DeepSeek-V2/V3/R1 and GLM-4.7-Flash GGUFs; NORM rope
    # (llama_model_rope_type) on the rotated tails of queries and of the shared key.
    # MoE: gating, weight norm and scale from their keys; a file without a gating key is
    # softmax-routed, but sigmoid for GLM-4.7-Flash (47 trunk layers, or 48, and its vocab).
    "deepseek2": Family("deepseek2", rope_style="norm", activation="silu", attention="mla",
                        moe=MoeRules(norm_weights=None, gating=None, reads_scale=True,
                                     gating_default=_deepseek2_gating),
                        synth=(MOE, "DEEPSEEK2_TABLE"),
                        cases=(SynthCase("deepseek2", "DeepSeek2 / GLM-4.7 Flash (MLA)", 4, 5,
                                         bench=(("kv_heads", 1),)),)),
    # llama.cpp (models/qwen3moe.cpp): softmax routing, chosen weights normalised, no scale
    # key read; NEOX rope.
    "qwen3moe": Family("qwen3moe", rope_style="neox", activation="silu", qk_norm=True,
                       moe=MoeRules(norm_weights=True, gating="softmax"),
                       synth=(MOE, "QWEN3MOE_TABLE"),
                       cases=(SynthCase("qwen3moe", "Qwen3-MoE", 4, 7, bench=(("ff", 512),)),)),
    # llama.cpp (models/minimax-m2.cpp): Q and K normed over the whole projection before
    # rope, partial rope (rope.dimension_count of the head), sigmoid routing from
    # expert_gating_func with exp_probs_b choosing, chosen weights normalised; NEOX rope.
    "minimax-m2": Family("minimax-m2", rope_style="neox", activation="silu",
                         qk_norm=True, qk_norm_span="projection",
                         moe=MoeRules(norm_weights=True, gating=None),
                         synth=(MOE, "MINIMAX_M2_TABLE"),
                         cases=(SynthCase("minimax-m2", "MiniMax-M2", 4, 7,
                                          bench=(("ff", 512),)),)),
    # llama.cpp (models/qwen3next.cpp): DeltaNet or gated attention by layer
    # (ModelConfig.deltanet_layers); the pre-FFN norm is post_attention_norm; NEOX rope
    # (llama_model_rope_type), partial where rope.dimension_count < key_length. MoE:
    # softmax routing, chosen weights normalised, no scale key read; the shared expert is
    # gated by sigmoid(h . ffn_gate_inp_shexp) (stages/moe.py).
    "qwen3next": Family("qwen3next", rope_style="neox", activation="silu", qk_norm=True,
                        attn_output_gate=True, cache_policy="KvRecurrent",
                        recurrent_mixer="gated_deltanet",
                        ffn_norm="post_attention_norm.weight",
                        moe=MoeRules(norm_weights=True, gating="softmax"),
                        synth=(HYBRID, "QWEN3NEXT_TABLE"),
                        cases=(SynthCase("qwen3next", "Qwen3Next", 6, 5, bench=(("ff", 512),)),)),
    # llama.cpp (models/gemma2.cpp): every even layer slides (pattern 2, window 4096 unless
    # the GGUF says), and sliding layers keep the global rope scale; Q is scaled by
    # 1/sqrt(head_dim) but for the 27B (46 layers): 1/sqrt(hidden / heads); caps 50 and 30.
    "gemma2": Family("gemma2", rope_style="neox", activation="gelu_tanh", post_norms=True,
                     embed_scale=True, swa_pattern=2, sliding_window_default=4096,
                     swa_rope_scale=True, swa_rope_base_key=True, attn_softcap=50.0,
                     final_softcap=30.0,
                     query_scale=lambda c: 1.0 / math.sqrt(
                         c.hidden // c.n_heads if c.n_layers == 46 else c.head_dim),
                     synth=(DENSE, "GEMMA2_TABLE"), cases=(SynthCase("gemma2", "Gemma2", 4, 7),)),
    # llama.cpp (models/olmo.cpp): weightless LayerNorms (LLM_NORM) before attention, FFN
    # and head; Q, K and V clamped when attention.clamp_kqv is set.
    "olmo": Family("olmo", rope_style="norm", activation="silu", norm="layer",
                   output_norm=None, clamp_kqv=True, synth=(DENSE, "OLMO_TABLE"),
                   cases=(SynthCase("olmo", "OLMo", 4, 7),)),
    # llama.cpp (models/olmo2.cpp): no pre-norms; RMSNorm of the whole Q and K projections,
    # then of the attention and FFN outputs. A windowed file (OLMo 3) slides 3 of 4 layers,
    # rotated at the global base (the graph reads no rope.freq_base_swa) and scale 1.
    "olmo2": Family("olmo2", rope_style="neox", activation="silu", qk_norm=True,
                    qk_norm_span="projection", post_norms=True, pre_norms=False,
                    swa_pattern=4, synth=(DENSE, "OLMO2_TABLE"),
                    cases=(SynthCase("olmo2", "OLMo2", 4, 7),)),
    # llama.cpp (models/glm4.cpp): four norms per layer like Gemma's, partial rope over the
    # first rope.dimension_count dims (NORM style), SwiGLU over a fused up projection.
    "glm4": Family("glm4", rope_style="norm", activation="silu", post_norms=True,
                   ffn_up_fused=True, synth=(DENSE, "GLM4_TABLE"),
                   cases=(SynthCase("glm4", "GLM4", 4, 7),)),
}


class UnsupportedFamily(UserError):
    """The GGUF's architecture has no torch implementation here."""


def family_for(architecture: str) -> Family:
    try:
        return FAMILIES[architecture]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedFamily(
            f"architecture '{architecture}' is not supported (supported: {known})") from None


def synth_archs() -> tuple[str, ...]:
    """The registered families that have a synthetic table."""
    return tuple(sorted(name for name, fam in FAMILIES.items() if fam.synth is not None))


def synth_cases() -> list[tuple[Family, SynthCase]]:
    """Every synthetic file the registry names, with its family, in registry order."""
    return [(fam, case) for fam in FAMILIES.values() for case in fam.cases]


def synth_case(name: str) -> tuple[Family, SynthCase]:
    """The registry's synthetic file `name` (a SynthCase name) and its family."""
    for fam, case in synth_cases():
        if case.name == name:
            return fam, case
    known = ", ".join(c.name for _, c in synth_cases())
    raise UnsupportedFamily(f"no synthetic file {name!r} (known: {known})")


# Families that code outside the registry names (the shipped models', the giant's).
LLAMA, GEMMA3, DEEPSEEK2 = (FAMILIES[name] for name in ("llama", "gemma3", "deepseek2"))
