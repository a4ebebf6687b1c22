"""The synthetic families held before issue 19, through the shared family bar
(tests/family_checks.py); each newer family has a test file of its own."""

from __future__ import annotations

import pytest

from family_checks import check_agreement

FIXTURES = ["qwen3_f32", "lfm2_f32", "falcon_h1_f32"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_follows_llama_cpp_teacher_forced(fixture, request):
    check_agreement(request.getfixturevalue(fixture), fixture)
