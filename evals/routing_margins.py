"""How close each row's expert choice came to another, observed while a runtime runs, and
near-ties broken the other way on request.

Top-k routing is discontinuous: where two experts' scores nearly tie, the order in which a
sum is taken (ours or llama.cpp's, AVX2 or AVX-512) may pick either, and the row then
leaves the reference by whole units though both computations are right; so do the rows
after it, which attend to its keys and values. A comparison with llama.cpp reads these
margins from our run to tell such a row from a real disagreement, and reruns with that
one choice made the other way (evals/numerics.py, family_agreement).
"""

from __future__ import annotations

import torch

from skippy.stages.moe import MoeFfn, Routing


def moe_blocks(rt) -> list[tuple[int, MoeFfn]]:
    """(layer, block) for the runtime's routed expert blocks, in layer order (a layer's
    FFN, or the expert block beside a dense FFN, as Gemma 4's); layer: the model's."""
    blocks = []
    for i, layer in enumerate(rt.layers):
        ffn = getattr(layer, "ffn", None)
        block = ffn if isinstance(ffn, MoeFfn) else getattr(ffn, "experts", None)
        if isinstance(block, MoeFfn):
            blocks.append((rt.spec.layer_start + i, block))
    return blocks


class _Observed:
    """A block's routing that keeps each row's margin, and makes the runner-up choice
    (Routing.runner_up) at the rows in `flips`; rows count from the last reset."""

    def __init__(self, routing: Routing):
        self.routing = routing
        self.margins: list[torch.Tensor] = []
        self.flips: set[int] = set()
        self.rows = 0

    def __call__(self, logits, bias=None):
        n, first = logits.shape[0], self.rows
        self.rows += n
        self.margins.append(self.routing.margin(logits, bias))
        experts, weights = self.routing(logits, bias)
        flip = [r - first for r in sorted(self.flips) if first <= r < first + n]
        if flip:
            other = self.routing.runner_up(logits[flip], bias)
            experts, weights = experts.clone(), weights.clone()
            experts[flip], weights[flip] = other
        return experts, weights

    def __getattr__(self, name):
        return getattr(self.routing, name)


class RoutingMargins:
    """While in a `with`, observes every routed block of `rt`. From each `start` the
    blocks count the rows they route (every row of a run goes through each block once,
    in the order rows ran), and make the runner-up choice at the (block, row) pairs
    that `start` names."""

    def __init__(self, rt):
        found = moe_blocks(rt)
        self.layers = [i for i, _ in found]  # the model layer of each block
        self.blocks = [b for _, b in found]
        self._seen = [_Observed(b.routing) for b in self.blocks]

    def __enter__(self) -> "RoutingMargins":
        for block, seen in zip(self.blocks, self._seen):
            block.routing = seen
        return self

    def __exit__(self, *exc) -> None:
        for block, seen in zip(self.blocks, self._seen):
            block.routing = seen.routing

    def start(self, flips: set[tuple[int, int]] = frozenset()) -> None:
        """A new run, with these (block, row) choices made the other way."""
        for b, seen in enumerate(self._seen):
            seen.margins, seen.rows = [], 0
            seen.flips = {r for fb, r in flips if fb == b}

    def margins(self, rows: int) -> torch.Tensor:
        """[blocks, rows]: each row's margin in each block since `start` (a model without
        experts: [0, rows])."""
        if not self._seen:
            return torch.empty(0, rows)
        per_block = [torch.cat(s.margins) if s.margins else torch.empty(0)
                     for s in self._seen]
        if any(len(m) != rows for m in per_block):
            raise ValueError(f"blocks routed {[len(m) for m in per_block]} rows, "
                             f"expected {rows}")
        return torch.stack(per_block)
