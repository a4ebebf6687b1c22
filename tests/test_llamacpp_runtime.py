"""The llama.cpp runtime: a whole model on llama.cpp, lanes as sequences of one context,
each with a KV stream of its own.

What is bitwise here and why is in stages/llamacpp_runtime.py's docstring. In short: the
cache paths (copy_lane, export/import, trimmed export, snapshots) give bitwise what a cold
prefill in the same chunking gives, and a lane's logits do not depend on the other lanes:
not on what they hold, not on which lanes decode beside it, not on lanes freed around it.
"""

from __future__ import annotations

import pytest
import torch

from skippy.evals.reference import LlamaCppReference
from skippy.stages.llamacpp_runtime import LlamaCppError, LlamaCppStageRuntime
from skippy.stages.runtime import LaneState, StageError, StageSpec
from skippy.topology.gguf_file import GGUFFile

CHUNK = 64  # the default chunk: llama.cpp runs it as one micro-batch
PROMPT = [(i * 7919) % 19000 + 100 for i in range(200)]  # boundaries 64, 128, 192
STEPS = 16
TEXT = ("The cache contract is simple: with the cache on, outputs must be identical to the "
        "cache off, the same greedy tokens and bitwise-equal logits for the same request. "
        "A restored prefix is bitwise what a cold run computes, and the suffix runs the same "
        "kernels on the same shapes. Rows made by decode steps are not prefill rows.")


def spec(path, **kw) -> StageSpec:
    # One thread: the arithmetic is the same as on two (decode runs single-token
    # micro-batches on one thread anyway), and ggml's spinning thread pool slows down
    # badly when the test machine's two cores are busy with other work.
    n = int(GGUFFile(path).arch_key("block_count"))
    return StageSpec(str(path), 0, n, **{"n_ctx": 1024, "chunk": CHUNK, "threads": 1, **kw})


def runtime(path, *, max_lanes=8, **kw) -> LlamaCppStageRuntime:
    return LlamaCppStageRuntime(spec(path, **kw), max_lanes=max_lanes)


def greedy(rt, lane, logits, steps=STEPS) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation from `logits`: the tokens and every step's logits."""
    tokens, rows = [], [logits]
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(rt.decode([(lane, torch.tensor(tokens[-1]))])[0].logits)
    return tokens, torch.stack(rows)


@pytest.fixture(scope="module")
def lfm2(smollm2, tmp_path_factory):
    from skippy.stages.synth import write_synthetic
    out = tmp_path_factory.mktemp("synth") / "lfm2-L6.gguf"
    return write_synthetic("lfm2", layers=6, seed=1, out=out, tokenizer_from=smollm2)


@pytest.fixture(scope="module", params=["smollm2", "qwen3_f32"])
def dense(request):
    """(path, runtime, a second runtime: another llama.cpp context of the same model)."""
    path = request.getfixturevalue(request.param)
    a, b = runtime(path), runtime(path)
    yield path, a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def cold(dense):
    """A cold run of PROMPT in a fresh lane: prompt logits and the greedy continuation."""
    _, rt, _ = dense
    lane = rt.alloc_lane()
    logits = rt.prefill(lane, torch.tensor(PROMPT)).logits
    tokens, rows = greedy(rt, lane, logits)
    rt.free_lane(lane)
    return tokens, rows


def free_all(rt):
    for lane in list(rt._lanes):
        rt.free_lane(lane)


