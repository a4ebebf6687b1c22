"""OpenAI's `/v1/embeddings` over the served model: each input's final hidden rows (after
the output norm, from the last stage) pooled and L2-normalized, as llama-server gives
them for a model served with embeddings.

Input: a string, an array of strings, an array of token ids, or an array of such arrays
(at most MAX_INPUTS). `encoding_format` float or base64 (little-endian f32); `pooling`
(ours, as llama-server's): mean (the default) or last, the model's own where its GGUF
names one. Every row is computed from the start (no prefix is taken from a cache), so the
vector is the same bits whether the caches are on or off.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from skippy.topology.gguf_file import GGUFFile

from .limits import GatewayLimits
from .openai_api import bad, model_of
from .request_building import ModelView, check_model

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
POOLING = ("mean", "last")


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list[tuple[int, ...]]
    pooling: str
    base64: bool


def parse(body: Mapping, view: ModelView, limits: GatewayLimits,
          default_pooling: str = "mean") -> EmbeddingRequest:
    """The inputs as token ids, checked; ApiError (4xx) for what cannot be embedded."""
    check_model(model_of(body), view.model)
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and _ids(raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad("input must be a string, an array of strings or of token ids, or an "
                  "array of such arrays", "input")
    if len(raw) > MAX_INPUTS:
        raise bad(f"at most {MAX_INPUTS} inputs a request, not {len(raw)}", "input")
    vocab, inputs = view.tokenizer.vocab_size, []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            ids = view.tokenizer.encode(item)
        elif isinstance(item, list) and _ids(item):
            ids = list(item)
            if any(not 0 <= t < vocab for t in ids):
                raise bad(f"input[{i}]: a token id is outside the vocabulary "
                          f"(0..{vocab - 1})", "input")
        else:
            raise bad(f"input[{i}] must be a string or an array of token ids", "input")
        if not ids:
            raise bad(f"input[{i}] is empty", "input")
        if len(ids) > view.n_ctx:
            raise bad(f"input[{i}] has {len(ids)} tokens, over the context of {view.n_ctx}",
                      "input", "context_length_exceeded")
        inputs.append(tuple(ids))
    if sum(map(len, inputs)) > limits.max_request_tokens:
        raise bad(f"the inputs hold more than {limits.max_request_tokens} tokens", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad("encoding_format must be float or base64", "encoding_format")
    if body.get("dimensions") is not None:
        raise bad("dimensions is not supported: the model's vectors have their own size",
                  "dimensions")
    pooling = body.get("pooling", default_pooling)
    if pooling not in POOLING:
        raise bad(f"pooling must be one of {', '.join(POOLING)}", "pooling")
    return EmbeddingRequest(inputs, pooling, encoding == "base64")


def render(request: EmbeddingRequest, vectors: list[torch.Tensor], model: str) -> dict:
    data = []
    for i, v in enumerate(vectors):
        unit = v / v.norm().clamp_min(1e-12)
        value = base64.b64encode(unit.to(torch.float32).numpy().tobytes()).decode() \
            if request.base64 else unit.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(map(len, request.inputs))
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def model_pooling(path) -> str:
    """The pooling the model's GGUF names (`{arch}.pooling_type`: 1 mean, 3 last), else
    mean (a generative model's file names none)."""
    gguf = GGUFFile(path)
    try:
        arch = gguf.metadata.get("general.architecture")
        kind = gguf.metadata.get(f"{arch}.pooling_type")
    finally:
        gguf.close()
    return {1: "mean", 3: "last"}.get(kind, "mean")


def _ids(items: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)
