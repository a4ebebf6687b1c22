"""Cache settings: one frozen config, one strict byte parser, environment variables and flags.

Every setting is one row of `SETTINGS`: its config field, its `SKIPPY_*` variable, its
flag and what it means (`skippy serve --help` prints them with their defaults). Flags
override variables, which override the defaults.

Byte sizes are `0` or a number with `GB` (10^9) or `GiB` (2^30), e.g. `3.5GB`, `2GiB`;
integers are plain decimal digits. Anything else is a `ConfigError` naming the setting.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from skippy.topology.errors import UserError

GB = 10**9
GiB = 2**30
MiB = 2**20

_BYTE_SIZE = re.compile(r"([0-9]+)(?:\.([0-9]{1,9}))?(GB|GiB)")
_INTEGER = re.compile(r"[0-9]+")
_BOOLS = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False}


class ConfigError(UserError):
    """A setting is invalid. The one-line message is `"{setting}: {reason}"`, where the
    setting is a field, variable or flag name; `field` is the config field concerned."""

    def __init__(self, setting: str, reason: str, field: str | None = None):
        super().__init__(f"{setting}: {reason}")
        self.reason = reason
        self.field = field


def parse_bytes(setting: str, text: str) -> int:
    """`0`, or a number (at most 9 decimals) with GB or GiB, to whole bytes, rounded down.

    Case-sensitive, no spaces, no other units: a unitless number is rejected rather than
    guessed at. Exact integer arithmetic, so `3.5GiB` is 3758096384, not a float's idea of it.
    """
    if text == "0":
        return 0
    m = _BYTE_SIZE.fullmatch(text)
    if m is None:
        raise ConfigError(setting, f"{text!r} is not a byte size "
                          "(use 0, or a number with GB or GiB, e.g. 3.5GB or 2GiB)")
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3)
    scale = 10 ** len(frac)
    return (int(whole) * scale + int(frac or "0")) * (GB if unit == "GB" else GiB) // scale


def parse_int(setting: str, text: str) -> int:
    """Plain decimal digits only: no sign, spaces, underscores or exponents."""
    if _INTEGER.fullmatch(text) is None:
        raise ConfigError(setting, f"{text!r} is not a whole number (use digits only, e.g. 64)")
    return int(text)


def parse_bool(setting: str, text: str) -> bool:
    """on/off, 1/0, true/false (any letter case)."""
    value = _BOOLS.get(text.lower())
    if value is None:
        raise ConfigError(setting, f"{text!r} is not on/off (use on, off, 1, 0, true or false)")
    return value


@dataclass(frozen=True)
class CacheConfig:
    """The cache settings of one stage (`SETTINGS` says what each field means).

    Prefix keys are lengths that are multiples of `stride` (itself a multiple of the prefill
    chunk, so a restored prefix is bitwise what a cold prefill computes). On a stage that
    keeps the row-invariant contract the stride only paces admission: a dense entry holds
    its whole prompt and a hit runs to the token (stages/stage_cache.py). The exact whole
    prompt is a separate key (decoded results) that serves only an identical prompt; it is
    never offered as the prefix of a longer one — see `exact_prompt_key_allowed`.
    """

    enabled: bool = True
    chunk: int = 64
    stride: int = 64
    min_prefix: int = 64
    max_prefix: int = 8192
    max_entries: int = 256
    max_bytes: int = 2 * GiB
    max_tokens_per_entry: int = 8192
    activation_max_entries: int = 256
    activation_max_bytes: int = 512 * MiB
    block_store_max_bytes: int = 4 * GiB
    cold_max_bytes: int = 4 * GiB
    admit_after: int = 2
    record_limit: int = 4

    def __post_init__(self) -> None:
        def bad(name: str, reason: str) -> ConfigError:
            return ConfigError(name, reason, name)

        if not isinstance(self.enabled, bool):
            raise bad("enabled", f"must be a bool, got {self.enabled!r}")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if type(value) is not int or value < 0:  # bool is an int; not here
                raise bad(f.name, f"must be a non-negative int, got {value!r}")
        for name in ("chunk", "max_tokens_per_entry", "admit_after", "record_limit"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be at least 1, got {getattr(self, name)}")
        if self.stride < 1 or self.stride % self.chunk:
            raise bad("stride", f"must be a positive multiple of chunk ({self.chunk}), "
                                f"got {self.stride}")
        for name in ("min_prefix", "max_prefix"):
            value = getattr(self, name)
            if value < 1 or value % self.stride:
                raise bad(name, f"must be a positive multiple of stride ({self.stride}), "
                                f"got {value}")
        if self.min_prefix > self.max_prefix:
            raise bad("min_prefix", f"{self.min_prefix} is above max_prefix ({self.max_prefix})")

    @property
    def stage_bytes(self) -> int:
        """What one stage's caches may hold: resident state and activation frames (the
        block store and the disk tier are the node's, shared by its stages)."""
        return self.max_bytes + self.activation_max_bytes

    def within(self, room: int | None) -> CacheConfig:
        """These settings with the stage budgets scaled down, each in its share, to hold
        at most `room` bytes (the plan's room for a stage whose node leaves less than
        configured); unchanged where `room` is None or enough."""
        want = self.stage_bytes
        if room is None or room >= want:
            return self
        return replace(self, max_bytes=self.max_bytes * room // want,
                       activation_max_bytes=self.activation_max_bytes * room // want)

    def candidate_lengths(self, n_tokens: int) -> list[int]:
        """Prefix lengths a lookup tries for an `n_tokens` prompt, longest first: multiples
        of stride in [min_prefix, min(max_prefix, n_tokens)]. Includes n_tokens itself only
        when it is a multiple of stride; a hit that long leaves no suffix to compute, so a
        caller that needs the last row's output must have it from the same entry."""
        if not self.enabled:
            return []
        top = min(self.max_prefix, n_tokens) // self.stride * self.stride
        return list(range(top, self.min_prefix - 1, -self.stride))

    def record_lengths(self, n_tokens: int) -> list[int]:
        """Boundaries to record after a successful prefill of `n_tokens`: the longest
        `record_limit` candidates that also fit `max_tokens_per_entry`, longest first."""
        fitting = [n for n in self.candidate_lengths(n_tokens) if n <= self.max_tokens_per_entry]
        return fitting[: self.record_limit]

    def exact_prompt_key_allowed(self, n_tokens: int) -> bool:
        """Whether the whole prompt may be kept under its exact-prompt key (decoded results).

        Callers look that key up with the full prompt only, before the prefix candidates,
        and never use it to serve a longer prompt; its length need not be a stride multiple.
        """
        return self.enabled and 1 <= n_tokens <= self.max_tokens_per_entry

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: Any) -> CacheConfig:
        """Defaults, then `SKIPPY_*` variables, then `overrides` (typed field values)."""
        return cls._resolve(environ, {}, overrides)

    @classmethod
    def from_flags(cls, flags: Mapping[str, str],
                   environ: Mapping[str, str] = os.environ) -> CacheConfig:
        """Defaults, then `SKIPPY_*` variables, then `flags`: the text given to each flag
        that was used, by flag name (`{"--cache-bytes": "2GiB"}`)."""
        by_flag = {s.flag: s for s in SETTINGS}
        unknown = set(flags) - set(by_flag)
        if unknown:
            raise TypeError(f"unknown cache flags: {sorted(unknown)}")
        return cls._resolve(environ, {by_flag[f].field: (f, text) for f, text in flags.items()},
                            {})

    @classmethod
    def _resolve(cls, environ: Mapping[str, str], flags: dict[str, tuple[str, str]],
                 overrides: dict[str, Any]) -> CacheConfig:
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown cache settings: {sorted(unknown)}")
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}  # field -> the variable or flag that set it
        for s in SETTINGS:
            source, text = flags.get(s.field, (s.env, environ.get(s.env)))
            if text is not None:
                values[s.field] = s.parse(source, text)
                origin[s.field] = source
        values.update(overrides)
        for name in overrides:
            origin.pop(name, None)
        try:
            return cls(**values)
        except ConfigError as e:
            # Name what the user typed, not only the field it fed.
            if e.field in origin:
                raise ConfigError(origin[e.field], e.reason, e.field) from None
            raise


