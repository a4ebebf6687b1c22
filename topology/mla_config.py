"""DeepSeek2's multi-head latent attention (MLA): its sizes and rope settings, read from
the GGUF keys llama.cpp reads (models/deepseek2.cpp, llama-model.cpp, llama-context.cpp).

DeepSeek-V2, DeepSeek-V3 / R1 and GLM-4.7-Flash GGUFs all use the `deepseek2`
architecture. Each token leaves one latent row per layer: the normed compressed KV
(kv_lora_rank) and the shared rotated key part (rope.dimension_count). That row is all
a lane keeps (stages/mla.py); per-head keys and values are never expanded.

The scalars that decide rope and the attention scale are computed here in float32, in
llama.cpp's order, so both sides rotate and scale by the same floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_file import GGUFFile, ModelConfigError

_F = np.float32
# llama.cpp's YaRN defaults (llama_hparams; llama-cpp-python passes the same); deepseek2
# reads no keys for them.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


@dataclass(frozen=True)
class RopeScaling:
    """What ggml_rope_ext gets for deepseek2: YaRN when ext_factor is 1, else plain
    (linear) scaling by freq_scale. attn_factor scales cos and sin."""

    freq_base: float
    freq_scale: float
    ext_factor: float
    attn_factor: float
    n_ctx_orig: int
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW

    def corr_dims(self, n_dims: int) -> tuple[float, float]:
        """The pair range [low, high] over which YaRN ramps from extrapolation to
        interpolation (ggml_rope_yarn_corr_dims)."""
        def dim(beta: float) -> np.float32:
            ratio = _F(self.n_ctx_orig) / (_F(beta) * _F(2) * _F(np.pi))
            return _F(n_dims) * np.log(ratio) / (_F(2) * np.log(_F(self.freq_base)))
        low = max(0.0, float(np.floor(dim(self.beta_fast))))
        high = min(float(n_dims - 1), float(np.ceil(dim(self.beta_slow))))
        return low, high

    def mscale(self) -> float:
        """The factor on cos and sin (rope_yarn's mscale)."""
        m = _F(self.attn_factor)
        if self.ext_factor != 0.0:
            m = m * (_F(1) + _F(0.1) * np.log(_F(1) / _F(self.freq_scale)))
        return float(m)


@dataclass(frozen=True)
class MlaConfig:
    q_lora_rank: int    # 0: queries come from attn_q directly (the "lite" models)
    kv_lora_rank: int   # width of the compressed latent
    k_head: int         # per-head query/key width: nope + rope (key_length_mla)
    v_head: int         # per-head value width (value_length_mla)
    rope_dim: int       # rotated tail of each query head, and of the shared key part
    absorbed: bool      # attn_k_b / attn_v_b (is_mla) rather than the unsplit attn_kv_b
    kq_scale: float     # softmax scale: mscale^2 / sqrt(k_head)
    rope: RopeScaling

    @property
    def nope(self) -> int:
        return self.k_head - self.rope_dim

    @property
    def latent(self) -> int:
        """Floats a lane keeps per token and layer."""
        return self.kv_lora_rank + self.rope_dim

    def describe(self) -> str:
        r = self.rope
        return (f"mla q_lora={self.q_lora_rank} kv_lora={self.kv_lora_rank} k={self.k_head} "
                f"v={self.v_head} rope={self.rope_dim} base={r.freq_base} "
                f"scale={r.freq_scale} ext={r.ext_factor} attn={r.attn_factor} "
                f"orig={r.n_ctx_orig} kq={self.kq_scale}")


def _is_lite(f: GGUFFile, n_layers: int) -> bool:
    # llama.cpp reads no q_lora_rank for these layer counts (DeepSeek-V2-Lite and kin):
    # their queries come from attn_q.
    vocab = int(f.tensors["token_embd.weight"].shape[1])
    return n_layers in (26, 27) or (n_layers == 48 and vocab == 128256)


def read_mla(f: GGUFFile, n_layers: int, n_heads: int) -> MlaConfig:
    """The MLA sizes and rope of a deepseek2 file whose trunk has `n_layers` layers."""
    arch = f.architecture
    hidden = int(f.arch_key("embedding_length"))
    k_full = int(f.arch_key("attention.key_length", hidden // n_heads))
    v_full = int(f.arch_key("attention.value_length", hidden // n_heads))
    k_mla = int(f.arch_key("attention.key_length_mla", 0) or 0)
    v_mla = int(f.arch_key("attention.value_length_mla", 0) or 0)
    absorbed = bool(k_mla and v_mla)
    k_head, v_head = (k_mla, v_mla) if absorbed else (k_full, v_full)
    rope_dim = int(f.arch_key("rope.dimension_count", k_full))
    if k_head - rope_dim < 1:
        raise ModelConfigError(f"{arch}: key width {k_head} leaves no unrotated part "
                               f"beside rope {rope_dim}")
    if float(f.arch_key("attention.temperature_scale", 0.0) or 0.0) != 0.0:
        raise ModelConfigError(f"{arch}: attention temperature scaling is not supported")
    q_lora = 0 if _is_lite(f, n_layers) else int(f.arch_key("attention.q_lora_rank", 0) or 0)
    rope = read_rope_scaling(f)
    return MlaConfig(q_lora_rank=q_lora, kv_lora_rank=int(f.arch_key("attention.kv_lora_rank")),
                     k_head=k_head, v_head=v_head, rope_dim=rope_dim, absorbed=absorbed,
                     kq_scale=kq_scale(rope, float(_yarn_log_mul(f)), k_head), rope=rope)


def read_rope_scaling(f: GGUFFile) -> RopeScaling:
    """rope.scaling.* as llama.cpp turns them into rope parameters (llama-model.cpp's
    load_hparams, then llama_context's constructor with llama-cpp-python's defaults)."""
    kind = f.arch_key("rope.scaling.type", "linear")
    factor = _F(f.arch_key("rope.scaling.factor", 0.0) or 0.0)
    freq_scale = _F(1) if factor == 0 or kind == "none" else _F(1) / factor
    ext = 1.0 if kind == "yarn" else 0.0
    attn = _F(1)
    if ext:
        factor = _F(1) / freq_scale
        log_mul = _yarn_log_mul(f)
        if log_mul != 0:
            # deepseek2: mscale follows mscale_all_dim unless that is 1 (then 1 as well)
            attn = _yarn_mscale(factor, log_mul) / _yarn_mscale(factor, log_mul)
        else:
            attn = _yarn_mscale(factor, _F(1))
        # ggml's rope multiplies this factor back in: cancelled here
        attn = attn * (_F(1) / (_F(1) + _F(0.1) * np.log(factor)))
    attn = attn * _F(f.arch_key("rope.scaling.attn_factor", 1.0) or 1.0)
    n_ctx_orig = int(f.arch_key("rope.scaling.original_context_length", 0) or 0) \
        or int(f.arch_key("context_length", 4096))
    return RopeScaling(freq_base=float(f.arch_key("rope.freq_base", 10000.0)),
                       freq_scale=float(freq_scale), ext_factor=ext, attn_factor=float(attn),
                       n_ctx_orig=n_ctx_orig)


def _yarn_log_mul(f: GGUFFile) -> np.float32:
    # deepseek2's converter stores 0.1 * mscale_all_dim; llama.cpp divides the 0.1 out
    return _F(f.arch_key("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / _F(0.1)


def _yarn_mscale(scale: np.float32, m: np.float32) -> np.float32:
    return _F(1) if scale <= 1 else _F(0.1) * _F(m) * np.log(scale) + _F(1)


def kq_scale(rope: RopeScaling, log_mul: float, k_head: int) -> float:
    """deepseek2's softmax scale: the original attention factor and the YaRN log
    multiplier folded into mscale, squared, over sqrt(k_head)."""
    inv = np.log(_F(1) / _F(rope.freq_scale))
    attn_org = _F(rope.attn_factor) * (_F(1) + _F(0.1) * inv)
    mscale = attn_org * (_F(1) + _F(0.1) * _F(log_mul) * inv)
    return float(_F(1) * mscale * mscale / np.sqrt(_F(k_head)))