# -- numerics against llama.cpp's own high-level path ---------------------------------------
# Same engine, different shapes: the reference prefills the 71-token prompt as one batch,
# without flash attention, with an f32 KV cache. This runtime uses 32-row micro-batches
# and flash attention. Measured max |Δ| on the last row: SmolLM2 Q4_1 0.44, with 90 %
# top-1 over all rows. Every Q4_1 matmul quantizes its activations to 8 bits, which
# magnifies small differences. The f32 synthetic qwen3: 4.2e-3, 100 % top-1.
@pytest.mark.parametrize("name, bound, top1", [("smollm2", 1.0, 0.85), ("qwen3_f32", 1e-2, 1.0)])
def test_prefill_logits_agree_with_the_llama_cpp_reference(request, name, bound, top1):
    path = request.getfixturevalue(name)
    reference = LlamaCppReference(path, n_ctx=256, threads=1)
    ids = reference.llm.tokenize(TEXT.encode(), add_bos=False)
    ref = reference.logits(ids)
    rt = runtime(path)
    lane = rt.alloc_lane()
    last = rt.prefill(lane, torch.tensor(ids)).logits
    rows = rt.prefill(lane, torch.tensor(ids), logits="all").logits
    rt.close()
    assert last.shape == (ref.shape[1],) and last.dtype == torch.float32
    assert rows.shape == ref.shape
    assert int(last.argmax()) == int(ref[-1].argmax())
    assert float((last - torch.from_numpy(ref[-1])).abs().max()) < bound
    assert (rows.argmax(1).numpy() == ref.argmax(1)).mean() >= top1


# -- cache paths are bitwise a cold prefill -------------------------------------------------
def test_copy_lane_then_tail_is_bitwise_a_cold_prefill(dense, cold):
    _, rt, _ = dense
    tokens, rows = cold
    for b in (CHUNK, 2 * CHUNK, 3 * CHUNK):  # at 192 only the 8-row last chunk runs
        src = rt.alloc_lane()  # a prompt that shares only the first b tokens
        rt.prefill(src, torch.tensor(PROMPT[:b] + [5] * 40), logits="none")
        dst = rt.alloc_lane()
        rt.copy_lane(src, dst, b)
        rt.free_lane(src)  # dst keeps the shared cells
        assert rt.lane_length(dst) == rt.prefill_boundary(dst) == b
        logits = rt.prefill(dst, torch.tensor(PROMPT[b:]), start=b).logits
        assert torch.equal(logits, rows[0]), f"prefill logits differ after copy at {b}"
        got_tokens, got_rows = greedy(rt, dst, logits)
        assert got_tokens == tokens
        assert torch.equal(got_rows, rows), f"decode differs after copy at {b}"
        rt.free_lane(dst)


def test_resuming_inside_long_prompts_is_bitwise(smollm2):
    # 600 tokens run as micro-batches [0, 256), [256, 512), [512, 576), [576, 600): the
    # last chunk alone. Resumed at 64 the first is [64, 256), at 320 [320, 512); every
    # row takes the same kernel as in the cold run (the tiled one, but for the last 24).
    long = [(i * 4451) % 17000 + 200 for i in range(600)]
    rt = runtime(smollm2, max_lanes=2)
    assert rt.micro_batch == 256
    assert list(rt._segments(0, 600)) == [(0, 256), (256, 512), (512, 576), (576, 600)]
    assert list(rt._segments(320, 600)) == [(320, 512), (512, 576), (576, 600)]
    lane = rt.alloc_lane()
    cold = rt.prefill(lane, torch.tensor(long)).logits
    for b in (64, 320, 512, 576):
        rt.copy_lane(lane, lane, b)
        warm = rt.prefill(lane, torch.tensor(long[b:]), start=b).logits
        assert torch.equal(warm, cold), f"resume at {b} differs"
    rt.close()


def test_a_cold_prefill_does_not_depend_on_where_its_cells_sit(dense, cold):
    _, rt, _ = dense
    filler = [rt.alloc_lane() for _ in range(3)]
    for i, lane in enumerate(filler):  # 40, 80, 120 cells ahead of the new lane
        rt.prefill(lane, torch.tensor([7 + i] * 40 * (i + 1)), logits="none")
    lane = rt.alloc_lane()
    logits = rt.prefill(lane, torch.tensor(PROMPT)).logits
    assert torch.equal(greedy(rt, lane, logits)[1], cold[1])
    free_all(rt)


