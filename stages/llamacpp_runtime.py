"""The llama.cpp stage runtime: a whole model at llama.cpp speed (DESIGN.md §6).

One llama.cpp context serves every lane. A lane is a sequence id in one unified KV cache
(`kv_unified=True`: a state exported here loads into any other context of the same model;
per-sequence streams would refuse it with "n_stream mismatch"). Resident prefixes move
between lanes with `llama_memory_seq_cp`, which shares cells instead of copying them;
payloads are llama.cpp's own per-sequence state bytes, opaque to us.

Exactness (DESIGN.md §5.3) on llama.cpp's CPU kernels. Prefill runs each lane in
position-aligned chunks, decode in fixed groups of `lane_batch` rows. That alone is not
enough, because in a shared cache a lane's cells sit wherever free cells were. These
settings make a lane's arithmetic independent of that placement, measured on this build
(SmolLM2 Q4_1; the max |Δlogit| each one removes is given in brackets):

- Flash attention on. Its CPU kernel walks the cells in index order and skips the cells
  masked for the row, so other lanes' cells drop out exactly. Without flash attention,
  softmax and V products reduce over every cell, and the result changes when the same
  prompt lands elsewhere in the cache [0.43-0.57].
- Micro-batches of fewer than 64 rows. From 64 rows the kernel switches to a tiled
  algorithm whose 64-cell KV tiles are aligned to cell indices, so placement matters
  again [0.54]. `n_ubatch` is the largest divisor of the chunk below 64, so chunk
  boundaries stay micro-batch boundaries.
- Single-token micro-batches on one thread. A one-row micro-batch over >= 512 cells
  takes a split-KV path with one slice of cells per thread, and those slices are
  aligned to cell indices too [0.45]. Batches of 2 or more rows use n_threads_batch.

What is NOT covered is cell *order*. llama.cpp puts new rows into the first free cells,
so a lane's next token can land in a hole another lane left, ahead of the lane's own
earlier cells. The kernel then adds up that lane's keys in a different order. On the
Q4_1 file that gave max |Δ| 0.36-0.50 on the next step. The greedy path held for 16
steps on one prompt, and on a random-token prompt it changed after 4. On an F16
requantization the next step moved by 0.01-0.02. Per-lane KV streams
(`kv_unified=False`) rule this out: they measured bitwise. The costs are a state format
tied to n_seq_max, and partial copies, which llama.cpp does not support across streams.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import torch

from skippy.topology.gguf_file import GGUFFile

from .frame import Frame
from .runtime import (LaneState, StageError, StageOutput, StageRuntime, StageSpec,
                      check_prefill)

log = logging.getLogger(__name__)

STATE_KEY = "llama_state"  # LaneState.fixed key of the opaque llama.cpp sequence state

# The CPU flash-attention kernel switches to its tiled algorithm at this many rows
# (placement-dependent: see the module docstring).
FA_TILED_MIN_ROWS = 64

# The KV cache holds f16. An f32 cache would buy nothing: llama.cpp casts K and V to f16
# for flash attention (measured: identical logits, twice the state bytes).
KV_DTYPE = "f16"


class LlamaCppError(RuntimeError):
    """llama.cpp refused an operation: a decode failed, or a state would not load. The
    message carries llama.cpp's own last error line where it logged one."""


class KvCacheFull(LlamaCppError):
    """No free KV cells for the rows: the lanes together hold the context's n_ctx cells.
    Free a lane, or shorten one, and retry."""


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


def micro_batch_rows(chunk: int) -> int:
    """The largest divisor of `chunk` below FA_TILED_MIN_ROWS."""
    return max(d for d in range(1, min(chunk, FA_TILED_MIN_ROWS - 1) + 1) if chunk % d == 0)


@dataclass
class _Lane:
    length: int = 0      # positions held (prefill + decode)
    prefilled: int = 0   # positions computed by prefill: the only ones a later prefill reuses


