"""Our torch stages against llama.cpp, logits at every position, on the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import first_of_each_use_case
from skippy.evals.reference import LlamaCppReference
from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

WINDOW = 256


def whole_model(path) -> TorchStageRuntime:
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    return TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=1024))


def prompt_ids(ref: LlamaCppReference, record: dict) -> list[int]:
    """The last 256 tokens of the prompt's text (BOS kept first where the model adds one)."""
    text = "".join(m["content"] for m in record["messages"])
    ids = ref.llm.tokenize(text.encode(), add_bos=True, special=True)
    bos = ref.llm.token_bos()
    if ids and ids[0] == bos:
        return [bos] + ids[1:][-(WINDOW - 1):]
    return ids[-WINDOW:]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def compare_on_corpus(path, corpus) -> dict:
    ref = LlamaCppReference(path)
    rt = whole_model(path)
    agree = total = 0
    final_cos = []
    for record in first_of_each_use_case(corpus):
        ids = prompt_ids(ref, record)
        expected = ref.logits(ids)
        lane = rt.alloc_lane()
        got = rt.prefill(lane, torch.tensor(ids), logits="all").logits.numpy()
        rt.free_lane(lane)
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += len(ids)
        final_cos.append(float(cosine(got[-1], expected[-1])))
    result = {"top1": agree / total, "positions": total, "min_final_cosine": min(final_cos)}
    print(f"\n{path.name}: {result}")
    return result


def test_smollm2_matches_llama_cpp_on_f16(smollm2_f16, corpus):
    r = compare_on_corpus(smollm2_f16, corpus)
    assert r["top1"] >= 0.99
    assert r["min_final_cosine"] >= 0.9999


@pytest.mark.slow
def test_gemma3_matches_llama_cpp_on_f16(gemma3_f16, corpus):
    r = compare_on_corpus(gemma3_f16, corpus)
    assert r["top1"] >= 0.99
    assert r["min_final_cosine"] >= 0.9999


def test_synthetic_qwen3_f32_matches_llama_cpp(qwen3_f32, corpus):
    """f32 weights on both sides: the only differences are summation order."""
    ref = LlamaCppReference(qwen3_f32)
    rt = whole_model(qwen3_f32)
    worst, checked, decided = 0.0, 0, 0
    for record in first_of_each_use_case(corpus, 1):
        ids = prompt_ids(ref, record)[:160]
        expected = ref.logits(ids)
        lane = rt.alloc_lane()
        got = rt.prefill(lane, torch.tensor(ids), logits="all").logits.numpy()
        rt.free_lane(lane)
        worst = max(worst, float(np.abs(got - expected).max()))
        top2 = np.sort(expected, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1e-3
        assert (got.argmax(-1)[clear] == expected.argmax(-1)[clear]).all()
        checked += len(ids)
        decided += int(clear.sum())
    print(f"\nqwen3 f32: max |dlogit| {worst:.2e} over {checked} positions "
          f"({decided} with a top-2 margin > 1e-3)")
    assert worst <= 1e-3