def format_bytes(n: int) -> str:
    """`n` bytes as `parse_bytes` reads them back exactly: 0, else GiB, else GB, with the
    fewest decimals (at most 9) that spell `n` exactly."""
    if n == 0:
        return "0"
    for unit, size in (("GiB", GiB), ("GB", GB)):
        for places in range(10):
            if n * 10**places % size == 0:
                whole, frac = divmod(n * 10**places // size, 10**places)
                return f"{whole}.{frac:0{places}d}{unit}" if places else f"{whole}{unit}"
    raise ValueError(f"{n} bytes has no exact spelling in GB or GiB")


def _format_bool(value: bool) -> str:
    return "on" if value else "off"


_FORMATS = {parse_bool: _format_bool, parse_bytes: format_bytes}


@dataclass(frozen=True)
class Setting:
    """One cache setting: the config field it feeds, the variable and flag that set it (as
    text, read by `parse`), and what it means."""

    field: str
    env: str
    flag: str
    parse: Any  # (setting name, text) -> value
    meaning: str

    def default_text(self) -> str:
        """The field's default as the variable or flag would spell it."""
        value = next(f.default for f in fields(CacheConfig) if f.name == self.field)
        return _FORMATS.get(self.parse, str)(value)


SETTINGS = (
    Setting("enabled", "SKIPPY_CACHE", "--cache", parse_bool,
            "on/off (also 1/0, true/false); off disables every stage cache"),
    Setting("chunk", "SKIPPY_CACHE_CHUNK", "--cache-chunk", parse_int,
            "the runtime's prefill chunk C (DESIGN.md §5.3)"),
    Setting("stride", "SKIPPY_CACHE_STRIDE", "--cache-stride", parse_int,
            "prefix lengths are multiples of it; a positive multiple of the chunk"),
    Setting("min_prefix", "SKIPPY_CACHE_MIN_PREFIX", "--cache-min-prefix", parse_int,
            "shortest prefix recorded, and looked up where hits end on a stride (where they "
            "run to the token, stems down to 8 tokens); a multiple of the stride"),
    Setting("max_prefix", "SKIPPY_CACHE_MAX_PREFIX", "--cache-max-prefix", parse_int,
            "longest prefix looked up or recorded, in tokens; a multiple of the stride"),
    Setting("max_entries", "SKIPPY_CACHE_MAX_ENTRIES", "--cache-max-entries", parse_int,
            "resident entries per stage (LRU beyond it)"),
    Setting("max_bytes", "SKIPPY_CACHE_BYTES", "--cache-bytes", parse_bytes,
            "resident state bytes per stage; 0 disables resident caching"),
    Setting("max_tokens_per_entry", "SKIPPY_CACHE_MAX_TOKENS", "--cache-max-tokens", parse_int,
            "longest token sequence one entry may hold"),
    Setting("activation_max_entries", "SKIPPY_ACTIVATION_CACHE_ENTRIES",
            "--cache-activation-entries", parse_int, "cached activation frames per stage"),
    Setting("activation_max_bytes", "SKIPPY_ACTIVATION_CACHE_BYTES", "--cache-activation-bytes",
            parse_bytes, "activation frame bytes per stage; 0 disables the activation cache"),
    Setting("block_store_max_bytes", "SKIPPY_BLOCK_STORE_BYTES", "--cache-block-store-bytes",
            parse_bytes, "payload block store bytes per node; 0 disables the block store"),
    Setting("cold_max_bytes", "SKIPPY_CACHE_COLD_BYTES", "--cache-cold-bytes", parse_bytes,
            "disk tier per stage: resident entries evicted from RAM are kept on the node's "
            "disk (zstd) and restored on a hit instead of recomputed; 0 = off"),
    Setting("admit_after", "SKIPPY_CACHE_ADMIT_AFTER", "--cache-admit-after", parse_int,
            "sightings of a prefix before it is captured; 1 = first sight"),
    Setting("record_limit", "SKIPPY_CACHE_RECORD_LIMIT", "--cache-record-limit", parse_int,
            "boundaries recorded per prefill (the longest ones)"),
)