def test_export_import_is_bitwise_in_another_lane_and_another_context(dense, cold):
    _, rt, other = dense
    tokens, rows = cold
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT), logits="none")
    state = rt.export_state(lane, len(PROMPT))
    assert set(state.fixed) == {"llama_state"} and not state.keys and not state.values
    assert state.fixed["llama_state"].dtype == torch.uint8
    assert (state.n_tokens, state.prefilled) == (len(PROMPT), len(PROMPT))
    for target in (rt, other):
        dst = target.alloc_lane()
        target.prefill(dst, torch.tensor([9] * 70), logits="none")  # cleared by import
        target.import_state(dst, state)
        assert target.lane_length(dst) == len(PROMPT)
        assert target.prefill_boundary(dst) == 3 * CHUNK
        got_tokens, got_rows = greedy(target, dst, rows[0])
        assert got_tokens == tokens
        assert torch.equal(got_rows, rows)
    # Re-exporting the imported lane gives the same bytes (roundtrip_state_matches): all
    # exports go through one scratch sequence id, which llama.cpp writes into the bytes.
    again = other.export_state(dst, len(PROMPT))
    assert torch.equal(again.fixed["llama_state"], state.fixed["llama_state"])
    free_all(rt)
    free_all(other)


def test_a_state_loads_only_where_the_stream_count_matches(smollm2):
    # llama.cpp refuses a sequence state from a context with another number of streams;
    # the identity says so, so that no cache offers one to the other.
    a, b = runtime(smollm2, max_lanes=2), runtime(smollm2, max_lanes=3)
    assert a.identity()["kv_layout"] != b.identity()["kv_layout"]
    lane = a.alloc_lane()
    a.prefill(lane, torch.tensor(PROMPT[:64]), logits="none")
    dst = b.alloc_lane()
    with pytest.raises(LlamaCppError, match="n_stream mismatch"):
        b.import_state(dst, a.export_state(lane, 64))
    assert b.lane_length(dst) == 0
    a.close()
    b.close()


def test_a_trimmed_export_and_a_snapshot_resume_bitwise(dense, cold):
    _, rt, other = dense
    _, rows = cold
    lane = rt.alloc_lane()
    out = rt.prefill(lane, torch.tensor(PROMPT), snapshots=(CHUNK, 2 * CHUNK))
    assert torch.equal(out.logits, rows[0])
    rt.decode([(lane, torch.tensor(1))])  # a decode row past the prompt
    for b in (CHUNK, 2 * CHUNK):
        trimmed = rt.export_state(lane, b)
        assert torch.equal(trimmed.fixed["llama_state"], out.snapshots[b].fixed["llama_state"])
        for state in (out.snapshots[b], trimmed):
            assert (state.n_tokens, state.prefilled) == (b, b)
            dst = other.alloc_lane()
            other.import_state(dst, state)
            logits = other.prefill(dst, torch.tensor(PROMPT[b:]), start=b).logits
            assert torch.equal(logits, rows[0]), f"resume at {b} differs"
            other.free_lane(dst)
    # the trim used the scratch sequence and left the lane whole
    assert rt.lane_length(lane) == len(PROMPT) + 1
    assert rt.export_state(lane, 0).n_tokens == 0
    free_all(rt)


# -- lanes are independent ------------------------------------------------------------------
def test_a_lane_decodes_the_same_alone_or_beside_other_lanes(dense, cold):
    _, rt, _ = dense
    tokens, rows = cold
    a, b = rt.alloc_lane(), rt.alloc_lane()
    la = rt.prefill(a, torch.tensor(PROMPT)).logits
    lb = rt.prefill(b, torch.tensor(PROMPT[:100])).logits
    for t in range(STEPS):
        out = rt.decode([(b, torch.tensor(int(lb.argmax()))),
                         (a, torch.tensor(tokens[t]))])
        lb, la = out[0].logits, out[1].logits
        assert torch.equal(la, rows[t + 1])
    free_all(rt)


