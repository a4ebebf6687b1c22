"""What a family's synthetic tensor table is: its knobs (one typed table: sizes, its own
options, Llama 3 rope factors, its variants), the sizes they resolve to, and the tensors.

A family's registry entry (topology/families.py) names its table; stages/synth.py turns
a table and a set of knob values into a file. Every knob a caller sets, from the CLI's
`--set KEY=VALUE` or a keyword, is checked here against the table, so an unknown key or
a bad value is one line saying which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from skippy.topology.errors import UserError

Value = int | float | bool | str

# Sizes every table has; head_dim's default None means hidden // heads.
SIZE_KNOBS = ("hidden", "ff", "heads", "kv_heads", "head_dim")


class SynthError(UserError):
    """Bad arguments for a synthetic model (unknown arch or knob, inconsistent sizes, no
    tokenizer)."""


@dataclass(frozen=True)
class Dims:
    """Resolved sizes of one synthetic model."""

    layers: int
    hidden: int
    ff: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rope_base: float
    rms_eps: float
    rope_freqs: bool = False  # Llama 3 rope frequency factors (rope_freqs.weight)
    # The table's own options, with the caller's values
    options: Mapping[str, int | float | None] = dataclasses.field(default_factory=dict)
    variant: str = ""  # one of the table's variants ("" where it has none)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: GGUF name, numpy shape (out_features, in_features) and how to fill it.

    `init` is "embed" (N(0, 1): token rows are looked up, not summed, so they need no
    fan-in scaling), "proj" (N(0, 1/sqrt(fan_in)): keeps each projection's output at the
    scale of its input), "norm" (1 + N(0, 0.1): near identity, but not exactly, so a port
    that forgets a norm weight is caught), "bias" (N(0, 0.1)), "ssm_a" (-exp(N(0, 0.5)):
    Mamba2's negative per-head decay rate A), "qk_norm" ("norm" times head_dim^-1/4: for
    Q and K norms of a family that does not scale its scores, so that the scores are of
    unit scale), "head_norm" (0.3 + N(0, 0.03): a final norm that scales logits down),
    "rope_freqs" (Llama 3's frequency factors, computed, not drawn), "rope_divisors"
    (Gemma 4's proportional-rope divisors, fixed) or "tied_embed" (N(0, 1/(16 fan_in)):
    Gemma 2's embeddings, which are also its head).
    """

    name: str
    shape: tuple[int, ...]
    init: str
    always_f32: bool = False  # stored as f32 whatever the file's dtype (like the 1-D norms)


