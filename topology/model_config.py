"""Model hyper-parameters inferred from GGUF metadata and the tensor index."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .families import Family, family_for
from .gguf_file import GGUFFile, ModelConfigError
from .mla_config import MlaConfig, read_mla


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
    # DeepSeek2: multi-head latent attention sizes and rope (topology/mla_config.py)
    mla: MlaConfig | None = None
    # Gemma 4 (read from its GGUF keys): the sliding-window layers as listed per layer
    # (None: the family's fixed pattern); sliding-window layers' head and rope sizes (0:
    # the global layers'); the last shared_kv_layers layers compute no K/V and read an
    # earlier layer's (kv_source); the per-layer embedding width.
    swa_layers: frozenset[int] | None = None
    head_dim_swa: int = 0
    rope_dim_swa: int = 0
    shared_kv_layers: int = 0
    per_layer_dim: int = 0
    # Mixture of experts (stages/moe.py; the llama.cpp keys in moe_fields): a layer with a
    # `ffn_gate_inp` router runs n_expert_used of n_expert experts per token (plus any
    # shared experts). expert_gating: "softmax", "sigmoid", "softmax_weight" or
    # "sqrt_softplus"; expert_weights_scale 0: no scale; expert_groups > 1: grouped routing.
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    n_expert_shared: int = 0
    expert_shared_ff: int = 0
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating: str = "softmax"
    expert_groups: int = 0
    expert_groups_used: int = 0
    leading_dense_layers: int = 0
    # Qwen3-Next: layers whose mixer is a gated DeltaNet instead of attention. Its sizes use
    # the ssm_* fields as llama.cpp reads them: ssm_heads = value heads (time_step_rank),
    # ssm_groups = key heads (group_count), ssm_d_state = the head size of both.
    deltanet_layers: frozenset[int] = frozenset()
    # Multi-token-prediction (NextN) layers the file appends after the trunk's (GLM-4.7-
    # Flash, DeepSeek-V3): blocks n_layers .. n_layers + nextn_layers - 1; the last stage
    # runs the first as speculation's proposer (stages/nextn.py), the trunk never.
    nextn_layers: int = 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
        arch = f.architecture
        family = family_for(arch)
        hidden = int(f.arch_key("embedding_length"))
        n_heads = int(f.arch_key("attention.head_count"))
        # block_count includes the appended multi-token-prediction layers (GLM-4.7-Flash):
        # llama.cpp's trunk, like ours, runs the others
        nextn = int(f.arch_key("nextn_predict_layers", 0) or 0)
        n_layers = int(f.arch_key("block_count")) - nextn
        n_kv = f.arch_key("attention.head_count_kv", n_heads)
        conv_layers: frozenset[int] = frozenset()
        conv_l_cache = 0
        if isinstance(n_kv, list):
            if len(n_kv) != n_layers:
                raise ModelConfigError(f"{arch}: {len(n_kv)} per-layer KV head counts for "
                                       f"{n_layers} layers")
            if family.recurrent_mixer == "shortconv":
                # llama.cpp (LFM2): a layer with no KV heads is a short-conv layer.
                conv_layers = frozenset(i for i, n in enumerate(n_kv) if n == 0)
                conv_l_cache = int(f.arch_key("shortconv.l_cache", 0))
                if conv_layers and conv_l_cache < 2:
                    raise ModelConfigError(f"{arch}: shortconv.l_cache must be at least 2, "
                                           f"not {conv_l_cache}")
            # the attention layers' counts: all equal for the families we run
            counts = sorted({n for i, n in enumerate(n_kv) if i not in conv_layers})
            if len(counts) > 1:
                raise ModelConfigError(f"{arch}: per-layer KV head counts differ: {counts}")
            n_kv = counts[0] if counts else n_heads
        ssm: dict[str, object] = {}
        if family.recurrent_mixer == "mamba2_parallel":
            def need(key: str) -> int:
                value = f.arch_key(key)
                if value is None:
                    raise ModelConfigError(f"{arch}: missing {arch}.{key}")
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
                raise ModelConfigError(f"{arch}: ssm.conv_kernel must be at least 2")
        elif family.recurrent_mixer == "gated_deltanet":
            ssm = deltanet_fields(f, n_layers)
        sliding_window = int(f.arch_key("attention.sliding_window",
                                        family.sliding_window_default) or 0)
        gemma4 = _gemma4_keys(f, n_layers) if family.per_layer_keys else {}
        if family.recurrent_mixer and sliding_window:
            # newer llama.cpp makes every attention layer of a windowed LFM2 sliding-window
            raise ModelConfigError(f"{arch}: sliding-window attention is not supported "
                                   f"for this family")
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
            mla=read_mla(f, n_layers, n_heads) if family.attention == "mla" else None,
            nextn_layers=nextn,
            **_family_options(f, family),
            **ssm,
            **gemma4,
            **moe_fields(f, family),
        )

    def nextn_tensors(self, names) -> list[str]:
        """What the last stage loads beside its layers for speculation's NextN proposer
        (stages/nextn.py), of the file's tensor `names`: its first NextN block, and the
        token embeddings where the block has none of its own. Latent-attention
        (deepseek2) files only."""
        if not self.nextn_layers or self.mla is None:
            return []
        p = f"blk.{self.n_layers}."
        out = [n for n in names if n.startswith(p)]
        if out and p + "nextn.embed_tokens.weight" not in out:
            out.append("token_embd.weight")
        return out

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def frame_width(self) -> int:
        """Values per row of a frame between stages: the hidden row, and with per-layer
        embeddings (Gemma 4) the scaled token embedding beside it, which later stages'
        layers read their per-layer inputs from."""
        return self.hidden * (2 if self.per_layer_dim else 1)

    def cut_groups(self) -> tuple[tuple[int, int], ...]:
        """Layer groups [a, b) no stage boundary may split (the family's cut rule)."""
        rule = self.family.keep_together
        return tuple((int(a), int(b)) for a, b in rule(self)) if rule else ()

    def is_conv_layer(self, layer: int) -> bool:
        return layer in self.conv_layers

    @property
    def is_recurrent(self) -> bool:
        """Some layer keeps recurrent state: a lane's state cannot be cut shorter."""
        return bool(self.conv_layers or self.ssm_layers or self.deltanet_layers)

    def is_deltanet_layer(self, layer: int) -> bool:
        return layer in self.deltanet_layers

    def is_ssm_layer(self, layer: int) -> bool:
        return layer in self.ssm_layers

    def is_swa_layer(self, layer: int) -> bool:
        if self.swa_layers is not None:
            return self.sliding_window > 0 and layer in self.swa_layers
        return self.family.is_swa_layer(layer, self.sliding_window)

    def rope_base_for(self, layer: int) -> float:
        if self.is_swa_layer(layer):
            # the file's rope.freq_base_swa (read where the family's graph reads it), else
            # the family's constant (llama.cpp's default or hard-coded value)
            for base in (self.rope_base_swa, self.family.rope_base_swa):
                if base is not None:
                    return base
        return self.rope_base

    def head_dim_for(self, layer: int) -> int:
        """K (= V) head size of `layer`: Gemma 4's sliding-window layers have their own."""
        return self.head_dim_swa if self.head_dim_swa and self.is_swa_layer(layer) \
            else self.head_dim

    def v_head_dim_for(self, layer: int) -> int:
        # Gemma 4 keeps V's head size equal to K's in both kinds of layer (llama.cpp checks)
        return self.head_dim_swa if self.head_dim_swa and self.is_swa_layer(layer) \
            else self.v_head_dim

    def rope_dim_for(self, layer: int) -> int:
        return self.rope_dim_swa if self.rope_dim_swa and self.is_swa_layer(layer) \
            else self.rope_dim

    def has_kv(self, layer: int) -> bool:
        """Whether `layer` computes and stores K and V (else it reads kv_source's)."""
        return layer < self.n_layers - self.shared_kv_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose KV `layer` attends over. llama.cpp (Gemma 3n / 4): a shared
        layer reads the last KV layer if it is global, the one before if it slides (the
        converter puts a sliding-window layer then a global one last among the KV layers)."""
        if self.has_kv(layer):
            return layer
        first_shared = self.n_layers - self.shared_kv_layers
        return first_shared - (2 if self.is_swa_layer(layer) else 1)

    def kv_values_per_token(self, layer: int) -> int:
        """K and V values one token adds to `layer`'s own cache (0: it stores none)."""
        if self.is_conv_layer(layer) or self.is_deltanet_layer(layer) or \
                not self.has_kv(layer):
            return 0
        if self.mla is not None:  # one latent row per token (stages/mla.py)
            return self.mla.latent
        return self.n_kv_heads * (self.head_dim_for(layer) + self.v_head_dim_for(layer))

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


def _gemma4_keys(f: GGUFFile, n_layers: int) -> dict[str, object]:
    """Gemma 4's per-layer pattern and sizes, from the keys llama.cpp reads for it."""
    arch = f.architecture
    pattern = f.arch_key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise ModelConfigError(f"{arch}: attention.sliding_window_pattern must list all "
                               f"{n_layers} layers")
    shared = int(f.arch_key("attention.shared_kv_layers", 0) or 0)
    if shared and not 2 <= n_layers - shared:
        raise ModelConfigError(f"{arch}: {shared} shared-KV layers leave fewer than 2 KV layers")
    return {
        "swa_layers": frozenset(i for i, s in enumerate(pattern) if s),
        "head_dim_swa": int(f.arch_key("attention.key_length_swa", 0) or 0),
        "rope_dim_swa": int(f.arch_key("rope.dimension_count_swa", 0) or 0),
        "shared_kv_layers": shared,
        "per_layer_dim": int(f.arch_key("embedding_length_per_layer_input", 0) or 0),
    }


# llama.cpp's llama_expert_gating_func_type values (0: none)
_GATINGS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}


