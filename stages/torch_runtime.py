"""The torch stage runtime: any contiguous layer range of a supported family.

Hybrid families (LFM2, Falcon-H1, Qwen3-Next) keep recurrent conv (and SSM or DeltaNet)
state beside the attention KV. That state exists only at the lane's current length and at
the boundaries a prefill was asked to snapshot (chunk boundaries on a chunked stage, any
token on a row-invariant one): it cannot be cut back to a shorter prefix, so exports,
copies and prefill starts are limited to those lengths (and 0).
"""

from __future__ import annotations

import ctypes
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from skippy.topology.model_config import ModelConfig
from skippy.topology.model_package import open_model

from . import qkernel
from .ffn import make_ffn
from .frame import Frame, from_wire, to_wire
from .kv import LaneKv
from .layers import Rope
from .linear import SMALL_ROWS, Embeddings, RescoredHead, kernels, make_head, row_invariant
from .moe import MoeFfn
from .runtime import (LaneState, StageError, StageOutput, StageRuntime, StageSpec,
                      check_prefill)
from .runtime_kind import Exactness
from .decoder import DecoderRun
from .gemma4_run import Gemma4Run
from .deltanet import GatedDeltaNet, deltanet_state_shapes
from .gated_attention import GatedAttention
from .norms import make_norm
from .softcap import soft_cap
from .mamba2 import Mamba2, ParallelMixer, mamba2_state_shapes
from .mla import MlaAttention, YarnRope, latent_kv_shape
from .nextn import NextN
from .shortconv import ShortConv
from .transformer import Attention, DecoderLayer, Segment
from .weights import ROPE_FREQS, StageTensors, load_stage_tensors

# 5: every attention row through stages/attention.c (blocked online softmax), prefill too;
# 6: the integer formats' rows in one level at every row count, no bf16 copy (linear.py)
RUNTIME_ABI = f"skippy-torch/6 torch-{torch.__version__}"
# A recurrent lane on a row-invariant stage keeps its state at the ends of its last few
# prefill calls (beside the cache's snapshots): a follow-up that changes the prompt's
# tail resumes there, not at 0. Each copy holds every recurrent layer's state.
LANE_SNAPSHOTS = 4


