"""Model hyper-parameters inferred from GGUF metadata and the tensor index."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .families import Family, family_for
from .gguf_file import GGUFFile


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: Family
    n_layers: int
    hidden: int
    ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_dim: int
    rope_base: float
    rope_scale: float          # linear position scale (1.0 = none)
    rms_eps: float             # the norms' eps (LayerNorm families: layer_norm_epsilon)
    vocab: int
    context_length: int
    sliding_window: int        # 0 = no sliding-window layers
    tied_head: bool            # no output.weight: the head is token_embd
    # Hybrid families: layers whose token mixer is a short causal convolution (LFM2), and
    # the convolution's length (its recurrent state holds conv_l_cache - 1 rows).
    conv_layers: frozenset[int] = frozenset()
    conv_l_cache: int = 0
    # Falcon-H1: layers that run a Mamba2 SSM beside attention, and its sizes (llama.cpp's
    # ssm.conv_kernel, ssm.inner_size, ssm.state_size, ssm.time_step_rank = SSM heads,
    # ssm.group_count).
    ssm_layers: frozenset[int] = frozenset()
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_heads: int = 0
    ssm_groups: int = 0
    # Soft caps of attention scores and of the head's logits (0: none; Gemma 2), the clamp
    # of Q, K and V (0: none; OLMo), and the sliding layers' own rope base when the GGUF
    # gives one (rope.freq_base_swa).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    clamp_kqv: float = 0.0
    rope_base_swa: float | None = None

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
        arch = f.architecture
        family = family_for(arch)
        hidden = int(f.arch_key("embedding_length"))
        n_heads = int(f.arch_key("attention.head_count"))
        n_layers = int(f.arch_key("block_count"))
        n_kv = f.arch_key("attention.head_count_kv", n_heads)
        conv_layers: frozenset[int] = frozenset()
        conv_l_cache = 0
        if isinstance(n_kv, list):
            if len(n_kv) != n_layers:
                raise ValueError(f"{arch}: {len(n_kv)} per-layer KV head counts for "
                                 f"{n_layers} layers")
            if family.recurrent_mixer == "shortconv":
                # llama.cpp (LFM2): a layer with no KV heads is a short-conv layer.
                conv_layers = frozenset(i for i, n in enumerate(n_kv) if n == 0)
                conv_l_cache = int(f.arch_key("shortconv.l_cache", 0))
                if conv_layers and conv_l_cache < 2:
                    raise ValueError(f"{arch}: shortconv.l_cache must be at least 2, "
                                     f"not {conv_l_cache}")
            # the attention layers' counts: all equal for the families we run
            counts = sorted({n for i, n in enumerate(n_kv) if i not in conv_layers})
            if len(counts) > 1:
                raise ValueError(f"{arch}: per-layer KV head counts differ: {counts}")
            n_kv = counts[0] if counts else n_heads
        ssm: dict[str, object] = {}
        if family.recurrent_mixer == "mamba2_parallel":
            def need(key: str) -> int:
                value = f.arch_key(key)
                if value is None:
                    raise ValueError(f"{arch}: missing {arch}.{key}")
                return int(value)

            ssm = {
                "ssm_layers": frozenset(range(n_layers)),
                "ssm_d_conv": need("ssm.conv_kernel"),
                "ssm_d_inner": need("ssm.inner_size"),
                "ssm_d_state": need("ssm.state_size"),
                "ssm_heads": need("ssm.time_step_rank"),
                "ssm_groups": int(f.arch_key("ssm.group_count", 1) or 1),
            }
            if ssm["ssm_d_conv"] < 2:
                raise ValueError(f"{arch}: ssm.conv_kernel must be at least 2")
        sliding_window = int(f.arch_key("attention.sliding_window",
                                        family.sliding_window_default) or 0)
        if family.recurrent_mixer and sliding_window:
            # newer llama.cpp makes every attention layer of a windowed LFM2 sliding-window
            raise ValueError(f"{arch}: sliding-window attention is not supported for this family")
        head_dim = int(f.arch_key("attention.key_length", hidden // n_heads))
        scaling = f.arch_key("rope.scaling.type", "none")
        factor = float(f.arch_key("rope.scaling.factor", 1.0) or 1.0)
        embd = f.tensors["token_embd.weight"]
        return cls(
            architecture=arch,
            family=family,
            n_layers=n_layers,
            hidden=hidden,
            ff=int(f.arch_key("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            v_head_dim=int(f.arch_key("attention.value_length", head_dim)),
            rope_dim=int(f.arch_key("rope.dimension_count", head_dim)),
            rope_base=float(f.arch_key("rope.freq_base", 10000.0)),
            rope_scale=1.0 / factor if scaling == "linear" else 1.0,
            rms_eps=_norm_eps(f, family),
            vocab=int(embd.shape[1]),
            context_length=int(f.arch_key("context_length", 4096)),
            sliding_window=sliding_window,
            tied_head="output.weight" not in f.tensors,
            conv_layers=conv_layers,
            conv_l_cache=conv_l_cache,
            **ssm,
            **_family_options(f, family),
        )

    def is_conv_layer(self, layer: int) -> bool:
        return layer in self.conv_layers

    @property
    def is_recurrent(self) -> bool:
        """Some layer keeps recurrent state: a lane's state cannot be cut shorter."""
        return bool(self.conv_layers or self.ssm_layers)

    def is_ssm_layer(self, layer: int) -> bool:
        return layer in self.ssm_layers

    def is_swa_layer(self, layer: int) -> bool:
        return self.family.is_swa_layer(layer, self.sliding_window)

    def rope_base_for(self, layer: int) -> float:
        if self.is_swa_layer(layer):
            # a constant llama.cpp hard-codes for the family wins over the file's key
            for base in (self.family.rope_base_swa, self.rope_base_swa):
                if base is not None:
                    return base
        return self.rope_base

    def rope_scale_for(self, layer: int) -> float:
        # llama.cpp scales only the global layers (local layers keep scale 1), but Gemma 2's
        if self.is_swa_layer(layer) and not self.family.swa_rope_scale:
            return 1.0
        return self.rope_scale

    def attention_scale(self) -> float:
        """The factor Q.K is scaled by before the softmax."""
        if self.family.query_scale is not None:
            return self.family.query_scale(self)
        return 1.0 / math.sqrt(self.head_dim)


def _norm_eps(f: GGUFFile, family: Family) -> float:
    if family.norm == "layer":  # LayerNorm families name their eps apart (llama.cpp)
        return float(f.arch_key("attention.layer_norm_epsilon", 1e-5))
    return float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6))


def _family_options(f: GGUFFile, family: Family) -> dict[str, float | None]:
    """The family's optional caps and clamp as the GGUF sets them (llama.cpp's defaults
    where the family caps and the key is absent), and its sliding layers' rope base."""
    out: dict[str, float | None] = {}
    if family.attn_softcap:
        out["attn_softcap"] = float(f.arch_key("attn_logit_softcapping", family.attn_softcap))
    if family.final_softcap:
        out["final_softcap"] = float(f.arch_key("final_logit_softcapping",
                                                family.final_softcap))
    if family.clamp_kqv:
        out["clamp_kqv"] = float(f.arch_key("attention.clamp_kqv", 0.0) or 0.0)
    base = f.arch_key("rope.freq_base_swa")
    if base is not None and family.swa_rope_base_key:
        out["rope_base_swa"] = float(base)
    return out
