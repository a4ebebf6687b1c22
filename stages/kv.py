"""Per-lane attention KV storage, token-major and grown in chunk-sized steps."""

from __future__ import annotations

import torch


class LaneKv:
    """K and V for each layer of a stage: [capacity, kv_heads, head_dim] per layer.

    Token-major storage makes `keys(i, lo, hi)` a contiguous slice whose layout does not
    depend on the capacity, so attention over it computes the same bits however large
    the buffer has grown.
    """

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, v_head_dim: int,
                 step: int, max_tokens: int):
        self.shape_k = (kv_heads, head_dim)
        self.shape_v = (kv_heads, v_head_dim)
        self.step, self.max_tokens = step, max_tokens
        self.k = [torch.zeros(0, *self.shape_k) for _ in range(n_layers)]
        self.v = [torch.zeros(0, *self.shape_v) for _ in range(n_layers)]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def ensure(self, n_tokens: int) -> None:
        if n_tokens <= self.capacity:
            return
        new_cap = max(n_tokens, min(2 * self.capacity, self.max_tokens))
        new_cap = -(-new_cap // self.step) * self.step
        old = self.capacity
        for i in range(len(self.k)):
            k = torch.zeros(new_cap, *self.shape_k)
            v = torch.zeros(new_cap, *self.shape_v)
            k[:old] = self.k[i]
            v[:old] = self.v[i]
            self.k[i], self.v[i] = k, v

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][pos: pos + k.shape[0]] = k
        self.v[layer][pos: pos + v.shape[0]] = v

    def keys(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        return self.k[layer][lo:hi]

    def values(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        return self.v[layer][lo:hi]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
