"""A greedy request at one stage server, call by call, as the driver makes it."""

from __future__ import annotations

import torch

from skippy.mesh.stage.server import StageServer
from skippy.proto import stage_pb2 as pb


def run(server: StageServer, tokens: list[int], peers=(), namespace="", n=3):
    """A greedy request at one stage: (cached prompt tokens, tokens, logits rows)."""
    session = server.open_session()
    try:
        plan = session.handle(pb.StageCall(plan=pb.Plan(
            tokens=tokens, limit=len(tokens) - 1, peers=peers, namespace=namespace)))
        sampling = pb.Sampling(temperature=0, logits=True)
        reply = session.handle(pb.StageCall(prefill=pb.Prefill(
            tokens=tokens, start=plan.plan.start, sampling=sampling, namespace=namespace)))
        cached, ids, rows = reply.token.cached_tokens, [], []
        for _ in range(n):
            ids.append(reply.token.id)
            rows.append(torch.frombuffer(bytearray(reply.token.logits), dtype=torch.float32))
            reply = session.handle(pb.StageCall(decode=pb.Decode(token=reply.token.id)))
        return cached, ids, rows
    finally:
        session.close()
