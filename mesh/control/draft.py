"""A draft model as speculation's proposer: a small model of the served model's vocabulary,
whole in the driver's process, whose greedy continuation of the context is proposed for
the stages to verify (mesh/control/speculation.py says how verification keeps the text
exact: the draft decides only how many tokens a step emits, never which).

Each request holds a lane of the draft's own runtime; before proposing, the lane is cut
back to what it shares with the context (a rejected proposal's rows go) and the rest of
the context is prefilled. One lock serialises the draft's calls: it is a small model, and
requests take turns on it between their steps.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from skippy.stages.factory import make_runtime
from skippy.stages.runtime import StageError, StageSpec
from skippy.stages.runtime_kind import TORCH
from skippy.topology.errors import UserError
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model

from ..tokenizer import Tokenizer


class DraftModel:
    """The draft's runtime, shared by every request's `DraftSession`."""

    def __init__(self, path: str | Path, target: str | Path, *, n_ctx: int,
                 weight_format: str = "int4"):
        path = Path(path)
        if _vocabulary(path) != _vocabulary(target):
            raise UserError(f"draft model {path.name} has another vocabulary than "
                            f"{Path(target).name}: its proposals would be other tokens")
        f = open_model(path)
        try:
            layers = ModelConfig.from_gguf(f).n_layers
        finally:
            f.close()
        spec = StageSpec(str(path), 0, layers, 0, 1, "f32", n_ctx=n_ctx,
                         weight_format=weight_format)
        self.runtime = make_runtime(spec, TORCH)
        self.path = path
        self.lock = threading.Lock()

    def session(self) -> DraftSession:
        return DraftSession(self)


def _vocabulary(path: str | Path) -> tuple:
    """The vocabulary's size and every 97th token's bytes: a model with another
    vocabulary differs there."""
    tok = Tokenizer(path)
    return tok.vocab_size, tuple(tok.piece(i, special=True)
                                 for i in range(0, tok.vocab_size, 97))


class DraftSession:
    """One request's lane in the draft."""

    def __init__(self, draft: DraftModel):
        self.draft, self.runtime = draft, draft.runtime
        with draft.lock:
            self.lane = self.runtime.alloc_lane()
        self.held: list[int] = []  # the tokens whose rows the lane holds

    def __call__(self, context: list[int], k: int) -> list[int]:
        """The draft's greedy k tokens after `context`."""
        if k <= 0 or len(context) + k > self.runtime.spec.n_ctx:
            return []
        with self.draft.lock:
            start = self._shared(context)
            logits = self.runtime.prefill(self.lane, torch.tensor(context[start:]),
                                          start=start).logits
            out = [int(torch.argmax(logits))]
            for _ in range(k - 1):
                step, = self.runtime.decode([(self.lane, torch.tensor(out[-1]))])
                out.append(int(torch.argmax(step.logits)))
            self.held = list(context) + out[:-1]
        return out

    def _shared(self, context: list[int]) -> int:
        """Where a prefill of `context` may start: the tokens the lane holds that the
        context begins with, less one (a prefill computes at least the last row),
        where the runtime can resume there; else 0."""
        n = 0
        while n < min(len(self.held), len(context) - 1) and self.held[n] == context[n]:
            n += 1
        try:
            return self.runtime.resume_point(self.lane, n, len(context))
        except (StageError, ValueError):
            return 0

    def close(self) -> None:
        with self.draft.lock:
            self.runtime.free_lane(self.lane)
