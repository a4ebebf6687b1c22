"""The last stage's answer to a verify step (speculative decoding): which of the proposed
tokens stand."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from skippy.proto import stage_pb2 as pb


def verified(sample: Callable[[torch.Tensor], pb.Token], logits: torch.Tensor,
             proposed: Sequence[int]) -> pb.Token:
    """Each row sampled in order exactly as a decode step would (the same sampler, grammar
    and generator), until a draw differs from the token proposed for the next position;
    that draw is the last one. Every token emitted is the token decoding without
    proposals emits there. The first token, the rest in its `more`."""
    first = sample(logits[0])
    for i, proposal in enumerate(proposed):
        if (first.more[-1] if first.more else first).id != proposal:
            break
        first.more.append(sample(logits[i + 1]))
    return first
