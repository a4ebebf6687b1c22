"""Model hyper-parameters inferred from GGUF metadata and the tensor index."""

from __future__ import annotations

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
    rms_eps: float
    vocab: int
    context_length: int
    sliding_window: int        # 0 = no sliding-window layers
    tied_head: bool            # no output.weight: the head is token_embd

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
        arch = f.architecture
        family = family_for(arch)
        hidden = int(f.arch_key("embedding_length"))
        n_heads = int(f.arch_key("attention.head_count"))
        n_kv = f.arch_key("attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):  # per-layer counts: all equal for the dense families
            if len(set(n_kv)) != 1:
                raise ValueError(f"{arch}: per-layer KV head counts differ: {sorted(set(n_kv))}")
            n_kv = n_kv[0]
        head_dim = int(f.arch_key("attention.key_length", hidden // n_heads))
        scaling = f.arch_key("rope.scaling.type", "none")
        factor = float(f.arch_key("rope.scaling.factor", 1.0) or 1.0)
        embd = f.tensors["token_embd.weight"]
        return cls(
            architecture=arch,
            family=family,
            n_layers=int(f.arch_key("block_count")),
            hidden=hidden,
            ff=int(f.arch_key("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            v_head_dim=int(f.arch_key("attention.value_length", head_dim)),
            rope_dim=int(f.arch_key("rope.dimension_count", head_dim)),
            rope_base=float(f.arch_key("rope.freq_base", 10000.0)),
            rope_scale=1.0 / factor if scaling == "linear" else 1.0,
            rms_eps=float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            vocab=int(embd.shape[1]),
            context_length=int(f.arch_key("context_length", 4096)),
            sliding_window=int(f.arch_key("attention.sliding_window", 0) or 0),
            tied_head="output.weight" not in f.tensors,
        )

    def is_swa_layer(self, layer: int) -> bool:
        return self.family.is_swa_layer(layer, self.sliding_window)

    def rope_base_for(self, layer: int) -> float:
        if self.is_swa_layer(layer) and self.family.rope_base_swa is not None:
            return self.family.rope_base_swa
        return self.rope_base

    def rope_scale_for(self, layer: int) -> float:
        # llama.cpp scales only the global layers; local layers keep scale 1.
        return 1.0 if self.is_swa_layer(layer) else self.rope_scale
