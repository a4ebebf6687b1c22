"""Mixture-of-experts feed-forward blocks: a router picks n_used of n_expert experts per
token and sums their outputs by weight (llama.cpp's build_moe_ffn), plus any shared
experts every token runs.

Each expert is held in the stage's weight format on its own (make_linear on its slice of
the layer's 3-D tensor: Q4_0 / Q8_0 experts keep the file's blocks), and only the chosen
experts run, each over the rows that chose it.

Exactness (DESIGN.md §5.3): only real rows (Segment.n_real) are routed; padding rows get
no expert output. Where our kernel is built, every piece computes a row alone, so the
block is row-invariant where its experts are (BlockLinear): the router's float32 product
and gate run in rowops.c (torch's GEMM blocks a row's sums by the call's rows and
threads, and its exp rounds a vector's tail unlike its body), the choice and the weights'
sums are per-row selections and in-order adds, and an expert runs the rows that chose it
together. Experts that are not row-invariant (fp32, bf16) run one row at a time in
decode. The chosen experts' outputs are added in selection order, as llama.cpp adds them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from skippy.topology.gguf_file import ModelConfigError
from skippy.topology.model_config import ModelConfig

from . import qkernel
from .layers import gated_activation
from .linear import LEAN, BlockLinear, Linear, Matrix, RowLinear, fuse_linear, make_linear
from .weights import StageTensors

GATINGS = ("softmax", "sigmoid", "softmax_weight", "sqrt_softplus")
# llama.cpp clamps the sum of the chosen weights before normalising: the least normal f16
_MIN_WEIGHT_SUM = 6.103515625e-5


@dataclass(frozen=True)
class Routing:
    """How a row's experts and their weights follow from the router's logits."""

    n_used: int
    gating: str = "softmax"
    norm: bool = False        # divide the chosen weights by their sum
    scale: float = 0.0        # multiply the chosen weights (0 or 1: no scale)
    groups: int = 0           # > 1: experts in groups; only the best groups_used compete
    groups_used: int = 0

    def __post_init__(self):
        if self.gating not in GATINGS:
            raise ValueError(f"unknown expert gating '{self.gating}' (known: {GATINGS})")

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Routing":
        return cls(cfg.n_expert_used, cfg.expert_gating, cfg.expert_weights_norm,
                   cfg.expert_weights_scale, cfg.expert_groups, cfg.expert_groups_used)

    def __call__(self, logits: torch.Tensor,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, n_expert] -> (experts [n, n_used] in selection order, best first;
        their weights [n, n_used]). `bias` (exp_probs_b) shifts the choice, not the
        weights."""
        probs = self._gate(logits)
        experts = torch.topk(self._scores(probs, bias), self.n_used, dim=-1,
                             sorted=True).indices
        return experts, self._weights(probs, experts)

    def margin(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[n]: how near each row's choice is to another: the last chosen expert's score
        minus the best left out's (inf where every expert is chosen), in the scores the
        choice compares (a near-tie between groups is not measured). A near-zero gap is a
        near-tie that another summation order (llama.cpp's, another instruction set's)
        may break the other way."""
        scores = self._scores(self._gate(logits), bias)
        if self.n_used >= scores.shape[-1]:
            return scores.new_full(scores.shape[:-1], float("inf"))
        top = torch.topk(scores, self.n_used + 1, dim=-1, sorted=True).values
        return top[:, -2] - top[:, -1]

    def runner_up(self, logits: torch.Tensor,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The choice the other side of that near-tie makes: as __call__, with the last
        chosen expert replaced by the best one left out (evals: a near-tie broken the
        way the reference broke it)."""
        probs = self._gate(logits)
        scores = self._scores(probs, bias)
        if self.n_used >= scores.shape[-1]:
            return self(logits, bias)
        top = torch.topk(scores, self.n_used + 1, dim=-1, sorted=True).indices
        experts = torch.cat([top[:, :self.n_used - 1], top[:, self.n_used:]], dim=-1)
        return experts, self._weights(probs, experts)

    def _scores(self, probs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What the choice compares: the gate's output, shifted by `bias`, outside the
        best groups -inf."""
        choose = probs + bias if bias is not None else probs
        return self._best_groups(choose) if self.groups > 1 else choose

    def _weights(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        weights = probs.gather(-1, experts)
        if self.gating == "softmax_weight":
            weights = _gate(weights, "softmax")
        if self.norm:  # the sum in selection order (torch's sum blocks by the call's shape)
            total = weights[:, 0]
            for j in range(1, weights.shape[1]):
                total = total + weights[:, j]
            weights = weights / total[:, None].clamp(min=_MIN_WEIGHT_SUM)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return weights

    def _gate(self, logits: torch.Tensor) -> torch.Tensor:
        if self.gating == "softmax_weight":
            return logits  # the softmax comes over the chosen ones
        return _gate(logits, self.gating)

    def _best_groups(self, choose: torch.Tensor) -> torch.Tensor:
        """Scores of experts outside the best `groups_used` groups (a group's score: the
        sum of its two best) set to -inf."""
        n, e = choose.shape
        grouped = choose.view(n, self.groups, e // self.groups)
        score = grouped.topk(2, dim=-1, sorted=True).values.sum(-1)
        best = score.topk(self.groups_used, dim=-1, sorted=True).indices
        keep = torch.zeros(n, self.groups, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)


def _gate(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A router's gate over each row of x: our kernel's, which computes a row alone, for
    float32 rows where it is built; else torch's (float64: the definitions' tests)."""
    lib = qkernel.library()
    if lib is not None and x.dtype == torch.float32:
        return qkernel.gate(lib, x, kind)
    if kind == "softmax":
        return torch.softmax(x, dim=-1)
    if kind == "sigmoid":
        return torch.sigmoid(x)
    return torch.sqrt(F.softplus(x))


class Expert:
    """One gated FFN: down(act(gate(h)) * up(h)), each product optionally scaled by a
    number (llama.cpp's per-expert `.scale` tensors)."""

    def __init__(self, gate_up: Linear, split: list[int], down: Linear, activation: str,
                 scales: tuple[float | None, float | None, float | None] = (None,) * 3):
        self.gate_up, self.split, self.down = gate_up, split, down
        self.activation, self.scales = activation, scales
        # Rows run together only where every product's bits per row are independent of
        # how many rows come with it (our integer kernel)
        self.row_invariant = isinstance(gate_up, BlockLinear) and isinstance(down, BlockLinear)

    @classmethod
    def of(cls, gate: Matrix | torch.Tensor, up: Matrix | torch.Tensor,
           down: Matrix | torch.Tensor, fmt: str, activation: str, scales=(None,) * 3):
        gate_up, split = fuse_linear([gate, up], fmt)
        return cls(gate_up, split, make_linear(down, fmt), activation, scales)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).split(self.split, dim=-1)
        sg, su, sd = self.scales
        if sg is not None:
            gate = gate * sg
        if su is not None:
            up = up * su
        y = self.down(gated_activation(gate, up, self.activation))
        return y * sd if sd is not None else y

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def _expert_scales(t: StageTensors, p: str, e: int, merged: bool):
    """Expert e's (gate, up, down) output scales where the file has them (a merged
    gate_up stack takes the up scale on both halves, as llama.cpp applies it)."""
    def one(name: str) -> float | None:
        s = t.get(p + name)
        return None if s is None else float(s.reshape(-1)[e])
    up = one("ffn_up_exps.scale")
    gate = up if merged else one("ffn_gate_exps.scale")
    return gate, up, one("ffn_down_exps.scale")


def expert_format(fmt: str) -> str:
    """The format routed experts are held in: the stage's, but never with the bfloat16
    prefill copy of the integer formats (linear.py): it would hold 2 bytes per weight
    beside 0.6-1.1, for experts that see few rows of a chunk each (a chunk of C rows
    gives an expert about C * n_used / n_expert), mostly under SMALL_ROWS, where the
    integer kernel runs anyway."""
    return fmt if fmt in ("fp32", "bf16") or fmt.endswith(LEAN) else fmt + LEAN


def load_experts(index: int, t: StageTensors, fmt: str, activation: str) -> list[Expert]:
    """Layer `index`'s routed experts, each in format `fmt` (held as expert_format says;
    gate and up as separate 3-D tensors, or one merged gate_up tensor)."""
    p = f"blk.{index}."
    fmt = expert_format(fmt)
    down = t.experts(p + "ffn_down_exps.weight")
    if p + "ffn_gate_up_exps.weight" in t.names:  # gate and up in one stack
        out = []
        for e, (gate_up, d) in enumerate(zip(t.experts(p + "ffn_gate_up_exps.weight"), down)):
            half = gate_up.values.shape[0] // 2
            out.append(Expert(make_linear(gate_up, fmt), [half, half], make_linear(d, fmt),
                              activation, _expert_scales(t, p, e, True)))
        return out
    gate_up = zip(t.experts(p + "ffn_gate_exps.weight"), t.experts(p + "ffn_up_exps.weight"))
    return [Expert.of(g, u, d, fmt, activation, _expert_scales(t, p, e, False))
            for e, ((g, u), d) in enumerate(zip(gate_up, down))]


class MoeFfn:
    """A mixture-of-experts FFN block (the Ffn protocol of stages/transformer.py): the
    router (float32, as quantizers leave it), the routed experts, any shared experts (run
    by every row; qwen3next gates them by sigmoid(h . ffn_gate_inp_shexp))."""

    def __init__(self, index: int, cfg: ModelConfig, t: StageTensors, fmt: str,
                 activation: str | None = None):
        p = f"blk.{index}."
        activation = activation or cfg.family.activation
        if cfg.n_expert_used <= 0:
            raise ValueError(f"layer {index} has a router, but {cfg.family.name} reads no "
                             f"mixture-of-experts settings (topology/families.py: moe)")
        self.router = RowLinear(t[p + "ffn_gate_inp.weight"])
        self.bias = t.get(p + "exp_probs_b.bias")
        self.routing = Routing.of(cfg)
        self.experts = load_experts(index, t, fmt, activation)
        if len(self.experts) != self.router.out_features:
            raise ModelConfigError(f"layer {index}: {len(self.experts)} experts, router for "
                                   f"{self.router.out_features}")
        self.shared = None
        if p + "ffn_up_shexp.weight" in t.names:
            self.shared = Expert.of(t.matrix(p + "ffn_gate_shexp.weight"),
                                    t.matrix(p + "ffn_up_shexp.weight"),
                                    t.matrix(p + "ffn_down_shexp.weight"), fmt, activation)
        gate = t.get(p + "ffn_gate_inp_shexp.weight")
        self.shared_gate = RowLinear(gate.reshape(1, -1)) if gate is not None else None
        self.block = OneCall.of(self)

    def __call__(self, h: torch.Tensor, segments) -> torch.Tensor:
        if self.block is not None and h.dtype == torch.float32:
            return self.block(h, segments)
        decode = all(s.n == 1 for s in segments)
        out = self.routed(h, segments, decode)
        if self.shared is not None:
            y = self.shared(h)
            if self.shared_gate is not None:
                y = y * _gate(self.shared_gate(h), "sigmoid")
            out = out + y
        return out

    def routed(self, h: torch.Tensor, segments, decode: bool,
               logits: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for the segments' real rows (zero elsewhere);
        `logits` [n, n_expert] given by a family that computes its own (else the router's
        over h)."""
        out = h.new_zeros(h.shape)
        if not segments:
            return out
        rows = torch.cat([torch.arange(s.row0, s.row0 + s.n_real) for s in segments])
        if rows.numel() == 0:
            return out
        x = h[rows]
        logits = self.router(x) if logits is None else logits[rows]
        if decode and qkernel.library() is None:  # torch's gates: each row alone
            picks = [self.routing(logits[r:r + 1], self.bias) for r in range(len(rows))]
            experts = torch.cat([e for e, _ in picks])
            weights = torch.cat([w for _, w in picks])
        else:
            experts, weights = self.routing(logits, self.bias)
        out[rows] = self._mix(x, experts, weights, decode)
        return out

    def _mix(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
             decode: bool) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{experts[:, j]}(x), added in order j = 0, 1, ..."""
        n, k = experts.shape
        ys = x.new_empty(n, k, x.shape[1])
        flat = experts.reshape(-1)
        for e in torch.unique(flat).tolist():
            at = (flat == e).nonzero().squeeze(1)  # positions row * k + j
            expert = self.experts[e]
            step = 1 if decode and not expert.row_invariant else len(at)
            for i in range(0, len(at), step):
                part = at[i:i + step]
                ys[part // k, part % k] = expert(x[part // k])
        out = ys[:, 0] * weights[:, 0:1]
        for j in range(1, k):
            out = out + ys[:, j] * weights[:, j:j + 1]
        return out

    @property
    def row_invariant(self) -> bool:
        """Does the block compute each row alone (every expert on our integer kernel, the
        router and gates in rowops.c)?"""
        experts = self.experts + ([self.shared] if self.shared is not None else [])
        return qkernel.library() is not None and all(e.row_invariant for e in experts)

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode row reads: the router, n_used experts (as large as
        any), the shared experts."""
        expert = max(e.nbytes for e in self.experts)
        shared = self.shared.nbytes if self.shared is not None else 0
        return self.router.nbytes + self.routing.n_used * expert + shared

    @property
    def held_nbytes(self) -> int:
        """Weight bytes the block holds: every expert (the planner's figure)."""
        shared = self.shared.nbytes if self.shared is not None else 0
        return self.router.nbytes + sum(e.nbytes for e in self.experts) + shared


class _Block(ctypes.Structure):
    """moe.c's moe_block."""

    _fields_ = [("hidden", ctypes.c_int64)] \
        + [(n, ctypes.c_int) for n in ("n_expert", "n_used", "gating", "norm")] \
        + [("scale", ctypes.c_float), ("groups", ctypes.c_int), ("groups_used", ctypes.c_int)] \
        + [(n, ctypes.c_void_p) for n in ("router", "bias", "gate_up", "down", "gate_scale",
                                          "up_scale", "down_scale")] \
        + [("act", ctypes.c_int)] \
        + [(n, ctypes.c_void_p) for n in ("shared_gate_up", "shared_down", "shared_gate")]


def _plain(expert: Expert | None) -> bool:
    """Does the expert fit moe.c (integer-kernel products, gate and up in equal halves,
    an activation of skr_gated)?"""
    return expert is None or (isinstance(expert.gate_up, BlockLinear)
                              and isinstance(expert.down, BlockLinear)
                              and expert.split[0] == expert.split[1]
                              and expert.activation in qkernel.GATED)


def _scales(experts: list[Expert]) -> list[torch.Tensor | None] | None:
    """Each product's per-expert scales as one [n_expert] vector (None: unscaled), or None
    where some experts have one and others not."""
    out = []
    for i in range(3):
        have = [e.scales[i] for e in experts]
        if all(s is None for s in have):
            out.append(None)
        elif all(s is not None for s in have):
            out.append(torch.tensor(have, dtype=torch.float32))
        else:
            return None
    return out


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


class OneCall:
    """A block through moe.c in one call (the same bits as MoeFfn's own path: every step
    the same function or float operation, in the same order); `of` gives None where the
    block has another form (float experts)."""

    def __init__(self, lib: ctypes.CDLL, block: MoeFfn):
        self.lib, self.ffn = lib, block  # the block owns every tensor described here
        r, experts = block.routing, block.experts
        self.gate_up = (qkernel.QMat * len(experts))(*[qkernel.qmat(e.gate_up) for e in experts])
        self.down = (qkernel.QMat * len(experts))(*[qkernel.qmat(e.down) for e in experts])
        shared = block.shared
        self.shared = (qkernel.qmat(shared.gate_up), qkernel.qmat(shared.down)) \
            if shared is not None else None
        self.scales = _scales(experts)
        ptr = ctypes.addressof
        self.desc = _Block(
            block.router.in_features, len(experts), r.n_used,
            -1 if r.gating == "softmax_weight" else qkernel.GATES[r.gating], int(r.norm),
            r.scale if r.scale not in (0.0, 1.0) else 0.0, r.groups, r.groups_used,
            block.router.weight.data_ptr(),
            block.bias.data_ptr() if block.bias is not None else None,
            ptr(self.gate_up), ptr(self.down),
            *[v.data_ptr() if v is not None else None for v in self.scales],
            qkernel.gated_act(lib, experts[0].activation),
            ptr(self.shared[0]) if shared is not None else None,
            ptr(self.shared[1]) if shared is not None else None,
            block.shared_gate.weight.data_ptr() if block.shared_gate is not None else None)

    @classmethod
    def of(cls, block: MoeFfn) -> "OneCall | None":
        lib = qkernel.library()
        experts = block.experts
        if lib is None or not experts \
                or not all(_plain(e) for e in experts + [block.shared]) \
                or _scales(experts) is None or (block.shared is not None
                                                and block.shared.scales != (None,) * 3) \
                or len({e.activation for e in experts}) != 1 \
                or (block.shared is not None
                    and block.shared.activation != experts[0].activation) \
                or not all(_f32(t) for t in (block.router.weight, block.bias)) \
                or (block.shared_gate is not None and not _f32(block.shared_gate.weight)):
            return None
        return cls(lib, block)

    def __call__(self, h: torch.Tensor, segments,
                 logits: torch.Tensor | None = None) -> torch.Tensor:
        """The block over h's rows; rows outside the segments' real rows get no routed
        output (padding). `logits` [rows, n_expert]: a family's own router logits."""
        x = h.contiguous()
        if logits is not None:
            logits = logits.to(torch.float32).contiguous()
        rows = x.shape[0]
        real = None
        if not _every_row_real(segments, rows):
            real = torch.zeros(rows, dtype=torch.uint8)
            for s in segments:
                real[s.row0:s.row0 + s.n_real] = 1
        out = torch.empty_like(x)
        rc = self.lib.skm_moe(ctypes.addressof(self.desc), x.data_ptr(), rows,
                              real.data_ptr() if real is not None else None,
                              logits.data_ptr() if logits is not None else None,
                              out.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError("mixture of experts: no scratch memory")
        return out


def _every_row_real(segments, rows: int) -> bool:
    """Are the segments' rows 0 .. rows - 1 in order, every one real (no padding)?"""
    row = 0
    for s in segments:
        if s.row0 != row or s.n_real != s.n:
            return False
        row += s.n
    return row == rows
