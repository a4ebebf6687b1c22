"""Our kernels: the quantized matmul (stages/qmatmul.c) and the per-row operations of a
decode step (stages/rowops.c), built on the node at first use, for the instruction set
the node's torch runs with, and loaded with ctypes.

Each node compiles its own copy (a C compiler is needed; a second or two), kept under
`$SKIPPY_HOME/kernels` by source digest and instruction set. The instruction set follows
`torch.backends.cpu.get_cpu_capability()`, so `ATEN_CPU_CAPABILITY=avx2` restricts this
kernel as it restricts torch's. Every build computes the same bits (the C file says why),
so the choice changes speed only; it is still reported (`kernel_name`) and recorded in a
stage's identity. `SKIPPY_QKERNEL=off` turns the kernel off (torch's kernels then serve
the integer formats), `=c` forces the plain C path.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import math
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(n)
           for n in ("qmatmul.c", "rowops.c", "attention.c", "pool.c", "scan.c", "decoder.c",
                     "moe.c")]
# included by the sources: part of the digest
HEADERS = [Path(__file__).with_name(n) for n in ("fmath.h", "kernels.h")]
TN, QK = 16, 32  # columns per packed tile, inputs per block (qmatmul.c)
FLAGS = {
    "avx512-vnni": ["-DSKQ_AVX512", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw",
                    "-mavx512vl", "-mavx512vnni"],
    "avx2": ["-DSKQ_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "c": [],
}
COMMON = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-fopenmp", "-ffp-contract=off"]


@lru_cache(maxsize=None)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                break  # the blank line after the first processor
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_name() -> str:
    return _cpuinfo().get("model name", "?")


def isa() -> str:
    """The instruction set to build for: what torch runs with on this CPU."""
    forced = os.environ.get("SKIPPY_QKERNEL", "")
    if forced in FLAGS:
        return forced
    cap = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    if cap == "AVX512" and "avx512_vnni" in flags:
        return "avx512-vnni"
    if cap in ("AVX2", "AVX512") and {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "c"


def _home() -> Path:
    env = os.environ.get("SKIPPY_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "skippy"


def _build(which: str) -> Path:
    """The shared library for `which`, compiled once per node (a lock keeps concurrent
    stages from building it twice)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
                            + " ".join(FLAGS[which] + COMMON).encode())
    out = _home() / "kernels" / f"skippy-{digest.hexdigest()[:12]}-{which}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc or gcc) to build the quantized matmul kernel")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            run = subprocess.run([cc, *COMMON, *FLAGS[which], *map(str, SOURCES), "-lm",
                                  "-o", str(tmp)], capture_output=True, text=True)
            if run.returncode:
                raise OSError(f"building our kernels failed: {run.stderr.strip()[-500:]}")
            os.replace(tmp, out)
    return out


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None when it is off or could not be built (said once on
    stderr: the integer formats then run on torch's kernels)."""
    which = isa()
    if os.environ.get("SKIPPY_QKERNEL") == "off":
        return None
    try:
        # torch is imported first: its libgomp is the OpenMP runtime our prefill calls join
        lib = ctypes.CDLL(str(_build(which)))
    except OSError as e:
        print(f"skippy: quantized kernel unavailable ({e}); using torch's", file=sys.stderr)
        return None
    lib.skq_matmul.restype = ctypes.c_int
    lib.skq_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_int]
    lib.skq_isa.restype = ctypes.c_char_p
    _declare_rowops(lib)
    return lib


def kernel_name() -> str:
    """What the integer formats run on here: "skq-<isa>" or "torch"."""
    lib = library()
    return f"skq-{lib.skq_isa().decode()}" if lib is not None else "torch"


def _tiles(t: torch.Tensor, fill: float) -> torch.Tensor:
    """[N, ...] padded with `fill` to whole tiles of TN rows, as [tiles, TN, ...]."""
    n = t.shape[0]
    pad = -n % TN
    if pad:
        t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    return t.reshape(-1, TN, *t.shape[1:])