def test_padded_decode_groups_make_neighbours_irrelevant(dense):
    path, _, _ = dense
    rt = runtime(path, lane_batch=4)
    lanes = [rt.alloc_lane() for _ in range(3)]
    first = [rt.prefill(lane, torch.tensor(PROMPT[: 60 + 30 * i])).logits for i, lane in
             enumerate(lanes)]
    token = [torch.tensor(int(x.argmax())) for x in first]
    alone = rt.decode([(lanes[0], token[0])])[0].logits
    rt.copy_lane(lanes[0], lanes[0], 60)  # undo that step
    together = rt.decode([(lane, t) for lane, t in zip(lanes, token)])
    assert torch.equal(together[0].logits, alone)
    assert [rt.lane_length(lane) for lane in lanes] == [61, 91, 121]
    rt.close()


def test_a_long_lane_on_two_threads_is_exact_whatever_its_neighbours(smollm2):
    # A one-row micro-batch over >= 512 cells splits the cells between the threads. In a
    # private stream the split depends on the lane's own length only: the same on a cold
    # lane, beside a busy neighbour, and after an export/import. The thread count does
    # change the sums, which is why it is in the identity.
    long = [(i * 4451) % 17000 + 200 for i in range(600)]
    two = runtime(smollm2, threads=2, max_lanes=3)
    cold = two.alloc_lane()
    expected = greedy(two, cold, two.prefill(cold, torch.tensor(long)).logits, 3)[1]
    two.free_lane(cold)
    busy = two.alloc_lane()
    two.prefill(busy, torch.tensor([11] * 300), logits="none")
    lane = two.alloc_lane()
    logits = two.prefill(lane, torch.tensor(long)).logits
    state = two.export_state(lane, len(long))
    rows = [logits]
    for _ in range(3):  # the neighbour decodes in the same steps
        out = two.decode([(busy, torch.tensor(5)), (lane, torch.tensor(int(rows[-1].argmax())))])
        rows.append(out[1].logits)
    assert torch.equal(torch.stack(rows), expected)
    moved = two.alloc_lane()
    two.free_lane(lane)
    two.import_state(moved, state)
    assert torch.equal(greedy(two, moved, logits, 3)[1], expected)
    two.close()
    one = runtime(smollm2, threads=1, max_lanes=1)
    lane = one.alloc_lane()
    on_one = greedy(one, lane, one.prefill(lane, torch.tensor(long)).logits, 3)[1]
    one.close()
    assert torch.equal(on_one[0], expected[0])  # same prefill (row batches, no split)
    assert not torch.equal(on_one[1:], expected[1:])  # the split-KV decode differs


LONG = [(i * 4451) % 17000 + 200 for i in range(800)]


@pytest.mark.parametrize("lane_batch", [1, 2])
def test_decode_rows_are_the_same_alone_and_together(smollm2, lane_batch):
    # Two threads, so that a long lane alone takes the split-KV path (module docstring).
    # lane_batch 1: each long lane alone, then the short ones in one call (the long lane
    # between them takes a padding row there); 2: all four in one call. Either way every
    # row equals that lane's row decoded alone.
    rt = runtime(smollm2, threads=2, lane_batch=lane_batch, max_lanes=4)
    lengths = (40, 700, 200, 300)  # two under SPLIT_KV_LENGTH, two over
    lanes = [rt.alloc_lane() for _ in lengths]
    for lane, n in zip(lanes, lengths):
        rt.prefill(lane, torch.tensor(LONG[:n]), logits="none")
    alone = []
    for lane, n in zip(lanes, lengths):
        alone.append(rt.decode([(lane, torch.tensor(42))])[0].logits)
        rt.copy_lane(lane, lane, n)  # undo the step
    calls = []
    run = rt._run
    rt._run = lambda rows, want: (calls.append(len(rows)), run(rows, want))
    together = rt.decode([(lane, torch.tensor(42)) for lane in lanes])
    assert calls == ([1, 1, 3] if lane_batch == 1 else [4])
    for a, t in zip(alone, together):
        assert torch.equal(a, t.logits)
    assert [rt.lane_length(lane) for lane in lanes] == [n + 1 for n in lengths]
    rt.close()