def _one_count(f: GGUFFile, key: str) -> int:
    """A count llama.cpp reads as a key or a per-layer array: one value for every layer."""
    value = f.arch_key(key, 0)
    if isinstance(value, list):
        counts = {int(v) for v in value if int(v)}
        if len(counts) > 1:
            raise ModelConfigError(f"{f.architecture}: per-layer {key} differ: {sorted(counts)}")
        return counts.pop() if counts else 0
    return int(value or 0)


def moe_fields(f: GGUFFile, family: Family) -> dict[str, object]:
    """The mixture-of-experts fields of ModelConfig as llama.cpp reads them for `family`
    (its constants in family.moe where its graph hard-codes them); {} for a dense family."""
    rules = family.moe
    arch = f.architecture
    if rules is None:
        return {}
    n_expert = int(f.arch_key("expert_count", 0) or 0)
    if n_expert == 0 and not any(n.endswith(".ffn_gate_inp.weight") for n in f.tensors):
        return {}  # every layer dense (e.g. a deepseek2 file of leading dense layers only)
    used = _one_count(f, "expert_used_count")
    if n_expert <= 0 or not 0 < used <= n_expert:
        raise ModelConfigError(f"{arch}: expert_count {n_expert}, expert_used_count {used}")
    gating = rules.gating
    if gating is None:
        code = int(f.arch_key("expert_gating_func", 0) or 0)
        default = rules.gating_default
        if callable(default):  # the family decides by the file (deepseek2: GLM-4.7-Flash)
            default = default(f)
        gating = _GATINGS.get(code, default if code == 0 else None)
        if gating is None:
            raise ModelConfigError(f"{arch}: expert_gating_func {code} is not supported")
    norm = rules.norm_weights
    if norm is None:
        norm = bool(f.arch_key("expert_weights_norm", False))
    groups = int(f.arch_key("expert_group_count", 0) or 0)
    groups_used = int(f.arch_key("expert_group_used_count", 0) or 0)
    if groups > 1 and (n_expert % groups or not 0 < groups_used < groups):
        raise ModelConfigError(f"{arch}: {n_expert} experts in {groups} groups, {groups_used} used")
    return {
        "n_expert": n_expert,
        "n_expert_used": used,
        "expert_ff": _one_count(f, "expert_feed_forward_length"),
        "n_expert_shared": int(f.arch_key("expert_shared_count", 0) or 0),
        "expert_shared_ff": int(f.arch_key("expert_shared_feed_forward_length", 0) or 0),
        "expert_weights_scale": (float(f.arch_key("expert_weights_scale", 0.0) or 0.0)
                                 if rules.reads_scale else 0.0),
        "expert_weights_norm": norm,
        "expert_gating": gating,
        "expert_groups": groups,
        "expert_groups_used": groups_used,
        "leading_dense_layers": int(f.arch_key("leading_dense_block_count", 0) or 0),
    }