S16, Z16 = 16, 32  # qmatmul.c's SKQ_S16 / SKQ_Z16: the scales / zeros are halves
TEAM = 64  # qmatmul.c's SKQ_TEAM: on torch's OpenMP team whatever the row count
OMP_ROWS = 4  # qmatmul.c's: calls of more rows take that team anyway
_team = threading.local()


@contextmanager
def openmp_team(on: bool = True):
    """Matmuls inside run on torch's OpenMP team even at a few rows. After a prefill's
    many-row calls that team is still awake (spinning), and pool.c's workers, which one- to
    four-row calls take, would fight it for the cores: Gemma 3's head row after a 16-row
    prefill took 10 ms that way and takes 6 on the team. Each tile is still one thread's:
    the same bits."""
    was = getattr(_team, "on", False)
    _team.on = on
    try:
        yield
    finally:
        _team.on = was


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """[N, blocks] -> [tiles, blocks, TN] (qmatmul.c's layout): halves where every value
    is one (GGUF's block scales are), so a one-row call reads less; else float32. The
    kernel reads a half's float exactly: the same bits either way."""
    s = scale.to(torch.float32)
    if torch.equal(s.half().float(), s):
        s = s.half()
    return _tiles(s, 0.0).permute(0, 2, 1).contiguous()


def kind_word(kind: int, s: torch.Tensor, z: torch.Tensor | None) -> int:
    """skq_matmul's kind: 4 or 8, with the flags of the tables held as halves."""
    return kind | (S16 if s.dtype == torch.float16 else 0) \
        | (Z16 if z is not None and z.dtype == torch.float16 else 0)


