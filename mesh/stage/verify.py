"""Speculation at the last stage: which of a verify step's proposed tokens stand, and the
proposals its own proposer (a file's NextN layer, stages/nextn.py) sends with an answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from skippy.proto import stage_pb2 as pb
from skippy.stages.stage_spec import Exactness


def plan_reply(runtime, start: int, below: pb.PlanReply | None) -> pb.PlanReply:
    """A stage's plan: its `start`, and what speculation may do with the stages from here
    down (`below`: the next stage's plan; None at the last stage): verify proposals where
    every one keeps the row-invariant contract; take the last stage's own proposals."""
    invariant = runtime.exactness is Exactness.ROW_INVARIANT
    if below is None:
        return pb.PlanReply(start=start, verify=invariant,
                            propose=getattr(runtime, "nextn", None) is not None)
    return pb.PlanReply(start=start, verify=invariant and below.verify, propose=below.propose)


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


def step_answer(sample: Callable[[torch.Tensor], pb.Token], out, d: pb.Decode, speculated,
                nextn, lane: int, length: int) -> pb.Token:
    """The last stage's answer to a decode step `d` (its lane now `length` tokens long):
    its token, or a verify step's tokens (`speculated(proposed, accepted)` counts them),
    and where the request runs the stage's proposer, its proposals for the next step."""
    if not d.proposed:
        answer = sample(out.logits)
    else:
        answer = verified(sample, out.logits, d.proposed)
        speculated(len(d.proposed), len(answer.more))
    if nextn is not None and d.propose:  # the proposer takes the step's accepted rows
        # (a step that asks for none, under load or while proposals are held back, costs
        # it nothing: its rows are left out)
        emitted = [answer.id, *(t.id for t in answer.more)]
        nextn.step(lane, length - 1 - len(d.proposed), d.token, emitted,
                   out.trunk[:len(emitted)])
        answer.proposals.extend(nextn.propose(lane, d.propose))
    return answer


def propose_after_prefill(nextn, lane: int, tokens: Sequence[int], start: int, out,
                          answer: pb.Token, k: int) -> None:
    """The proposer takes the prompt rows a prefill computed, and `k` proposals
    (Sampling.propose) go with the answer's token."""
    nextn.extend(lane, [*tokens, answer.id], start, out.trunk)
    answer.proposals.extend(nextn.propose(lane, k))
