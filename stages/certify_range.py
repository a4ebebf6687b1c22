"""Certify one stage of a model alone: `skippy certify --model PKG --stage A..B`.

A giant model's late stage must be checked without materialising the layers before it
(the specification's DeepSeek3 proof: only the selected stage's parts are opened). The
stage [A, B) takes deterministic synthetic upstream activations instead: rows drawn from a
fixed seed, one per position, so every run and every check feeds the same rows to the
same positions (stage 0 takes fixed token ids instead). Its outputs — every frame row of a
middle stage, the logits of the last — are compared bitwise:

- split_handoff: [A, B) cut in two stages with the f32 wire against [A, B) whole.
- restore_equals_recompute / repeated_hits: state snapshotted at a chunk boundary while
  prefilling other rows that share the prefix, through a block store, continued.
- full_state: the whole state after the prompt, exported, imported, continued.
- row_invariant: as in stages/certify_rows.py.
Diagnostics as in stages/certify.py.
"""

from __future__ import annotations

import numpy as np
import torch

from skippy.cache.blocks import BlockStore
from skippy.cache.payload import PayloadKind
from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model
from skippy.topology.tally import Progress, Tally

from .certify import (CHUNK, STEPS, Check, Report,
                      max_abs_diff, state_bytes, through_store)
from .certify_rows import row_invariance
from .frame import to_wire
from .runtime import StageError, StageSpec
from .runtime_kind import REFERENCE_FORMAT, TORCH, RuntimeKind

SEED = 19


def parse_range(text: str, n_layers: int | None = None) -> tuple[int, int]:
    """'A..B' -> (A, B): layers A up to, not including, B."""
    a, sep, b = text.partition("..")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit():
        raise StageError(f"--stage takes A..B (layers A up to B, B excluded), not {text!r}")
    start, end = int(a), int(b)
    if start >= end or (n_layers is not None and end > n_layers):
        raise StageError(f"--stage {text}: need 0 <= A < B <= {n_layers or 'the layer count'}")
    return start, end


class _Upstream:
    """What the stages before [A, B) would send: token ids at stage 0, else rows [n, hidden]
    of N(0, 1) floats, drawn once per position from a fixed seed."""

    def __init__(self, cfg: ModelConfig, first: bool, n: int, seed: int = SEED):
        rng = np.random.default_rng(seed)
        self.first = first
        self.ids = torch.as_tensor(rng.integers(50, min(cfg.vocab, 30000), n))
        self.rows = torch.from_numpy(rng.standard_normal((n, cfg.hidden), dtype=np.float32))

    def inputs(self, start: int, end: int, other_from: int | None = None):
        """Positions [start, end); from `other_from` on, another prompt's (same prefix)."""
        cut = max(0, (end if other_from is None else other_from) - start)
        if self.first:
            ids = self.ids[start:end].clone()
            ids[cut:] = 7
            return ids
        rows = self.rows[start:end].clone()
        rows[cut:] *= -1
        return to_wire(start, rows, "f32")


def _stages(path, cfg: ModelConfig, cuts: list[int], weight_format: str,
            runtime: RuntimeKind):
    """Runtimes for consecutive ranges between `cuts`, numbered as inside the whole model
    (a stage ending at the last layer is a last stage: it computes logits)."""
    last = cuts[-1] == cfg.n_layers
    n = len(cuts) - 1
    total = (cuts[0] > 0) + n + (not last)
    first_index = int(cuts[0] > 0)
    return [runtime.make(StageSpec(str(path), a, b, first_index + i, total, "f32", n_ctx=1024,
                                   chunk=CHUNK, weight_format=weight_format))
            for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def _run(stages, lanes, up: _Upstream, n: int, start: int = 0, other_from: int | None = None,
         snapshots=()):
    """Prefill positions [start, n), then STEPS decode steps: the last stage's outputs (its
    last logits or frame row, then each step's) and each stage's snapshots."""
    x, snaps, out = up.inputs(start, n, other_from), [], None
    for s, lane in zip(stages, lanes):
        out = s.prefill(lane, x, start, "last", snapshots=snapshots)
        snaps.append(out.snapshots)
        x = out.frame
    return [_output(out)] + _decode(stages, lanes, up, n), snaps


def _decode(stages, lanes, up: _Upstream, n: int) -> list[torch.Tensor]:
    """STEPS decode steps after position n: the last stage's output of each."""
    seq = []
    for p in range(n, n + STEPS):
        x = up.inputs(p, p + 1)
        for s, lane in zip(stages, lanes):
            out = s.decode([(lane, x)])[0]
            x = out.frame
        seq.append(_output(out))
    return seq


def _output(out) -> torch.Tensor:
    return out.logits if out.logits is not None else out.frame.rows[-1].float()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float]:
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    return same, max(max_abs_diff(x, y) for x, y in zip(a, b))