class QMat(ctypes.Structure):
    """kernels.h's qmat: a matrix on our integer kernel (BlockLinear's tables)."""

    _fields_ = [("kind", ctypes.c_int), ("w", ctypes.c_void_p), ("s", ctypes.c_void_p),
                ("z", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


def qmat(lin) -> QMat:
    """A BlockLinear's tables as kernels.h's qmat (the linear keeps them alive)."""
    return QMat(kind_word(lin.kind, lin.s, lin.z), lin.w.data_ptr(), lin.s.data_ptr(),
                lin.z.data_ptr() if lin.z is not None else None,
                lin.out_features, lin.in_features)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 0..15) -> bytes [tiles, blocks, 4, TN, 4]: the low
    nibble input 4j + u of a block, the high nibble input 16 + 4j + u."""
    n, k = codes.shape
    c = _tiles(codes.to(torch.uint8), 8).reshape(-1, TN, k // QK, 2, 4, 4)
    lo = c[:, :, :, 0].permute(0, 2, 3, 1, 4)
    hi = c[:, :, :, 1].permute(0, 2, 3, 1, 4)
    return (lo | (hi << 4)).contiguous()


def pack8(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes [N, K] (int8) -> bytes [tiles, blocks, 8, TN, 4]."""
    n, k = codes.shape
    c = _tiles(codes.to(torch.int8), 0).reshape(-1, TN, k // QK, 8, 4)
    return c.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8)


def pack6(codes: torch.Tensor, sub: torch.Tensor, d: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K as qmatmul.c's kind 6: codes [N, K] (uint8 0..63), sub-scales [N, K / 16]
    (int8), d [N, K / 256] (halves) -> the packed codes [tiles, blocks, 384] (kind 4's
    nibbles of the low 4 bits, then per half h the top 2 bits of input 16h + 4j + u in
    bits 2j of byte [h][i][u]), the sub-scales [tiles, blocks, 2, TN] and d [tiles,
    K / 256, TN]."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    low = pack4(c & 15).reshape(-1, k // QK, 256)
    top = _tiles(c >> 4, 0).reshape(-1, TN, k // QK, 2, 4, 4)  # [t, i, b, h, j, u]
    planes = sum(top[:, :, :, :, j] << (2 * j) for j in range(4))  # [t, i, b, h, u]
    planes = planes.permute(0, 2, 3, 1, 4).reshape(-1, k // QK, 128)
    w = torch.cat([low, planes.to(torch.uint8)], dim=2).contiguous()
    sub_t = _tiles(sub.to(torch.int8), 0).reshape(-1, TN, k // QK, 2)
    d_t = _tiles(d.to(torch.float16), 0.0).permute(0, 2, 1)
    return w, sub_t.permute(0, 2, 3, 1).contiguous(), d_t.contiguous()


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as contiguous `dtype`, without an op where it already is (a decode step's ops
    run with the caches emptied by the weights' stream: each costs tens of us)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def matmul(lib: ctypes.CDLL, kind: int, w: torch.Tensor, s: torch.Tensor,
           z: torch.Tensor | None, n: int, x: torch.Tensor,
           use_c: bool = False) -> torch.Tensor:
    """y = x @ W.T through the kernel; x float32 [M, K]."""
    x = _as(x, torch.float32)
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    team = TEAM if getattr(_team, "on", False) else 0
    word = kind if kind == 6 else kind_word(kind, s, z)
    rc = lib.skq_matmul(word | team, w.data_ptr(), s.data_ptr(),
                        z.data_ptr() if z is not None else None,
                        n, k, x.data_ptr(), m, y.data_ptr(), torch.get_num_threads(),
                        int(use_c))
    if rc:
        raise MemoryError("quantized matmul: no scratch memory")
    return y


# -- per-row operations (rowops.c) ----------------------------------------------------------

class AttnShape(ctypes.Structure):
    """attention.c's attn_shape: one attention layer's shape and its per-layer tensors."""

    _fields_ = [(n, ctypes.c_int) for n in ("heads", "kv_heads", "head_dim", "v_head_dim",
                                            "rope_dim", "rope_style", "window")] \
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] \
        + [(n, ctypes.c_void_p) for n in ("qk_norm", "cos", "sin")] \
        + [("softcap", ctypes.c_float)] \
        + [("v_row", ctypes.c_int), ("rope_at", ctypes.c_int)]
    # softcap: scores capped as cap * tanh(s / cap), 0: not; v_row != 0: values inside the
    # key rows, v_row floats apart (MLA), 0: a value cache of their own; rope_at: where in
    # a head its rotated part starts. Unset fields are 0 (ctypes zero-fills them).


def _declare_rowops(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.skr_rms_norm.restype = None
    lib.skr_rms_norm.argtypes = [p, p, i64, i64, i64, ctypes.c_float, p]
    for fn in (lib.skr_attend_rows, lib.skr_attend_cached):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(AttnShape), p, i64, p, p, p, p, ctypes.c_int]
    lib.skr_gated.restype = None
    lib.skr_set_gelu_f16.restype = None
    lib.skr_set_gelu_f16.argtypes = [p]
    lib.skr_gated.argtypes = [ctypes.c_int, p, p, i64, i64, i64, p, ctypes.c_int]
    lib.skr_linear_f32.restype = None
    lib.skr_linear_f32.argtypes = [p, i64, p, i64, i64, i64, p, i64, ctypes.c_int]
    lib.skr_linear_f32_heads.restype = None
    lib.skr_linear_f32_heads.argtypes = [p, i64, i64, p, i64, i64, i64, i64, i64, p, i64,
                                         i64, ctypes.c_int]
    for fn in (lib.skr_q6k_rows, lib.skr_q8_0_rows):  # rows of a quantized table
        fn.restype = None
        fn.argtypes = [p, i64, p, i64, p]
    lib.skr_q8_rows.restype = ctypes.c_int
    lib.skr_q8_rows.argtypes = [p, p, i64, i64, p, i64, p]
    lib.skr_f16_rows.restype = ctypes.c_int
    lib.skr_f16_rows.argtypes = [p, i64, ctypes.c_float, p]
    lib.skr_f16_values.restype = None
    lib.skr_f16_values.argtypes = [p, p, i64, i64, p]
    lib.skr_soft_cap.restype = None
    lib.skr_soft_cap.argtypes = [p, i64, ctypes.c_float, ctypes.c_float, p]
    lib.skr_gate.restype = None
    lib.skr_gate.argtypes = [ctypes.c_int, p, i64, i64, p]
    lib.skd_layers.restype = ctypes.c_int  # decoder.c
    lib.skd_layers.argtypes = [p, ctypes.c_int, p, i64, i64, p, p, p, p, ctypes.c_int]
    lib.skd_gemma4_layers.restype = ctypes.c_int
    lib.skd_gemma4_layers.argtypes = [p, ctypes.c_int, p, i64, i64, p, p, i64, p, p, p, p,
                                      ctypes.c_int]
    lib.skr_layer_norm.restype = None
    lib.skr_layer_norm.argtypes = [p, i64, i64, ctypes.c_float, p]
    lib.skm_moe.restype = ctypes.c_int  # moe.c
    lib.skm_moe.argtypes = [p, p, i64, p, p, p, ctypes.c_int]
    lib.skr_rows_dot.restype = ctypes.c_int
    lib.skr_rows_dot.argtypes = [p, p, i64, p, i64, i64, p, p]
    lib.skr_rows_dot_f32.restype = None
    lib.skr_rows_dot_f32.argtypes = [p, i64, p, i64, i64, p, p]
    lib.skq_rows_dot6.restype = ctypes.c_int
    lib.skq_rows_dot6.argtypes = [p, p, p, i64, p, i64, i64, p, p]
    lib.skq_rows6.restype = ctypes.c_int
    lib.skq_rows6.argtypes = [p, p, p, i64, i64, p, i64, p]
    lib.skr_top_rows.restype = None
    lib.skr_top_rows.argtypes = [p, i64, i64, i64, p]
    # -- the recurrent mixers' scans (scan.c) --
    c_int, c_float = ctypes.c_int, ctypes.c_float
    lib.skr_scan_conv.restype = None
    lib.skr_scan_conv.argtypes = [p, p, i64, i64, i64, p, c_int, p, c_int, p, c_int]
    lib.skr_scan_mamba2.restype = c_int
    lib.skr_scan_mamba2.argtypes = [p, i64, i64, p, i64, p, p, p, c_int, c_int, c_int, c_int,
                                    p, p, p, c_int]
    lib.skr_scan_deltanet.restype = c_int
    lib.skr_scan_deltanet.argtypes = [p, p, i64, p, i64, p, i64, i64, i64, p, p, c_int, c_int,
                                      c_int, c_float, p, p, p, c_int]


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension; `weight` spans the
    last one or more dimensions of x (per-head norms)."""
    x = _as(x, torch.float32)
    w = _as(weight, torch.float32)
    k = x.shape[-1]
    out = torch.empty_like(x)
    lib.skr_rms_norm(x.data_ptr(), w.data_ptr(), x.numel() // k, k, w.numel() // k, eps,
                     out.data_ptr())
    return out


def layer_norm(lib: ctypes.CDLL, x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the last dimension (rowops.c), no weight."""
    x = _as(x, torch.float32)
    out = torch.empty_like(x)
    k = x.shape[-1]
    lib.skr_layer_norm(x.data_ptr(), x.numel() // k, k, eps, out.data_ptr())
    return out


GATED = {"silu": 0, "gelu_tanh": 1, "gelu_f16": 2}  # rowops.c skr_gated's activations


def gated_act(lib: ctypes.CDLL, act: str) -> int:
    """skr_gated's number for `act`, its table handed over first where it reads one."""
    if act == "gelu_f16":
        lib.skr_set_gelu_f16(gelu_f16_table().data_ptr())
    return GATED[act]


@lru_cache(maxsize=1)
def gelu_f16_table() -> torch.Tensor:
    """GELU's tanh form of every f16 value, in double precision (libm's, the same on every
    instruction set), rounded to f16: [65536] float32, indexed by the f16's bits
    (llama.cpp's GGML_GELU_FP16 table)."""
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = []
    for v in values.tolist():
        if math.isfinite(v):
            v = 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
        out.append(v)
    return torch.tensor(out, dtype=torch.float64).to(torch.float16).to(torch.float32)


def gated(lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up elementwise (rowops.c: every element by the same float operations,
    wherever the call's rows put it); gate and up [rows, n], e.g. the halves of one
    product's rows."""
    if gate.stride() != up.stride() or gate.stride(-1) != 1 or gate.dtype != torch.float32:
        gate, up = gate.float().contiguous(), up.float().contiguous()
    rows, n = gate.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    lib.skr_gated(gated_act(lib, act), gate.data_ptr(), up.data_ptr(), rows, n, gate.stride(0),
                  out.data_ptr(), torch.get_num_threads())
    return out


def linear_f32(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] times float32 weight [n_out, k] transposed, each output by rowops.c's
    fixed-order dot: a row's bits depend on neither the call's rows nor the threads.
    x and out may be strided views whose rows are contiguous (a head of a wider row)."""
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    rows, k = x.shape
    n_out = weight.shape[0]
    if out is None:
        out = torch.empty(rows, n_out, dtype=torch.float32)
    lib.skr_linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), rows, k, n_out,
                       out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out


def linear_f32_heads(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
                     out: torch.Tensor) -> None:
    """linear_f32 of each head in one call: x [rows, H, k] (rows and heads strided,
    each head's k floats contiguous) times weight [H, n_out, k] (contiguous) into out
    [rows, H, n_out] (likewise strided): head h's outputs bitwise linear_f32(x[:, h],
    weight[h])."""
    rows, heads, k = x.shape
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    if not weight.is_contiguous() or out.stride(-1) != 1:
        raise ValueError("linear_f32_heads: a contiguous weight and out's last dimension")
    n_out = weight.shape[1]
    lib.skr_linear_f32_heads(x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(),
                             weight.stride(0), heads, rows, k, n_out, out.data_ptr(),
                             out.stride(0), out.stride(1), torch.get_num_threads())


def soft_cap(lib: ctypes.CDLL, x: torch.Tensor, inv: float, cap: float) -> torch.Tensor:
    """tanh(x * inv) * cap elementwise (rowops.c: each value by the same float operations,
    in one thread)."""
    x = _as(x, torch.float32)
    out = torch.empty_like(x)
    lib.skr_soft_cap(x.data_ptr(), x.numel(), inv, cap, out.data_ptr())
    return out


GATES = {"softmax": 0, "sigmoid": 1, "sqrt_softplus": 2}  # rowops.c skr_gate's kinds


def gate(lib: ctypes.CDLL, x: torch.Tensor, kind: str) -> torch.Tensor:
    """A router's gate over the last dimension of x, each row alone (rowops.c)."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    lib.skr_gate(GATES[kind], x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                 out.data_ptr())
    return out


def attend_rows(lib: ctypes.CDLL, shape: AttnShape, qkv: torch.Tensor, rows: int,
                  pos: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
                  out: torch.Tensor) -> None:
    """attention.c skr_attend_rows over the first `rows` rows of qkv (changed in place:
    normed and rotated), into out; pos, keys and values are per row."""
    _attend(lib.skr_attend_rows, shape, qkv, rows, pos, keys, values, out)


def attend_cached(lib: ctypes.CDLL, shape: AttnShape, q: torch.Tensor, pos: list[int],
                  keys: list[torch.Tensor], values: list[torch.Tensor],
                  out: torch.Tensor) -> None:
    """attention.c skr_attend_cached: rows q ([rows, heads * head_dim], normed and
    rotated, their k and v already in the caches) over their lanes' keys, into out."""
    _attend(lib.skr_attend_cached, shape, q, len(pos), pos, keys, values, out)


def _attend(fn, shape: AttnShape, rows_in: torch.Tensor, rows: int, pos: list[int],
            keys: list[torch.Tensor], values: list[torch.Tensor], out: torch.Tensor) -> None:
    arr = ctypes.c_void_p * rows
    at = (ctypes.c_int64 * rows)(*pos)
    ks, vs = arr(*(k.data_ptr() for k in keys)), arr(*(v.data_ptr() for v in values))
    rc = fn(ctypes.byref(shape), rows_in.data_ptr(), rows, at, ks, vs, out.data_ptr(),
            torch.get_num_threads())
    if rc:
        raise MemoryError("decode attention: no scratch memory")


def q8_rows(lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
    """[len(ids), k]: Int8Blocks.rows of ids (int64) in one call."""
    ids = _as(ids, torch.int64)
    out = torch.empty(ids.numel(), codes.shape[1], dtype=torch.float32)
    if lib.skr_q8_rows(codes.data_ptr(), scale.data_ptr(), codes.shape[1], codes.shape[0],
                       ids.data_ptr(), ids.numel(), out.data_ptr()):
        raise IndexError(f"a row id out of range [0, {codes.shape[0]})")
    return out


def f16_rows(lib: ctypes.CDLL, x: torch.Tensor, limit: float) -> torch.Tensor | None:
    """x (contiguous float32) as f16 where every |value| is below `limit`, else None."""
    out = torch.empty(x.shape, dtype=torch.float16)
    return out if lib.skr_f16_rows(x.data_ptr(), x.numel(), limit, out.data_ptr()) else None


def f16_values(lib: ctypes.CDLL, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[n, k] float32: f16 rows (contiguous) times their float32 scales, in one call."""
    n, k = rows.shape
    out = torch.empty(n, k, dtype=torch.float32)
    lib.skr_f16_values(rows.data_ptr(), scale.data_ptr(), n, k, out.data_ptr())
    return out


def rows_dot(lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor,
             x: torch.Tensor) -> torch.Tensor:
    """For each row of x, its dot product with the Q8_0 rows idx picks ([rows, top])."""
    idx = _as(idx, torch.int64)
    x = _as(x, torch.float32)
    out = torch.empty(idx.shape, dtype=torch.float32)
    rc = lib.skr_rows_dot(codes.data_ptr(), scale.data_ptr(), codes.shape[1], idx.data_ptr(),
                          idx.shape[0], idx.shape[1], x.data_ptr(), out.data_ptr())
    if rc:
        raise MemoryError("rows_dot: no scratch memory")
    return out


def rows_dot_f32(lib: ctypes.CDLL, w: torch.Tensor, idx: torch.Tensor,
                 x: torch.Tensor) -> torch.Tensor:
    """For each row of x, its dot product with the float32 rows of w idx picks."""
    x = _as(x, torch.float32)
    out = torch.empty(idx.shape, dtype=torch.float32)
    lib.skr_rows_dot_f32(w.data_ptr(), w.shape[1], idx.data_ptr(), idx.shape[0],
                         idx.shape[1], x.data_ptr(), out.data_ptr())
    return out


def rows_dot6(lib: ctypes.CDLL, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor,
              idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """rows_dot_f32 over a kind-6 matrix's float32 values (pack6's w, s, z), each picked
    row dequantized as GGUF dequantizes it: the same bits, without a float32 copy."""
    x = _as(x, torch.float32)
    out = torch.empty(idx.shape, dtype=torch.float32)
    if lib.skq_rows_dot6(w.data_ptr(), s.data_ptr(), z.data_ptr(), x.shape[1],
                         idx.data_ptr(), idx.shape[0], idx.shape[1], x.data_ptr(),
                         out.data_ptr()):
        raise MemoryError("rows_dot6: no scratch memory")
    return out


def rows6(lib: ctypes.CDLL, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, k: int,
          n: int, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids), k]: the float32 values of an n-row kind-6 matrix's rows `ids`."""
    ids = _as(ids, torch.int64)
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    if lib.skq_rows6(w.data_ptr(), s.data_ptr(), z.data_ptr(), k, n, ids.data_ptr(),
                     ids.numel(), out.data_ptr()):
        raise IndexError(f"row out of range [0, {n})")
    return out


def top_rows(lib: ctypes.CDLL, y: torch.Tensor, top: int) -> torch.Tensor:
    """[rows, top] int64: the indices of each row's top highest values, in no order."""
    y = _as(y, torch.float32)
    idx = torch.empty(y.shape[0], top, dtype=torch.int64)
    lib.skr_top_rows(y.data_ptr(), y.shape[0], y.shape[1], top, idx.data_ptr())
    return idx


# -- the recurrent mixers' scans (scan.c) ----------------------------------------------------

def _rows_f32(x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows whose elements are contiguous (a strided view of a wider row is
    kept as it is)."""
    if x.dtype != torch.float32 or x.stride(-1) != 1 or x.ndim != 2:
        x = x.float().reshape(x.shape[0], -1).contiguous()
    return x


def scan_conv(lib: ctypes.CDLL, state: torch.Tensor, x: torch.Tensor, taps: torch.Tensor,
              bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """The n output rows of a depthwise causal conv over [state; x] (state [width - 1, ch],
    taps [width, ch], tap 0 oldest), + bias, then SiLU where asked: scan.c skr_scan_conv,
    each row by the same float operations whatever the call."""
    x = _rows_f32(x)
    state = state.float().contiguous()
    n, ch = x.shape
    out = torch.empty(n, ch, dtype=torch.float32)
    lib.skr_scan_conv(state.data_ptr(), x.data_ptr(), x.stride(0), n, ch, taps.data_ptr(),
                      taps.shape[0], None if bias is None else bias.data_ptr(), int(silu),
                      out.data_ptr(), torch.get_num_threads())
    return out


def scan_mamba2(lib: ctypes.CDLL, xbc: torch.Tensor, n_real: int, dt: torch.Tensor,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, groups: int,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan over the conv output rows xbc [n, x | B | C] and raw time steps dt
    [n, n_head] from state [n_head, head_dim, d_state]: (y [n, n_head * head_dim], the
    state after row n_real - 1, a new tensor)."""
    xbc, dt = xbc.float().contiguous(), _rows_f32(dt)
    state = state.float().contiguous()
    n_head, head_dim, d_state = state.shape
    n = xbc.shape[0]
    y = torch.empty(n, n_head * head_dim, dtype=torch.float32)
    new = torch.empty_like(state)
    rc = lib.skr_scan_mamba2(xbc.data_ptr(), n, n_real, dt.data_ptr(), dt.stride(0),
                             dt_bias.data_ptr(), A.data_ptr(), D.data_ptr(), n_head, head_dim,
                             d_state, groups, state.data_ptr(), new.data_ptr(), y.data_ptr(),
                             torch.get_num_threads())
    if rc:
        raise MemoryError("mamba2 scan: no scratch memory")
    return y, new


def scan_deltanet(lib: ctypes.CDLL, qk: torch.Tensor, v: torch.Tensor, ba: torch.Tensor,
                  n_real: int, dt_bias: torch.Tensor, A: torch.Tensor, scale: float,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the L2-normed rows qk [n, 2 * n_k, d] (q heads, then k
    heads), v [n, n_v * d] and the raw betas and alphas ba [n, 2 * n_v] from state [n_v,
    d, d]: (out [n, n_v, d], the state after row n_real - 1, a new tensor)."""
    qk = qk.float().contiguous()
    v, ba = _rows_f32(v), _rows_f32(ba)
    state = state.float().contiguous()
    n, n_k2, d = qk.shape
    n_v = state.shape[0]
    out = torch.empty(n, n_v, d, dtype=torch.float32)
    new = torch.empty_like(state)
    rc = lib.skr_scan_deltanet(qk.data_ptr(), qk[:, n_k2 // 2:].data_ptr(), qk.stride(0),
                               v.data_ptr(), v.stride(0), ba.data_ptr(), ba.stride(0), n,
                               n_real, dt_bias.data_ptr(), A.data_ptr(), n_k2 // 2, n_v, d,
                               scale, state.data_ptr(), new.data_ptr(), out.data_ptr(),
                               torch.get_num_threads())
    if rc:
        raise MemoryError("deltanet scan: no scratch memory")
    return out, new
