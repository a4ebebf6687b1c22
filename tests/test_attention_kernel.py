"""Our attention kernel (stages/attention.c): the q/k norms, rope and KV write of each
row, attention as torch computes it, and a row's bits fixed by its position alone —
whatever the rows beside it, the lanes beside it, the thread count or the build."""

from __future__ import annotations

import ctypes

import pytest
import torch

from skippy.stages import qkernel

lib = qkernel.library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: torch's attention serves")


def _rope_tables(n: int, dim: int):
    ang = torch.arange(n)[:, None] * (10000.0 ** (-torch.arange(dim // 2) * 2 / dim))[None]
    return torch.cos(ang).contiguous(), torch.sin(ang).contiguous()


@pytest.mark.parametrize("style, window", [(0, 0), (1, 5)])
def test_decode_attention_matches_torch(style, window):
    H, G, D, L = 4, 2, 32, 9
    cos, sin = _rope_tables(64, D)
    shape = qkernel.AttnShape(H, G, D, D, D, style, window, 1e-6, D ** -0.5, None)
    shape.cos, shape.sin = cos.data_ptr(), sin.data_ptr()
    keys = [torch.randn(16, G, D) for _ in range(2)]
    values = [torch.randn(16, G, D) for _ in range(2)]
    qkv = torch.randn(2, (H + 2 * G) * D)
    pos = [L, 3]
    out = torch.zeros(2, H * D)
    rotated = qkv.clone()
    qkernel.attend_rows(lib, shape, rotated, 2, pos, keys, values, out)
    for r in range(2):
        p = pos[r]
        qk = qkv[r, :(H + G) * D].view(H + G, D)
        if style == 0:  # pairs (2i, 2i + 1)
            z = torch.view_as_complex(qk.reshape(H + G, D // 2, 2).contiguous())
            qk = torch.view_as_real(z * torch.complex(cos[p], sin[p])).reshape(H + G, D)
        else:  # halves
            a, b = qk[:, :D // 2], qk[:, D // 2:]
            qk = torch.cat([a * cos[p] - b * sin[p], a * sin[p] + b * cos[p]], -1)
        assert torch.allclose(keys[r][p], qk[H:], atol=1e-6)  # the KV write
        assert torch.allclose(values[r][p], qkv[r, (H + G) * D:].view(G, D))
        lo = max(0, p + 1 - window) if window else 0
        k, v = keys[r][lo:p + 1], values[r][lo:p + 1]
        q = qk[:H]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[None, :, None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None],
            scale=D ** -0.5, enable_gqa=True)[0, :, 0].reshape(-1)
        assert torch.allclose(out[r], want, atol=1e-5)
    one = torch.zeros(1, H * D)  # row 1 alone gives the same bits
    keys2 = [k.clone() for k in keys]
    qkernel.attend_rows(lib, shape, qkv[1:].clone(), 1, pos[1:], keys2[1:], values[1:], one)
    assert torch.equal(one[0], out[1])


@pytest.mark.parametrize("window", [0, 5])
def test_cached_attention_is_decode_attention_over_prepared_rows(window):
    """Rows a family normed, rotated and wrote to the cache itself (Gemma 4) attend with
    the bits of attend_rows's, which prepares them; the caches are only read."""
    H, G, D, pos = 4, 2, 32, [9, 3]
    cos, sin = _rope_tables(64, D)
    prepare = qkernel.AttnShape(H, G, D, D, D, 1, window, 1e-6, 1.0, None)
    prepare.cos, prepare.sin = cos.data_ptr(), sin.data_ptr()
    keys = [torch.randn(16, G, D) for _ in range(2)]
    values = [torch.randn(16, G, D) for _ in range(2)]
    qkv = torch.randn(2, (H + 2 * G) * D)
    want = torch.zeros(2, H * D)
    qkernel.attend_rows(lib, prepare, qkv, 2, pos, keys, values, want)  # qkv now rotated
    held = [k.clone() for k in keys + values]
    got = torch.zeros(2, H * D)
    cached = qkernel.AttnShape(H, G, D, D, 0, 0, window, 1e-6, 1.0, None)
    qkernel.attend_cached(lib, cached, qkv[:, :H * D].contiguous(), pos, keys, values, got)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, held))


def _lane_rows(shape, qkv, pos0, n, calls=(None,), threads=1, kernel=None):
    """Rows [pos0, pos0 + n) of one lane (2 kv heads of 32) through skr_attend_rows in
    calls of the given row counts (None: the rest at once), on a fresh cache."""
    fn = (kernel or lib).skr_attend_rows
    torch.set_num_threads(threads)
    keys, values = torch.zeros(160, 2, 32), torch.zeros(160, 2, 32)
    out = torch.zeros(n, shape.heads * 32)
    r = 0
    for size in calls:
        size = n - r if size is None else size
        got = torch.zeros(size, shape.heads * 32)
        qkernel._attend(fn, shape, qkv[r:r + size].clone(), size,
                        list(range(pos0 + r, pos0 + r + size)), [keys] * size,
                        [values] * size, got)
        out[r:r + size] = got
        r += size
    return out


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (24, 0.0), (0, 30.0)])
def test_attention_rows_are_row_invariant(window, softcap):
    """A row's bits are fixed by its position alone: a 100-row prefill in one call, row by
    row (decode steps), in calls of 3 and 17, at 1 and 2 threads, and beside other lanes."""
    H, G, D, n = 6, 2, 32, 100
    cos, sin = _rope_tables(256, D)
    shape = qkernel.AttnShape(H, G, D, D, D, 1, window, 1e-6, D ** -0.5, None, softcap=softcap)
    shape.cos, shape.sin = cos.data_ptr(), sin.data_ptr()
    qkv = torch.randn(n, (H + 2 * G) * D, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        whole = _lane_rows(shape, qkv, 0, n)
        for calls, t in (([1] * n, 1), ([3] * 33 + [1], 2), ([17] * 5 + [15], 1),
                         ([64, 36], 2), ([5, 59, 36], 1)):
            assert torch.equal(_lane_rows(shape, qkv, 0, n, calls=calls, threads=t), whole), \
                (calls[:3], t)
        # the last rows beside 7 other lanes' rows in one call
        keys, values = torch.zeros(160, G, D), torch.zeros(160, G, D)
        start = qkv[:n - 4].clone()
        qkernel.attend_rows(lib, shape, start, n - 4, list(range(n - 4)), [keys] * (n - 4),
                            [values] * (n - 4), torch.zeros(n - 4, H * D))
        others = [(torch.zeros(160, G, D), torch.zeros(160, G, D)) for _ in range(7)]
        mixed = torch.cat([qkv[n - 4:], torch.randn(7, qkv.shape[1])])
        pos = list(range(n - 4, n)) + [3, 40, 0, 99, 7, 64, 31]
        got = torch.zeros(11, H * D)
        qkernel.attend_rows(lib, shape, mixed, 11, pos, [keys] * 4 + [k for k, _ in others],
                            [values] * 4 + [v for _, v in others], got)
        assert torch.equal(got[:4], whole[n - 4:])
    finally:
        torch.set_num_threads(threads)


def test_prefill_attention_matches_torch_causal():
    """Many rows of one lane in one call: torch's causal attention over the same rows."""
    H, G, D, n = 4, 2, 32, 70
    cos, sin = _rope_tables(128, D)
    shape = qkernel.AttnShape(H, G, D, D, 0, 0, 0, 1e-6, D ** -0.5, None)  # no rope
    shape.cos, shape.sin = cos.data_ptr(), sin.data_ptr()
    qkv = torch.randn(n, (H + 2 * G) * D)
    got = _lane_rows(shape, qkv, 0, n)
    q = qkv[:, :H * D].view(n, H, D).transpose(0, 1)
    k = qkv[:, H * D:(H + G) * D].view(n, G, D).transpose(0, 1)
    v = qkv[:, (H + G) * D:].view(n, G, D).transpose(0, 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=D ** -0.5, enable_gqa=True)[0]
    assert torch.allclose(got, want.transpose(0, 1).reshape(n, -1), atol=1e-5)


def test_attention_bits_are_the_same_in_every_build():
    """The plain C build and the vector builds this CPU runs give a row the same bits."""
    flags = qkernel.cpu_flags()
    runnable = ["c"] + (["avx2"] if {"avx2", "fma"} <= flags else []) \
        + (["avx512-vnni"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    H, G, D, n = 4, 2, 32, 40
    cos, sin = _rope_tables(64, D)
    shape = qkernel.AttnShape(H, G, D, D, D, 0, 0, 1e-6, D ** -0.5, None)
    shape.cos, shape.sin = cos.data_ptr(), sin.data_ptr()
    qkv = torch.randn(n, (H + 2 * G) * D)
    outs = []
    for which in runnable:
        other = ctypes.CDLL(str(qkernel._build(which)))
        other.skr_attend_rows.restype = ctypes.c_int
        other.skr_attend_rows.argtypes = lib.skr_attend_rows.argtypes
        outs.append(_lane_rows(shape, qkv, 0, n, kernel=other))
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), runnable


def _latent_rows(shape, rows_in, calls=(None,), threads=1, kernel=None):
    """Multi-head latent attention (stages/mla.py): rows [0, n) of one lane, each
    [heads x (latent + rope) | its latent row], through skr_attend_rows in calls of the
    given row counts on a fresh cache of latent rows, which are also the values (v_row)."""
    fn = (kernel or lib).skr_attend_rows
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, D, H = rows_in.shape[0], shape.head_dim, shape.heads
        cache = torch.zeros(160, 1, D)
        out, r = torch.zeros(n, H * shape.v_head_dim), 0
        for size in calls:
            size = n - r if size is None else size
            got = torch.zeros(size, H * shape.v_head_dim)
            qkernel._attend(fn, shape, rows_in[r:r + size].clone(), size,
                            list(range(r, r + size)), [cache] * size, [cache] * size, got)
            out[r:r + size] = got
            r += size
        return out, cache
    finally:
        torch.set_num_threads(threads_before)


def _latent_shape(H, L, R, cos, sin):
    shape = qkernel.AttnShape(H, 1, L + R, L, R, 0, 0, 1e-6, (L + R) ** -0.5, None,
                              v_row=L + R, rope_at=L)
    shape.cos, shape.sin = cos.data_ptr(), sin.data_ptr()
    return shape


def test_latent_attention_matches_torch():
    """One key row per token whose first L floats are the values; q_pe and k_pe (the last
    R floats of each head) rotated at the row's position; the latent rows written to the
    cache: torch's causal attention over the same rows."""
    H, L, R, n = 4, 64, 16, 70
    cos, sin = _rope_tables(128, R)
    shape = _latent_shape(H, L, R, cos, sin)
    rows_in = torch.randn(n, (H + 1) * (L + R), generator=torch.Generator().manual_seed(2))
    got, cache = _latent_rows(shape, rows_in)
    x = rows_in.view(n, H + 1, L + R)
    pe = torch.view_as_complex(x[..., L:].reshape(n, H + 1, R // 2, 2).contiguous())
    turned = pe * torch.complex(cos[:n], sin[:n])[:, None]
    x = torch.cat([x[..., :L], torch.view_as_real(turned).reshape(n, H + 1, R)], -1)
    assert torch.allclose(cache[:n, 0], x[:, H], atol=1e-6)  # the latent rows written
    keys = x[:, H]
    want = torch.nn.functional.scaled_dot_product_attention(
        x[:, :H].transpose(0, 1)[None], keys[None, None], keys[None, None, :, :L],
        is_causal=True, scale=(L + R) ** -0.5)[0]
    assert torch.allclose(got, want.transpose(0, 1).reshape(n, -1), atol=1e-5)


def test_latent_attention_bits_are_row_invariant_in_every_build():
    """At DeepSeek's sizes (kv_lora_rank 512, rope 64: heads of 576, values of 512) and 20
    heads (tiles of 12 rows; a decode row's heads split over the threads): a row's bits are
    the same in one call, row by row, in calls of 3 at 2 threads, and in every build."""
    flags = qkernel.cpu_flags()
    runnable = ["c"] + (["avx2"] if {"avx2", "fma"} <= flags else []) \
        + (["avx512-vnni"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    H, L, R, n = 20, 512, 64, 40
    cos, sin = _rope_tables(64, R)
    shape = _latent_shape(H, L, R, cos, sin)
    rows_in = torch.randn(n, (H + 1) * (L + R), generator=torch.Generator().manual_seed(3))
    outs = []
    for which in runnable:
        other = ctypes.CDLL(str(qkernel._build(which)))
        other.skr_attend_rows.restype = ctypes.c_int
        other.skr_attend_rows.argtypes = lib.skr_attend_rows.argtypes
        whole, cache = _latent_rows(shape, rows_in, kernel=other)
        for calls, t in (([1] * n, 2), ([3] * 13 + [1], 2), ([17, 23], 1)):
            again, cache2 = _latent_rows(shape, rows_in, calls, t, kernel=other)
            assert torch.equal(again, whole) and torch.equal(cache2, cache), (which, calls[:2], t)
        outs.append(whole)
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), runnable
