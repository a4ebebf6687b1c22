"""The mixture-of-experts block (stages/moe.py) against plain per-row formulas: routing in
every variant llama.cpp's build_moe_ffn has for our families, shared experts, per-expert
scales; and 3-D quantized expert stacks reaching the integer kernel as the file's blocks."""

from __future__ import annotations

import math

import pytest
import torch

from skippy.stages.linear import BlockLinear, Matrix, held_bytes, row_invariant
from skippy.stages.moe import MoeFfn, Routing
from skippy.stages.transformer import Segment

E, HIDDEN, FF = 8, 64, 32


def oracle_route(row: list[float], r: Routing, bias: list[float] | None):
    """One row's (experts, weights) by the definitions, in plain Python."""
    if r.gating == "softmax":
        m = max(row)
        z = sum(math.exp(v - m) for v in row)
        probs = [math.exp(v - m) / z for v in row]
    elif r.gating == "sigmoid":
        probs = [1 / (1 + math.exp(-v)) for v in row]
    elif r.gating == "sqrt_softplus":
        probs = [math.sqrt(math.log1p(math.exp(v))) for v in row]
    else:
        probs = list(row)
    choose = [p + (bias[i] if bias else 0.0) for i, p in enumerate(probs)]
    if r.groups > 1:
        size = len(row) // r.groups
        score = [sum(sorted(choose[g * size:(g + 1) * size])[-2:]) for g in range(r.groups)]
        keep = sorted(range(r.groups), key=lambda g: -score[g])[:r.groups_used]
        choose = [c if i // size in keep else -math.inf for i, c in enumerate(choose)]
    experts = sorted(range(len(row)), key=lambda i: -choose[i])[:r.n_used]
    w = [probs[i] for i in experts]
    if r.gating == "softmax_weight":
        m = max(w)
        w = [math.exp(v - m) / sum(math.exp(u - m) for u in w) for v in w]
    if r.norm:
        s = max(sum(w), 6.103515625e-5)
        w = [v / s for v in w]
    if r.scale not in (0.0, 1.0):
        w = [v * r.scale for v in w]
    return experts, w


@pytest.mark.parametrize("routing, with_bias", [
    (Routing(2, "softmax", norm=True), False),             # qwen3moe
    (Routing(2, "sigmoid", norm=True), True),              # minimax-m2, deepseek3
    (Routing(3, "softmax", scale=2.5), False),             # deepseek2: a weights scale
    (Routing(2, "softmax_weight"), False),
    (Routing(2, "sqrt_softplus", norm=True, scale=1.5), True),
    (Routing(2, "sigmoid", norm=True, scale=2.5, groups=4, groups_used=2), True),  # grouped
])
def test_routing_follows_the_definitions(routing, with_bias):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, E, generator=gen, dtype=torch.float64)
    bias = torch.randn(E, generator=gen, dtype=torch.float64) * 0.3 if with_bias else None
    experts, weights = routing(logits, bias)
    for r in range(logits.shape[0]):
        want_e, want_w = oracle_route(logits[r].tolist(), routing,
                                      bias.tolist() if bias is not None else None)
        assert experts[r].tolist() == want_e
        assert weights[r].tolist() == pytest.approx(want_w, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("routing", [Routing(2, "softmax", norm=True),
                                     Routing(2, "sigmoid", norm=True, scale=2.5)])
def test_a_near_tie_is_measured_and_can_go_the_other_way(routing):
    """margin: the last chosen score minus the best left out; runner_up: the choice with
    those two swapped, weighed by the same definitions."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, E, generator=gen, dtype=torch.float64)
    bias = torch.randn(E, generator=gen, dtype=torch.float64) * 0.3
    experts, _ = routing(logits, bias)
    gap = routing.margin(logits, bias)
    other, weights = routing.runner_up(logits, bias)
    probs = torch.softmax(logits, -1) if routing.gating == "softmax" else torch.sigmoid(logits)
    scores = probs + bias
    for r in range(logits.shape[0]):
        ranked = sorted(range(E), key=lambda i: -float(scores[r, i]))
        assert experts[r].tolist() == ranked[:2] and other[r].tolist() == [ranked[0], ranked[2]]
        assert float(gap[r]) == pytest.approx(float(scores[r, ranked[1]] - scores[r, ranked[2]]))
        w = probs[r, other[r]] / probs[r, other[r]].sum() * (routing.scale or 1.0)
        assert weights[r].tolist() == pytest.approx(w.tolist(), rel=1e-12)
    assert torch.isinf(Routing(E, "softmax").margin(logits)).all()  # every expert chosen


def test_grouped_routing_picks_only_from_the_best_groups():
    r = Routing(2, "sigmoid", groups=4, groups_used=1)
    logits = torch.full((1, E), -5.0)
    logits[0, 0] = 4.0   # group 0: best single expert, weak second
    logits[0, 6] = 3.0   # group 3: two strong experts beat group 0's best two
    logits[0, 7] = 3.0
    experts, _ = r(logits)
    assert sorted(experts[0].tolist()) == [6, 7]


class FakeTensors:
    """What MoeFfn reads of a StageTensors, from a dict of float32 tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.names = tensors, set(tensors)

    def __getitem__(self, name):
        return self.tensors[name]

    def get(self, name):
        return self.tensors.get(name)

    def matrix(self, name):
        return Matrix(self.tensors[name])

    def experts(self, name):
        return [Matrix(w) for w in self.tensors[name]]


def moe_layer(shared: bool, gated_shared: bool, scales: bool):
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
    p = "blk.0."
    t = {p + "ffn_gate_inp.weight": rand(E, HIDDEN), p + "exp_probs_b.bias": rand(E) * 0.5,
         p + "ffn_gate_exps.weight": rand(E, FF, HIDDEN),
         p + "ffn_up_exps.weight": rand(E, FF, HIDDEN),
         p + "ffn_down_exps.weight": rand(E, HIDDEN, FF)}
    if shared:
        t |= {p + "ffn_gate_shexp.weight": rand(2 * FF, HIDDEN),
              p + "ffn_up_shexp.weight": rand(2 * FF, HIDDEN),
              p + "ffn_down_shexp.weight": rand(HIDDEN, 2 * FF)}
    if gated_shared:
        t[p + "ffn_gate_inp_shexp.weight"] = rand(HIDDEN)
    if scales:
        t |= {p + f"ffn_{w}_exps.scale": 1 + rand(E) for w in ("gate", "up", "down")}
    return t


def oracle_moe(t: dict, h: torch.Tensor, routing: Routing) -> torch.Tensor:
    p = "blk.0."
    silu = torch.nn.functional.silu

    def scale(w, e):
        s = t.get(p + f"ffn_{w}_exps.scale")
        return 1.0 if s is None else float(s[e])
    out = []
    for row in h:
        experts, weights = routing((t[p + "ffn_gate_inp.weight"] @ row)[None],
                                   t[p + "exp_probs_b.bias"])
        y = torch.zeros(HIDDEN)
        for e, w in zip(experts[0].tolist(), weights[0].tolist()):
            g = (t[p + "ffn_gate_exps.weight"][e] @ row) * scale("gate", e)
            u = (t[p + "ffn_up_exps.weight"][e] @ row) * scale("up", e)
            y = y + (t[p + "ffn_down_exps.weight"][e] @ (silu(g) * u)) * scale("down", e) * w
        if p + "ffn_up_shexp.weight" in t:
            s = t[p + "ffn_down_shexp.weight"] @ (silu(t[p + "ffn_gate_shexp.weight"] @ row)
                                                  * (t[p + "ffn_up_shexp.weight"] @ row))
            if p + "ffn_gate_inp_shexp.weight" in t:
                s = s * torch.sigmoid(t[p + "ffn_gate_inp_shexp.weight"] @ row)
            y = y + s
        out.append(y)
    return torch.stack(out)


class Cfg:
    """The ModelConfig fields MoeFfn reads."""

    def __init__(self, routing: Routing):
        self.n_expert_used, self.expert_gating = routing.n_used, routing.gating
        self.expert_weights_norm, self.expert_weights_scale = routing.norm, routing.scale
        self.expert_groups, self.expert_groups_used = routing.groups, routing.groups_used
        self.family = type("F", (), {"activation": "silu"})


@pytest.mark.parametrize("shared, gated_shared, scales", [
    (False, False, False), (True, False, False), (True, True, False), (False, False, True)])
@pytest.mark.parametrize("decode", [False, True])
def test_block_follows_the_definitions(shared, gated_shared, scales, decode):
    routing = Routing(2, "sigmoid", norm=True, scale=2.0)
    t = moe_layer(shared, gated_shared, scales)
    ffn = MoeFfn(0, Cfg(routing), FakeTensors(t), "fp32")
    h = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(5))
    if decode:  # one row per lane; row 5 pads the step
        segments = [Segment(None, r, 1, 10 + r) for r in range(5)]
    else:  # a chunk of 6 rows, 5 real
        segments = [Segment(None, 0, 6, 0, n_real=5)]
    got = ffn(h, segments)
    want = oracle_moe(t, h, routing)
    assert torch.allclose(got[:5], want[:5], rtol=1e-5, atol=1e-6)
    if not shared:
        assert not got[5].any()


