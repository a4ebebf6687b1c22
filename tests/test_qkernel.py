"""Our quantized matmul kernel (stages/qmatmul.c): the vector paths give the plain C
definition's bits, a row's bits never depend on the rows beside it or the thread count,
and the result is the blocks' values times the quantized rows."""

from __future__ import annotations

import ctypes

import pytest
import torch

from skippy.stages import qkernel
from skippy.stages.layers import gelu_f16
from skippy.stages.linear import Int4Blocks, Int8Blocks
from skippy.stages.norms import layer_norm

lib = qkernel.library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: torch's kernels serve")


def _weights(kind: int, n: int, k: int, zero: bool, seed: int = 0, halves: bool = False):
    """Packed blocks of a random matrix and their values; halves: scales (and zeros) that
    are halves, as GGUF's are, so that the packing keeps them as halves."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == 4:
        b = Int4Blocks.from_float(w)
        z = b.offset + 8 * b.scale if zero else torch.zeros_like(b.scale)
        if halves:
            b = Int4Blocks(b.codes, b.scale.half().float(), b.offset)
            z = z.half().float()
        values = ((b.codes.float() - 8).view(n, -1, 32) * b.scale[..., None]
                  + z[..., None]).view(n, k)
        return (qkernel.pack4(b.codes), qkernel.pack_scales(b.scale),
                qkernel.pack_scales(z) if zero else None, values)
    b = Int8Blocks.from_float(w)  # its scales are halves, as Q8_0's
    if not halves:  # float32 scales, which the packing keeps as floats
        b = Int8Blocks(b.codes, b.scale * 1.001)
    values = (b.codes.float().view(n, -1, 32) * b.scale[..., None]).view(n, k)
    return qkernel.pack8(b.codes), qkernel.pack_scales(b.scale), None, values


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """Rows as the kernel sees them: int8 per block of 32, d = amax / 127."""
    m, k = x.shape
    g = x.view(m, -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(g * torch.where(d > 0, 1 / d, 0)), 0)
    return (q * d).view(m, k)


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("kind, zero", [(4, False), (4, True), (8, False)])
@pytest.mark.parametrize("n, k", [(50, 64), (576, 576), (37, 1536)])
def test_vector_path_equals_the_c_definition(kind, zero, n, k, halves):
    w, s, z, values = _weights(kind, n, k, zero, halves=halves)
    assert (s.dtype == torch.float16) == halves
    x = torch.randn(11, k)  # 11 rows: whole row groups and a tail
    got = qkernel.matmul(lib, kind, w, s, z, n, x)
    assert torch.equal(got, qkernel.matmul(lib, kind, w, s, z, n, x, use_c=True))
    want = _quantized(x) @ values.T
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("kind", [4, 8])
def test_a_rows_bits_ignore_its_neighbours_and_the_threads(kind):
    w, s, z, _ = _weights(kind, 200, 256, zero=kind == 4)
    x = torch.randn(40, 256)  # 40 rows: above OMP_ROWS, on OpenMP's team
    whole = qkernel.matmul(lib, kind, w, s, z, 200, x)
    alone = torch.cat([qkernel.matmul(lib, kind, w, s, z, 200, x[i:i + 1]) for i in range(40)])
    assert torch.equal(whole, alone)
    threes = torch.cat([qkernel.matmul(lib, kind, w, s, z, 200, x[i:i + 3])
                        for i in range(0, 40, 3)])
    assert torch.equal(whole, threes)
    with qkernel.openmp_team():  # a prefill's head row: few rows on the OpenMP team
        assert torch.equal(whole, torch.cat([qkernel.matmul(lib, kind, w, s, z, 200, x[i:i + 2])
                                             for i in range(0, 40, 2)]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qkernel.matmul(lib, kind, w, s, z, 200, x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, one)


@pytest.mark.parametrize("kind, zero", [(4, True), (4, False), (8, False)])
def test_scales_held_as_halves_give_the_floats_bits(kind, zero):
    """Every half (subnormals, both signs) read by each path as its exact float."""
    w, s, z, _ = _weights(kind, 70, 320, zero)
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 0x7c00, s.shape, generator=g, dtype=torch.int32)
    bits[..., :3] = torch.tensor([1, 0x3ff, 0x400])  # the smallest, largest subnormal, normal
    sign = torch.randint(0, 2, s.shape, generator=g, dtype=torch.int32) << 15
    s16 = (bits | sign).to(torch.int16).view(torch.float16)
    z16 = s16.flip(-1).contiguous() if z is not None else None
    x = torch.randn(9, 320)
    for use_c in (False, True):
        half = qkernel.matmul(lib, kind, w, s16, z16, 70, x, use_c=use_c)
        whole = qkernel.matmul(lib, kind, w, s16.float(),
                               z16.float() if z16 is not None else None, 70, x, use_c=use_c)
        assert torch.equal(half, whole) and half.isfinite().all()


def test_every_build_this_cpu_runs_gives_the_same_bits():
    """The AVX2 and AVX-512 builds against the plain C one, where the CPU has them."""
    flags = qkernel.cpu_flags()
    runnable = ["c"] + (["avx2"] if {"avx2", "fma", "f16c"} <= flags else []) \
        + (["avx512-vnni"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    x = torch.randn(9, 320)
    for kind, zero, halves in ((4, True, False), (4, False, False), (8, False, False),
                               (4, True, True), (8, False, True)):
        w, s, z, _ = _weights(kind, 70, 320, zero, halves=halves)
        outs = []
        for which in runnable:
            other = ctypes.CDLL(str(qkernel._build(which)))
            for f, t in (("skq_matmul", ctypes.c_int), ("skq_isa", ctypes.c_char_p)):
                getattr(other, f).restype = t
            other.skq_matmul.argtypes = lib.skq_matmul.argtypes
            assert other.skq_isa().decode() == which
            outs.append(qkernel.matmul(other, kind, w, s, z, 70, x))
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), runnable


def test_every_build_gives_the_same_activation_bits():
    """rowops.c's loops as each build's compiler vectorized them, against the plain C."""
    flags = qkernel.cpu_flags()
    runnable = ["c"] + (["avx2"] if {"avx2", "fma"} <= flags else []) \
        + (["avx512-vnni"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    g, u = torch.randn(9, 100) * 5, torch.randn(9, 100)
    w = torch.randn(13, 100)
    builds = []
    for which in runnable:
        other = ctypes.CDLL(str(qkernel._build(which)))
        qkernel._declare_rowops(other)
        builds.append(other)
    for act in qkernel.GATED:
        outs = [qkernel.gated(other, g, u, act) for other in builds]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), (act, runnable)
    for kind in qkernel.GATES:
        outs = [qkernel.gate(other, g, kind) for other in builds]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), (kind, runnable)
    outs = [qkernel.linear_f32(other, g, w) for other in builds]
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), ("linear_f32", runnable)


def test_kernel_name_says_what_runs(monkeypatch):
    assert qkernel.kernel_name() == f"skq-{qkernel.isa()}"
    monkeypatch.setenv("SKIPPY_QKERNEL", "avx2")
    assert qkernel.isa() == "avx2"


# -- per-row operations (rowops.c) ----------------------------------------------------------

def test_rms_norm_is_the_formula_row_by_row():
    x, w = torch.randn(7, 3, 64), torch.randn(3, 64)  # per-head weights, as q/k norms use
    got = qkernel.rms_norm(lib, x, w, 1e-6)
    want = x * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6).float() * w
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkernel.rms_norm(lib, x[2:3], w, 1e-6), got[2:3])  # a row alone


@pytest.mark.parametrize("act, want", [
    ("silu", lambda g: torch.nn.functional.silu(g)),
    ("gelu_tanh", lambda g: torch.nn.functional.gelu(g, approximate="tanh")),
    ("gelu_f16", lambda g: gelu_f16(g))])  # llama.cpp's table: the same bits as torch's lookup
def test_gated_is_the_activation_and_each_element_its_own(act, want):
    g = torch.cat([torch.randn(37, 70) * 4, torch.linspace(-120, 120, 70)[None]])
    u = torch.randn(38, 70)
    both = torch.cat([g, u], dim=1)  # the halves of one product's rows, as the FFN has them
    got = qkernel.gated(lib, *both.split(70, dim=1), act)
    assert torch.allclose(got, want(g) * u, rtol=1e-5, atol=1e-6)
    if act == "gelu_f16":
        assert torch.equal(got, want(g) * u)
    assert got.isfinite().all()
    # a row alone, a few rows, on one thread: the same bits (torch's own differ in a
    # vector's tail), whatever lanes of a vector its elements fall in
    assert torch.equal(torch.cat([qkernel.gated(lib, g[i:i + 3], u[i:i + 3], act)
                                  for i in range(0, 38, 3)]), got)
    assert torch.equal(qkernel.gated(lib, g[:, 3:], u[:, 3:], act), got[:, 3:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qkernel.gated(lib, g, u, act), got)
    finally:
        torch.set_num_threads(threads)


def test_gelu_f16_rounds_to_the_half_as_torch_does():
    """Every finite half below 10 in magnitude, the midpoints between neighbours (ties go
    to the even one) and a float either side of each: our kernel's rounding (integer
    arithmetic, rowops.c half_bits) picks the table entry torch's .half() picks."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    halves = halves[halves.isfinite() & (halves.abs() < 10)].unique()  # sorted
    mids = (halves[:-1].double() + halves[1:].double()) / 2
    x = torch.cat([halves, mids.float(), torch.nextafter(mids.float(), torch.tensor(1e9)),
                   torch.nextafter(mids.float(), torch.tensor(-1e9)),
                   torch.tensor([1e-30, -1e-30, 2.0 ** -25, 2.0 ** -24, 3 * 2.0 ** -26])])
    x = x[x.abs() < 10][None]
    got = qkernel.gated(lib, x, torch.ones_like(x), "gelu_f16")
    assert torch.equal(got, gelu_f16(x))