def test_a_long_lane_alone_decodes_beside_a_padding_row_with_lane_batch_2(smollm2):
    # Its row then takes the path it takes beside other lanes, not the split-KV path.
    grouped = runtime(smollm2, threads=2, lane_batch=2, max_lanes=2)
    split = runtime(smollm2, threads=2, max_lanes=2)
    rows = []
    for rt in (grouped, split):
        lane = rt.alloc_lane()
        logits = rt.prefill(lane, torch.tensor(LONG[:300])).logits
        rows.append(greedy(rt, lane, logits, 2)[1])
        rt.close()
    assert torch.equal(rows[0][0], rows[1][0])      # the same prefill
    assert not torch.equal(rows[0][1:], rows[1][1:])  # decoded on another path
    assert grouped.identity() != split.identity()


def test_sliding_window_and_recurrent_models_decode_each_lane_alone(gemma3, lfm2):
    # Gemma 3's rows change with the other lanes' lengths (module docstring).
    for path in (gemma3, lfm2):
        rt = runtime(path, lane_batch=2)
        assert rt.identity()["numeric_policy"]["decode_groups"] == "none"
        rt.close()


@pytest.mark.parametrize("n1, common, n2, start", [
    (40, 30, 50, 30),        # both prompts are one last chunk: resume at the first new row
    (600, 590, 610, 590),    # both last chunks begin at 576, past 512 cells
    (300, 299, 300, 298),    # not one row alone over >= 512 cells: one row earlier
    (200, 150, 230, 128),    # the prompts part before the last chunk: its boundary
    (100, 90, 140, 64),      # last chunks begin at 64 and 128: the boundary
])
def test_a_prompt_resumes_inside_the_last_chunk_it_shares_with_the_lane(smollm2, n1, common,
                                                                        n2, start):
    # Two threads: a lone row over >= 512 cells would take the split-KV path.
    rt = runtime(smollm2, threads=2, n_ctx=2048, max_lanes=2)
    first = LONG[:n1] if n1 <= len(LONG) else (LONG * 2)[:n1]
    second = first[:common] + [(i * 31) % 9000 + 300 for i in range(n2 - common)]
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(first), logits="none")
    assert rt.resume_point(lane, common, n2) == start
    warm = rt.prefill(lane, torch.tensor(second[start:]), start=start).logits
    cold_lane = rt.alloc_lane()
    cold = rt.prefill(cold_lane, torch.tensor(second)).logits
    assert torch.equal(greedy(rt, lane, warm, 3)[1], greedy(rt, cold_lane, cold, 3)[1])
    rt.close()


def test_copied_rows_resume_only_at_chunk_boundaries(smollm2):
    rt = runtime(smollm2, max_lanes=2)
    a, b = rt.alloc_lane(), rt.alloc_lane()
    rt.prefill(a, torch.tensor(LONG[:40]), logits="none")
    assert rt.resume_point(a, 30, 50) == 30
    rt.copy_lane(a, b, 40)  # how b's rows ran is not known to b
    assert rt.resume_point(b, 30, 50) == 0
    with pytest.raises(StageError, match="multiple of 64"):
        rt.prefill(b, torch.tensor(LONG[30:50]), start=30)
    rt.close()


def test_a_full_neighbour_still_takes_its_padding_row(smollm2):
    rt = runtime(smollm2, n_ctx=128, lane_batch=2, max_lanes=2)
    full, lane = rt.alloc_lane(), rt.alloc_lane()
    rt.prefill(full, torch.tensor(PROMPT[:128]), logits="none")
    logits = rt.prefill(lane, torch.tensor(PROMPT[:100])).logits
    with pytest.raises(StageError, match="full"):
        rt.decode([(full, torch.tensor(1))])
    rt.decode([(lane, torch.tensor(int(logits.argmax())))])
    assert (rt.lane_length(full), rt.lane_length(lane)) == (128, 101)
    rt.close()


