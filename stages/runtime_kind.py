"""The stage runtimes there are, one descriptor each, chosen once from the user's choice.

A descriptor says what a runtime runs (any layer range, or only a whole model; a per-stage
package, or one GGUF file), what it holds (weights in one of our formats, or the file's
own), and which exactness contract of DESIGN.md §5.3 its kernels keep. The command line,
the engines and certify resolve a name once (`runtime_kind`); from then on they ask the
descriptor what it can do, never which one it is.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .stage_spec import DEFAULT_WEIGHT_FORMAT, WEIGHT_FORMATS, Exactness, StageError, StageSpec

if TYPE_CHECKING:  # the contract imports torch: a descriptor is read without it
    from .runtime import StageRuntime

# A StageSpec's own weight format: the reference arithmetic (certify's default).
REFERENCE_FORMAT = "fp32"


class UnknownRuntime(StageError):
    """A runtime name none of the descriptors has."""


@dataclass(frozen=True)
class RuntimeKind:
    name: str
    module: str                      # where its StageRuntime class lives (imported on use)
    cls: str
    layer_ranges: bool               # any contiguous layer range; False: a whole model
    packages: bool                   # reads a per-stage package; False: one GGUF file
    weight_formats: tuple[str, ...]  # formats it holds weights in; (): the file's own
    serve_format: str                # the format `skippy serve` holds weights in, untold
    exactness: Exactness             # the most it keeps: each stage says (StageRuntime)

    def make(self, spec: StageSpec) -> StageRuntime:
        """This runtime serving `spec`."""
        return getattr(importlib.import_module(self.module), self.cls)(spec)

    def stages(self, asked: int | None) -> int | None:
        """How many stages to cut the model into for `asked` (None: the planner's choice);
        StageError where this runtime cannot serve that many."""
        if self.layer_ranges:
            return asked
        if asked not in (None, 1):
            raise StageError(f"the {self.name} runtime serves a whole model: use --stages 1")
        return 1

    def check_model(self, package: bool) -> None:
        """StageError where this runtime cannot read the model's form (a package)."""
        if package and not self.packages:
            raise StageError(f"the {self.name} runtime serves a .gguf file, not a package: "
                             "use --runtime torch, or the GGUF the package was split from")

    def check_weight_format(self, fmt: str) -> None:
        """StageError for a format this runtime cannot hold weights in."""
        if fmt not in WEIGHT_FORMATS:
            raise StageError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, "
                             f"not {fmt!r}")
        if fmt not in self.weight_formats and fmt != REFERENCE_FORMAT:
            raise StageError(f"the {self.name} runtime has no weight formats (it computes "
                             f"with the file's own weights): {fmt!r} is for the torch runtime")

    def held_format(self, fmt: str) -> str | None:
        """The format its weights are held in (reports): None for the file's own."""
        return fmt if self.weight_formats else None

    def tensor_bytes(self, fmt: str) -> Callable[[str, str, tuple[int, ...]], float] | None:
        """What the planner counts for each tensor it holds (None: the planner's fp32
        default, for the file's own weights)."""
        if not self.weight_formats:
            return None
        from .linear import held_bytes  # torch: only once a plan is sized
        return functools.partial(held_bytes, fmt)


TORCH = RuntimeKind("torch", "skippy.stages.torch_runtime", "TorchStageRuntime",
                    layer_ranges=True, packages=True, weight_formats=WEIGHT_FORMATS,
                    serve_format=DEFAULT_WEIGHT_FORMAT, exactness=Exactness.ROW_INVARIANT)
LLAMA_CPP = RuntimeKind("llama.cpp", "skippy.stages.llamacpp_runtime",
                        "LlamaCppStageRuntime", layer_ranges=False, packages=False,
                        weight_formats=(), serve_format=REFERENCE_FORMAT,
                        exactness=Exactness.CHUNKED)
RUNTIMES: dict[str, RuntimeKind] = {k.name: k for k in (TORCH, LLAMA_CPP)}


def runtime_kind(name: str) -> RuntimeKind:
    """The runtime named `name`: the one place a runtime's name is read."""
    try:
        return RUNTIMES[name]
    except KeyError:
        raise UnknownRuntime(f"unknown runtime {name!r} (choose from "
                             f"{', '.join(RUNTIMES)})") from None
