"""What a stage is asked to be, without torch: its spec (model, layer range, shapes,
weight format), the weight formats a torch stage can hold, and the error a runtime
refuses a call with. The command line and the planner read these without loading torch
(a `skippy` command that only checks its arguments starts in a fraction of the time).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from skippy.topology.errors import UserError
from skippy.topology.planner import DEFAULT_N_CTX

# How a torch stage can hold its weights (stages/linear.py: what each one means)
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "int8-lean", "int4-lean")
LEAN = "-lean"


class StageError(UserError):
    """A call the runtime refuses (bad range, misaligned start, unknown lane, a format it
    lacks): a user's mistake when it is their split or format (the CLI's one line); made
    by the mesh while serving, it is a bug of ours, and the stage RPC answers it as one
    (logged with an error id, never the request's `invalid`)."""


class Exactness(enum.Enum):
    """The exactness contract a runtime's kernels keep (DESIGN.md §5.3); where a cached
    prefix may be reused follows from it."""
    # Prefill in chunks of exactly C rows at multiples of C (a short last chunk padded and
    # masked), decode at a fixed lane batch; prefixes reused at multiples of C only, decode
    # rows rebuilt as decode steps.
    CHUNKED = "chunked"
    # Every op computes a row alone (reduction order fixed by the model, never by the call,
    # the start, the lanes beside it or the threads): any start, no padding, a decode row
    # bitwise the prefill row at its position.
    ROW_INVARIANT = "row-invariant"


# The serving default (`skippy serve`): the fastest weight format whose top-1 agreement
# with the fp32 computation of the same weights is llama.cpp's own on the same file or
# better, >= 97 % (evals/format_accuracy.py).
# A StageSpec's own default stays fp32, the reference arithmetic.
DEFAULT_WEIGHT_FORMAT = "int4"


@dataclass(frozen=True)
class StageSpec:
    model_path: str
    layer_start: int
    layer_end: int
    stage_index: int = 0
    n_stages: int = 1
    wire_dtype: str = "f16"
    n_ctx: int = DEFAULT_N_CTX
    chunk: int = 64          # prefill chunk C; reuse boundaries are multiples of it
    # Decode batch B: decode always runs exactly B rows (padded). 1 by default: fp32
    # F.linear at M=1 takes the GEMV path, faster per row than small GEMMs (evals/README.md).
    lane_batch: int = 1
    weight_format: str = "fp32"  # one of WEIGHT_FORMATS
    threads: int | None = None
    # The whole split's identity (planner.topology_digest): a stage's frames depend on
    # where the stages before it cut, so its cached state is keyed by the split too.
    topology_digest: str = ""

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.n_stages - 1
