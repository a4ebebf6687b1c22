"""The runtime descriptors: a runtime's name is read in one place, and what it can serve is
asked of its descriptor, never of its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from skippy.mesh.cli import build_parser
from skippy.mesh.usage import UsageError
from skippy.stages import qkernel
from skippy.stages.linear import WEIGHT_FORMATS
from skippy.stages.runtime import StageError, StageSpec
from skippy.stages.runtime_kind import LLAMA_CPP, RUNTIMES, TORCH, Exactness, \
    UnknownRuntime, runtime_kind

ROOT = Path(__file__).resolve().parent.parent


def test_a_name_resolves_to_its_descriptor_and_an_unknown_one_is_refused_there():
    assert runtime_kind("torch") is TORCH and runtime_kind("llama.cpp") is LLAMA_CPP
    with pytest.raises(UnknownRuntime, match=r"unknown runtime 'tensorrt' \(choose from "
                                             r"torch, llama\.cpp\)"):
        runtime_kind("tensorrt")


@pytest.mark.parametrize("command", [["serve"], ["certify"]])
def test_the_command_line_hands_on_the_descriptor(command):
    assert build_parser().parse_args(command).runtime is TORCH
    assert build_parser().parse_args([*command, "--runtime", "llama.cpp"]).runtime is LLAMA_CPP
    with pytest.raises(UsageError, match="unknown runtime 'nope'"):
        build_parser().parse_args([*command, "--runtime", "nope"])


def test_every_runtime_names_the_exactness_contract_its_kernels_keep():
    assert TORCH.exactness is Exactness.ROW_INVARIANT  # the most it keeps
    assert LLAMA_CPP.exactness is Exactness.CHUNKED
    assert all(runtime_kind(name).name == name for name in RUNTIMES)


@pytest.mark.parametrize("fmt, contract", [("int8", Exactness.ROW_INVARIANT),
                                           ("fp32", Exactness.CHUNKED)])
def test_a_stage_says_the_contract_it_keeps_and_its_identity_carries_it(qwen3_f32, fmt,
                                                                        contract):
    if qkernel.library() is None:
        contract = Exactness.CHUNKED  # torch's int kernels: the chunked contract
    rt = TORCH.make(StageSpec(str(qwen3_f32), 0, 6, 0, 1, "f32", n_ctx=256, weight_format=fmt))
    assert rt.exactness is contract
    policy = rt.identity()["numeric_policy"]
    assert policy["contract"] == contract.value
    assert (policy["chunk"] == "any") == (contract is Exactness.ROW_INVARIANT)
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.arange(50, 60))
    if contract is Exactness.CHUNKED:  # a start off the chunk grid, or k decode rows
        with pytest.raises(StageError, match="multiple of"):
            rt.prefill(lane, torch.arange(55, 60), start=5)
        with pytest.raises(StageError, match="exactly one row per lane"):
            rt.decode([(lane, torch.tensor([1, 2]))])
        return
    resumed = rt.prefill(lane, torch.arange(55, 60), start=5, logits="all",
                         rows_per_call=2).logits
    two = rt.decode([(lane, torch.tensor([3, 4]))])[0].logits
    other = rt.alloc_lane()
    rt.prefill(other, torch.arange(50, 60), rows_per_call=3)
    one = [rt.decode([(other, torch.tensor(t))])[0].logits for t in (3, 4)]
    assert two.shape == (2, rt.cfg.vocab) and torch.equal(two, torch.stack(one))
    cold = rt.prefill(rt.alloc_lane(), torch.tensor([*range(50, 60), 3, 4]), logits="all")
    assert torch.equal(cold.logits[5:10], resumed) and torch.equal(cold.logits[10:], two)


def test_a_whole_model_runtime_serves_one_stage():
    assert LLAMA_CPP.stages(None) == 1 and LLAMA_CPP.stages(1) == 1
    with pytest.raises(StageError, match="serves a whole model: use --stages 1"):
        LLAMA_CPP.stages(2)
    assert TORCH.stages(None) is None and TORCH.stages(5) == 5


def test_packages_and_weight_formats_are_what_the_descriptor_says():
    TORCH.check_model(package=True)
    with pytest.raises(StageError, match="serves a .gguf file, not a package"):
        LLAMA_CPP.check_model(package=True)
    for fmt in WEIGHT_FORMATS:
        TORCH.check_weight_format(fmt)
        assert TORCH.held_format(fmt) == fmt and TORCH.tensor_bytes(fmt) is not None
    LLAMA_CPP.check_weight_format("fp32")  # a spec's own default: the file's weights
    assert LLAMA_CPP.held_format("fp32") is None and LLAMA_CPP.tensor_bytes("fp32") is None
    with pytest.raises(StageError, match="no weight formats"):
        LLAMA_CPP.check_weight_format("int4")
    with pytest.raises(StageError, match="must be one of"):
        TORCH.check_weight_format("fp8")


def test_the_descriptor_makes_its_runtime(qwen3_f32):
    runtime = TORCH.make(StageSpec(str(qwen3_f32), 0, 6, 0, 1, "f32", n_ctx=256))
    assert type(runtime).__name__ == TORCH.cls and runtime.n_ctx == 256


# a comparison of a runtime's name: `== "torch"`, `!= 'llama.cpp'`, `in ("torch", ...)`
_ASKS_NAME = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](torch|llama\.cpp)["']""")


def test_no_product_code_asks_which_runtime_it_is_by_name():
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
                 for folder in ("topology", "stages", "cache", "mesh")
                 for p in sorted((ROOT / folder).rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if _ASKS_NAME.search(line)]
    assert not offenders, "ask the runtime's descriptor instead:\n" + "\n".join(offenders)
