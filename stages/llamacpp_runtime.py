"""The llama.cpp stage runtime: a whole model at llama.cpp speed (DESIGN.md §6).

One llama.cpp context serves every lane. A lane is a sequence id with a KV stream of its
own (`kv_unified=False`): n_ctx cells that no other lane touches. Payloads are llama.cpp's
own per-sequence state bytes, opaque to us.

Every setting below makes a row's arithmetic independent of the batch it runs in, so a
cached, resumed or batched row is bitwise a cold one. tests/test_llamacpp_runtime.py
checks each rule; the figures that chose them are in evals/README.md ("llama.cpp runtime").
- Private streams: in a unified cache a new row can land in a hole another lane left, and
  flash attention then sums the lane's keys in another order; each lane's prefill would
  also walk every other lane's cells.
- Flash attention on: its CPU kernel skips masked cells exactly, so cells past a lane's
  end (a decode group spans the longest lane) drop out.
- Every prompt row takes the same attention kernel, cached or not. From 64 rows a
  micro-batch runs a tiled kernel, below that a per-row one, and the two sum differently;
  in the tiled one a row does not depend on the other rows. So a dense prefill runs
  micro-batches that end at multiples of `micro_batch`, and its last chunk (1 to 64 rows)
  runs alone: a prefill resumed at a chunk boundary runs the same kernels as a cold one.
  Recurrent models, and chunks that are not multiples of 64, run one chunk per micro-batch.
- On the per-row kernel a row depends neither on the rows beside it nor on their number,
  so a prompt whose last chunk begins where the lane's last prompt's did resumes at any
  row inside it (`resume_point`), as llama.cpp's server does. Not where the lane's rows
  were copied or imported (how they ran is not known), not with float matrices (one row
  takes another matmul kernel), never as one row alone over >= 512 cells (split-KV).
- A fixed thread count, in the identity: one row over >= 512 cells takes a split-KV path
  with one slice of cells per thread, exact for a given count in a private stream.
- Decode rows of several lanes run as one micro-batch, where a row does not depend on the
  rows beside it. A row alone takes another kernel from 256 tokens in the lane (split-KV:
  llama.cpp pads a stream's view to 256 cells) and always with F32/F16/BF16 matrices: with
  `lane_batch` 1 (the default) such a lane decodes alone and the others together; with
  `lane_batch` >= 2 every lane decodes together, a lone one beside a padding row.
  Recurrent models (a padding row would advance a neighbour's state) and sliding-window
  ones (a row changes with the other lanes' lengths) decode every lane alone.

Streams share no cells, so copies between lanes go through the state bytes (export,
import, cut the tail); and a state loads only into a context with as many streams
("n_stream mismatch"): the count is part of the identity.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import torch

from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_package import is_package
from skippy.topology.planner import DEFAULT_LANES

from .frame import Frame
from .runtime import (LaneState, StageError, StageOutput, StageRuntime, StageSpec,
                      check_prefill)

log = logging.getLogger(__name__)

STATE_KEY = "llama_state"  # LaneState.fixed key of the opaque llama.cpp sequence state

# The CPU flash-attention kernel switches to its tiled algorithm at this many rows of a
# micro-batch (its sums differ from the per-row one's: see the module docstring).
FA_TILED_MIN_ROWS = 64
# Rows of a dense prefill's micro-batches: the fewest that prefill as fast as larger ones,
# so other lanes' decode rows wait least between them (evals/README.md, llama.cpp runtime).
PREFILL_ROWS = 256
# A lane this long decodes over >= 512 cells: alone, its row takes the split-KV path
# (module docstring).
SPLIT_KV_LENGTH = 256

# The KV cache holds f16: llama.cpp casts K and V to f16 for flash attention anyway, so an
# f32 cache would only double the state bytes (evals/README.md, llama.cpp runtime).
KV_DTYPE = "f16"


class LlamaCppError(RuntimeError):
    """llama.cpp refused an operation: a decode failed, or a state would not load. The
    message carries llama.cpp's own last error line where it logged one."""


# -- llama.cpp process setup ---------------------------------------------------------------
_recent_errors: deque[str] = deque(maxlen=4)
# ggml_log_level in this ggml: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (the
# comment in llama_cpp/_logger.py still has the older numbering).
_GGML_WARN, _GGML_ERROR = 3, 4
_backend_ready = False