@pytest.fixture(scope="module")
def qwen3moe_blocks(smollm2, tmp_path_factory):
    """A small qwen3moe requantized by llama.cpp: Q4_0 and Q8_0 expert stacks."""
    from skippy.mesh.models import requantize
    from skippy.stages.synth import write_synthetic
    d = tmp_path_factory.mktemp("synth")
    src = write_synthetic("qwen3moe", layers=2, seed=11, out=d / "moe-blocks-qwen3moe-L2.gguf",
                          tokenizer_from=smollm2, hidden=128, heads=2, kv_heads=1, ff=64)
    out = {kind: requantize(src, kind) for kind in ("q4_0", "q8_0")}
    return out


@pytest.mark.parametrize("kind, fmt, bits", [("q4_0", "int4", 4), ("q8_0", "int8", 8),
                                             ("q8_0", "int4", 8)])
def test_quantized_expert_stacks_reach_the_integer_kernel_as_the_files_blocks(
        qwen3moe_blocks, kind, fmt, bits):
    from skippy.stages.weights import dequantize_tensor
    from skippy.topology.gguf_file import GGUFFile
    from moe_checks import whole
    path = qwen3moe_blocks[kind]
    rt = whole(path, weight_format=fmt)
    ffn = rt.layers[1].ffn
    for e in ffn.experts:
        assert isinstance(e.gate_up, BlockLinear) and e.gate_up.kind == bits
        assert isinstance(e.down, BlockLinear) and e.down.kind == bits
    f = GGUFFile(path)
    # each expert's blocks are its own slice of the stack: the same values as gguf-py's
    stack = dequantize_tensor(f, "blk.1.ffn_down_exps.weight")
    from skippy.stages.weights import StageTensors
    per_expert = StageTensors(f, list(f.tensors)).experts("blk.1.ffn_down_exps.weight")
    for e, m in enumerate(per_expert):
        blocks = m.int4.dequantize() if bits == 4 else m.int8.rows(torch.arange(m.values.shape[0]))
        assert torch.equal(blocks, stack[e])
    # the planner's bytes for the layer's experts are what the block holds
    planned = sum(held_bytes(fmt, n, i.qtype.name, tuple(i.shape))
                  for n, i in f.tensors.items() if n.startswith("blk.1.ffn_") and "exps" in n)
    held = sum(_held(e.gate_up) + _held(e.down) for e in ffn.experts)
    assert planned == pytest.approx(held, rel=0.01)