def deltanet_layer_pattern(n_layers: int, interval: int) -> frozenset[int]:
    """Qwen3-Next without an explicit list: every interval-th layer (1-based) is full
    attention, the rest are DeltaNet (llama.cpp's default interval is 4)."""
    return frozenset(i for i in range(n_layers) if (i + 1) % interval != 0)


def deltanet_fields(f: GGUFFile, n_layers: int) -> dict[str, object]:
    """Qwen3-Next's DeltaNet layers and sizes, from the keys llama.cpp reads: the layer list
    attention.recurrent_layers if present, else full_attention_interval (default 4)."""
    arch = f.architecture

    def need(key: str) -> int:
        value = f.arch_key(key)
        if value is None:
            raise ModelConfigError(f"{arch}: missing {arch}.{key}")
        return int(value)

    listed = f.arch_key("attention.recurrent_layers")
    if listed is not None:
        if len(listed) != n_layers:
            raise ModelConfigError(f"{arch}: {len(listed)} recurrent-layer flags for "
                                   f"{n_layers} layers")
        layers = frozenset(i for i, r in enumerate(listed) if r)
    else:
        interval = int(f.arch_key("full_attention_interval", 4))
        if interval < 1:
            raise ModelConfigError(f"{arch}: full_attention_interval must be at least 1")
        layers = deltanet_layer_pattern(n_layers, interval)
    out = {
        "deltanet_layers": layers,
        "ssm_d_conv": need("ssm.conv_kernel"),
        "ssm_d_inner": need("ssm.inner_size"),
        "ssm_d_state": need("ssm.state_size"),
        "ssm_heads": need("ssm.time_step_rank"),
        "ssm_groups": need("ssm.group_count"),
    }
    if out["ssm_d_conv"] < 2:
        raise ModelConfigError(f"{arch}: ssm.conv_kernel must be at least 2")
    if out["ssm_heads"] % out["ssm_groups"] or \
            out["ssm_d_inner"] != out["ssm_heads"] * out["ssm_d_state"]:
        # llama.cpp's fused DeltaNet op needs key and value heads of one size
        raise ModelConfigError(f"{arch}: value heads {out['ssm_heads']} x state "
                               f"{out['ssm_d_state']} must equal inner size "
                               f"{out['ssm_d_inner']} and be a multiple of the key heads "
                               f"{out['ssm_groups']}")
    return out