def _return_freed_memory() -> None:
    """Hand the allocator's free pages back to the OS. Loading reads every matrix, converts
    it and drops it, and glibc keeps much of that freed memory, while a stage's limit is
    its memory (RSS before and after: evals/README.md, torch runtime). No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class _Lane:
    kv: LaneKv
    length: int = 0      # rows held (prefill + decode)
    # rows a later prefill may reuse: those computed by prefill and, on a row-invariant
    # stage, the decode rows after them
    prefilled: int = 0
    # Recurrent families: the conv state at each chunk boundary a prefill snapshotted
    # (references: LaneKv replaces conv tensors instead of writing into them).
    saved: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # Recurrent families: the lane's last decode step of several rows (a verify step):
    # its start, the recurrent state there, and its inputs, so that a rewind inside it
    # takes the state back and runs the kept rows again (the same bits: row-invariant)
    step: tuple[int, list[torch.Tensor], object] | None = None


class TorchStageRuntime(StageRuntime):
    def __init__(self, spec: StageSpec):
        f = open_model(spec.model_path)
        cfg = ModelConfig.from_gguf(f)
        if not 0 <= spec.layer_start < spec.layer_end <= cfg.n_layers:
            raise StageError(f"layer range [{spec.layer_start}, {spec.layer_end}) is not "
                             f"inside the model's {cfg.n_layers} layers")
        if spec.chunk < 1 or spec.lane_batch < 1:
            raise StageError("chunk and lane_batch must be >= 1")
        if spec.threads:
            torch.set_num_threads(spec.threads)
        # One thread or two compute the same bits in every format but fp32, whose
        # F.linear splits its sums by thread (tests/test_grpc_service.py checks both).
        self.thread_invariant = spec.weight_format != "fp32"
        self.spec, self.cfg = spec, cfg
        self.n_ctx = min(spec.n_ctx, cfg.context_length)
        t = load_stage_tensors(f, cfg, spec.layer_start, spec.layer_end,
                               first=spec.is_first, last=spec.is_last)
        self.weights_digest, self.weights_source_bytes = t.digest, t.source_bytes
        self._build_layers(t)
        # the layers in one kernel call where every one has a form decoder.c runs (same bits)
        self.decoder_run = Gemma4Run.of(self.layers, self.per_layer) \
            if cfg.family.graph is not None else DecoderRun.of(self.layers)
        self.embed = Embeddings(t.matrix("token_embd.weight", q6k=True),
                                t.table_rows("token_embd.weight")) if spec.is_first else None
        self.embed_scale = math.sqrt(cfg.hidden) if cfg.family.embed_scale else None
        if spec.is_last:
            self.norm = make_norm(cfg, t, cfg.family.output_norm)
            head = "token_embd.weight" if cfg.tied_head else "output.weight"
            # The head's top logits stay fp32 in every format: they pick the token, and a
            # head in fewer bits lost top-1 agreement (evals/format_accuracy.py).
            # It runs lane_batch rows at a time (_logits).
            self.head = make_head(t.matrix(head, q6k=True), spec.weight_format,
                                  spec.lane_batch)
        # speculation's proposer where the file ships NextN layers (stages/nextn.py)
        self.nextn = NextN(cfg, t, spec.weight_format, self.head, self.norm, spec.chunk,
                           self.n_ctx) if spec.is_last and cfg.nextn_tensors(t.names) else None
        self.exactness = self._exactness()
        # Decode rows of several lanes share a step unpadded where a row's bits do not
        # depend on how many rows come with it: on a row-invariant stage (certify checks
        # decode rows beside 7 lanes), and dense layers on torch's integer kernels (up to
        # SMALL_ROWS rows; tests/test_shape_invariance.py) — at the last stage only with a
        # rescored head (an fp32 head's rows depend on the call's). Elsewhere steps run
        # exactly lane_batch rows, padded.
        integer = spec.weight_format.removesuffix("-lean") in ("int4", "int8")
        self.free_groups = (not spec.is_last or isinstance(self.head, RescoredHead)) and (
            self.exactness is Exactness.ROW_INVARIANT
            or (integer and not self.recurrent and cfg.mla is None))
        f.close()
        del t
        _return_freed_memory()
        self._lanes: dict[int, _Lane] = {}
        self._next_lane = 0

    @property
    def frames_need_tokens(self) -> bool:
        return bool(self.side_width)

    def _build_layers(self, t: StageTensors) -> None:
        """The stage's decoder layers, each with its mixer (attention, short conv,
        attention beside Mamba2, or gated DeltaNet), and the KV and recurrent-state slots
        they use."""
        spec, cfg = self.spec, self.cfg
        ropes: dict[tuple[float, float], Rope] = {}
        factors = t.get(ROPE_FREQS)  # llama3-style per-dimension frequency factors
        self.layers: list[DecoderLayer] = []
        self.attn_layers: list[int] = []  # model layer index of each KV slot
        self.conv_layers: list[int] = []  # model layer index of each short-conv layer
        # Recurrent state slots of LaneKv.conv: their export names ("conv.N": short-conv,
        # Mamba2 or DeltaNet conv state of layer N, "ssm.N": Mamba2 SSM state or DeltaNet
        # delta state) and shapes.
        self.state_names: list[str] = []
        self.state_shapes: list[tuple[int, ...]] = []
        # Gemma 4's per-layer embeddings: frames carry the scaled token embedding x0 beside
        # the hidden row ([hidden | x0]) and their token ids (stages/gemma4.py)
        self.per_layer = None
        self.side_width = cfg.frame_width - cfg.hidden
        if cfg.family.graph is not None:  # a family with a graph of its own (Gemma 4)
            module, name = cfg.family.graph
            build = getattr(importlib.import_module(module), name)
            self.layers, self.attn_layers, self.per_layer = build(
                cfg, t, spec.layer_start, spec.layer_end, spec.weight_format)
            self.recurrent = False
            return
        for i in range(spec.layer_start, spec.layer_end):
            if cfg.is_conv_layer(i):
                mixer = ShortConv(i, len(self.state_names), cfg, t, spec.weight_format)
                self.conv_layers.append(i)
                self.state_names.append(f"conv.{i}")
                self.state_shapes.append((cfg.conv_l_cache - 1, cfg.hidden))
            elif cfg.mla is not None:  # DeepSeek2: one latent row per token in the KV slot
                if "mla" not in ropes:
                    ropes["mla"] = YarnRope(cfg.rope_dim, cfg.mla.rope)
                mixer = MlaAttention(i, len(self.attn_layers), cfg, t, spec.weight_format,
                                     ropes["mla"])
                self.attn_layers.append(i)
            elif cfg.is_deltanet_layer(i):  # Qwen3-Next: conv state and delta state
                mixer = GatedDeltaNet(i, len(self.state_names), cfg, t, spec.weight_format)
                self.state_names += [f"conv.{i}", f"ssm.{i}"]
                self.state_shapes += list(deltanet_state_shapes(cfg))
            else:
                key = (cfg.rope_base_for(i), cfg.rope_scale_for(i))
                if key not in ropes:
                    ropes[key] = Rope(cfg.rope_dim, key[0], key[1], cfg.family.rope_style,
                                      factors)
                kind = GatedAttention if cfg.family.attn_output_gate else Attention
                mixer = kind(i, len(self.attn_layers), cfg, t, spec.weight_format, ropes[key])
                self.attn_layers.append(i)
                if cfg.is_ssm_layer(i):  # Falcon-H1: Mamba2 beside attention
                    ssm = Mamba2(i, len(self.state_names), cfg, t, spec.weight_format)
                    mixer = ParallelMixer(mixer, ssm)
                    self.state_names += [f"conv.{i}", f"ssm.{i}"]
                    self.state_shapes += list(mamba2_state_shapes(cfg))
            self.layers.append(DecoderLayer(i, cfg, t, mixer,
                                            make_ffn(i, cfg, t, spec.weight_format)))
        self.recurrent = bool(self.state_names)

    def _exactness(self) -> Exactness:
        """Row-invariant where every op of the stage computes a row on its own: the
        matrices on our integer kernel, attention through attention.c, norms, rope and
        MoE routing through rowops.c (a family with its own graph says so per layer).
        Latent attention (MLA: rowops.c and attention.c) and the recurrent mixers (conv,
        Mamba2, DeltaNet: scan.c) say whether they keep the row-invariant contract."""
        if self.cfg.family.graph is not None:
            plain = all(layer.row_invariant for layer in self.layers)
        else:
            plain = all(
                layer.mixer.row_invariant for layer in self.layers
                if isinstance(layer.mixer, (ShortConv, ParallelMixer, GatedDeltaNet,
                                            MlaAttention))) and all(
                layer.ffn.row_invariant for layer in self.layers if isinstance(layer.ffn, MoeFfn))
        return Exactness.ROW_INVARIANT if plain and row_invariant(self.spec.weight_format) \
            else Exactness.CHUNKED

    # -- lanes -----------------------------------------------------------------------------
    def alloc_lane(self) -> int:
        lane = self._next_lane
        self._next_lane += 1
        cfg = self.cfg
        conv_shapes = tuple(self.state_shapes)
        if cfg.mla is not None:  # one latent row per token and layer
            kv_heads, k_dim, v_dim = latent_kv_shape(cfg.mla)
        else:  # head sizes per layer: Gemma 4's sliding and global layers differ
            kv_heads = cfg.n_kv_heads
            k_dim = [cfg.head_dim_for(i) for i in self.attn_layers]
            v_dim = [cfg.v_head_dim_for(i) for i in self.attn_layers]
        self._lanes[lane] = _Lane(LaneKv(len(self.attn_layers), kv_heads, k_dim, v_dim,
                                         self.spec.chunk, self.n_ctx, conv_shapes))
        return lane

    def free_lane(self, lane: int) -> None:
        self._lanes.pop(lane, None)
        if self.nextn is not None:
            self.nextn.free(lane)

    def _lane(self, lane: int) -> _Lane:
        try:
            return self._lanes[lane]
        except KeyError:
            raise StageError(f"unknown lane {lane}") from None

    def lane_length(self, lane: int) -> int:
        return self._lane(lane).length

    def resume_point(self, lane: int, common: int, n_tokens: int) -> int:
        """A row-invariant stage resumes at any token its lane holds, rows made by decode
        included (each is bitwise the prefill row at its position); a chunked one at the
        last chunk boundary of its prefill rows. A recurrent lane only where it holds the
        state (_resumable)."""
        if self.recurrent:
            return max(b for b in self._resumable(self._lane(lane)) if b <= common)
        if self.exactness is Exactness.ROW_INVARIANT:
            return min(common, self.prefill_boundary(lane))
        return super().resume_point(lane, common, n_tokens)

    def prefill_boundary(self, lane: int) -> int:
        st = self._lane(lane)
        if self.recurrent:
            return max(self._resumable(st))
        if self.exactness is Exactness.ROW_INVARIANT:
            return st.prefilled
        return st.prefilled // self.spec.chunk * self.spec.chunk

    def _resumable(self, st: _Lane) -> set[int]:
        """Recurrent lanes: the starts whose conv state the lane still has (its snapshots
        and, when it is all prefill rows, its length: on a chunked stage only at a chunk
        boundary)."""
        starts = {0, *st.saved}
        free = self.exactness is Exactness.ROW_INVARIANT
        if st.length == st.prefilled and (free or st.length % self.spec.chunk == 0):
            starts.add(st.length)
        return starts

    def _conv_state_at(self, st: _Lane, n_tokens: int) -> list[torch.Tensor]:
        if n_tokens == st.length:
            return st.kv.conv
        if n_tokens in st.saved:
            return st.saved[n_tokens]
        if n_tokens == 0:
            return st.kv.empty_conv()
        raise StageError(f"recurrent state exists only at the lane's length {st.length} and "
                         f"its snapshots {sorted(st.saved)}, not at {n_tokens} tokens")

    # -- compute ---------------------------------------------------------------------------
    def _inputs(self, inputs: torch.Tensor | Frame, start: int) -> torch.Tensor:
        """Token ids (stage 0) or float32 rows (later stages)."""
        if self.spec.is_first:
            if isinstance(inputs, Frame):
                raise StageError("stage 0 takes token ids, not a frame")
            ids = torch.as_tensor(inputs, dtype=torch.long)
            ids = ids if ids.ndim == 1 else ids.reshape(-1)
            # a decode step's few ids checked in Python: one op, where min and max took four
            lo, hi = _bounds(ids.tolist()) if ids.numel() <= 64 else \
                (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
            if lo < 0 or hi >= self.cfg.vocab:
                raise StageError(f"token id out of range [0, {self.cfg.vocab})")
            return ids
        if not isinstance(inputs, Frame):
            raise StageError("a non-first stage takes a Frame of activation rows")
        if inputs.start != start:
            raise StageError(f"frame starts at {inputs.start}, expected {start}")
        width = self.cfg.hidden + self.side_width
        if inputs.rows.ndim != 2 or inputs.rows.shape[1] != width:
            raise StageError(f"frame rows must be [n, {width}]")
        if self.side_width and (inputs.tokens is None or
                                tuple(inputs.tokens.shape) != (inputs.n_rows,)):
            raise StageError("this model's frames need their rows' token ids")
        return from_wire(inputs)

    def _tokens(self, inputs: torch.Tensor | Frame) -> torch.Tensor | None:
        """The input rows' token ids where the layers need them (per-layer embeddings)."""
        if not self.side_width:
            return None
        if isinstance(inputs, Frame):
            return inputs.tokens.to(torch.long).reshape(-1)
        return torch.as_tensor(inputs, dtype=torch.long).reshape(-1)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        if not self.spec.is_first:
            return x
        rows = self.embed(x)
        rows = rows * self.embed_scale if self.embed_scale is not None else rows
        # the frame's side columns: the scaled token embedding itself
        return torch.cat([rows, rows], dim=1) if self.side_width else rows

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor | list[int],
                    segments: list[Segment], tokens: torch.Tensor | None = None,
                    owned: bool = False) -> torch.Tensor:
        """The rows after the stage's layers; `owned`: x is a fresh tensor of the caller's,
        which the layers may overwrite."""
        if self.side_width:  # rows [hidden | x0]: the layers see hidden, x0 passes on
            x, x0 = x[:, :self.cfg.hidden], x[:, self.cfg.hidden:]
            self.per_layer.set(x0, tokens)
        if self.decoder_run is not None:  # None where a layer has another form
            out = self.decoder_run(x, segments, owned)
            if out is not None:
                return torch.cat([out, x0], dim=1) if self.side_width else out
        positions = torch.as_tensor(positions)  # decoder.c reads the segments instead
        for layer in self.layers:
            x = layer.forward(x, positions, segments)
        return torch.cat([x, x0], dim=1) if self.side_width else x

    def _logits(self, hidden: torch.Tensor, group: int) -> torch.Tensor:
        """Head over rows in padded groups of exactly `group` rows: a row's logits then do
        not depend on how many rows came with it. Serving ("last" and decode) uses groups
        of lane_batch; the diagnostic "all" uses groups of `chunk` rows (lane_batch for a
        float32 head on a row-invariant stage, whose groups decode's must match)."""
        # without a frame's side columns
        x = self.norm(hidden[:, :self.cfg.hidden] if self.side_width else hidden)
        if x.shape[0] == group:  # a decode step's one group: no slicing or padding ops
            logits = self.head(x)
            return soft_cap(logits, self.cfg.final_softcap) if self.cfg.final_softcap \
                else logits
        out = []
        for i in range(0, x.shape[0], group):
            part = x[i:i + group]
            n = part.shape[0]
            if n < group:
                part = torch.cat([part, part.new_zeros(group - n, part.shape[1])])
            out.append(self.head(part)[:n])
        logits = torch.cat(out) if len(out) > 1 else out[0]
        # elementwise and monotonic: a rescored head's candidates stay its top logits
        return soft_cap(logits, self.cfg.final_softcap) if self.cfg.final_softcap else logits

    def prefill(self, lane: int, inputs: torch.Tensor | Frame, start: int = 0,
                logits: str = "last", snapshots: tuple[int, ...] = (),
                between_chunks: Callable[[], None] | None = None,
                rows_per_call: int | None = None) -> StageOutput:
        st = self._lane(lane)
        free = self.exactness is Exactness.ROW_INVARIANT  # any start, no padding
        if rows_per_call is not None and not (free and rows_per_call >= 1):
            raise StageError("rows_per_call is for row-invariant stages, and at least 1")
        C = rows_per_call or self.spec.chunk
        x_in, tok_in = self._inputs(inputs, start), self._tokens(inputs)
        end = check_prefill(start, x_in.shape[0], chunk=1 if free else C,
                            boundary=self.prefill_boundary(lane), n_ctx=self.n_ctx,
                            logits=logits, snapshots=snapshots)
        if self.recurrent and start not in self._resumable(st):
            raise StageError(f"prefill start {start}: recurrent state cannot be rolled back; "
                             f"starts available: {sorted(self._resumable(st))}")
        st.kv.ensure(end if free else -(-end // C) * C)
        if self.recurrent:  # rewind the conv state to start (checked available above)
            st.kv.conv = list(self._conv_state_at(st, start))
            st.saved = {b: s for b, s in st.saved.items() if b <= start}
        st.length = st.prefilled = start  # state past start is discarded
        outs = []
        # calls of C rows; a row-invariant stage also ends one at each snapshot (same bits)
        stops = sorted({*range(start + C, end, C), end, *(snapshots if free else ())})
        for s, e in zip([start] + stops, stops):
            outs.append(self._prefill_call(st, x_in[s - start: e - start],
                                           None if tok_in is None else tok_in[s - start:e - start],
                                           s, C if not free else None))
            if self.recurrent and (e in snapshots or (free and e < end)):
                # recurrent state moves on with the next chunk: capture it while passing
                # (a row-invariant lane also at its calls' ends, to resume there later)
                st.saved[e] = list(st.kv.conv)
            if between_chunks is not None and e < end:
                between_chunks()
        st.length = st.prefilled = end
        if self.recurrent and free:  # the lane keeps its last few call ends, not every one
            ends = sorted(b for b in st.saved if b > start and b not in snapshots)
            for b in ends[:-LANE_SNAPSHOTS]:
                del st.saved[b]
        # Attention state is token-major: a prefix snapshot is a slice of the final one.
        out = StageOutput(snapshots={b: self.export_state(lane, b) for b in snapshots})
        hidden = torch.cat(outs) if len(outs) > 1 else outs[0]
        if not self.spec.is_last:
            out.frame = to_wire(start, hidden, self.spec.wire_dtype, tokens=tok_in)
            return out
        out.trunk = hidden
        if logits == "last":
            with qkernel.openmp_team(hidden.shape[0] > qkernel.OMP_ROWS):
                out.logits = self._logits(hidden[-1:], self.spec.lane_batch)[0]
        elif logits == "hidden":  # embeddings: each row after the output norm
            out.hidden = self.norm(hidden[:, :self.cfg.hidden])
        elif logits == "all":  # an fp32 head on a row-invariant stage: decode's groups
            fixed = free and not isinstance(self.head, RescoredHead)
            out.logits = self._logits(hidden, self.spec.lane_batch if fixed else self.spec.chunk)
        return out

    def _prefill_call(self, st: _Lane, rows: torch.Tensor, toks: torch.Tensor | None,
                      s: int, pad_to: int | None) -> torch.Tensor:
        """One call of the layers over a lane's rows from position s (padded to `pad_to`
        rows where the stage keeps the chunked contract); its real rows' outputs."""
        m = rows.shape[0]
        n = pad_to or m  # padding sits after every real row: masked
        x = self._embed(_padded(rows, n))
        toks = None if toks is None else _padded(toks, n)
        x = self._run_layers(x, torch.arange(s, s + n), [Segment(st.kv, 0, n, s, n_real=m)], toks)
        return x[:m]

    def decode(self, steps: list[tuple[int, torch.Tensor | Frame]]) -> list[StageOutput]:
        """The next rows of each lane: one (a 0-d token id or a one-row Frame), or on a
        row-invariant stage k >= 1 (k token ids, a k-row Frame: the lane's next k
        positions, as a verify step of proposed tokens), whose outputs then hold k rows."""
        lanes = [lane for lane, _ in steps]
        if len(set(lanes)) != len(lanes):
            raise StageError("a lane may appear once per decode step")
        B = SMALL_ROWS if self.free_groups else self.spec.lane_batch
        results: list[StageOutput] = []
        for g in range(0, len(steps), B):
            results += self._decode_group(steps[g:g + B], B)
        return results

    def _decode_group(self, group: list[tuple[int, torch.Tensor | Frame]],
                      B: int) -> list[StageOutput]:
        """One call of the layers over up to B lanes' rows (a chunked stage: padded to B
        rows, so a lane's arithmetic ignores its neighbours)."""
        rows, positions, segments, tokens = [], [], [], []
        for lane, inp in group:
            st = self._lane(lane)
            x = self._inputs(inp, st.length)
            k = x.shape[0]
            if k != 1 and (k < 1 or self.exactness is not Exactness.ROW_INVARIANT):
                raise StageError("decode takes exactly one row per lane on a stage that keeps "
                                 "the chunked contract" if k else "decode needs a row per lane")
            if st.length + k > self.n_ctx:
                raise StageError(f"lane {lane} is full ({self.n_ctx} tokens)")
            if self.recurrent:
                st.step = (st.length, list(st.kv.conv), inp) if k > 1 else None
            st.kv.ensure(st.length + k)
            segments.append(Segment(st.kv, len(positions), k, st.length))
            positions += range(st.length, st.length + k)
            rows.append(x)
            tokens.append(self._tokens(inp))
        n = len(positions)
        x = self._embed(rows[0] if len(rows) == 1 else torch.cat(rows))
        toks = torch.cat(tokens) if self.side_width else None
        if not self.free_groups and n < B:
            x, positions = _padded(x, B), positions + [0] * (B - n)
            toks = None if toks is None else _padded(toks, B)
        # the rows are this call's own: ids looked up, a frame's f16 or q8 rows converted,
        # several lanes' rows joined or padded (an f32 frame's rows are the frame's)
        owned = self.spec.is_first or len(rows) > 1 or n < x.shape[0] or (
            isinstance(group[0][1], Frame) and group[0][1].rows.dtype != torch.float32)
        x = self._run_layers(x, positions, segments, toks, owned)
        real = x if x.shape[0] == n else x[:n]  # ops after the layers' pass run cold: few
        logits = self._logits(real, n if self.free_groups else B) \
            if self.spec.is_last else None
        # every lane's rows to the wire dtype at once (each row on its own: the same bits
        # as lane by lane, in a quarter of the time: ~11 small ops a call)
        wire = None if self.spec.is_last else to_wire(0, real, self.spec.wire_dtype)
        return [self._decoded(lane, seg, x, logits, toks, wire)
                for (lane, _), seg in zip(group, segments)]

    def _decoded(self, lane: int, seg: Segment, x: torch.Tensor, logits: torch.Tensor | None,
                 toks: torch.Tensor | None, wire: Frame | None) -> StageOutput:
        """A lane's output of its decode rows (seg), and the lane moved past them."""
        st = self._lanes[lane]
        a, b = seg.row0, seg.row0 + seg.n
        whole = a == 0 and b == x.shape[0]  # a lone lane's rows: no slicing ops
        if self.spec.is_last:
            out = StageOutput(logits=logits[a] if seg.n == 1 else logits[a:b],
                              trunk=x if whole else x[a:b])
        elif whole:
            out = StageOutput(frame=Frame(st.length, wire.rows, wire.scale, toks))
        else:
            out = StageOutput(frame=Frame(
                st.length, wire.rows[a:b], None if wire.scale is None else wire.scale[a:b],
                None if toks is None else toks[a:b]))
        if self.exactness is Exactness.ROW_INVARIANT and st.prefilled == st.length:
            st.prefilled += seg.n  # a decode row is the prefill row: reusable as one
        st.length += seg.n
        return out

    def rewind(self, lane: int, n_tokens: int) -> None:
        """Attention rows past n_tokens are simply dropped (the next rows overwrite them).
        Recurrent state exists at the lane's end and its snapshots: inside the lane's last
        verify step it is taken back to the step's start and the kept rows run again."""
        st = self._lane(lane)
        if n_tokens == st.length:
            return
        if not 0 <= n_tokens < st.length:
            raise StageError(f"lane {lane} holds {st.length} tokens: it cannot rewind to "
                             f"{n_tokens}")
        redo = None
        if self.recurrent:
            if st.step is None or n_tokens < st.step[0]:
                raise StageError(f"recurrent state of lane {lane} exists at {st.length} and "
                                 f"its snapshots, not at {n_tokens} tokens")
            start, conv, inputs = st.step
            st.kv.conv = list(conv)
            redo, n_tokens = _first_rows(inputs, n_tokens - start), start
        st.length = n_tokens
        st.prefilled = min(st.prefilled, n_tokens)
        st.saved = {b: c for b, c in st.saved.items() if b <= n_tokens}
        st.step = None
        if redo is not None:
            self._decode_group([(lane, redo)], SMALL_ROWS if self.free_groups
                               else self.spec.lane_batch)

    # -- state -----------------------------------------------------------------------------
    def copy_lane(self, src: int, dst: int, n_tokens: int) -> None:
        self.import_state(dst, self.export_state(src, n_tokens))

    def export_state(self, lane: int, n_tokens: int) -> LaneState:
        """KV rows [0, n_tokens) of every attention layer; for recurrent families also the
        conv state at n_tokens, which exists only at the lane's length, at its snapshot
        boundaries and at 0 (any other n_tokens raises StageError)."""
        st = self._lane(lane)
        if not 0 <= n_tokens <= st.length:
            raise StageError(f"lane {lane} holds {st.length} tokens, not {n_tokens}")
        conv = self._conv_state_at(st, n_tokens) if self.recurrent else []
        n = len(self.attn_layers)
        return LaneState(
            n_tokens=n_tokens,
            prefilled=min(n_tokens, st.prefilled),
            keys=[st.kv.keys(i, 0, n_tokens).clone() for i in range(n)],
            # MLA: the latent rows are the whole state; values are part of them
            values=[] if self.cfg.mla is not None else
            [st.kv.values(i, 0, n_tokens).clone() for i in range(n)],
            fixed={name: c.clone() for name, c in zip(self.state_names, conv)},
        )

    def import_state(self, lane: int, state: LaneState) -> None:
        st = self._lane(lane)
        n_attn = len(self.attn_layers)
        n_values = 0 if self.cfg.mla is not None else n_attn
        if len(state.keys) != n_attn or len(state.values) != n_values:
            raise StageError("state has a different number of attention layers")
        if any(tuple(k.shape[1:]) != shape for k, shape in zip(state.keys, st.kv.shapes_k)):
            raise StageError("state's KV rows have a different layout")
        names = self.state_names
        if set(state.fixed) != set(names):
            raise StageError(f"state carries recurrent state {sorted(state.fixed)}, "
                             f"this stage needs {names}")
        conv = [state.fixed[name] for name in names]
        if any(tuple(c.shape) != shape for c, shape in zip(conv, st.kv.conv_shapes)):
            raise StageError("recurrent state has a different shape")
        n = state.n_tokens
        st.kv.ensure(max(n, 1))
        for i in range(n_attn):
            k = state.keys[i]
            st.kv.write(i, 0, k, state.values[i] if n_values else k[..., :0])
        st.kv.conv = [c.to(torch.float32).clone() for c in conv]
        st.saved = {}
        st.length, st.prefilled = n, state.prefilled

    def _recurrent_state_kind(self) -> str:
        cfg = self.cfg
        if cfg.deltanet_layers:
            return (f"gated-deltanet d_conv={cfg.ssm_d_conv} k_heads={cfg.ssm_groups} "
                    f"v_heads={cfg.ssm_heads} head_dim={cfg.ssm_d_state} f32")
        if cfg.ssm_layers:
            return (f"mamba2 d_conv={cfg.ssm_d_conv} d_inner={cfg.ssm_d_inner} "
                    f"d_state={cfg.ssm_d_state} heads={cfg.ssm_heads} groups={cfg.ssm_groups} f32")
        return f"shortconv l_cache={cfg.conv_l_cache} f32"

    def _kv_layout(self) -> str:
        m = self.cfg.mla
        if m is None:
            return "token-major"
        # one row of latent + rope floats per token: never mixed with per-head K/V payloads
        return f"token-major mla-latent kv_lora={m.kv_lora_rank} rope={m.rope_dim}"
    def _metadata_options(self) -> dict[str, object]:
        """Options read from the GGUF's metadata (not its tensors, which the weights digest
        covers) that change the arithmetic; present only where a family sets them."""
        cfg = self.cfg
        options = {"soft_caps": [cfg.attn_softcap, cfg.final_softcap],
                   "clamp_kqv": cfg.clamp_kqv, "rope_base_swa": cfg.rope_base_swa}
        return {k: v for k, v in options.items() if v not in (None, 0.0, [0.0, 0.0])}

    def identity(self) -> dict[str, object]:
        cfg, spec = self.cfg, self.spec
        return {
            "weights_digest": self.weights_digest,
            "architecture": cfg.architecture,
            "stage_index": spec.stage_index,
            "layer_range": [spec.layer_start, spec.layer_end],
            "runtime_abi": RUNTIME_ABI,
            "kv_layout": self._kv_layout(),
            "kv_dtype": "f32",
            "wire_dtype": spec.wire_dtype,
            "n_ctx": self.n_ctx,
            "rope": [cfg.rope_base, cfg.family.rope_base_swa, cfg.rope_scale, cfg.rope_dim],
            **({"recurrent_state": self._recurrent_state_kind()} if self.recurrent else {}),
            **({"mla": cfg.mla.describe()} if cfg.mla is not None else {}),
            **self._metadata_options(),
            "numeric_policy": {
                "compute": "f32",
                # torch's kernels differ by CPU kind (AVX2 vs AVX-512 round differently):
                # nodes of one cluster need not share one, nor their cached state
                "cpu": torch.backends.cpu.get_cpu_capability(),
                "weights": spec.weight_format,
                "kernels": kernels(spec.weight_format),
                "threads": "any" if self.thread_invariant else torch.get_num_threads(),
                "contract": self.exactness.value,
                "chunk": "any" if self.exactness is Exactness.ROW_INVARIANT else spec.chunk,
                "lane_batch": "any" if self.free_groups else spec.lane_batch,
            },
        }


def _bounds(values: list[int]) -> tuple[int, int]:
    return (min(values), max(values)) if values else (0, 0)


def _first_rows(inputs: torch.Tensor | Frame, n: int) -> torch.Tensor | Frame | None:
    """A decode step's first n input rows (token ids or a frame's rows); None for none."""
    if n == 0:
        return None
    if isinstance(inputs, Frame):
        return Frame(inputs.start, inputs.rows[:n],
                     None if inputs.scale is None else inputs.scale[:n],
                     None if inputs.tokens is None else inputs.tokens[:n])
    return torch.as_tensor(inputs).reshape(-1)[:n]


def _padded(rows: torch.Tensor, n: int) -> torch.Tensor:
    """rows followed by zero rows up to n."""
    if rows.shape[0] >= n:
        return rows
    return torch.cat([rows, rows.new_zeros((n - rows.shape[0],) + tuple(rows.shape[1:]))])
