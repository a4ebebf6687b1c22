"""The recurrent mixers' kernels (stages/scan.c): the conv and the Mamba2 and DeltaNet scans
follow their torch formulas, a token's bits and the state after it never depend on how
the tokens are split into calls or on the thread count, padding rows never enter the
state, and every build this CPU runs gives the same bits."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from skippy.stages import qkernel
from skippy.stages.layers import causal_conv

lib = qkernel.library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: torch's scans serve")

# odd sizes: vector bodies and scalar tails both run
H, P, N, G = 6, 10, 13, 2         # Mamba2: heads, head_dim, d_state, groups
NK, NV, D = 2, 6, 20              # DeltaNet: key heads, value heads, head_dim
WIDTH = 4                         # conv taps


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mamba2_inputs(n: int, seed: int = 0):
    g = _gen(seed)
    xbc = torch.randn(n, H * P + 2 * G * N, generator=g)
    dt = torch.randn(n, H, generator=g) * 8  # both sides of softplus's threshold of 20
    dt[::7, 0] = 25.0
    dt[3::11, 1] = -100.0  # exp underflows
    dt_bias = torch.randn(H, generator=g)
    A = -torch.rand(H, generator=g) * 4
    Dp = torch.randn(H, generator=g)
    state = torch.randn(H, P, N, generator=g)
    return xbc, dt, dt_bias, A, Dp, state


def _mamba2_torch(xbc, dt, dt_bias, A, Dp, state):
    """stages/mamba2.py's torch scan, in float64."""
    n = xbc.shape[0]
    x, b, c = xbc.double().split([H * P, G * N, G * N], dim=-1)
    x = x.reshape(n, H, P)
    b = b.reshape(n, G, N).repeat_interleave(H // G, 1)
    c = c.reshape(n, G, N).repeat_interleave(H // G, 1)
    dts = F.softplus(dt.double() + dt_bias.double())
    s, ys = state.double(), []
    for t in range(n):
        s = s * torch.exp(dts[t] * A.double())[:, None, None] \
            + b[t][:, None, :] * (x[t] * dts[t][:, None])[:, :, None]
        ys.append((s * c[t][:, None, :]).sum(-1))
    return (torch.stack(ys) + x * Dp.double()[:, None]).reshape(n, -1), s


def _deltanet_inputs(n: int, seed: int = 0):
    g = _gen(seed)
    qk = F.normalize(torch.randn(n, 2 * NK, D, generator=g), dim=-1)
    v = torch.randn(n, NV * D, generator=g)
    ba = torch.randn(n, 2 * NV, generator=g) * 6
    ba[::5, 1] = 40.0  # softplus above its threshold, sigmoid saturated
    ba[2::9, 0] = -120.0
    dt_bias = torch.randn(NV, generator=g)
    A = -torch.rand(NV, generator=g) * 2
    state = torch.randn(NV, D, D, generator=g) * 0.1
    return qk, v, ba, dt_bias, A, state


def _deltanet_torch(qk, v, ba, dt_bias, A, state, scale):
    """stages/deltanet.py's torch recurrence, in float64."""
    n, rep = qk.shape[0], NV // NK
    q = qk[:, :NK].double().repeat_interleave(rep, 1)
    k = qk[:, NK:].double().repeat_interleave(rep, 1)
    v = v.double().reshape(n, NV, D)
    ba = ba.double().reshape(n, NK, 2, rep)
    beta = torch.sigmoid(ba[:, :, 0].reshape(n, NV))
    decay = torch.exp(F.softplus(ba[:, :, 1].reshape(n, NV) + dt_bias.double()) * A.double())
    s, outs = state.double(), []
    for t in range(n):
        s = s * decay[t][:, None, None]
        delta = (v[t] - (s * k[t][:, None, :]).sum(-1)) * beta[t][:, None]
        s = s + delta[:, :, None] * k[t][:, None, :]
        outs.append((s * q[t][:, None, :]).sum(-1) * scale)
    return torch.stack(outs), s


def _in_calls(fn, n: int, calls: list[int], state):
    """fn(a, b, state) -> (rows, state) over tokens [0, n) in calls of the given sizes."""
    rows, a = [], 0
    for size in calls:
        out, state = fn(a, min(a + size, n), state)
        rows.append(out)
        a += size
    assert a >= n
    return torch.cat(rows), state


def test_conv_is_causal_conv_bit_for_bit_and_silu_follows_torch():
    g = _gen(1)
    taps = torch.randn(WIDTH, 37, generator=g)
    state, x = torch.randn(WIDTH - 1, 37, generator=g), torch.randn(50, 37, generator=g) * 9
    bias = torch.randn(37, generator=g)
    plain = qkernel.scan_conv(lib, state, x, taps)
    want = causal_conv(torch.cat([state, x]), list(taps), 50)
    assert torch.equal(plain, want)  # the same float operations in the same order
    got = qkernel.scan_conv(lib, state, x, taps, bias, silu=True)
    assert torch.allclose(got, F.silu(want + bias), rtol=1e-6, atol=1e-6)
    wide = torch.randn(50, 100, generator=g)  # strided rows: a view of a wider product
    assert torch.equal(qkernel.scan_conv(lib, state, wide[:, 10:47], taps),
                       qkernel.scan_conv(lib, state, wide[:, 10:47].contiguous(), taps))


def test_mamba2_scan_follows_torch():
    xbc, dt, dt_bias, A, Dp, state = _mamba2_inputs(40)
    y, new = qkernel.scan_mamba2(lib, xbc, 40, dt, dt_bias, A, Dp, G, state)
    want_y, want_state = _mamba2_torch(xbc, dt, dt_bias, A, Dp, state)
    assert torch.allclose(y.double(), want_y, rtol=1e-4, atol=1e-4)
    assert torch.allclose(new.double(), want_state, rtol=1e-4, atol=1e-4)


def test_deltanet_scan_follows_torch():
    qk, v, ba, dt_bias, A, state = _deltanet_inputs(40)
    out, new = qkernel.scan_deltanet(lib, qk, v, ba, 40, dt_bias, A, D ** -0.5, state)
    want_out, want_state = _deltanet_torch(qk, v, ba, dt_bias, A, state, D ** -0.5)
    assert torch.allclose(out.double(), want_out, rtol=1e-4, atol=1e-5)
    assert torch.allclose(new.double(), want_state, rtol=1e-4, atol=1e-5)


def _mamba2_step(inputs):
    xbc, dt, dt_bias, A, Dp, _ = inputs
    return lambda a, b, s: qkernel.scan_mamba2(lib, xbc[a:b], b - a, dt[a:b], dt_bias, A, Dp,
                                               G, s)


def _deltanet_step(inputs):
    qk, v, ba, dt_bias, A, _ = inputs
    return lambda a, b, s: qkernel.scan_deltanet(lib, qk[a:b], v[a:b], ba[a:b], b - a,
                                                 dt_bias, A, D ** -0.5, s)


@pytest.mark.parametrize("scan", ["mamba2", "deltanet"])
def test_a_tokens_bits_ignore_the_calls_and_the_threads(scan):
    """100 tokens in one call, token by token, in calls of 3 and 17 and 64, on 1 and 2
    threads: the same rows and the same state after them, bit for bit."""
    n = 100
    inputs = _mamba2_inputs(n) if scan == "mamba2" else _deltanet_inputs(n)
    step = _mamba2_step(inputs) if scan == "mamba2" else _deltanet_step(inputs)
    threads = torch.get_num_threads()
    try:
        whole = _in_calls(step, n, [n], inputs[-1])
        for calls, t in (([1] * n, 1), ([3] * 34, 2), ([17] * 6, 1), ([64, 36], 2),
                         ([5, 59, 36], 1)):
            torch.set_num_threads(t)
            rows, state = _in_calls(step, n, calls, inputs[-1])
            assert torch.equal(rows, whole[0]) and torch.equal(state, whole[1]), (calls[:3], t)
    finally:
        torch.set_num_threads(threads)


def test_padding_rows_never_enter_the_state():
    """A call of 16 rows, 9 real: the real rows' outputs and the state after them are the
    9-row call's; the input state is never written."""
    m_in, d_in = _mamba2_inputs(16), _deltanet_inputs(16)
    held = [m_in[-1].clone(), d_in[-1].clone()]
    xbc, dt, dt_bias, A, Dp, state = m_in
    y, s = qkernel.scan_mamba2(lib, xbc, 9, dt, dt_bias, A, Dp, G, state)
    y9, s9 = qkernel.scan_mamba2(lib, xbc[:9], 9, dt[:9], dt_bias, A, Dp, G, state)
    assert torch.equal(y[:9], y9) and torch.equal(s, s9)
    qk, v, ba, dt_bias, A, state = d_in
    out, s = qkernel.scan_deltanet(lib, qk, v, ba, 9, dt_bias, A, 0.25, state)
    out9, s9 = qkernel.scan_deltanet(lib, qk[:9], v[:9], ba[:9], 9, dt_bias, A, 0.25, state)
    assert torch.equal(out[:9], out9) and torch.equal(s, s9)
    assert torch.equal(m_in[-1], held[0]) and torch.equal(d_in[-1], held[1])


def test_scan_bits_are_the_same_in_every_build():
    """The plain C build and the vector builds this CPU runs give the conv, both scans and
    the states the same bits (softplus, sigmoid, exp and SiLU included: our polynomials)."""
    flags = qkernel.cpu_flags()
    runnable = ["c"] + (["avx2"] if {"avx2", "fma"} <= flags else []) \
        + (["avx512-vnni"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    g = _gen(3)
    taps = torch.randn(WIDTH, 70, generator=g)
    cstate, cx = torch.randn(WIDTH - 1, 70, generator=g), torch.randn(45, 70, generator=g) * 12
    bias = torch.randn(70, generator=g)
    m_in, d_in = _mamba2_inputs(45, seed=4), _deltanet_inputs(45, seed=5)
    outs = []
    for which in runnable:
        other = ctypes.CDLL(str(qkernel._build(which)))
        qkernel._declare_rowops(other)
        xbc, dt, dt_bias, A, Dp, state = m_in
        qk, v, ba, dbias, dA, dstate = d_in
        outs.append([qkernel.scan_conv(other, cstate, cx, taps, bias, silu=True),
                     *qkernel.scan_mamba2(other, xbc, 40, dt, dt_bias, A, Dp, G, state),
                     *qkernel.scan_deltanet(other, qk, v, ba, 40, dbias, dA, D ** -0.5,
                                            dstate)])
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0])), runnable
