"""Cache settings: the strict byte parser, validation, candidate lengths, variables and
flags by name (the command line that gives them is tests/test_cache_flags.py's)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from skippy.cache.config import (
    SETTINGS, CacheConfig, ConfigError, GiB, MiB, format_bytes, parse_bytes,
)
from skippy.topology.errors import UserError

ACCEPTED = [
    ("0", 0),
    ("0GB", 0),
    ("0GiB", 0),
    ("1GB", 10**9),
    ("1GiB", 2**30),
    ("2GiB", 2 * 2**30),
    ("3.5GB", 3_500_000_000),
    ("3.5GiB", 3_758_096_384),
    ("1.5GB", 1_500_000_000),
    ("0.000000001GB", 1),
    ("0.000000001GiB", 1),            # 1.073741824 bytes, rounded down
    ("0.5GiB", 512 * 2**20),
    ("1.123456789GB", 1_123_456_789),
    ("12GB", 12 * 10**9),
]

REJECTED = [
    "3.5", "100", "1", "10%", "-1GB", "-0", "1TB", "512MB", "1MiB", "3.5 GB", "3.5gb",
    "3.5gib", "3.5Gb", "", " 1GB", "1GB ", "1GB\n", "1e9GB", "1.GB", ".5GB", "1.1234567891GB",
    "+1GB", "1,5GB", "1_000GB", "GB", "00", "0.0", "١GB",
]


@pytest.mark.parametrize("text, expected", ACCEPTED)
def test_parse_bytes_accepts(text, expected):
    assert parse_bytes("SKIPPY_CACHE_BYTES", text) == expected


@pytest.mark.parametrize("text, expected", ACCEPTED)
def test_format_bytes_spells_what_parse_bytes_reads_back(text, expected):
    assert parse_bytes("x", format_bytes(expected)) == expected


def test_format_bytes_prefers_gib_and_few_decimals():
    assert [format_bytes(n) for n in (0, 2 * GiB, 512 * MiB, 10**9, 3_500_000_000)] == \
        ["0", "2GiB", "0.5GiB", "1GB", "3.5GB"]


@pytest.mark.parametrize("text", REJECTED)
def test_parse_bytes_rejects_with_the_setting_named(text):
    with pytest.raises(ConfigError) as err:
        parse_bytes("SKIPPY_CACHE_BYTES", text)
    message = str(err.value)
    assert message.startswith("SKIPPY_CACHE_BYTES: ")
    assert repr(text) in message and "GiB" in message
    assert "\n" not in message.replace(repr(text), "")  # one line


def test_parse_bytes_message_reads_as_documented():
    with pytest.raises(ConfigError, match=r"^SKIPPY_CACHE_BYTES: '3\.5gb' is not a byte size "
                                          r"\(use 0, or a number with GB or GiB, "
                                          r"e\.g\. 3\.5GB or 2GiB\)$"):
        parse_bytes("SKIPPY_CACHE_BYTES", "3.5gb")


def test_config_error_is_the_users_never_a_builtin_value_error():
    # the CLI tells a UserError in one line; a builtin ValueError would read a bug as theirs
    assert issubclass(ConfigError, UserError) and not issubclass(ConfigError, ValueError)


def test_defaults():
    c = CacheConfig()
    assert (c.enabled, c.chunk, c.stride, c.min_prefix, c.max_prefix) == (True, 64, 64, 64, 8192)
    assert c.max_bytes == 2 * GiB and c.activation_max_bytes == 512 * MiB
    assert c.block_store_max_bytes == 4 * GiB
    assert (c.max_entries, c.max_tokens_per_entry, c.activation_max_entries) == (256, 8192, 256)
    assert (c.admit_after, c.record_limit) == (2, 4)


@pytest.mark.parametrize("kwargs, field", [
    ({"stride": 32}, "stride"),                          # not a multiple of chunk
    ({"stride": 0}, "stride"),
    ({"chunk": 0}, "chunk"),
    ({"chunk": 128}, "stride"),                          # default stride 64 no longer fits
    ({"min_prefix": 100}, "min_prefix"),
    ({"min_prefix": 0}, "min_prefix"),
    ({"max_prefix": 100}, "max_prefix"),
    ({"min_prefix": 256, "max_prefix": 128}, "min_prefix"),
    ({"max_entries": -1}, "max_entries"),
    ({"max_bytes": -1}, "max_bytes"),
    ({"max_bytes": 1.5}, "max_bytes"),
    ({"max_tokens_per_entry": 0}, "max_tokens_per_entry"),
    ({"admit_after": 0}, "admit_after"),
    ({"record_limit": 0}, "record_limit"),
    ({"activation_max_bytes": True}, "activation_max_bytes"),
    ({"enabled": "yes"}, "enabled"),
])
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}: ") as err:
        CacheConfig(**kwargs)
    assert err.value.field == field


def test_zero_byte_caps_are_valid_and_mean_disabled():
    c = CacheConfig(max_bytes=0, activation_max_bytes=0, block_store_max_bytes=0, max_entries=0)
    assert c.max_bytes == 0


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        CacheConfig().stride = 128  # type: ignore[misc]


def test_candidates_are_stride_multiples_longest_first():
    assert CacheConfig().candidate_lengths(200) == [192, 128, 64]


def test_whole_prompt_is_a_prefix_candidate_only_on_a_stride_multiple():
    c = CacheConfig()
    assert c.candidate_lengths(192) == [192, 128, 64]
    assert c.candidate_lengths(191) == [128, 64]


def test_candidates_clip_to_min_and_max_prefix():
    c = CacheConfig(stride=64, min_prefix=128, max_prefix=256)
    assert c.candidate_lengths(1000) == [256, 192, 128]
    assert c.candidate_lengths(200) == [192, 128]
    assert c.candidate_lengths(127) == []


def test_prompt_shorter_than_min_prefix_has_no_candidates():
    assert CacheConfig().candidate_lengths(63) == []
    assert CacheConfig().candidate_lengths(0) == []


def test_stride_coarser_than_chunk():
    c = CacheConfig(chunk=32, stride=96, min_prefix=96, max_prefix=960)
    assert c.candidate_lengths(300) == [288, 192, 96]


def test_disabled_cache_has_no_candidates_and_no_exact_key():
    c = CacheConfig(enabled=False)
    assert c.candidate_lengths(1000) == [] and c.record_lengths(1000) == []
    assert not c.exact_prompt_key_allowed(100)


def test_record_lengths_are_the_longest_record_limit_candidates():
    c = CacheConfig(record_limit=2)
    assert c.record_lengths(200) == [192, 128]
    assert c.record_lengths(100) == [64]
    assert CacheConfig().record_lengths(1000) == [960, 896, 832, 768]


def test_record_lengths_respect_max_tokens_per_entry():
    c = CacheConfig(max_tokens_per_entry=150, record_limit=4)
    assert c.candidate_lengths(400) == [384, 320, 256, 192, 128, 64]  # lookup still tries them
    assert c.record_lengths(400) == [128, 64]


def test_exact_prompt_key_needs_no_stride_but_fits_an_entry():
    c = CacheConfig(max_tokens_per_entry=100)
    assert c.exact_prompt_key_allowed(7)
    assert c.exact_prompt_key_allowed(100)
    assert not c.exact_prompt_key_allowed(101)
    assert not c.exact_prompt_key_allowed(0)


ENV = {
    "SKIPPY_CACHE": "on",
    "SKIPPY_CACHE_CHUNK": "32",
    "SKIPPY_CACHE_STRIDE": "64",
    "SKIPPY_CACHE_MIN_PREFIX": "128",
    "SKIPPY_CACHE_MAX_PREFIX": "4096",
    "SKIPPY_CACHE_MAX_ENTRIES": "10",
    "SKIPPY_CACHE_BYTES": "3.5GB",
    "SKIPPY_CACHE_MAX_TOKENS": "2048",
    "SKIPPY_ACTIVATION_CACHE_ENTRIES": "11",
    "SKIPPY_ACTIVATION_CACHE_BYTES": "0.5GiB",
    "SKIPPY_BLOCK_STORE_BYTES": "0",
    "SKIPPY_CACHE_ADMIT_AFTER": "1",
    "SKIPPY_CACHE_RECORD_LIMIT": "3",
}


def test_every_variable_is_read():
    c = CacheConfig.from_env(ENV)
    assert c == CacheConfig(
        enabled=True, chunk=32, stride=64, min_prefix=128, max_prefix=4096, max_entries=10,
        max_bytes=3_500_000_000, max_tokens_per_entry=2048, activation_max_entries=11,
        activation_max_bytes=512 * MiB, block_store_max_bytes=0, admit_after=1, record_limit=3)


def test_empty_environment_gives_defaults():
    assert CacheConfig.from_env({}) == CacheConfig()


@pytest.mark.parametrize("text, expected", [
    ("on", True), ("1", True), ("true", True), ("TRUE", True),
    ("off", False), ("0", False), ("false", False), ("Off", False),
])
def test_cache_switch_words(text, expected):
    assert CacheConfig.from_env({"SKIPPY_CACHE": text}).enabled is expected


@pytest.mark.parametrize("var, text", [
    ("SKIPPY_CACHE", "yes"),
    ("SKIPPY_CACHE", ""),
    ("SKIPPY_CACHE_MAX_ENTRIES", "12abc"),
    ("SKIPPY_CACHE_MAX_ENTRIES", "-1"),
    ("SKIPPY_CACHE_STRIDE", " 64"),
    ("SKIPPY_CACHE_STRIDE", "6.4e1"),
    ("SKIPPY_CACHE_ADMIT_AFTER", "+2"),
    ("SKIPPY_CACHE_BYTES", "3.5"),
    ("SKIPPY_BLOCK_STORE_BYTES", "10%"),
])
def test_bad_variable_is_named(var, text):
    with pytest.raises(ConfigError, match=rf"^{var}: {re.escape(repr(text))}"):
        CacheConfig.from_env({var: text})


@pytest.mark.parametrize("env, message", [
    ({"SKIPPY_CACHE_STRIDE": "0"}, "SKIPPY_CACHE_STRIDE: must be a positive multiple of chunk"),
    ({"SKIPPY_CACHE_ADMIT_AFTER": "0"}, "SKIPPY_CACHE_ADMIT_AFTER: must be at least 1"),
    ({"SKIPPY_CACHE_MIN_PREFIX": "128", "SKIPPY_CACHE_MAX_PREFIX": "64"},
     "SKIPPY_CACHE_MIN_PREFIX: 128 is above max_prefix (64)"),
])
def test_invalid_value_from_a_variable_names_the_variable(env, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        CacheConfig.from_env(env)


def test_overrides_beat_the_environment():
    c = CacheConfig.from_env({"SKIPPY_CACHE_RECORD_LIMIT": "3"}, record_limit=7)
    assert c.record_limit == 7


def test_unknown_override_is_a_type_error():
    with pytest.raises(TypeError):
        CacheConfig.from_env({}, strides=64)


def test_a_flag_beats_its_variable_and_is_named_when_bad():
    env = {"SKIPPY_CACHE_BYTES": "1GB", "SKIPPY_CACHE_MAX_ENTRIES": "10"}
    c = CacheConfig.from_flags({"--cache-bytes": "2GiB"}, environ=env)
    assert (c.max_bytes, c.max_entries) == (2 * GiB, 10)
    with pytest.raises(ConfigError, match=r"^--cache-stride: must be a positive multiple"):
        CacheConfig.from_flags({"--cache-stride": "48"}, environ={})


def test_unknown_flag_is_a_type_error():
    with pytest.raises(TypeError):
        CacheConfig.from_flags({"--cache-strides": "64"}, environ={})


def test_every_setting_has_a_flag_a_variable_and_a_field():
    assert [s.field for s in SETTINGS] == [f.name for f in dataclasses.fields(CacheConfig)]
    assert len({s.flag for s in SETTINGS}) == len({s.env for s in SETTINGS}) == len(SETTINGS)
