"""The `--cache*` flags of `skippy serve`, one per row of cache/config.py's `SETTINGS`,
their help made from the same rows (meaning, default, variable)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from skippy.cache.config import SETTINGS, CacheConfig


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `--cache*` flags. Values stay strings here and are parsed strictly by
    `CacheConfig.from_flags`, so a bad flag is reported like a bad variable."""
    group = parser.add_argument_group(
        "cache", "stage cache settings; a flag overrides its SKIPPY_* variable. Byte sizes "
                 "are 0 or a number with GB (10^9) or GiB (2^30), e.g. 3.5GB, 2GiB")
    for s in SETTINGS:
        text = f"{s.meaning} (default {s.default_text()}; ${s.env})"
        group.add_argument(s.flag, dest=_dest(s.flag), default=None, metavar=s.field.upper(),
                           help=text.replace("%", "%%"))


def cache_config(args: argparse.Namespace,
                 environ: Mapping[str, str] = os.environ) -> CacheConfig:
    """Defaults, then `SKIPPY_*` variables, then the flags of `add_cache_arguments`."""
    flags = {s.flag: getattr(args, _dest(s.flag)) for s in SETTINGS}
    return CacheConfig.from_flags({f: text for f, text in flags.items() if text is not None},
                                  environ)
