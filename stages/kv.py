"""Per-lane state storage: attention KV (token-major, grown in chunk-sized steps) and the
fixed-size recurrent state of hybrid families' short-conv layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LaneKv:
    """A lane's memory in one stage.

    K and V for each attention layer: [capacity, kv_heads, head_dim] per layer. Token-major
    storage makes `keys(i, lo, hi)` a contiguous slice whose layout does not depend on the
    capacity, so attention over it computes the same bits however large the buffer has grown.

    conv: for each short-conv layer, the last l_cache - 1 conv inputs ([l_cache - 1, width])
    at the lane's current length. Unlike KV rows it cannot be cut back to a shorter prefix,
    so it is replaced (never written in place) on every update: a reference taken at a
    chunk boundary stays that boundary's state.
    """

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int | Sequence[int],
                 v_head_dim: int | Sequence[int], step: int, max_tokens: int,
                 conv_shapes: tuple[tuple[int, int], ...] = ()):
        # head sizes: one for every layer, or one per layer (Gemma 4's sliding-window and
        # global layers differ)
        def per_layer(d):
            return list(d) if isinstance(d, Sequence) else [d] * n_layers

        self.shapes_k = [(kv_heads, d) for d in per_layer(head_dim)]
        self.shapes_v = [(kv_heads, d) for d in per_layer(v_head_dim)]
        self.step, self.max_tokens = step, max_tokens
        self.k = [torch.zeros(0, *shape) for shape in self.shapes_k]
        self.v = [torch.zeros(0, *shape) for shape in self.shapes_v]
        self.conv_shapes = tuple(conv_shapes)
        self.conv = self.empty_conv()
        self._capacity = 0
        self._pointers: tuple | None = None  # (k list, v list, their addresses)

    @property
    def capacity(self) -> int:
        return self._capacity

    def ensure(self, n_tokens: int) -> None:
        if n_tokens <= self.capacity:
            return
        new_cap = max(n_tokens, min(2 * self.capacity, self.max_tokens))
        new_cap = -(-new_cap // self.step) * self.step
        old = self.capacity
        for i in range(len(self.k)):
            k = torch.zeros(new_cap, *self.shapes_k[i])
            v = torch.zeros(new_cap, *self.shapes_v[i])
            k[:old] = self.k[i]
            v[:old] = self.v[i]
            self.k[i], self.v[i] = k, v
        self._capacity = new_cap
        self._pointers = None

    def pointers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each layer's K and V addresses (our kernels read the caches there), the same
        tuple until the buffers grow or are replaced: a decode step builds no new list."""
        got = self._pointers
        if got is None or got[0] is not self.k or got[1] is not self.v:
            got = self._pointers = (self.k, self.v, (
                tuple(t.data_ptr() for t in self.k), tuple(t.data_ptr() for t in self.v)))
        return got[2]

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][pos: pos + k.shape[0]] = k
        self.v[layer][pos: pos + v.shape[0]] = v

    def keys(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        return self.k[layer][lo:hi]

    def values(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        return self.v[layer][lo:hi]

    def empty_conv(self) -> list[torch.Tensor]:
        """The conv state of an empty prefix: nothing came before position 0."""
        return [torch.zeros(shape) for shape in self.conv_shapes]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.conv)