def test_layer_norm_is_the_formula_row_by_row():
    x = torch.randn(9, 200) * 3 + 1
    got = qkernel.layer_norm(lib, x, 1e-5)
    d = x.double()
    want = (d - d.mean(-1, keepdim=True)) / torch.sqrt(d.var(-1, unbiased=False, keepdim=True)
                                                       + 1e-5)
    assert torch.allclose(got, want.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer_norm(x, 1e-5), got)  # the norms' path is this kernel
    assert torch.equal(qkernel.layer_norm(lib, x[4:5], 1e-5), got[4:5])


def test_top_rows_are_each_rows_highest_and_its_own():
    y = torch.randn(5, 3000)
    y[3] = y[3].round()  # many equal values: any of them may fill the last places
    got = qkernel.top_rows(lib, y, 64)
    want = y.topk(64, dim=1).values
    for r in range(5):
        assert len(set(got[r].tolist())) == 64
        assert torch.equal(y[r, got[r]].sort(descending=True).values, want[r])
        assert torch.equal(qkernel.top_rows(lib, y[r:r + 1], 64), got[r:r + 1])
    assert torch.equal(qkernel.top_rows(lib, y, 3000).sort(1).values,
                       torch.arange(3000).expand(5, -1))  # every index once


def test_float32_rows_dot_is_the_picked_rows_times_x():
    w, x = torch.randn(500, 96), torch.randn(3, 96)
    idx = torch.randint(0, 500, (3, 64))
    got = qkernel.rows_dot_f32(lib, w, idx, x)
    assert torch.allclose(got, (w[idx] * x[:, None, :]).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(qkernel.rows_dot_f32(lib, w, idx[1:2], x[1:2]), got[1:2])


def test_rows_dot_is_the_rows_float32_values_times_x():
    b = Int8Blocks.from_float(torch.randn(300, 128))
    x = torch.randn(3, 128)
    idx = torch.randint(0, 300, (3, 20))
    got = qkernel.rows_dot(lib, b.codes, b.scale, idx, x)
    want = (b.rows(idx) * x[:, None, :]).sum(-1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def _alone_in_any_call(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over x's rows at once, checked bitwise against the rows in calls of 1 and 3 and
    on one thread (the row-invariant contract)."""
    got = fn(x)
    assert torch.equal(torch.cat([fn(x[i:i + 1]) for i in range(len(x))]), got)
    assert torch.equal(torch.cat([fn(x[i:i + 3]) for i in range(0, len(x), 3)]), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fn(x), got)
    finally:
        torch.set_num_threads(threads)
    return got


@pytest.mark.parametrize("kind, want", [
    ("softmax", lambda x: torch.softmax(x, -1)),
    ("sigmoid", torch.sigmoid),
    ("sqrt_softplus", lambda x: torch.sqrt(torch.nn.functional.softplus(x)))])
def test_a_router_gate_is_the_formula_and_each_row_its_own(kind, want):
    x = torch.cat([torch.randn(40, 72) * 4, torch.linspace(-100, 100, 72)[None]])
    got = _alone_in_any_call(lambda rows: qkernel.gate(lib, rows, kind), x)
    assert torch.allclose(got, want(x), rtol=1e-5, atol=1e-7)


def test_a_float32_product_is_the_formula_and_each_row_its_own():
    x, w = torch.randn(70, 200), torch.randn(48, 200)
    got = _alone_in_any_call(lambda rows: qkernel.linear_f32(lib, rows, w), x)
    assert torch.allclose(got.double(), x.double() @ w.double().t(), rtol=1e-4, atol=1e-4)
    # a head's slice of wider rows in, a slice of wider rows out
    wide, out = torch.randn(5, 3, 200), torch.zeros(5, 2, 48)
    qkernel.linear_f32(lib, wide[:, 1], w, out=out[:, 1])
    assert torch.equal(out[:, 1], qkernel.linear_f32(lib, wide[:, 1].contiguous(), w))
    assert not out[:, 0].any()


def test_every_heads_product_in_one_call_is_each_heads_own():
    # latent attention's up-projections: heads are columns of wider rows, in and out
    rows, heads, k, n = 6, 4, 40, 24
    x = torch.randn(rows, heads, k + 8)[..., 3:3 + k]
    w = torch.randn(heads, n, k)
    out = torch.zeros(rows, heads + 1, n + 5)
    qkernel.linear_f32_heads(lib, x, w, out[:, :heads, :n])
    for h in range(heads):
        assert torch.equal(out[:, h, :n], qkernel.linear_f32(lib, x[:, h].contiguous(), w[h]))
    assert not out[:, heads].any() and not out[..., n:].any()


def _q6k(n: int, k: int, seed: int = 0):
    """A random Q6_K matrix as kind 6's tables, and its values d * sub * (code - 32)."""
    from skippy.stages.linear import Q6KBlocks, Q6KLinear
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
    sub = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int32).to(torch.int8)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half()
    values = d.float().repeat_interleave(256, 1) * sub.float().repeat_interleave(16, 1) \
        * (codes.float() - 32)
    return Q6KLinear(Q6KBlocks(codes, sub, d)), values


@pytest.mark.parametrize("n, k", [(50, 256), (576, 512), (37, 1536)])
def test_q6k_vector_path_equals_the_c_definition(n, k):
    lin, values = _q6k(n, k)
    x = torch.randn(11, k)  # 11 rows: whole row groups and a tail
    got = lin(x)
    assert torch.equal(got, qkernel.matmul(lib, 6, lin.w, lin.s, lin.z, n, x, use_c=True))
    want = _quantized(x) @ values.T
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())
    assert lin.nbytes <= -(-n // 16) * 16 * k * 6.57 / 8  # 6.56 bits a weight, whole tiles


def test_a_q6k_head_rescores_from_its_blocks_as_from_its_float32_values():
    from skippy.stages.linear import Embeddings, Matrix, Q6KBlocks, RescoredHead
    lin, values = _q6k(300, 512, seed=5)
    g = torch.Generator().manual_seed(5)  # _q6k's draws again: the same blocks
    codes = torch.randint(0, 64, (300, 512), generator=g, dtype=torch.uint8)
    sub = torch.randint(-128, 128, (300, 32), generator=g, dtype=torch.int32).to(torch.int8)
    d = (torch.rand(300, 2, generator=g) * 1e-3).half()
    x = torch.randn(3, 512)
    idx = torch.randint(0, 300, (3, 64))
    assert torch.equal(qkernel.rows_dot6(lib, lin.w, lin.s, lin.z, idx, x),
                       qkernel.rows_dot_f32(lib, values, idx, x))  # GGUF's values, same bits
    blocks = Q6KBlocks(codes, sub, d)
    head = RescoredHead(None, q6k=blocks)
    assert head.exact is None  # no float32 copy kept
    table = Embeddings(Matrix(values, None, None, blocks))  # an embedding table likewise
    ids = torch.tensor([[0, 299, 7], [7, 150, 0]])
    assert table.table is None and torch.equal(table(ids), values[ids])
    with pytest.raises(IndexError):
        table(torch.tensor([300]))
    y = lin(x)
    top = qkernel.top_rows(lib, y, head.top)
    assert torch.equal(head(x), y.scatter_(1, top, qkernel.rows_dot_f32(lib, values, top, x)))


def test_q6k_rows_bits_ignore_their_neighbours_threads_and_build():
    lin, _ = _q6k(200, 512, seed=3)
    x = torch.randn(40, 512)
    whole = lin(x)
    assert torch.equal(whole, torch.cat([lin(x[i:i + 1]) for i in range(40)]))
    assert torch.equal(whole, torch.cat([lin(x[i:i + 3]) for i in range(0, 40, 3)]))
    flags = qkernel.cpu_flags()
    runnable = ["c"] + (["avx2"] if {"avx2", "fma", "f16c"} <= flags else []) \
        + (["avx512-vnni"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    for which in runnable:
        other = ctypes.CDLL(str(qkernel._build(which)))
        other.skq_matmul.restype = ctypes.c_int
        other.skq_matmul.argtypes = lib.skq_matmul.argtypes
        assert torch.equal(qkernel.matmul(other, 6, lin.w, lin.s, lin.z, 200, x), whole), which


def test_q8_rows_are_the_blocks_rows_and_refuse_an_id_past_the_table():
    b = Int8Blocks.from_float(torch.randn(300, 128))
    ids = torch.tensor([0, 299, 17, 17])
    assert torch.equal(qkernel.q8_rows(lib, b.codes, b.scale, ids), b.rows(ids))
    for bad in (300, -1):
        with pytest.raises(IndexError):
            qkernel.q8_rows(lib, b.codes, b.scale, torch.tensor([3, bad]))
