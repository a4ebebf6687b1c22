"""Calls at one stage, as the driver makes them: a greedy request at a stage server, a
Session stream over gRPC, and the stage's figures once its sessions have ended."""

from __future__ import annotations

import queue
import time

import torch

from skippy.mesh.stage.server import StageServer
from skippy.proto import stage_pb2 as pb
from skippy.proto import stage_pb2_grpc


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


def session_stream(channel, calls: queue.Queue, metadata, timeout: float | None = None):
    """The replies of a Session stream at the stage behind `channel`, fed the calls put in
    `calls` (None ends the stream), each carrying `metadata` (the cluster's token)."""
    return stage_pb2_grpc.StageStub(channel).Session(iter(calls.get, None), metadata=metadata,
                                                     timeout=timeout)


def settled(server: StageServer, within_s: float = 10.0) -> dict:
    """The stage's figures once every session has ended (a server ends a stream on its
    own time, after the caller's last call), or after `within_s`."""
    deadline = time.monotonic() + within_s
    while server.stats()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.stats()