class LlamaCppStageRuntime(StageRuntime):
    """A whole-model stage on llama.cpp. Lanes are sequence ids 1..max_lanes of one
    context, and they share its KV cache of `kv_cells` cells. By default that is
    n_ctx * max_lanes, so that every lane can reach n_ctx positions as on the torch
    runtime; shared prefixes (copy_lane) share cells. The cache is allocated and zeroed up
    front: SmolLM2 takes 23 KB a cell, so 1024 x 8 cells come to 189 MB. A smaller
    `kv_cells` saves memory, and KvCacheFull then says when it runs out.

    Sequence 0 is scratch: it pads decode groups, and every export goes through it.
    llama.cpp writes the sequence id into the state bytes (and ignores it on import), so
    exporting from one fixed id makes a prefix's bytes the same whichever lane held it:
    payloads dedupe, and re-exports match."""

    def __init__(self, spec: StageSpec, *, max_lanes: int = 8, kv_cells: int | None = None):
        f = GGUFFile(spec.model_path)
        n_layers = int(f.arch_key("block_count", 0))
        arch = f.architecture
        f.close()
        if (spec.layer_start, spec.layer_end, spec.stage_index, spec.n_stages) != \
                (0, n_layers, 0, 1):
            raise StageError("the llama.cpp runtime serves a whole model (--stages 1)")
        if spec.chunk < 1 or spec.lane_batch < 1 or max_lanes < 1:
            raise StageError("chunk, lane_batch and max_lanes must be >= 1")
        if spec.lane_batch > micro_batch_rows(spec.chunk):
            # A decode group must be one micro-batch, or a row's shapes would depend on
            # its place in the group.
            raise StageError(f"lane_batch {spec.lane_batch} exceeds the micro-batch of "
                             f"{micro_batch_rows(spec.chunk)} rows (chunk {spec.chunk})")
        self._ll = ll = _init_llama_cpp()
        self.spec, self.architecture, self.n_layers = spec, arch, n_layers
        self.max_lanes = max_lanes
        self.threads = spec.threads or 2
        self.micro_batch = micro_batch_rows(spec.chunk)
        self._model = self._ctx = self._batch = None

        mparams = ll.llama_model_default_params()
        self._model = ll.llama_model_load_from_file(str(spec.model_path).encode(), mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {spec.model_path}{_last_error()}")
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model))
        self.recurrent = bool(ll.llama_model_is_recurrent(self._model)
                              or ll.llama_model_is_hybrid(self._model))
        self.n_ctx = min(spec.n_ctx, ll.llama_model_n_ctx_train(self._model))
        self.kv_cells = kv_cells or self.n_ctx * max_lanes

        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.kv_cells  # llama.cpp's n_ctx: cells; we cap positions per lane
        cparams.n_batch = spec.chunk
        cparams.n_ubatch = self.micro_batch
        cparams.n_seq_max = max_lanes + 1  # + the scratch sequence
        cparams.kv_unified = True
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = cparams.type_v = ll.GGML_TYPE_F16
        # Single-token micro-batches on one thread: no split-KV path (module docstring).
        cparams.n_threads = 1
        cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise LlamaCppError(f"llama.cpp could not create a context{_last_error()}")
        self._mem = ll.llama_get_memory(self._ctx)
        self._scratch = 0

        rows = spec.chunk
        self._batch = ll.llama_batch_init(rows, 0, 1)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(rows,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(rows,))
        self._wants = np.ctypeslib.as_array(self._batch.logits, shape=(rows,))
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(rows,))[:] = 1
        self._seq_ids = [self._batch.seq_id[i] for i in range(rows)]

        self.weights_digest = weights_digest(spec.model_path)
        self._lanes: dict[int, _Lane] = {}

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
        if rc == 1:
            raise KvCacheFull(f"no free KV cells for {n} rows: the lanes hold all "
                              f"{self.kv_cells} cells")
        if rc != 0:
            raise LlamaCppError(f"llama_decode failed with {rc}{_last_error()}")

    def _logits_row(self, i: int) -> np.ndarray:
        ptr = self._ll.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy()

    def prefill(self, lane: int, inputs: torch.Tensor | Frame, start: int = 0,
                logits: str = "last", snapshots: tuple[int, ...] = ()) -> StageOutput:
        """Positions [start, start + n) in chunks of `chunk` rows at multiples of the chunk.
        The last chunk may be short, and it is not padded. Exactness does not need the
        padding: a later prefill never reuses a short chunk's rows (prefill_boundary
        rounds down), and the same request runs the same short chunk whether or not a
        cache served its prefix. "all" is a diagnostic: it makes every row an output, so
        llama.cpp runs the last layer over more rows, and its last row need not equal
        "last" bitwise (equal on SmolLM2 Q4_1, not on f32 weights)."""
        st = self._lane(lane)
        C = self.spec.chunk
        ids = self._ids(inputs)
        n = len(ids)
        end = check_prefill(start, n, chunk=C, boundary=self.prefill_boundary(lane),
                            n_ctx=self.n_ctx, logits=logits, snapshots=snapshots)
        if not self._ll.llama_memory_seq_rm(self._mem, lane, start, -1):
            raise StageError(f"lane {lane} holds recurrent state at {st.length} that cannot "
                             f"be rolled back to {start}: import a snapshot at {start} first")
        st.length = st.prefilled = start  # state past start is discarded
        out = StageOutput()
        rows_out: list[np.ndarray] = []
        for s in range(start, end, C):
            m = min(C, end - s)
            if logits == "all":
                want = [True] * m
            else:
                want = [False] * m
                want[-1] = logits == "last" and s + m == end
            try:
                self._run([(ids[s - start + j], s + j, lane) for j in range(m)], want)
            except LlamaCppError:
                self._drop_from(lane, s)
                raise
            st.length = st.prefilled = s + m
            if logits == "all":
                ptr = self._ll.llama_get_logits(self._ctx)
                rows_out.append(np.ctypeslib.as_array(ptr, shape=(m, self.vocab)).copy())
            elif want[-1]:
                rows_out.append(self._logits_row(m - 1))
            if s + m in snapshots:
                # Captured as the prefill passes b: recurrent state cannot go back later.
                out.snapshots[s + m] = self._export(lane, s + m, st.prefilled)
        if logits == "all":
            out.logits = torch.from_numpy(np.concatenate(rows_out))
        elif logits == "last":
            out.logits = torch.from_numpy(rows_out[-1])
        return out

    def decode(self, steps: list[tuple[int, torch.Tensor | Frame]]) -> list[StageOutput]:
        """One position per lane, in groups of exactly `lane_batch` rows: a short group
        is padded with scratch rows, and every row asks for logits. The shapes are then the
        same whichever lanes decode together."""
        lanes = [lane for lane, _ in steps]
        if len(set(lanes)) != len(lanes):
            raise StageError("a lane may appear once per decode step")
        tokens = []
        for lane, inp in steps:
            st = self._lane(lane)
            ids = self._ids(inp)
            if len(ids) != 1:
                raise StageError("decode takes exactly one token per lane")
            if st.length + 1 > self.n_ctx:
                raise StageError(f"lane {lane} is full ({self.n_ctx} tokens)")
            tokens.append(ids[0])
        B = self.spec.lane_batch
        results: list[StageOutput] = []
        for g in range(0, len(steps), B):
            rows = [(tokens[g + r], self._lanes[lane].length, lane)
                    for r, lane in enumerate(lanes[g:g + B])]
            real = len(rows)
            rows += [(0, p, self._scratch) for p in range(B - real)]  # padding
            try:
                self._run(rows, [True] * B)
            except LlamaCppError:
                for _, pos, lane in rows[:real]:
                    self._drop_from(lane, pos)
                raise
            finally:
                if real < B:
                    self._ll.llama_memory_seq_rm(self._mem, self._scratch, -1, -1)
            for r, lane in enumerate(lanes[g:g + B]):
                results.append(StageOutput(logits=torch.from_numpy(self._logits_row(r))))
                self._lanes[lane].length += 1
        return results

    def _drop_from(self, lane: int, pos: int) -> None:
        """After a failed llama_decode: the lane keeps [0, pos), or, where recurrent state
        cannot be cut back, nothing."""
        st = self._lanes[lane]
        if self._ll.llama_memory_seq_rm(self._mem, lane, pos, -1):
            st.length, st.prefilled = pos, min(st.prefilled, pos)
        else:
            self._ll.llama_memory_seq_rm(self._mem, lane, -1, -1)
            st.length = st.prefilled = 0

    # -- state -----------------------------------------------------------------------------
    def copy_lane(self, src: int, dst: int, n_tokens: int) -> None:
        """ResidentKv: dst shares src's cells for [0, n_tokens) (no KV bytes move)."""
        s, d = self._lane(src), self._lane(dst)
        if not 0 <= n_tokens <= s.length:
            raise StageError(f"lane {src} holds {s.length} tokens, not {n_tokens}")
        if self.recurrent and n_tokens != s.length:
            raise StageError(f"recurrent state cannot be cut: lane {src} holds {s.length} "
                             f"tokens, not {n_tokens}")
        if src == dst:
            if n_tokens < s.length:
                self._ll.llama_memory_seq_rm(self._mem, src, n_tokens, -1)
        else:
            self._ll.llama_memory_seq_rm(self._mem, dst, -1, -1)
            self._ll.llama_memory_seq_cp(self._mem, src, dst, 0, -1 if self.recurrent
                                         else n_tokens)
        d.length, d.prefilled = n_tokens, min(n_tokens, s.prefilled)

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
        """[0, n_tokens) of the lane, by way of the scratch sequence (shared cells, no
        KV copy), which also cuts a dense lane shorter."""
        ll, scratch = self._ll, self._scratch
        ll.llama_memory_seq_rm(self._mem, scratch, -1, -1)
        ll.llama_memory_seq_cp(self._mem, lane, scratch, 0, -1 if self.recurrent else n_tokens)
        try:
            size = ll.llama_state_seq_get_size(self._ctx, scratch)
            blob = torch.empty(size, dtype=torch.uint8)
            ptr = ctypes.cast(blob.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
            written = ll.llama_state_seq_get_data(self._ctx, ptr, size, scratch)
        finally:
            ll.llama_memory_seq_rm(self._mem, scratch, -1, -1)
        if written != size:
            raise LlamaCppError(f"llama.cpp wrote {written} of {size} state bytes"
                                f"{_last_error()}")
        return LaneState(n_tokens=n_tokens, prefilled=prefilled, fixed={STATE_KEY: blob})

    def import_state(self, lane: int, state: LaneState) -> None:
        """The lane becomes `state` (cleared first). Raises LlamaCppError, leaving the lane
        empty, where llama.cpp refuses the bytes (another model, layout or KV dtype)."""
        st = self._lane(lane)
        blob = state.fixed.get(STATE_KEY)
        if blob is None or blob.dtype != torch.uint8 or state.keys or state.values:
            raise StageError("not a llama.cpp state (no fixed['llama_state'] uint8 bytes)")
        blob = blob.cpu().contiguous()
        self._ll.llama_memory_seq_rm(self._mem, lane, -1, -1)
        st.length = st.prefilled = 0
        ptr = ctypes.cast(blob.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        if not self._ll.llama_state_seq_set_data(self._ctx, ptr, blob.numel(), lane):
            self._ll.llama_memory_seq_rm(self._mem, lane, -1, -1)
            raise LlamaCppError(f"llama.cpp refused the state{_last_error()}")
        held = self._ll.llama_memory_seq_pos_max(self._mem, lane) + 1
        if held != state.n_tokens:
            self._ll.llama_memory_seq_rm(self._mem, lane, -1, -1)
            raise LlamaCppError(f"the state holds {held} positions, not {state.n_tokens}")
        st.length, st.prefilled = state.n_tokens, min(state.prefilled, state.n_tokens)

    def identity(self) -> dict[str, object]:
        import llama_cpp

        spec = self.spec
        return {
            "weights_digest": self.weights_digest,
            "architecture": self.architecture,
            "stage_index": 0,
            "layer_range": [0, self.n_layers],
            "runtime_abi": f"llama.cpp/{llama_cpp.__version__}",
            "kv_layout": "llama.cpp-seq-state/unified",
            "kv_dtype": KV_DTYPE,
            "wire_dtype": spec.wire_dtype,
            "n_ctx": self.n_ctx,
            "rope": [],  # from the GGUF: its hyperparameters are in weights_digest
            "numeric_policy": {
                "compute": "llama.cpp-cpu",
                "flash_attn": True,
                "threads": self.threads,
                "decode_threads": 1 if spec.lane_batch == 1 else self.threads,
                "chunk": spec.chunk,
                "micro_batch": self.micro_batch,
                "lane_batch": spec.lane_batch,
            },
        }