def _on_llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp would log model loading line by line to stderr. Keep its warnings and
    # errors at debug/info level in Python logging (the shipped Gemma file warns on every
    # load), and remember the last errors: the exceptions raised here quote them.
    if level not in (_GGML_WARN, _GGML_ERROR):
        return
    msg = text.decode("utf-8", "replace").strip()
    if msg:
        if level == _GGML_ERROR:
            _recent_errors.append(msg)
        log.log(logging.INFO if level == _GGML_ERROR else logging.DEBUG, "llama.cpp: %s", msg)


_log_callback = None  # the ctypes callback object must outlive every llama.cpp call


def _init_llama_cpp():
    """Import llama_cpp, route its logging to Python logging, init the backend (once)."""
    global _backend_ready, _log_callback
    import llama_cpp

    if not _backend_ready:
        _log_callback = llama_cpp.llama_log_callback(_on_llama_log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


def _last_error() -> str:
    return f" (llama.cpp: {_recent_errors[-1]})" if _recent_errors else ""


def weights_digest(path: str | Path) -> str:
    """BLAKE3 over the architecture's hyperparameters and every tensor's name, type,
    shape and stored bytes. The bytes are hashed as stored, with no dequantizing, so this
    is cheap. Only the model decides the value: file names and key order do not."""
    f = GGUFFile(path)
    try:
        arch = f.architecture
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update(f"gguf-whole:{arch}".encode())
        for key in sorted(k for k in f.metadata if k.startswith(arch + ".")):
            h.update(f"|{key}={f.get(key)!r}".encode())
        for info in sorted(f.tensors.values(), key=lambda t: t.name):
            h.update(f"|{info.name}:{info.qtype.name}:{info.shape}|".encode())
            h.update(memoryview(f.raw(info.name)))
        return h.hexdigest()
    finally:
        f.close()


@dataclass
class _Lane:
    length: int = 0      # positions held (prefill + decode)
    prefilled: int = 0   # positions computed by prefill: the only ones a later prefill reuses
    tail_exact: bool = False  # its prompt's last chunk ran in this lane, one row at a time


class LlamaCppStageRuntime(StageRuntime):
    """A whole-model stage on llama.cpp. Lanes are sequence ids 1..max_lanes of one
    context, each with its own KV stream of n_ctx cells. The streams are allocated and
    zeroed up front, so memory grows with max_lanes x n_ctx from the start (a cell's size:
    evals/README.md, llama.cpp runtime).

    Sequence 0 is scratch: every export goes through it. llama.cpp writes the sequence
    id into the state bytes (and ignores it on import), so exporting from one fixed id
    makes a prefix's bytes the same whichever lane held it: payloads dedupe, and
    re-exports match."""

    # Lanes are few (each a preallocated stream) and copies between them go through the
    # state bytes anyway: cache entries live as payloads, not as lanes.
    lane_entries = False

    def __init__(self, spec: StageSpec, *, max_lanes: int = DEFAULT_LANES):
        if is_package(spec.model_path):
            raise StageError("the llama.cpp runtime serves a .gguf file, not a package")
        f = GGUFFile(spec.model_path)
        n_layers = int(f.arch_key("block_count", 0))
        arch = f.architecture
        # Float matrices take another matmul kernel for one row than for several.
        self.float_weights = any(t.qtype.name in ("F32", "F16", "BF16") and len(t.shape) > 1
                                 for t in f.tensors.values())
        f.close()
        if (spec.layer_start, spec.layer_end, spec.stage_index, spec.n_stages) != \
                (0, n_layers, 0, 1):
            raise StageError("the llama.cpp runtime serves a whole model (--stages 1)")
        if spec.chunk < 1 or spec.lane_batch < 1 or max_lanes < 1:
            raise StageError("chunk, lane_batch and max_lanes must be >= 1")
        self._ll = _init_llama_cpp()
        self.spec, self.architecture, self.n_layers = spec, arch, n_layers
        self.max_lanes = max_lanes
        self.threads = spec.threads or 2
        self._model = self._ctx = self._batch = None
        self._load_model()
        self._choose_batching(max_lanes)
        self._create_context()
        self._init_batch()
        self.weights_digest = weights_digest(spec.model_path)
        self._lanes: dict[int, _Lane] = {}

    def _load_model(self) -> None:
        """The model, with what the runtime reads from it: vocabulary size, whether its
        state is recurrent, its context."""
        ll, spec = self._ll, self.spec
        mparams = ll.llama_model_default_params()
        self._model = ll.llama_model_load_from_file(str(spec.model_path).encode(), mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {spec.model_path}{_last_error()}")
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model))
        self.recurrent = bool(ll.llama_model_is_recurrent(self._model)
                              or ll.llama_model_is_hybrid(self._model))
        self.n_ctx = min(spec.n_ctx, ll.llama_model_n_ctx_train(self._model))

    def _choose_batching(self, max_lanes: int) -> None:
        """Which decode rows run together, how a prefill cuts its micro-batches, and
        whether a prompt may resume inside a lane's last chunk (module docstring)."""
        # Which decode rows run together (module docstring): "none" for recurrent and
        # sliding-window models, "short" lanes only with lane_batch 1, else "all".
        alone = self.recurrent or self._ll.llama_model_n_swa(self._model) > 0
        spec = self.spec
        self.decode_groups = "none" if alone else "short" if spec.lane_batch == 1 else "all"
        # Dense prefills run micro-batches of about PREFILL_ROWS rows, cut at multiples of
        # it; a chunk that is not a multiple of the tiled kernel's rows, or a recurrent
        # model (snapshots at chunk ends), one chunk at a time (module docstring).
        C = spec.chunk
        self.micro_batch = C * max(1, PREFILL_ROWS // C) \
            if not self.recurrent and C % FA_TILED_MIN_ROWS == 0 else C
        # A prompt may resume inside the lane's per-row last chunk (module docstring).
        self._tail_resume = not alone and not self.float_weights and \
            C % FA_TILED_MIN_ROWS == 0
        # Sequence 0 is scratch; lanes are 1..max_lanes. A decode group spans consecutive
        # sequences (llama.cpp puts rows of several streams into one micro-batch only
        # then), and must fit one micro-batch.
        n_seq = self.n_seq = 1 + max_lanes
        if self.decode_groups != "none" and n_seq > self.micro_batch:
            raise StageError(f"{max_lanes} lanes need a micro-batch of {n_seq} rows to "
                             f"decode together; the chunk gives {self.micro_batch}")

    def _create_context(self) -> None:
        """One context: a private KV stream of n_ctx + 1 cells per sequence, flash
        attention, an f16 cache and a fixed thread count (module docstring)."""
        ll, n_seq = self._ll, self.n_seq
        cparams = ll.llama_context_default_params()
        # llama.cpp's n_ctx counts the cells of all streams. One cell beyond n_ctx: a
        # padding row can then always go into a neighbour's stream, even a full one.
        cparams.n_ctx = (self.n_ctx + 1) * n_seq
        cparams.n_batch = self.micro_batch
        cparams.n_ubatch = self.micro_batch
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = cparams.type_v = ll.GGML_TYPE_F16
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise LlamaCppError(f"llama.cpp could not create a context{_last_error()}")
        self._mem = ll.llama_get_memory(self._ctx)
        self._scratch = 0

    def _init_batch(self) -> None:
        """One llama_batch of micro_batch rows, reused by every call, with numpy views of
        its token, position and output arrays."""
        rows = self.micro_batch
        self._batch = self._ll.llama_batch_init(rows, 0, 1)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(rows,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(rows,))
        self._wants = np.ctypeslib.as_array(self._batch.logits, shape=(rows,))
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(rows,))[:] = 1
        self._seq_ids = [self._batch.seq_id[i] for i in range(rows)]

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free llama.cpp's batch, context and model (idempotent)."""
        ll = getattr(self, "_ll", None)
        if ll is None:
            return
        batch, ctx, model = (getattr(self, k, None) for k in ("_batch", "_ctx", "_model"))
        self._batch = self._ctx = self._model = None
        self._lanes = {}
        if batch is not None:
            ll.llama_batch_free(batch)
        if ctx:
            ll.llama_free(ctx)
        if model:
            ll.llama_model_free(model)

    def __del__(self):
        self.close()

    # -- lanes -----------------------------------------------------------------------------
    def alloc_lane(self) -> int:
        if self._ctx is None:
            raise StageError("the runtime is closed")
        for seq in range(1, self.max_lanes + 1):
            if seq not in self._lanes:
                self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
                self._lanes[seq] = _Lane()
                return seq
        raise StageError(f"all {self.max_lanes} lanes are in use")

    def free_lane(self, lane: int) -> None:
        if self._lanes.pop(lane, None) is not None:
            self._ll.llama_memory_seq_rm(self._mem, lane, -1, -1)

    def _lane(self, lane: int) -> _Lane:
        try:
            return self._lanes[lane]
        except (KeyError, TypeError):
            raise StageError(f"unknown lane {lane}") from None

    def lane_length(self, lane: int) -> int:
        return self._lane(lane).length

    def prefill_boundary(self, lane: int) -> int:
        return self._lane(lane).prefilled // self.spec.chunk * self.spec.chunk

    def _per_row_tail(self, n_tokens: int) -> int | None:
        """Where an n_tokens prompt's last chunk begins, if it runs on the per-row kernel
        (fewer than FA_TILED_MIN_ROWS rows)."""
        last = (n_tokens - 1) // self.spec.chunk * self.spec.chunk
        return last if 0 < n_tokens - last < FA_TILED_MIN_ROWS else None

    def _shared_tail(self, lane: int, n_tokens: int) -> int | None:
        """Where the lane's per-row last chunk begins, if an n_tokens prompt's last chunk
        begins there too, so that it may resume inside it (module docstring)."""
        st = self._lanes[lane]
        tail = self._per_row_tail(st.prefilled)
        ok = self._tail_resume and st.tail_exact and tail == self._per_row_tail(n_tokens)
        return tail if ok else None

    @staticmethod
    def _split_kv(position: int) -> bool:
        """Whether one row alone at this position takes the split-KV path."""
        return position >= SPLIT_KV_LENGTH

    def resume_point(self, lane: int, common: int, n_tokens: int) -> int:
        """The chunk boundary, or, where the prompt's last chunk begins where the lane's
        did and both run per row, any row inside it (module docstring)."""
        grid = super().resume_point(lane, common, n_tokens)
        tail = self._shared_tail(lane, n_tokens)
        if tail is None or common <= tail:
            return grid
        p = min(common, self._lanes[lane].prefilled, n_tokens - 1)
        if n_tokens - p == 1 and self._split_kv(p) and p > tail:
            p -= 1  # not one row alone over >= 512 cells
        return max(grid, p)

    # -- compute ---------------------------------------------------------------------------
    def _ids(self, inputs: torch.Tensor | Frame) -> list[int]:
        if isinstance(inputs, Frame):
            raise StageError("the llama.cpp runtime takes token ids, not a frame")
        ids = torch.as_tensor(inputs, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise StageError(f"token id out of range [0, {self.vocab})")
        return ids.tolist()

    def _run(self, rows: list[tuple[int, int, int]], want: list[bool]) -> None:
        """One llama_decode over (token, position, seq) rows; `want` marks output rows."""
        n = len(rows)
        self._batch.n_tokens = n
        for i, (token, pos, seq) in enumerate(rows):
            self._tokens[i] = token
            self._pos[i] = pos
            self._seq_ids[i][0] = seq
        self._wants[:n] = want
        rc = self._ll.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise LlamaCppError(f"llama_decode failed with {rc}{_last_error()}")

    def _logits_row(self, i: int) -> np.ndarray:
        ptr = self._ll.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy()

    def _segments(self, start: int, end: int):
        """A prefill's micro-batches: [start, end) cut at multiples of micro_batch and
        where the prompt's last chunk begins (module docstring)."""
        U = self.micro_batch
        last = (end - 1) // self.spec.chunk * self.spec.chunk
        s = start
        while s < end:
            e = min(end, (s // U + 1) * U)
            if s < last < e:
                e = last
            yield s, e
            s = e

    def prefill(self, lane: int, inputs: torch.Tensor | Frame, start: int = 0,
                logits: str = "last", snapshots: tuple[int, ...] = (),
                between_chunks: Callable[[], None] | None = None) -> StageOutput:
        """Positions [start, start + n) in micro-batches that end at multiples of
        micro_batch, the prompt's last chunk alone (module docstring). That one may be
        short, and it is not padded: a later prefill reuses a short chunk's rows only
        for a prompt whose last chunk begins there too (resume_point). "all" is a
        diagnostic: it makes every row an output, so llama.cpp runs the last layer over
        more rows, and its last row need not equal "last" bitwise (equal on SmolLM2
        Q4_1, not on f32 weights)."""
        st = self._lane(lane)
        ids = self._ids(inputs)
        end = self._check_prefill(lane, start, len(ids), logits, snapshots)
        if not self._ll.llama_memory_seq_rm(self._mem, lane, start, -1):
            raise StageError(f"lane {lane} holds recurrent state at {st.length} that cannot "
                             f"be rolled back to {start}: import a snapshot at {start} first")
        st.length = st.prefilled = start  # state past start is discarded
        out = StageOutput()
        rows_out: list[np.ndarray] = []
        for s, e in self._segments(start, end):
            rows_out += self._prefill_segment(lane, ids[s - start:e - start], s, end, logits)
            if self.recurrent and e in snapshots:
                # Captured as the prefill passes e: recurrent state cannot go back later.
                out.snapshots[e] = self._export(lane, e, e)
            if between_chunks is not None and e < end:
                between_chunks()
        if not self.recurrent:  # dense state is cut to each boundary afterwards
            out.snapshots = {b: self._export(lane, b, b) for b in snapshots}
        if logits == "all":
            out.logits = torch.from_numpy(np.concatenate(rows_out))
        elif logits == "last":
            out.logits = torch.from_numpy(rows_out[-1])
        return out

    def _check_prefill(self, lane: int, start: int, n: int, logits: str,
                       snapshots: tuple[int, ...]) -> int:
        """check_prefill's verdict on [start, start + n), and its end. A start inside the
        lane's per-row last chunk is checked as that chunk's start (resume_point)."""
        C = self.spec.chunk
        first = start
        tail = self._shared_tail(lane, start + n)
        if start % C and tail is not None and tail < start <= self._lanes[lane].prefilled \
                and not (n == 1 and self._split_kv(start)):
            first = tail
        return check_prefill(first, n + start - first, chunk=C,
                             boundary=self.prefill_boundary(lane), n_ctx=self.n_ctx,
                             logits=logits, snapshots=snapshots)

    def _prefill_segment(self, lane: int, ids: list[int], s: int, end: int,
                         logits: str) -> list[np.ndarray]:
        """One micro-batch of a prefill ending at `end`: `ids` at positions s, s + 1, ...;
        the logits rows it was asked for (none, its last row, or all of them)."""
        st, m = self._lanes[lane], len(ids)
        e = s + m
        if logits == "all":
            want = [True] * m
        else:
            want = [False] * m
            want[-1] = logits == "last" and e == end
        try:
            self._run([(ids[j], s + j, lane) for j in range(m)], want)
        except LlamaCppError:
            self._drop_from(lane, s)
            raise
        st.length = st.prefilled = e
        last = (end - 1) // self.spec.chunk * self.spec.chunk
        if e == end and e - last < FA_TILED_MIN_ROWS:  # the per-row last chunk
            split = m == 1 and self._split_kv(s)
            st.tail_exact = not split and (s == last or st.tail_exact)
        if logits == "all":
            ptr = self._ll.llama_get_logits(self._ctx)
            return [np.ctypeslib.as_array(ptr, shape=(m, self.vocab)).copy()]
        return [self._logits_row(m - 1)] if want[-1] else []

    def decode(self, steps: list[tuple[int, torch.Tensor | Frame]]) -> list[StageOutput]:
        """One position per lane, in as few llama_decode calls as exactness allows (module
        docstring): a group spans consecutive sequences, one row each; a sequence in its
        span that is not decoding gets a padding row at its next position, removed
        afterwards. Every row asks for logits."""
        lanes = [lane for lane, _ in steps]
        if len(set(lanes)) != len(lanes):
            raise StageError("a lane may appear once per decode step")
        token: dict[int, int] = {}
        for lane, inp in steps:
            st = self._lane(lane)
            ids = self._ids(inp)
            if len(ids) != 1:
                raise StageError("decode takes exactly one token per lane")
            if st.length + 1 > self.n_ctx:
                raise StageError(f"lane {lane} is full ({self.n_ctx} tokens)")
            token[lane] = ids[0]
        logits: dict[int, torch.Tensor] = {}
        for seqs, members in self._groups(sorted(token)):
            rows = [(token[q], self._lanes[q].length, q) if q in members else
                    (0, self._lanes[q].length if q in self._lanes else 0, q) for q in seqs]
            try:
                self._run(rows, [True] * len(rows))
            except LlamaCppError:
                for _, pos, q in rows:
                    if q in members:
                        self._drop_from(q, pos)
                raise
            finally:
                for _, pos, q in rows:
                    if q not in members:
                        self._ll.llama_memory_seq_rm(self._mem, q, pos, -1)
            for r, q in enumerate(seqs):
                if q in members:
                    logits[q] = torch.from_numpy(self._logits_row(r))
                    self._lanes[q].length += 1
        return [StageOutput(logits=logits[lane]) for lane in lanes]

    def _groups(self, lanes: list[int]) -> list[tuple[range, set[int]]]:
        """Each llama_decode call of a step: the sequences it spans, and which of them
        decode (the others get padding rows). `lanes`: the decoding lanes, sorted."""
        if self.decode_groups == "none":
            return [(range(q, q + 1), {q}) for q in lanes]
        apart = [q for q in lanes if self._differs_alone(q)]
        if self.decode_groups == "short":
            rest = [q for q in lanes if q not in apart]
            groups = [[q] for q in apart] + ([rest] if rest else [])
            return [(range(g[0], g[-1] + 1), set(g)) for g in groups]
        q = lanes[0]
        if apart == lanes and len(lanes) == 1:  # a padding row beside it
            return [(range(q, q + 2) if q < self.max_lanes else range(q - 1, q + 1), {q})]
        return [(range(q, lanes[-1] + 1), set(lanes))]

    def _differs_alone(self, lane: int) -> bool:
        """Whether the lane's decode row alone differs from its row beside other lanes'
        (module docstring)."""
        return self.float_weights or self._split_kv(self._lanes[lane].length)

    def _drop_from(self, lane: int, pos: int) -> None:
        """After a failed llama_decode: the lane keeps [0, pos), or, where recurrent state
        cannot be cut back, nothing."""
        st = self._lanes[lane]
        st.tail_exact = False
        if self._ll.llama_memory_seq_rm(self._mem, lane, pos, -1):
            st.length, st.prefilled = pos, min(st.prefilled, pos)
        else:
            self._ll.llama_memory_seq_rm(self._mem, lane, -1, -1)
            st.length = st.prefilled = 0

    # -- state -----------------------------------------------------------------------------
    def copy_lane(self, src: int, dst: int, n_tokens: int) -> None:
        """ResidentKv: dst holds src's [0, n_tokens), by way of the state bytes (module
        docstring: streams do not share cells)."""
        s, d = self._lane(src), self._lane(dst)
        if not 0 <= n_tokens <= s.length:
            raise StageError(f"lane {src} holds {s.length} tokens, not {n_tokens}")
        if self.recurrent and n_tokens != s.length:
            raise StageError(f"recurrent state cannot be cut: lane {src} holds {s.length} "
                             f"tokens, not {n_tokens}")
        prefilled = min(n_tokens, s.prefilled)
        if src != dst:
            self._load(dst, self._get(src), s.length)
        if n_tokens < s.length:
            self._ll.llama_memory_seq_rm(self._mem, dst, n_tokens, -1)
        d.length, d.prefilled = n_tokens, prefilled
        d.tail_exact = False

    def export_state(self, lane: int, n_tokens: int) -> LaneState:
        """The lane's llama.cpp state for [0, n_tokens), as opaque bytes in
        fixed["llama_state"]. A dense lane can be cut shorter, a recurrent one cannot."""
        st = self._lane(lane)
        if not 0 <= n_tokens <= st.length:
            raise StageError(f"lane {lane} holds {st.length} tokens, not {n_tokens}")
        if n_tokens < st.length and self.recurrent:
            raise StageError(f"recurrent state cannot be cut: lane {lane} holds "
                             f"{st.length} tokens, not {n_tokens}")
        return self._export(lane, n_tokens, min(n_tokens, st.prefilled))

    def _export(self, lane: int, n_tokens: int, prefilled: int) -> LaneState:
        """[0, n_tokens) of the lane, by way of the scratch sequence, which also cuts a
        dense lane shorter."""
        scratch = self._scratch
        self._load(scratch, self._get(lane), self._lanes[lane].length)
        try:
            if n_tokens < self._lanes[lane].length:
                self._ll.llama_memory_seq_rm(self._mem, scratch, n_tokens, -1)
            blob = self._get(scratch)
        finally:
            self._ll.llama_memory_seq_rm(self._mem, scratch, -1, -1)
        return LaneState(n_tokens=n_tokens, prefilled=prefilled, fixed={STATE_KEY: blob})

    def _get(self, seq: int) -> torch.Tensor:
        """llama.cpp's state bytes of one sequence."""
        ll = self._ll
        size = ll.llama_state_seq_get_size(self._ctx, seq)
        blob = torch.empty(size, dtype=torch.uint8)
        ptr = ctypes.cast(blob.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        written = ll.llama_state_seq_get_data(self._ctx, ptr, size, seq)
        if written != size:
            raise LlamaCppError(f"llama.cpp wrote {written} of {size} state bytes"
                                f"{_last_error()}")
        return blob

    def _load(self, seq: int, blob: torch.Tensor, n_tokens: int) -> None:
        """Sequence `seq` becomes the state bytes (cleared first; left empty where
        llama.cpp refuses them or they hold other than n_tokens positions)."""
        ll = self._ll
        ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        blob = blob.cpu().contiguous()
        ptr = ctypes.cast(blob.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        if not ll.llama_state_seq_set_data(self._ctx, ptr, blob.numel(), seq):
            ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
            raise LlamaCppError(f"llama.cpp refused the state{_last_error()}")
        held = ll.llama_memory_seq_pos_max(self._mem, seq) + 1
        if held != n_tokens:
            ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
            raise LlamaCppError(f"the state holds {held} positions, not {n_tokens}")

    def import_state(self, lane: int, state: LaneState) -> None:
        """The lane becomes `state` (cleared first). Raises LlamaCppError, leaving the lane
        empty, where llama.cpp refuses the bytes (another model, layout or KV dtype)."""
        st = self._lane(lane)
        blob = state.fixed.get(STATE_KEY)
        if blob is None or blob.dtype != torch.uint8 or state.keys or state.values:
            raise StageError("not a llama.cpp state (no fixed['llama_state'] uint8 bytes)")
        st.length = st.prefilled = 0
        self._load(lane, blob, state.n_tokens)
        st.length, st.prefilled = state.n_tokens, min(state.prefilled, state.n_tokens)
        st.tail_exact = False

    def identity(self) -> dict[str, object]:
        import llama_cpp

        spec = self.spec
        return {
            "weights_digest": self.weights_digest,
            "architecture": self.architecture,
            "stage_index": 0,
            "layer_range": [0, self.n_layers],
            "runtime_abi": f"llama.cpp/{llama_cpp.__version__}",
            # a state loads only into a context with as many streams ("n_stream mismatch")
            "kv_layout": f"llama.cpp-seq-state/streams={self.n_seq}",
            "kv_dtype": KV_DTYPE,
            "wire_dtype": spec.wire_dtype,
            "n_ctx": self.n_ctx,
            "rope": [],  # from the GGUF: its hyperparameters are in weights_digest
            "numeric_policy": {
                "compute": "llama.cpp-cpu",
                # the kernels ggml was built with and found (AVX2, AVX-512, repacking)
                "cpu": llama_cpp.llama_print_system_info().decode().strip(),
                "flash_attn": True,
                "threads": self.threads,
                "contract": self.exactness.value,
                "chunk": spec.chunk,
                "micro_batch": self.micro_batch,
                "decode_groups": self.decode_groups,
            },
        }
