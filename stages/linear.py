"""The one linear-layer abstraction: every weight matrix of a stage goes through it.

A format is chosen per model at load and is part of the cache identity (it changes the
arithmetic):

- ``fp32``: the reference; float32 weights, float32 GEMM.
- ``bf16``: bfloat16 weights; rows are rounded to bfloat16 on the way in, accumulated
  by the bf16 GEMM, returned as float32.
- ``int4``: 4-bit weights in blocks of 32 inputs, a scale (and for Q4_1 an offset) per
  block. A matrix stored in the GGUF as 4-bit blocks (Q4_0, Q4_1) keeps the file's own
  codes, scales and offsets, and a Q8_0 matrix its 8-bit blocks; any other matrix (F16,
  F32, K-quants) is never stored in fewer bits than the file gives it, so it goes to
  8-bit blocks instead.
- ``int8``: 8-bit weights in blocks of 32 inputs (the file's Q8_0 blocks, else quantized
  from the float32 values: scale = max |w| / 127 per block).

The integer formats run on our kernel (stages/qmatmul.c, BlockLinear): rows are
quantized per block of 32 to int8 in one level and multiplied by the blocks as integers,
as llama.cpp does, at every row count; fast on AVX2 and AVX-512 alike, and a row's bits
never depend on how many rows come with it, where its call starts, or the threads: the
row-invariant contract (DESIGN.md §5.3). One level rather than two: two lifted decode
top-1 agreement with fp32 from 98.5 to 99.2 % on SmolLM2 but doubled the integer work,
2.2x the prefill time on AVX2, and every row must take the same number of levels. Nor
is there a bfloat16 copy for prefill rows where bf16 is native: oneDNN's GEMM is not
the integer kernel's arithmetic, so a row would change with its call size.

``int8-lean`` and ``int4-lean`` are the same matrices on our kernel. Where it cannot be
built (no C compiler), torch's weight-only int4 / int8 kernels serve these formats
instead (Int4Linear, Int8Linear: bf16 rows, one int8 scale per row; prefill chunks above
SMALL_ROWS rows through a bfloat16 copy of the weights, which the lean forms never hold:
about 0.6 (int4) or 1.1 (int8) byte per weight), they keep the chunked contract, and
the stage's identity says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import qkernel
from .stage_spec import LEAN, WEIGHT_FORMATS

GROUP = 32  # int4 group size: a GGUF Q4 block
SMALL_ROWS = 16  # torch's int8/int4 kernels up to this many rows, the bf16 copy above
_INNER_K_TILES = 2


@dataclass(frozen=True)
class Int4Blocks:
    """A matrix's 4-bit codes as the GGUF stores them: value = code * scale + offset per
    group of GROUP consecutive inputs. codes: uint8 [out, in] in 0..15; scale, offset:
    float32 [out, in // GROUP]."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int4Blocks":
        """Asymmetric round-to-nearest per group: the group's min and max span codes 0..15."""
        n, k = w.shape
        g = w.to(torch.float32).reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
        codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        return cls(codes.to(torch.uint8).reshape(n, k), scale, lo)

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        w = self.codes.to(torch.float32).view(n, k // GROUP, GROUP)
        return (w * self.scale[..., None] + self.offset[..., None]).view(n, k)


@dataclass(frozen=True)
class Int8Blocks:
    """A Q8_0 matrix as the GGUF stores it: value = code * scale per group of GROUP inputs.
    codes: int8 [out, in]; scale: float32 [out, in // GROUP]."""

    codes: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def from_float(cls, w: torch.Tensor, rows: int = 4096) -> "Int8Blocks":
        """Symmetric round-to-nearest per group as llama.cpp's Q8_0: codes from
        d = max |w| / 127, the scale kept as d's half (a one-row call then reads 8.5 bits
        a weight, not 9: qkernel.pack_scales). Made `rows` rows at a time: a large head's
        float temporaries stay small."""
        n, k = w.shape
        codes = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, k // GROUP, dtype=torch.float32)
        for a in range(0, n, rows):
            g = w[a:a + rows].to(torch.float32).reshape(-1, k // GROUP, GROUP)
            amax = g.abs().amax(-1)
            s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
            scale[a:a + rows] = s.half().float()
            codes[a:a + rows] = torch.round(g / s[..., None]).clamp_(-127, 127) \
                .to(torch.int8).reshape(-1, k)
        return cls(codes, scale)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The float32 values (code * scale) of the rows `idx` picks (any index shape)."""
        codes = self.codes[idx]
        shape = codes.shape
        return (codes.to(torch.float32).view(*shape[:-1], shape[-1] // GROUP, GROUP)
                * self.scale[idx][..., None]).view(shape)

    def as_int4_pair(self) -> Int4Blocks:
        """The same values as 4-bit blocks over twice the inputs: code = 16 * hi + lo with
        hi in -8..7 (scale 16 * d) and lo in 0..15 (scale d); x @ [W_hi | W_lo].T with
        x repeated twice is then x @ W.T, in one int4 call (torch's int8 kernel has one
        scale per row only, too coarse for the head: evals/README.md, torch runtime)."""
        q = self.codes.to(torch.int16)
        hi = torch.div(q, 16, rounding_mode="floor")
        lo = q - 16 * hi
        codes = torch.cat([hi + 8, lo], dim=1).to(torch.uint8)
        scale = torch.cat([16.0 * self.scale, self.scale], dim=1)
        offset = torch.cat([-128.0 * self.scale, torch.zeros_like(self.scale)], dim=1)
        return Int4Blocks(codes, scale, offset)


@dataclass(frozen=True)
class Q6KBlocks:
    """A Q6_K matrix as the GGUF stores it: value = d * sub * (code - 32). codes: uint8
    [out, in] in 0..63; sub: int8 [out, in // 16]; d: float16 [out, in // 256]."""

    codes: torch.Tensor
    sub: torch.Tensor
    d: torch.Tensor


@dataclass(frozen=True)
class Matrix:
    """A weight as loaded: float32 values (out, in), plus the file's blocks when it was
    stored as Q4_0/Q4_1 (int4), Q8_0 (int8) or Q6_K (q6k); None otherwise."""

    values: torch.Tensor
    int4: Int4Blocks | None = None
    int8: Int8Blocks | None = None
    q6k: Q6KBlocks | None = None


class Linear:
    """y = x @ W.T with W stored as (out_features, in_features) float32."""

    fmt = "fp32"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(torch.float32).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        """Weight bytes one call reads."""
        return self.weight.numel() * self.weight.element_size()


class RowLinear(Linear):
    """A small float32 matrix the quantizers leave alone (an MoE router), computed a row at
    a time by our kernel's fixed-order dots where it is built: a row's bits then depend on
    neither the call's rows nor the threads (MKL's GEMM and GEMV block their sums by both),
    which a row-invariant stage needs. Without the kernel, torch's product a row at a
    time, whose bits then do not depend on the thread count."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib = qkernel.library()
        if lib is None or x.ndim != 2:
            return torch.cat([F.linear(x[r:r + 1], self.weight) for r in range(x.shape[0])])
        return qkernel.linear_f32(lib, x, self.weight)


class TransposedLinear(Linear):
    """fp32 with W stored (in, out): y = x @ W. For one or two rows MKL's GEMV over this
    layout is faster, for 4 or more rows slower (evals/README.md, torch runtime). Used for
    the head at lane batches of 1-2."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(torch.float32).t().contiguous()
        self.in_features, self.out_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class Bf16Linear(Linear):
    fmt = "bf16"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).float()


class Int8Linear(Linear):
    """Symmetric per-row int8: w ≈ q * scale, |q| <= 127."""

    fmt = "int8"

    def __init__(self, weight: torch.Tensor, dense: bool = True):
        w = weight.to(torch.float32)
        self.out_features, self.in_features = w.shape
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        self.weight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)
        self.dense = w.to(torch.bfloat16) if dense else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if x.shape[0] > SMALL_ROWS and self.dense is not None:
            return F.linear(x, self.dense).float()
        return torch._weight_int8pack_mm(x, self.weight, self.scale).float()

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode call reads (the bf16 copy serves prefill only)."""
        return self.weight.numel() + self.scale.numel() * 2


class Int4Linear(Linear):
    """Group-wise int4 from the file's blocks. torch's kernel computes
    w = (q - 8) * scale + zero, so zero = offset + 8 * scale (0 for Q4_0 blocks)."""

    fmt = "int4"

    def __init__(self, blocks: Int4Blocks, dense: bool = True):
        self.out_features, self.in_features = blocks.codes.shape
        if self.in_features % GROUP:
            raise ValueError(f"int4 needs inputs in multiples of {GROUP}")
        self.weight = torch._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32).contiguous(), _INNER_K_TILES)
        zero = blocks.offset + 8.0 * blocks.scale
        # [in // GROUP, out, 2]
        self.scale_zero = torch.stack([blocks.scale.t(), zero.t()], dim=-1) \
            .to(torch.bfloat16).contiguous()
        self.dense = blocks.dequantize().to(torch.bfloat16) if dense else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if x.shape[0] > SMALL_ROWS and self.dense is not None:
            return F.linear(x, self.dense).float()
        return torch._weight_int4pack_mm_for_cpu(x, self.weight, GROUP, self.scale_zero).float()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale_zero.numel() * 2


class Int8AsInt4Linear(Int4Linear):
    """A Q8_0 matrix run as an int4 pair (Int8Blocks.as_int4_pair) through the int4 kernel,
    at every row count: no bf16 copy (it serves the head, where prefill asks for one row
    per lane, and the largest matrix of a stage)."""

    def __init__(self, blocks: Int8Blocks):
        super().__init__(blocks.as_int4_pair(), dense=False)
        self.in_features //= 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(torch.cat([x, x], dim=1), self.weight, GROUP,
                                                 self.scale_zero).float()


def row_invariant(fmt: str) -> bool:
    """Does format `fmt` compute each row the same whatever the call (the row-invariant
    contract)? Only on our kernel; fp32 (MKL), bf16 (oneDNN) and torch's int kernels
    keep the chunked contract."""
    return fmt.removesuffix(LEAN) in ("int4", "int8") and qkernel.library() is not None


def kernels(fmt: str) -> str:
    """What format `fmt` multiplies with on this node, for identities and reports:
    "torch" (fp32, bf16, or no kernel of ours), else "skq-<isa>/rows-q8x1" (rows in one
    level, at every row count)."""
    return f"{qkernel.kernel_name()}/rows-q8x1" if row_invariant(fmt) else "torch"


class BlockLinear(Linear):
    """Weights in blocks of 32 inputs (kind 4: 4-bit codes, scale, zero; kind 8: 8-bit
    codes, scale) through our kernel (stages/qmatmul.c) at every row count."""

    def __init__(self, kind: int, codes: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None):
        self.lib = qkernel.library()
        self.kind, self.fmt = kind, f"int{kind}"
        self.out_features, self.in_features = codes.shape
        if self.in_features % GROUP:
            raise ValueError(f"{self.fmt} blocks need inputs in multiples of {GROUP}")
        self.w = qkernel.pack4(codes) if kind == 4 else qkernel.pack8(codes)
        self.s = qkernel.pack_scales(scale)
        self.z = qkernel.pack_scales(zero) if zero is not None and bool(zero.any()) else None

    @classmethod
    def of(cls, m: "Matrix", base: str) -> "BlockLinear":
        """int4: the file's 4-bit blocks, else its Q8_0 blocks, else 8-bit blocks from the
        values; int8: the Q8_0 blocks or 8-bit blocks from the values."""
        if base == "int4" and m.int4 is not None:
            b4 = m.int4  # value = code * scale + offset = (code - 8) * scale + zero
            return cls(4, b4.codes, b4.scale, b4.offset + 8.0 * b4.scale)
        b8 = m.int8 if m.int8 is not None else Int8Blocks.from_float(m.values)
        return cls(8, b8.codes, b8.scale, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qkernel.matmul(self.lib, self.kind, self.w, self.s, self.z,
                              self.out_features, x)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.s, self.z)
                   if t is not None)


class Q6KLinear(Linear):
    """A Q6_K matrix on our kernel (qmatmul.c's kind 6): 6.56 bits a weight read, as
    llama.cpp reads it, where a Q8_0 of it reads 8.5; rows quantized as every kind's."""

    fmt = "q6k"

    def __init__(self, blocks: Q6KBlocks):
        self.lib = qkernel.library()
        self.out_features, self.in_features = blocks.codes.shape
        self.w, self.s, self.z = qkernel.pack6(blocks.codes, blocks.sub, blocks.d)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qkernel.matmul(self.lib, 6, self.w, self.s, self.z, self.out_features, x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 values of rows `ids` [...], shaped [..., in_features]: the bits
        of the matrix dequantized (GGUF's own formula)."""
        flat = qkernel.rows6(self.lib, self.w, self.s, self.z, self.in_features,
                             self.out_features, ids.reshape(-1))  # ids checked there
        return flat.reshape(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.s, self.z))


class RescoredHead:
    """A Q8_0 or Q6_K head for the compact formats: every logit from the file's 8-bit or
    6-bit blocks (our kernel, or torch's int4 kernel as an int4 pair; quantized rows, so
    a little off), then the TOP highest recomputed in float32 from the file's own values,
    exactly the fp32 head's weights. The token a greedy request takes, and every logit that
    sampling can plausibly pick, are then float32 logits; the rest keep the quantized
    rows' error. Deterministic for given shapes (the exactness
    contract): the same rows give the same candidates and the same sums."""

    fmt = "fp32-rescored"
    TOP = 64

    def __init__(self, blocks: Int8Blocks | None, exact: torch.Tensor | None = None,
                 q6k: Q6KBlocks | None = None):
        """exact: the head's float32 values where the file's head is neither Q8_0 nor
        Q6_K: the candidates come from `blocks`, our Q8_0 of them, and are rescored from
        these (one row of 4 bytes a weight is read per candidate, not per vocabulary
        entry). q6k (on our kernel): a Q6_K head (most 4-bit files') whose own blocks give
        the candidates, each rescored from its row dequantized as GGUF does it (the bits
        of its float32 values, which are not kept)."""
        self.lib = qkernel.library()
        if q6k is not None and self.lib is not None:
            self.approx = Q6KLinear(q6k)
            exact = None
        else:
            self.approx = BlockLinear(8, blocks.codes, blocks.scale, None) \
                if self.lib is not None else Int8AsInt4Linear(blocks)
        self.blocks, self.exact = blocks, exact
        self.out_features, self.in_features = self.approx.out_features, \
            self.approx.in_features
        self.top = min(self.TOP, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.approx(x)
        if self.lib is None:
            return self._torch_rescored(x, y)
        # each row alone in rowops.c: its candidates (one pass), their float32 dots
        idx = qkernel.top_rows(self.lib, y, self.top)  # [rows, top]
        if isinstance(self.approx, Q6KLinear):
            a = self.approx
            exact = qkernel.rows_dot6(self.lib, a.w, a.s, a.z, idx, x)
        elif self.exact is not None:
            exact = qkernel.rows_dot_f32(self.lib, self.exact, idx, x)
        else:
            exact = qkernel.rows_dot(self.lib, self.blocks.codes, self.blocks.scale, idx, x)
        return y.scatter_(1, idx, exact)

    def _torch_rescored(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Without our kernel: torch's candidates, each row's product alone."""
        idx = y.topk(self.top, dim=1, sorted=False).indices
        if self.exact is None:
            return y.scatter_(1, idx, (self.blocks.rows(idx) * x[:, None, :]).sum(-1))
        exact = torch.cat([F.linear(x[r:r + 1], self.exact[idx[r]]) for r in range(x.shape[0])])
        return y.scatter_(1, idx, exact)

    @property
    def nbytes(self) -> int:
        """Weight bytes one decode call reads (the candidates' rows are few)."""
        return self.approx.nbytes


class Embeddings:
    """Token rows of the embedding table. A Q8_0 table stays as its blocks, and a row is
    dequantized when asked for: code * scale, the same float32 values as the whole
    dequantized table (Gemma 3's would be 671 MB), at a quarter of the memory; a Q6_K
    table (most 4-bit files') as kind 6's tables on our kernel, at 0.82 bytes a value;
    another type as the file's bytes (`stored`: weights.QuantizedRows), each row
    dequantized as the whole table would be."""

    def __init__(self, weight: torch.Tensor | Matrix, stored=None):
        m = _as_matrix(weight)
        self.blocks = m.int8
        self.q6k = Q6KLinear(m.q6k) if m.int8 is None and m.q6k is not None \
            and qkernel.library() is not None else None
        self.stored = stored if m.int8 is None and self.q6k is None else None
        self.table = m.values if m.int8 is None and self.q6k is None and self.stored is None \
            else None
        self.q8_lib = qkernel.library() if self.blocks is not None and \
            self.blocks.codes.is_contiguous() and self.blocks.scale.is_contiguous() else None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        if self.q6k is not None:
            return self.q6k.rows(ids)
        if self.stored is not None:
            return self.stored.rows(ids)
        if self.q8_lib is not None and ids.ndim == 1:  # one call, not seven ops
            return qkernel.q8_rows(self.q8_lib, self.blocks.codes, self.blocks.scale, ids)
        return self.blocks.rows(ids)


def make_head(weight: torch.Tensor | Matrix, fmt: str, rows: int) -> Linear | RescoredHead:
    """The head: float32 in every format (it picks the token). The compact formats read a
    Q8_0 or Q6_K head's blocks (or our Q8_0 of another head) and rescore the top logits in float32
    (RescoredHead); fp32 the float32 matrix, transposed when it runs 1-2 rows at a time
    (TransposedLinear)."""
    m = _as_matrix(weight)
    if fmt != "fp32" and m.int8 is not None:
        return RescoredHead(m.int8)
    if fmt != "fp32" and m.q6k is not None and qkernel.library() is not None:
        # a Q6_K head (most 4-bit files'): candidates from its own blocks, rescored from
        # its rows dequantized
        return RescoredHead(None, q6k=m.q6k)
    if fmt != "fp32" and m.values.shape[1] % GROUP == 0:
        # another head: candidates from our Q8_0 of it, rescored from its float32
        # values, instead of every float32 row read per token
        return RescoredHead(Int8Blocks.from_float(m.values), exact=m.values)
    return TransposedLinear(m.values) if rows <= 2 else Linear(m.values)


def _as_matrix(weight: torch.Tensor | Matrix) -> Matrix:
    return weight if isinstance(weight, Matrix) else Matrix(weight)


def make_linear(weight: torch.Tensor | Matrix, fmt: str = "fp32") -> Linear:
    """The Linear of one weight in format `fmt` (see the module docstring)."""
    m = _as_matrix(weight)
    base, dense = fmt.removesuffix(LEAN), not fmt.endswith(LEAN)
    if fmt == "fp32":
        return Linear(m.values)
    if fmt == "bf16":
        return Bf16Linear(m.values)
    if base not in ("int4", "int8"):
        raise ValueError(f"weight format '{fmt}' is not supported "
                         f"(supported: {', '.join(WEIGHT_FORMATS)})")
    if qkernel.library() is not None and m.values.shape[1] % GROUP == 0:
        return BlockLinear.of(m, base)
    if base == "int4" and m.int4 is not None:
        return Int4Linear(m.int4, dense)
    if base == "int4" and m.int8 is not None:
        return Int8AsInt4Linear(m.int8)
    return Int8Linear(m.values, dense)


_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def held_bytes(fmt: str, name: str, qtype: str, shape: tuple[int, ...]) -> float:
    """Bytes a stage holds for one GGUF tensor (`qtype` its type name, `shape` in GGUF
    order, inputs first) in format `fmt`: the planner's memory estimate. Layer matrices
    go through make_linear (a 3-D expert stack expert by expert), a Q8_0 table through
    Embeddings and make_head; everything else (norms, convolutions, other tables, MoE
    routers) is held as float32. Ask for a tied head
    as "output.weight"."""
    n = 1
    for d in shape:
        n *= d
    if name == "token_embd.weight" and qtype == "Q8_0":  # Embeddings: the file's blocks
        return (1.0 + 4 / GROUP) * n
    if name == "per_layer_token_embd.weight":  # gemma4.TableColumns: the file's bytes
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        return n * block_bytes / block
    # our kernel holds a GGUF block's scale as a half (qkernel.pack_scales)
    scale = 2 if qkernel.library() is not None else 4
    if name == "output.weight" and qtype == "Q8_0" and fmt != "fp32":  # RescoredHead
        return (1.0 + 4 / GROUP + 1.0 + (4 + scale) / GROUP) * n
    if name.endswith(_ROUTERS):  # stages/moe.py holds routers as float32
        return 4.0 * n
    experts = len(shape) == 3 and "_exps." in name  # every expert held as a matrix
    if not name.startswith("blk.") or not (len(shape) == 2 or experts) or shape[0] % GROUP:
        return 4.0 * n
    base = fmt.removesuffix(LEAN)
    # a bf16 copy only on torch's int kernels (no kernel of ours), never for lean formats
    # nor for experts (stages/moe.py expert_format)
    dense = 0.0 if fmt.endswith(LEAN) or experts or qkernel.library() is not None else 2.0
    if base == "fp32":
        return 4.0 * n
    if base == "bf16":
        return 2.0 * n
    if base == "int4" and qtype in ("Q4_0", "Q4_1"):  # codes, a scale (Q4_1: a zero) per block
        return (0.5 + (scale + (4 if qtype == "Q4_1" else 0)) / GROUP + dense) * n
    # 8-bit blocks: the file's Q8_0, or made from the values (a float32 scale)
    return (1.0 + (scale if qtype == "Q8_0" else 4) / GROUP + dense) * n


def fuse_linear(weights: list[torch.Tensor | Matrix],
                fmt: str = "fp32") -> tuple[Linear, list[int]]:
    """One Linear for several projections of the same input (QKV, gate/up): fewer calls
    per token; returns the split sizes of its output. The files' blocks fuse only when
    every part has them of one kind (else the fused matrix goes to 8-bit blocks from its
    values)."""
    ms = [_as_matrix(w) for w in weights]
    values = torch.cat([m.values for m in ms], dim=0)
    int4 = int8 = None
    if all(m.int4 is not None for m in ms):
        int4 = Int4Blocks(*(torch.cat([getattr(m.int4, f) for m in ms], dim=0)
                            for f in ("codes", "scale", "offset")))
    elif all(m.int8 is not None for m in ms):
        int8 = Int8Blocks(*(torch.cat([getattr(m.int8, f) for m in ms], dim=0)
                            for f in ("codes", "scale")))
    return make_linear(Matrix(values, int4, int8), fmt), [m.values.shape[0] for m in ms]