def test_a_lane_freed_ahead_changes_nothing(smollm2):
    # In a unified cache llama.cpp would put the next token into the hole the freed lane
    # left, ahead of this lane's cells, and the sums changed (max |Δ| 0.50 on this
    # prompt). With a stream per lane there is no such hole.
    rt = runtime(smollm2)
    ref = rt.alloc_lane()
    expected = greedy(rt, ref, rt.prefill(ref, torch.tensor(PROMPT)).logits, 4)[1]
    rt.free_lane(ref)
    ahead = rt.alloc_lane()
    rt.prefill(ahead, torch.tensor(PROMPT[:64]), logits="none")
    lane = rt.alloc_lane()
    logits = rt.prefill(lane, torch.tensor(PROMPT)).logits
    rt.free_lane(ahead)
    assert torch.equal(greedy(rt, lane, logits, 4)[1], expected)
    rt.close()


# -- recurrent state (LFM2: short convolutions + attention) ---------------------------------
def test_recurrent_lanes_resume_only_from_whole_states(lfm2):
    rt = runtime(lfm2, lane_batch=2)
    other = runtime(lfm2)
    assert rt.recurrent
    # a padding row would advance a neighbour's recurrent state for good: groups of one
    assert rt.identity()["numeric_policy"]["decode_groups"] == "none"
    lane = rt.alloc_lane()
    out = rt.prefill(lane, torch.tensor(PROMPT), snapshots=(CHUNK, 2 * CHUNK))
    tokens, rows = greedy(rt, lane, out.logits, 4)
    for b, state in out.snapshots.items():
        dst = other.alloc_lane()
        other.import_state(dst, state)
        logits = other.prefill(dst, torch.tensor(PROMPT[b:]), start=b).logits
        assert torch.equal(logits, out.logits), f"resume from snapshot {b} differs"
        got_tokens, got_rows = greedy(other, dst, logits, 4)
        assert got_tokens == tokens and torch.equal(got_rows, rows)
        other.free_lane(dst)
    with pytest.raises(StageError, match="cannot be cut"):
        rt.export_state(lane, CHUNK)
    dst = rt.alloc_lane()
    with pytest.raises(StageError, match="cannot be cut"):
        rt.copy_lane(lane, dst, CHUNK)
    rt.copy_lane(lane, dst, rt.lane_length(lane))  # whole: fine
    with pytest.raises(StageError, match="rolled back"):
        rt.prefill(lane, torch.tensor(PROMPT[CHUNK:]), start=CHUNK)
    rt.close()
    other.close()


# -- Gemma 3 (sliding-window layers), a prompt inside the 512-token window -----------------
@pytest.mark.slow
def test_gemma3_cache_paths_are_bitwise(gemma3):
    rt = runtime(gemma3)
    cold = rt.alloc_lane()
    logits = rt.prefill(cold, torch.tensor(PROMPT)).logits
    expected = greedy(rt, cold, logits, 4)
    src = rt.alloc_lane()
    rt.prefill(src, torch.tensor(PROMPT[:CHUNK] + [5] * 10), logits="none")
    warm = rt.alloc_lane()
    rt.copy_lane(src, warm, CHUNK)
    got = rt.prefill(warm, torch.tensor(PROMPT[CHUNK:]), start=CHUNK).logits
    assert torch.equal(got, logits)
    assert torch.equal(greedy(rt, warm, got, 4)[1], expected[1])
    moved = rt.alloc_lane()
    rt.import_state(moved, rt.export_state(src, CHUNK))
    assert torch.equal(rt.prefill(moved, torch.tensor(PROMPT[CHUNK:]), start=CHUNK).logits,
                       logits)
    rt.close()


# -- identity and errors --------------------------------------------------------------------
def test_identity_names_the_engine_and_the_weights(dense):
    path, rt, other = dense
    ident = rt.identity()
    assert ident == other.identity()  # nothing per-process
    assert ident["runtime_abi"].startswith("llama.cpp/")
    assert ident["layer_range"] == [0, int(GGUFFile(path).arch_key("block_count"))]
    assert ident["kv_dtype"] == "f16" and ident["n_ctx"] == 1024
    assert ident["numeric_policy"]["chunk"] == CHUNK
    assert ident["numeric_policy"]["micro_batch"] == 256
    assert len(ident["weights_digest"]) == 64


