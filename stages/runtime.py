"""The StageRuntime contract: the one interface between the mesh and model code.

A runtime serves one contiguous layer range of one model. It holds lanes (sequence
slots, one per in-flight request), each with its own state, and runs:

- prefill: a lane's prompt rows from a start. Under the chunked contract (DESIGN.md §5.3)
  the start is chunk-aligned and the rows go in fixed chunks of exactly `chunk` rows (a
  short last chunk padded and masked), so a row's arithmetic never depends on where its
  request started; a row-invariant stage takes any start it holds and computes each row
  alone in calls of any size, unpadded;
- decode: one new row for each of several lanes (a chunked stage: at a fixed padded lane
  batch).

Stage 0 takes token ids; later stages take the previous stage's Frame. Non-final stages
return a Frame in the wire dtype; the final stage returns logits.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .frame import Frame
from .stage_spec import Exactness
# the contract's torch-free half, here too for every importer of the contract
from .stage_spec import DEFAULT_WEIGHT_FORMAT, StageError, StageSpec  # noqa: F401


@dataclass
class LaneState:
    """A lane's exported state for token positions [0, n_tokens).

    keys/values: per attention layer, token-major ([n_tokens, kv_heads, head_dim]) so
    prefixes share leading bytes. fixed: recurrent state (conv, SSM) at exactly n_tokens,
    by name; empty for dense families. A state with fixed parts cannot be cut shorter."""

    n_tokens: int
    prefilled: int  # leading rows computed by prefill (reusable by a later prefill)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    fixed: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = self.keys + self.values + list(self.fixed.values())
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class StageOutput:
    frame: Frame | None = None          # non-final stages
    logits: torch.Tensor | None = None  # final stage: [vocab] ("last") or [n, vocab] ("all")
    hidden: torch.Tensor | None = None  # final stage, "hidden": [n, hidden] after the norm
    trunk: torch.Tensor | None = None   # final stage: the computed rows before the norm
    # prefill(snapshots=...): the lane's state for [0, b) at each requested boundary b
    snapshots: dict[int, LaneState] = field(default_factory=dict)


class StageRuntime(abc.ABC):
    spec: StageSpec
    # Whether a dense cache entry may hold a lane of its own (copy_lane is cheap and lanes
    # are plentiful). False: entries are exported payloads in the block store instead.
    lane_entries: bool = True

    # Whether the arithmetic is the same on any number of threads: a stage may then take
    # more cores while it serves one session alone (mesh/stage/loop.py).
    thread_invariant: bool = False

    # The exactness contract this stage's kernels keep (DESIGN.md §5.3); its identity says it.
    exactness: Exactness = Exactness.CHUNKED

    # Whether the frames this stage takes must carry their rows' token ids (Frame.tokens).
    frames_need_tokens: bool = False

    @abc.abstractmethod
    def alloc_lane(self) -> int:
        """A fresh, empty lane."""

    @abc.abstractmethod
    def free_lane(self, lane: int) -> None: ...

    @abc.abstractmethod
    def lane_length(self, lane: int) -> int:
        """Tokens whose state the lane holds (prefill and decode rows)."""

    @abc.abstractmethod
    def prefill_boundary(self, lane: int) -> int:
        """The largest start a new prefill may use: the rows this lane's prefills computed
        (decode rows are never reused), a chunked stage's at the multiple of the chunk at
        or below them."""

    def resume_point(self, lane: int, common: int, n_tokens: int) -> int:
        """Where a prefill of an n_tokens prompt may start in this lane, whose rows match
        the prompt's first `common` tokens: the last chunk boundary at or below both
        `common` and prefill_boundary(lane)."""
        C = self.spec.chunk
        return min(common, self.prefill_boundary(lane)) // C * C

    @abc.abstractmethod
    def prefill(self, lane: int, inputs: torch.Tensor | Frame, start: int = 0,
                logits: str = "last", snapshots: tuple[int, ...] = (),
                between_chunks: Callable[[], None] | None = None,
                rows_per_call: int | None = None) -> StageOutput:
        """Run positions [start, start + n) for the lane; start must be <= prefill_boundary
        (lane) and, on a chunked stage, a multiple of the chunk. State beyond start is
        discarded. A row-invariant stage also takes `rows_per_call` (at most that many rows
        per call of its layers; default the chunk): the bits are the same whatever it is.
        `logits` (final stage): "last", "all" or "none". `snapshots`: boundaries b
        (chunk-aligned on a chunked stage) with start < b <= start + n whose state [0, b)
        is returned in StageOutput.snapshots (recurrent state cannot be rolled back
        afterwards, so it is captured while the prefill passes b). `between_chunks` runs
        after every chunk but the last: other lanes may decode there (a long prompt must
        not stall them)."""

    @abc.abstractmethod
    def decode(self, steps: list[tuple[int, torch.Tensor | Frame]]) -> list[StageOutput]:
        """One new position for each (lane, input); input is a token id (0-d tensor) or a
        one-row Frame. Returns one output per step, in order."""

    def rewind(self, lane: int, n_tokens: int) -> None:
        """The lane's state becomes its state at `n_tokens` (at most its length): the rows
        of proposed tokens a verify step computed and the sampler rejected are dropped.
        A runtime that cannot keeps its lanes where they are (any other length raises)."""
        if n_tokens != self.lane_length(lane):
            raise StageError(f"this runtime cannot rewind lane {lane} from "
                             f"{self.lane_length(lane)} to {n_tokens} tokens")

    @abc.abstractmethod
    def copy_lane(self, src: int, dst: int, n_tokens: int) -> None:
        """dst's state becomes src's state for positions [0, n_tokens)."""

    @abc.abstractmethod
    def export_state(self, lane: int, n_tokens: int) -> LaneState: ...

    @abc.abstractmethod
    def import_state(self, lane: int, state: LaneState) -> None:
        """The lane's state becomes `state`; a prefill may then continue from it."""

    @abc.abstractmethod
    def identity(self) -> dict[str, object]:
        """Every field that decides this stage's arithmetic (DESIGN.md §5.1), with no
        per-process values: equal across restarts and nodes for the same weights."""


def check_prefill(start: int, n: int, *, chunk: int, boundary: int, n_ctx: int,
                  logits: str, snapshots: tuple[int, ...]) -> int:
    """The contract's rules for one prefill request, for every runtime; returns its end."""
    if start % chunk or start > boundary:
        raise StageError(f"prefill start {start} must be a multiple of {chunk} and at most "
                         f"{boundary}")
    if logits not in ("last", "all", "none", "hidden"):
        raise StageError(f"logits must be last, all, none or hidden, not {logits!r}")
    if n == 0:
        raise StageError("prefill needs at least one row")
    end = start + n
    bad = [b for b in snapshots if b % chunk or not start < b <= end]
    if bad:
        raise StageError(f"snapshot boundaries {bad} must be multiples of {chunk} in "
                         f"({start}, {end}]")
    if end > n_ctx:
        raise StageError(f"{end} tokens exceed the context of {n_ctx}")
    return end