def certify_range(path, start: int, end: int, weight_format: str = REFERENCE_FORMAT,
                  progress: Progress | None = None, runtime: RuntimeKind = TORCH) -> Report:
    """Every check on layers [start, end) of `path` (a GGUF or a package: only that
    range's parts are opened), fed synthetic upstream activations. `progress(done, total)`
    hears the steps done: the cold run, the row check, the split (when the range has 2
    layers or more), the restores, the whole-state round trip."""
    if not runtime.layer_ranges:
        raise StageError(f"the {runtime.name} runtime serves a whole model: --stage "
                         "certifies one layer range alone")
    runtime.check_weight_format(weight_format)
    f = open_model(path)
    cfg = ModelConfig.from_gguf(f)
    f.close()
    start, end = parse_range(f"{start}..{end}", cfg.n_layers)
    report = Report(f"{path} layers {start}..{end} alone (synthetic upstream)", 1, runtime.name,
                    runtime.held_format(weight_format))
    n = 3 * CHUNK + 21
    up = _Upstream(cfg, start == 0, n + STEPS)
    stages = _stages(path, cfg, [start, end], weight_format, runtime)
    steps = Tally(5 if end - start > 1 else 4, progress)
    cold, _ = _run(stages, [s.alloc_lane() for s in stages], up, n)
    steps.add()
    report.checks.append(row_invariance(stages, up.inputs, n))
    steps.add()
    if end - start > 1:
        mid = (start + end) // 2
        two = _stages(path, cfg, [start, mid, end], weight_format, runtime)
        got, _ = _run(two, [s.alloc_lane() for s in two], up, n)
        same, d = _same(cold, got)
        report.checks.append(Check("split_handoff", same, f"cut at {mid}, f32 wire: outputs "
                                   f"bitwise {same}; max |d| {d:.2e}", d))
        steps.add()
    store = BlockStore()
    report.checks += _restore(stages, up, n, store, cold)
    steps.add()
    report.checks += _full_state(stages, up, n, store, cold)
    steps.add()
    return report


def _restore(stages, up: _Upstream, n: int, store: BlockStore, cold) -> list[Check]:
    b = (n - 1) // CHUNK * CHUNK
    _, snaps = _run(stages, [s.alloc_lane() for s in stages], up, n, other_from=b,
                    snapshots=(b,))
    restored = []
    for _ in range(2):
        lanes = [s.alloc_lane() for s in stages]
        for s, lane, snap in zip(stages, lanes, snaps):
            kind = PayloadKind.KvRecurrent if snap[b].fixed else PayloadKind.ResidentKv
            s.import_state(lane, through_store(snap[b], store, kind))
        restored.append(_run(stages, lanes, up, n, start=b)[0])
    same, d = _same(cold, restored[0])
    again, d2 = _same(restored[0], restored[1])
    return [Check("restore_equals_recompute", same, f"restored at {b} of {n}, {STEPS} decode "
                  f"steps: outputs bitwise {same}; max |d| {d:.2e}", d),
            Check("repeated_hits", again, f"two restores of one payload equal; max |d| "
                  f"{d2:.2e}", d2)]


def _full_state(stages, up: _Upstream, n: int, store: BlockStore, cold) -> list[Check]:
    """Export after the prompt, import elsewhere, decode: as the cold lane decoded."""
    a = [s.alloc_lane() for s in stages]
    x = up.inputs(0, n)
    for s, lane in zip(stages, a):
        x = s.prefill(lane, x, 0, "last").frame
    exported = [s.export_state(lane, n) for s, lane in zip(stages, a)]
    c = [s.alloc_lane() for s in stages]
    for s, lane, st in zip(stages, c, exported):
        s.import_state(lane, through_store(st, store, PayloadKind.FullState))
    same, d = _same(cold, [cold[0]] + _decode(stages, c, up, n))
    probe = [s.alloc_lane() for s in stages]
    for s, lane, st in zip(stages, probe, exported):
        s.import_state(lane, st)
    back = [s.export_state(lane, n) for s, lane in zip(stages, probe)]
    trip = all(state_bytes(x) == state_bytes(y) for x, y in zip(exported, back))
    return [Check("full_state", same, f"export at {n}, import, decode {STEPS}: bitwise "
                  f"{same}; max |d| {d:.2e}", d),
            Check("roundtrip_state_matches", None, f"re-export after import byte-identical: "
                  f"{trip}")]
