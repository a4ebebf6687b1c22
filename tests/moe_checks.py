"""Exactness checks of a mixture-of-experts family, written once (stages/moe.py): each
MoE family's test file calls them on its own synthetic file."""

from __future__ import annotations

import torch

from skippy.stages.moe import MoeFfn
from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.stages.transformer import Segment

PROMPT = [(i * 7919) % 40000 + 100 for i in range(120)]


def whole(path, **kw) -> TorchStageRuntime:
    from skippy.topology.gguf_file import GGUFFile
    from skippy.topology.model_config import ModelConfig
    n = ModelConfig.from_gguf(GGUFFile(path)).n_layers
    return TorchStageRuntime(StageSpec(str(path), 0, n, n_ctx=256, chunk=32, **kw))


def check_lanes_alone_equal_together(path, fmt: str, lanes: int = 5) -> None:
    """Decode rows of several lanes in one step, each bitwise the lane's row decoded
    alone (fp32 pads the step to lane_batch rows; the integer formats run it unpadded)."""
    rt = whole(path, lane_batch=8, weight_format=fmt)
    lengths = [20 + 13 * k for k in range(lanes)]
    ids = [rt.alloc_lane() for _ in lengths]
    for lane, n in zip(ids, lengths):
        rt.prefill(lane, torch.tensor(PROMPT[:n]), logits="none")
    step = [torch.tensor(PROMPT[n]) for n in lengths]
    alone = []
    for lane, n, tok in zip(ids, lengths, step):
        alone.append(rt.decode([(lane, tok)])[0].logits)
        rt.copy_lane(lane, lane, n)  # undo the step
    together = rt.decode(list(zip(ids, step)))
    for k in range(lanes):
        assert torch.equal(together[k].logits, alone[k]), f"{fmt}: lane {k}"


def check_padding_rows_not_routed(path, fmt: str = "fp32") -> None:
    """A short chunk's real rows out of every MoE block do not depend on what its padding
    rows hold, and padding rows get no routed expert output."""
    rt = whole(path, weight_format=fmt)
    gen = torch.Generator().manual_seed(1)
    moe = [layer.ffn for layer in rt.layers if isinstance(layer.ffn, MoeFfn)]
    assert moe, "no mixture-of-experts layer"
    for ffn in moe:
        h = torch.randn(32, rt.cfg.hidden, generator=gen)
        seg = Segment(None, 0, 32, 0, n_real=20)
        h2 = h.clone()
        h2[20:] = torch.randn(12, rt.cfg.hidden, generator=gen)
        assert torch.equal(ffn(h, [seg])[:20], ffn(h2, [seg])[:20])
        assert not ffn.routed(h2, [seg], decode=False)[20:].any()


def check_threads_do_not_change_bits(path, fmt: str = "int4") -> None:
    """The integer formats promise bits that do not depend on the thread count (the
    runtime's thread_invariant): prefill rows and a decode row, 1 thread vs 2."""
    got = []
    for n in (1, 2):
        rt = whole(path, weight_format=fmt, threads=n)
        assert rt.thread_invariant
        lane = rt.alloc_lane()
        rows = rt.prefill(lane, torch.tensor(PROMPT[:70]), logits="all").logits
        got.append(torch.cat([rows, rt.decode([(lane, rows[-1].argmax())])[0].logits[None]]))
    torch.set_num_threads(2)
    assert torch.equal(got[0], got[1])