def test_weights_digest_differs_between_models(smollm2, qwen3_f32):
    a = runtime(smollm2)
    b = runtime(qwen3_f32)
    assert a.identity()["weights_digest"] != b.identity()["weights_digest"]
    a.close()
    b.close()


def test_a_split_model_is_refused_in_one_line(smollm2):
    for s in (StageSpec(str(smollm2), 0, 15, 0, 2), StageSpec(str(smollm2), 15, 30, 1, 2),
              StageSpec(str(smollm2), 0, 29)):
        with pytest.raises(StageError) as e:
            LlamaCppStageRuntime(s)
        assert str(e.value) == "the llama.cpp runtime serves a whole model (--stages 1)"


def test_caller_mistakes_raise_stage_errors(dense):
    path, rt, _ = dense
    lane = rt.alloc_lane()
    with pytest.raises(StageError, match="unknown lane"):
        rt.prefill(99, torch.tensor(PROMPT))
    with pytest.raises(StageError, match="unknown lane"):
        rt.decode([(99, torch.tensor(1))])
    with pytest.raises(StageError, match="unknown lane"):
        rt.copy_lane(lane, 99, 0)
    with pytest.raises(StageError, match="unknown lane"):
        rt.export_state(99, 0)
    rt.prefill(lane, torch.tensor(PROMPT), logits="none")
    with pytest.raises(StageError, match="multiple of 64"):
        rt.prefill(lane, torch.tensor(PROMPT[10:]), start=10)
    with pytest.raises(StageError, match="at most 192"):
        rt.prefill(lane, torch.tensor(PROMPT), start=256)
    with pytest.raises(StageError, match="snapshot boundaries"):
        rt.prefill(lane, torch.tensor(PROMPT), snapshots=(100,))
    with pytest.raises(StageError, match="out of range"):
        rt.prefill(lane, torch.tensor([10 ** 7]))
    with pytest.raises(StageError, match="exceed the context"):
        rt.prefill(lane, torch.tensor([1] * 1025))
    with pytest.raises(StageError, match="once per decode step"):
        rt.decode([(lane, torch.tensor(1)), (lane, torch.tensor(2))])
    with pytest.raises(StageError, match="holds"):
        rt.export_state(lane, len(PROMPT) + 1)
    with pytest.raises(StageError, match="not a llama.cpp state"):
        rt.import_state(lane, LaneState(4, 4, keys=[torch.zeros(4, 1, 1)],
                                        values=[torch.zeros(4, 1, 1)]))
    with pytest.raises(StageError, match="micro-batch"):
        runtime(path, chunk=4)  # 8 lanes decode together in a micro-batch of 9 rows
    free_all(rt)


def test_garbage_state_is_refused_and_leaves_the_lane_empty(dense):
    _, rt, _ = dense
    lane = rt.alloc_lane()
    rt.prefill(lane, torch.tensor(PROMPT[:64]), logits="none")
    junk = LaneState(8, 8, fixed={"llama_state": torch.full((64,), 7, dtype=torch.uint8)})
    with pytest.raises(LlamaCppError, match="refused"):
        rt.import_state(lane, junk)
    assert rt.lane_length(lane) == 0
    rt.prefill(lane, torch.tensor(PROMPT[:64]), logits="none")  # still usable
    free_all(rt)


def test_lanes_run_out_and_come_back(smollm2):
    rt = runtime(smollm2, max_lanes=2)
    a, _ = rt.alloc_lane(), rt.alloc_lane()
    with pytest.raises(StageError, match="lanes are in use"):
        rt.alloc_lane()
    rt.free_lane(a)
    assert rt.alloc_lane() == a
    rt.close()
    with pytest.raises(StageError):
        rt.alloc_lane()