@dataclass(frozen=True)
class Knob:
    """One thing a caller may set: its type, its default (None: derived from the other
    knobs) and, for a text knob, its choices."""

    name: str
    kind: type
    default: Value | None
    choices: tuple[str, ...] = ()
    minimum: int = 0

    def check(self, arch: str, value: object) -> Value:
        """`value` as this knob's type (text is parsed), or a one-line SynthError."""
        if isinstance(value, str) and self.kind is not str:
            value = self._parse(arch, value)
        ok = {bool: lambda v: isinstance(v, bool),
              int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              str: lambda v: isinstance(v, str)}[self.kind](value)
        if not ok or (self.kind in (int, float) and value < self.minimum):
            raise SynthError(f"{arch} knob {self.name} takes {self._wants()}, not {value!r}")
        if self.choices and value not in self.choices:
            raise SynthError(f"{arch} has no {self.name} {value!r} "
                             f"({self.name}s: {', '.join(self.choices)})")
        return float(value) if self.kind is float else value

    def _parse(self, arch: str, text: str) -> Value:
        words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
        try:
            if self.kind is bool:
                return words[text.lower()]
            return self.kind(text)
        except (KeyError, ValueError):
            raise SynthError(f"{arch} knob {self.name} takes {self._wants()}, "
                             f"not {text!r}") from None

    def _wants(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return "text"
        what = "an integer" if self.kind is int else "a number"
        return f"{what} >= {self.minimum}"


@dataclass(frozen=True)
class SynthTable:
    """A family's synthetic file: default sizes, hyperparameter keys (without "{arch}."),
    tensor list, and what else a caller may set."""

    sizes: Mapping[str, int | float]  # hidden ff heads kv_heads head_dim context rope eps
    hparams: Callable[[Dims], dict[str, int | float | list[int]]]
    tensors: Callable[[Dims], list[TensorSpec]]
    # The family's own options and their defaults; None: derived from the other sizes.
    options: Mapping[str, int | float | None] = dataclasses.field(default_factory=dict)
    # Shapes of one family the `variant` knob picks between (the first is the default).
    variants: tuple[str, ...] = ()
    # Where not None, `rope_freqs` is a knob: Llama 3 rope factors at this rope base.
    rope_freqs_base: float | None = None
    # What the shape has beyond its sizes, for a bench's one-line description.
    describe: Callable[[Dims], str] | None = None

    def knobs(self) -> dict[str, Knob]:
        """Every knob of this table, in the order a file name lists them."""
        out = {k: Knob(k, int, self.sizes[k], minimum=1) for k in SIZE_KNOBS[:4]}
        out["head_dim"] = Knob("head_dim", int, None, minimum=2)
        for key, default in self.options.items():
            out[key] = Knob(key, float if isinstance(default, float) else int, default)
        if self.rope_freqs_base is not None:
            out["rope_freqs"] = Knob("rope_freqs", bool, False)
        if self.variants:
            out["variant"] = Knob("variant", str, self.variants[0], choices=self.variants)
        return out

    def checked(self, arch: str, settings: Mapping[str, object]) -> dict[str, Value]:
        """The caller's knob values, each checked and typed (None values: not set)."""
        knobs = self.knobs()
        out: dict[str, Value] = {}
        for key, value in settings.items():
            if value is None:
                continue
            if key not in knobs:
                raise SynthError(f"{arch} has no knob {key} (knobs: {', '.join(knobs)})")
            out[key] = knobs[key].check(arch, value)
        return out

    def changed(self, arch: str, settings: Mapping[str, object]) -> list[tuple[str, Value]]:
        """The knobs set to other than their defaults, in the table's order."""
        given = self.checked(arch, settings)
        return [(k, given[k]) for k, knob in self.knobs().items()
                if k in given and given[k] != knob.default]

    def resolve(self, arch: str, layers: int, vocab: int,
                settings: Mapping[str, object]) -> Dims:
        """The sizes of a file with `layers` blocks and these knob values."""
        given = self.checked(arch, settings)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise SynthError(f"layers must be a positive integer, not {layers!r}")
        d = {k: int(given.get(k, self.sizes[k])) for k in SIZE_KNOBS[:4]}
        if d["heads"] % d["kv_heads"]:
            raise SynthError(f"heads ({d['heads']}) must be a multiple of kv_heads "
                             f"({d['kv_heads']})")
        head_dim = given.get("head_dim")
        if head_dim is None:
            if d["hidden"] % d["heads"]:
                raise SynthError(f"hidden ({d['hidden']}) is not divisible by heads "
                                 f"({d['heads']}); pass head_dim explicitly")
            head_dim = d["hidden"] // d["heads"]
        if head_dim % 2:
            raise SynthError(f"head_dim must be a positive even integer (rope rotates "
                             f"pairs), not {head_dim!r}")
        rope_freqs = bool(given.get("rope_freqs", False))
        options = {k: given.get(k, v) for k, v in self.options.items()}
        return Dims(layers=layers, head_dim=int(head_dim), vocab=vocab,
                    context_length=int(self.sizes["context_length"]),
                    rope_base=float(self.rope_freqs_base if rope_freqs
                                    else self.sizes["rope_base"]),
                    rms_eps=float(self.sizes["rms_eps"]), rope_freqs=rope_freqs,
                    options=options, variant=str(given.get("variant", self.variants[0]
                                                           if self.variants else "")), **d)


def knob_suffix(pairs: Iterable[tuple[str, object]]) -> str:
    """Knob values as they go into a file name: "-rope_freqs", "-hidden128", "-varianta4b"."""
    return "".join(f"-{k}" if v is True else f"-{k}{v}" for k, v in pairs)


# The small shape most tables start from.
SMALL = {"hidden": 256, "ff": 768, "heads": 4, "kv_heads": 2, "head_dim": 64,
         "context_length": 4096, "rope_base": 1e6, "rms_eps": 1e-6}


def need_square_attention(d: Dims) -> None:
    if d.heads * d.head_dim != d.hidden:
        # llama.cpp creates some families' Q and output projections as n_embd x n_embd.
        raise SynthError(f"this family needs heads * head_dim == hidden ({d.heads} * "
                         f"{d.head_dim} != {d.hidden})")
