"""What the gateway asks of whatever runs the stages: one contract, two engines.

The in-process engine (mesh/control/local.py) links stage objects in this process; the
Ray engine (mesh/control/ray_engine.py) links stage actors over gRPC. Both run one
request driver (mesh/control/driver.py). The gateway sees only `Engine`: token ids in,
token ids out, one `Step` at a time. What it raises is ours (topology/errors.py):
RequestError (the request's fault), OverCapacity (no lane now), StageUnavailable (a stage
failed for good); anything else is a bug.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from skippy.topology.errors import RequestError
from skippy.topology.planner import DEFAULT_LANES

from ..sampler import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GenerationRequest:
    tokens: tuple[int, ...]          # the whole prompt, BOS included
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()   # end-of-generation ids: end it, not yielded
    namespace: str = ""              # per-tenant cache separation (`cache_salt`)
    probe: bool = False              # warm-up / health: bypasses every cache, fails on a fault
    logits: bool = False             # return each step's raw logits row (tests, evals)
    admitted: bool = False           # its lane is already reserved (Engine.reserve)
    pipeline: int | None = None      # run on this pipeline, wherever its prefix is (evals)
    # decode steps carry proposed tokens to verify (the same tokens either way); None:
    # the engine's default
    speculate: bool | None = None
    siblings: int = 1                # choices of one HTTP request, run together (`n`)


@dataclass(frozen=True)
class Step:
    token: int
    cached_tokens: int = 0           # prompt tokens served from caches (first step only)
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    logits: object = None            # a float32 tensor, when the request asked for them


@dataclass
class EngineInfo:
    model: str                       # the served model's name (`/v1/models`)
    path: str                        # its GGUF
    n_ctx: int                       # context a request may fill: prompt + max_tokens
    n_stages: int
    topology_digest: str             # stable identity of the split (planner)
    lanes: int = DEFAULT_LANES       # lane budget of one pipeline: the most choices (`n`)
                                     # one request may ask for
    extra: dict = field(default_factory=dict)


def check_fits(request: GenerationRequest, n_ctx: int) -> None:
    """RequestError (one line) unless the prompt is non-empty and fits with max_tokens."""
    if not request.tokens:
        raise RequestError("the prompt has no tokens", "prompt")
    if len(request.tokens) + request.max_tokens > n_ctx:
        raise RequestError(f"prompt ({len(request.tokens)} tokens) + max_tokens "
                           f"({request.max_tokens}) exceed the context of {n_ctx}",
                           "max_tokens", "context_length_exceeded")


class Engine(Protocol):
    info: EngineInfo

    def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        """The continuation, a token at a time; a stop id ends it without a Step.
        Cancelling the iteration (client gone) frees the request's lanes."""

    async def embed(self, tokens: tuple[int, ...], pooling: str = "mean",
                    namespace: str = "") -> torch.Tensor:
        """The final hidden state of `tokens` after the output norm, pooled (mean or
        last): the /v1/embeddings vector, before any normalization."""

    async def reserve(self, lanes: int) -> Callable[[], None]:
        """Reserve `lanes` lanes at once for a request's choices (each then sent with
        admitted=True), waiting in line a bounded time; OverCapacity if they do not come
        free. Returns what releases them (once)."""

    def stats(self) -> dict:
        """Figures for /metrics and the status page: {"stages": [{...}, ...], "nodes":
        {node: {...}}, "plan": {"nodes": [...], "stages": [...]}, ...}."""

    def status(self) -> dict:
        """{"serving": bool, "detail": str}: False while no pipeline can serve (a stage
        down and not yet back): /ready is then 503 and /health says degraded."""

    async def close(self) -> None: ...
