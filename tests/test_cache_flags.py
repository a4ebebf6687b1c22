"""`skippy serve`'s cache flags (mesh/cache_flags.py): every setting has its flag, flags
beat variables beat defaults, a bad flag is named, and the help is made from the settings."""

from __future__ import annotations

import argparse

import pytest

from skippy.cache.config import SETTINGS, CacheConfig, ConfigError, GiB, MiB
from skippy.mesh.cache_flags import add_cache_arguments, cache_config
from skippy.mesh.cli import build_parser


def parse(argv):
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return parser.parse_args(argv)


def test_flags_beat_variables_beat_defaults():
    env = {"SKIPPY_CACHE_BYTES": "1GB", "SKIPPY_CACHE_MAX_ENTRIES": "10"}
    c = cache_config(parse(["--cache-bytes", "2GiB"]), environ=env)
    assert c.max_bytes == 2 * GiB          # flag over variable
    assert c.max_entries == 10             # variable over default
    assert c.record_limit == 4             # default


def test_every_flag_is_read():
    argv = ["--cache", "off", "--cache-chunk", "32", "--cache-stride", "64",
            "--cache-min-prefix", "128", "--cache-max-prefix", "4096",
            "--cache-max-entries", "10", "--cache-bytes", "3.5GB", "--cache-max-tokens", "2048",
            "--cache-activation-entries", "11", "--cache-activation-bytes", "0.5GiB",
            "--cache-block-store-bytes", "0", "--cache-admit-after", "1",
            "--cache-record-limit", "3"]
    c = cache_config(parse(argv), environ={})
    assert c == CacheConfig(
        enabled=False, chunk=32, stride=64, min_prefix=128, max_prefix=4096, max_entries=10,
        max_bytes=3_500_000_000, max_tokens_per_entry=2048, activation_max_entries=11,
        activation_max_bytes=512 * MiB, block_store_max_bytes=0, admit_after=1, record_limit=3)


def test_no_flags_means_environment():
    assert cache_config(parse([]), environ={"SKIPPY_CACHE": "off"}).enabled is False


def test_bad_flag_is_named():
    with pytest.raises(ConfigError, match=r"^--cache-bytes: '3\.5' is not a byte size"):
        cache_config(parse(["--cache-bytes", "3.5"]), environ={})
    with pytest.raises(ConfigError, match=r"^--cache-stride: must be a positive multiple"):
        cache_config(parse(["--cache-stride", "48"]), environ={})


def test_serve_help_lists_every_setting_with_its_default_and_variable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for s in SETTINGS:
        assert f"{s.flag} {s.field.upper()} {s.meaning} (default {s.default_text()}; " \
               f"${s.env})" in text
    assert "--cache-bytes MAX_BYTES resident state bytes per stage; 0 disables resident " \
           "caching (default 2GiB; $SKIPPY_CACHE_BYTES)" in text
    assert "(default on; $SKIPPY_CACHE)" in text
    assert "(default 0.5GiB; $SKIPPY_ACTIVATION_CACHE_BYTES)" in text
