"""Our types <-> their protobuf messages on the data plane: activation frames
(stages.frame.Frame <-> skippy.v1.Frame), sampling settings (SamplingParams <-> Sampling)
and sampled tokens with their log-probabilities (Token).

Bytes are little-endian and row-major, as the schema says. Decoding does not copy: the
returned rows are a read-only view of the message's bytes (the receiving stage's
from_wire makes its float32 copy for f16 and q8; nothing in a stage writes to its input
rows). Encoding copies once, into the message's bytes.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from skippy.proto import stage_pb2
from skippy.stages.frame import Frame, is_unit_scale, unit_scale

from .constraint import Constraint
from .sampler import SamplingParams, TokenLogprobs

# wire dtype -> (proto enum, numpy dtype on the wire)
_CODECS = {
    "f32": (stage_pb2.Frame.F32, np.dtype("<f4")),
    "f16": (stage_pb2.Frame.F16, np.dtype("<f2")),
    "q8": (stage_pb2.Frame.Q8, np.dtype("i1")),
}
_BY_ENUM = {enum: (name, dtype) for name, (enum, dtype) in _CODECS.items()}
_SCALE = np.dtype("<f4")
# torch dtypes whose bytes in memory are the wire's (a little-endian host's)
_AS_WIRE = {torch.float32: np.dtype("<f4"), torch.float16: np.dtype("<f2"),
            torch.int8: np.dtype("i1")} if sys.byteorder == "little" else {}


class MalformedFrame(Exception):
    """A frame message whose sizes disagree with its header: a peer's bug, so ours (the
    stage logs it under an error id), never the request's fault."""


def _wire_bytes(t: torch.Tensor, dtype: np.dtype) -> bytes:
    if _AS_WIRE.get(t.dtype) == dtype and t.device.type == "cpu" and t.is_contiguous():
        # the bytes as they are, one call (a decode row's send runs with cold caches)
        return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
    return t.detach().cpu().contiguous().numpy().astype(dtype, copy=False).tobytes()


_FROM_WIRE = {dtype: t for t, dtype in _AS_WIRE.items()}
_warned = False  # torch's read-only warning comes once a process: filtered that once


def _view(buf: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    global _warned
    as_torch = _FROM_WIRE.get(dtype)
    if as_torch is None:  # big-endian host: one conversion copy
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("=")))
    if not buf:  # torch takes no empty buffer
        return torch.empty(shape, dtype=as_torch)
    if _warned:  # a decode row's hop: no warning filters set up and torn down each time
        return torch.frombuffer(buf, dtype=as_torch).view(shape)
    with warnings.catch_warnings():
        # torch warns that a tensor over immutable bytes is not writable: the read-only
        # view is the point of decoding without a copy.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        out = torch.frombuffer(buf, dtype=as_torch).view(shape)
    _warned = True
    return out


def frame_to_proto(frame: Frame, into: stage_pb2.Frame | None = None) -> stage_pb2.Frame:
    """The message for `frame` (written into `into`, a message's field, where given: no
    copy of the bytes); f16 frames whose scales are all 1 send no scales."""
    name = frame.wire_dtype
    enum, dtype = _CODECS[name]
    if frame.rows.ndim != 2:
        raise ValueError(f"frame rows must be [n, width], not {tuple(frame.rows.shape)}")
    n, width = frame.rows.shape
    msg = stage_pb2.Frame() if into is None else into
    msg.dtype, msg.start, msg.rows, msg.width = enum, frame.start, n, width
    msg.data = _wire_bytes(frame.rows, dtype)
    unit = is_unit_scale(frame.scale) or (
        name == "f16" and frame.scale is not None and bool((frame.scale == 1).all()))
    if frame.scale is not None and not unit:
        msg.scales = _wire_bytes(frame.scale.to(torch.float32), _SCALE)
    return msg


def frame_from_proto(msg: stage_pb2.Frame) -> Frame:
    """The frame in `msg`, its rows and scales viewing the message's bytes (read-only)."""
    if msg.dtype not in _BY_ENUM:
        raise MalformedFrame(f"unknown frame dtype {msg.dtype}")
    name, dtype = _BY_ENUM[msg.dtype]
    n, width = msg.rows, msg.width
    if len(msg.data) != n * width * dtype.itemsize:
        raise MalformedFrame(f"{name} frame of {n} x {width} carries {len(msg.data)} bytes")
    rows = _view(msg.data, dtype, (n, width))
    if name == "f32":
        if msg.scales:
            raise MalformedFrame("an f32 frame carries no scales")
        return Frame(msg.start, rows)
    if not msg.scales and name == "f16":
        return Frame(msg.start, rows, unit_scale(n))
    if len(msg.scales) != n * _SCALE.itemsize:
        raise MalformedFrame(f"{name} frame of {n} rows carries {len(msg.scales)} scale bytes")
    return Frame(msg.start, rows, _view(msg.scales, _SCALE, (n,)))


def decode_onward(d: stage_pb2.Decode, frame: Frame, step: int, rows: int,
                  traceparent: str = "") -> stage_pb2.StageCall:
    """The decode call a stage passes to the next: `d` with this stage's `frame` of it,
    and the step that ran it (its number here and its `rows`: the next stage runs it
    with the rest of that step's rows)."""
    call = stage_pb2.StageCall(traceparent=traceparent)
    sent = call.decode  # built in place: nothing copied into the call after
    sent.token, sent.replay, sent.reply_to, sent.propose = d.token, d.replay, d.reply_to, \
        d.propose
    sent.step, sent.cohort = step, rows
    sent.proposed.extend(d.proposed)
    if d.HasField("length"):
        sent.length = d.length
    frame_to_proto(frame, sent.frame)
    return call


def sampling_to_proto(s: SamplingParams, generated: Sequence[int] = ()) -> stage_pb2.Sampling:
    """The settings the last stage samples with; `generated`: the tokens a rebuilt
    request already produced (its penalties count them)."""
    msg = stage_pb2.Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                             presence_penalty=s.presence_penalty,
                             frequency_penalty=s.frequency_penalty,
                             logit_bias=dict(s.logit_bias), generated=list(generated))
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.constraint is not None:
        msg.constraint.kind, msg.constraint.text = s.constraint.kind, s.constraint.text
    return msg


def sampling_from_proto(msg: stage_pb2.Sampling) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0,
                          top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None,
                          presence_penalty=msg.presence_penalty,
                          frequency_penalty=msg.frequency_penalty,
                          logit_bias=tuple(sorted(msg.logit_bias.items())),
                          logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                          constraint=Constraint(msg.constraint.kind, msg.constraint.text)
                          if msg.HasField("constraint") else None)


def token_to_proto(token: int, logprobs: TokenLogprobs | None,
                   cached_tokens: int = 0) -> stage_pb2.Token:
    msg = stage_pb2.Token(id=token, cached_tokens=cached_tokens)
    if logprobs is not None:
        msg.logprob = logprobs.logprob
        msg.top.extend(stage_pb2.Alternative(id=i, logprob=lp) for i, lp in logprobs.top)
    return msg


def token_logprobs(msg: stage_pb2.Token) -> TokenLogprobs | None:
    if not msg.HasField("logprob"):
        return None
    return TokenLogprobs(msg.logprob, tuple((a.id, a.logprob) for a in msg.top))
