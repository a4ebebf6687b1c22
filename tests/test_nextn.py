"""A file's NextN layer as speculation's proposer (stages/nextn.py): a synthetic deepseek2
file with one NextN layer after its trunk (as GLM-4.7-Flash ships them). llama.cpp loads
it and the trunk follows llama.cpp; the last stage loads the layer (and plans its bytes);
its rows made step by step are the rows of one pass; and with its proposals, wrong or
right, every answer through 1 and 2 stages is bitwise the answer without speculation.
No file with trained NextN layers is reachable from these machines: how often its
proposals hold is left to real hardware."""

from __future__ import annotations

import pytest
import torch

from family_checks import check_agreement
from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.sampler import SamplingParams
from skippy.stages.factory import make_runtime
from skippy.stages.nextn import NextN
from skippy.stages.runtime import StageSpec
from skippy.stages.runtime_kind import TORCH
from skippy.stages.synth import write_synthetic
from skippy.stages.weights import owned_tensor_names
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig
from skippy.topology.planner import ModelFacts

TRUNK = 3
PROMPT = tuple((i * 7919) % 30000 + 100 for i in range(40))


@pytest.fixture(scope="module")
def nextn_file(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("nextn") / "deepseek2-nextn.gguf"
    return write_synthetic("deepseek2", layers=TRUNK, seed=11, out=out,
                           tokenizer_from=smollm2, nextn=1)


def test_the_trunk_follows_llama_cpp_and_the_last_stage_holds_the_layer(nextn_file):
    check_agreement(nextn_file, "deepseek2 + NextN", length=96, steps=8)
    f = GGUFFile(nextn_file)
    cfg = ModelConfig.from_gguf(f)
    assert (cfg.n_layers, cfg.nextn_layers) == (TRUNK, 1)
    last = owned_tensor_names(f, cfg, 2, TRUNK, first=False, last=True)
    assert f"blk.{TRUNK}.nextn.eh_proj.weight" in last and "token_embd.weight" in last
    assert f"blk.{TRUNK}.attn_norm.weight" in last
    assert not any(n.startswith(f"blk.{TRUNK}.") for n in
                   owned_tensor_names(f, cfg, 0, 2, first=True, last=False))
    facts = ModelFacts.from_gguf(nextn_file, weight_bytes=4)
    layer = sum(i.n_elements for n, i in f.tensors.items() if n.startswith(f"blk.{TRUNK}."))
    head = f.tensors["output.weight"].n_elements + f.tensors["output_norm.weight"].n_elements
    assert facts.last_bytes == 4 * (layer + head + f.tensors["token_embd.weight"].n_elements)
    assert len(facts.layer_bytes) == TRUNK


def _runtime(path):
    return make_runtime(StageSpec(str(path), 0, TRUNK, 0, 1, "f32", n_ctx=256,
                                  weight_format="int4"), TORCH)


def test_rows_made_step_by_step_are_the_rows_of_one_pass(nextn_file):
    rt = _runtime(nextn_file)
    lane = rt.alloc_lane()
    out = rt.prefill(lane, torch.tensor(PROMPT))
    seq, rows = list(PROMPT), [out.trunk]
    seq.append(int(torch.argmax(out.logits)))
    rt.nextn.extend(lane, seq, 0, out.trunk)
    for _ in range(5):  # one decode row at a time, then a two-row step
        o, = rt.decode([(lane, torch.tensor(seq[-1]))])
        rows.append(o.trunk)
        seq.append(int(torch.argmax(o.logits)))
        rt.nextn.step(lane, len(seq) - 2, seq[-2], [seq[-1]], o.trunk)
    stepped = rt.nextn.propose(lane, 4)
    alone = NextN.__new__(NextN)
    alone.__dict__.update({**rt.nextn.__dict__, "_lanes": {}})
    alone.extend(9, seq, 0, torch.cat(rows))
    assert alone.propose(9, 4) == stepped
    assert torch.equal(alone._lanes[9].last, rt.nextn._lanes[lane].last)
    # a step that skipped the proposer (under load): its row left out, the others stand
    o, = rt.decode([(lane, torch.tensor(seq[-1]))])
    seq.append(int(torch.argmax(o.logits)))
    o, = rt.decode([(lane, torch.tensor(seq[-1]))])
    seq.append(int(torch.argmax(o.logits)))
    rt.nextn.step(lane, len(seq) - 2, seq[-2], [seq[-1]], o.trunk)
    assert rt.nextn._lanes[lane].positions == [*range(len(seq) - 3), len(seq) - 2]
    # another prompt sharing the first 30 tokens: rows stand while their tokens do
    other = [*PROMPT[:30], 7, 8, 9]
    rt.nextn.extend(lane, [*other, 5, 6], 30, out.trunk[:4])
    assert rt.nextn._lanes[lane].positions == [*range(29), 30, 31, 32, 33]


class Oracle:
    """In place of the proposer's proposals, once the answer without speculation is
    known: that answer, wrong on purpose every third token."""
    truth: list[int] = []
    prompt = 0
    calls = 0
    real = NextN.propose

    @staticmethod
    def propose(nextn, lane, k):
        if not Oracle.truth:
            return Oracle.real(nextn, lane, k)
        Oracle.calls += 1
        at = len(nextn._lanes[lane].tokens) - Oracle.prompt
        out = Oracle.truth[at:at + k]
        return [t if (i + Oracle.calls) % 3 else (t + 1) % 1000 for i, t in enumerate(out)]


SAMPLINGS = [SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=0.9, seed=11, top_k=40, logprobs=1)]


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("proposals", ["its own", "mostly right"])
def test_its_proposals_leave_every_answer_the_same(nextn_file, stages, proposals,
                                                   monkeypatch):
    Oracle.calls = 0
    if proposals == "mostly right":
        monkeypatch.setattr(NextN, "propose", Oracle.propose)
    engine = InProcessEngine(nextn_file, stages, weight_format="int4",
                             cache=CacheConfig(enabled=False))
    for sampling in SAMPLINGS:
        Oracle.truth = []
        off = engine.complete(PROMPT, 24, sampling=sampling, speculate=False, logits=True)
        Oracle.truth, Oracle.prompt = [s.token for s in off], len(PROMPT)
        on = engine.complete(PROMPT, 24, sampling=sampling, speculate=True, logits=True)
        assert [s.token for s in on] == [s.token for s in off]
        assert [s.logprobs for s in on] == [s.logprobs for s in off]
        assert all(a.logits.numpy().tobytes() == b.logits.numpy().tobytes()
                   for a, b in zip(off, on))
    figures = engine.servers[-1].speculation
    print(f"\n{stages} stage(s), {proposals}: {figures}")
    assert figures["verify_steps"] > 0, figures
    if proposals == "mostly right":  # the stage's proposals verified: runs taken, and
        assert Oracle.calls > 0  # cut short where they were wrong
        assert 0 < figures["accepted_tokens"] < figures["proposed_tokens"], figures