def _held(lin) -> int:
    parts = [getattr(lin, k, None) for k in ("w", "s", "z", "dense")]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def test_q4_0_experts_decode_lanes_bitwise_alone_or_together(qwen3moe_blocks):
    from moe_checks import check_lanes_alone_equal_together
    check_lanes_alone_equal_together(qwen3moe_blocks["q4_0"], "int4")


def test_a_merged_gate_up_stack_is_the_same_block():
    """ffn_gate_up_exps ([E, 2 * ff, in]: gate rows, then up rows) as llama.cpp's
    create_tensor_gate_up_exps allows: bitwise the block of separate stacks."""
    p = "blk.0."
    t = moe_layer(shared=False, gated_shared=False, scales=False)
    merged = dict(t)
    merged[p + "ffn_gate_up_exps.weight"] = torch.cat(
        [merged.pop(p + "ffn_gate_exps.weight"), merged.pop(p + "ffn_up_exps.weight")], dim=1)
    routing = Routing(2, "softmax", norm=True)
    h = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    seg = [Segment(None, 0, 6, 0)]
    a = MoeFfn(0, Cfg(routing), FakeTensors(t), "fp32")(h, seg)
    b = MoeFfn(0, Cfg(routing), FakeTensors(merged), "fp32")(h, seg)
    assert torch.equal(a, b)


@pytest.mark.parametrize("routing", [
    Routing(2, "softmax", norm=True), Routing(2, "sigmoid", norm=True, scale=2.5),
    Routing(3, "softmax", scale=2.5), Routing(2, "softmax_weight"),
    Routing(2, "sqrt_softplus", norm=True, scale=1.5),
    Routing(2, "sigmoid", norm=True, scale=2.5, groups=4, groups_used=2)])
@pytest.mark.parametrize("shared, gated_shared, scales", [
    (False, False, False), (True, True, False), (False, False, True)])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_block_in_one_call_is_bitwise_its_own_path(routing, shared, gated_shared, scales,
                                                       fmt):
    """moe.c's one call against the block's torch path: a chunk with a padding row, and
    decode rows of lanes; per-expert scales; the router's logits given (Gemma 4)."""
    if not row_invariant(fmt):
        pytest.skip("no kernels of ours")
    t = moe_layer(shared, gated_shared, scales)
    ffn = MoeFfn(0, Cfg(routing), FakeTensors(t), fmt)
    assert ffn.block is not None
    h = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5))
    for segments in ([Segment(None, 0, 7, 0, n_real=6)],
                     [Segment(None, r, 1, 10 + r) for r in range(7)],
                     [Segment(None, 0, 3, 4), Segment(None, 3, 4, 9)]):
        one_call = ffn(h, segments)
        block, ffn.block = ffn.block, None
        own = ffn(h, segments)
        ffn.block = block
        assert torch.equal(one_call, own), (one_call - own).abs().max().item()
    if not shared:
        logits = torch.randn(7, E, generator=torch.Generator().manual_seed(8))
        segments = [Segment(None, 0, 7, 0, n_real=6)]
        assert torch.equal(ffn.block(h, segments, logits),
                           ffn.routed(h, segments, False, logits=logits))
