"""A file's first NextN (multi-token prediction) layer as speculation's proposer, at the
last stage. GLM-4.7-Flash and DeepSeek-V3 files append such layers after the trunk's;
llama.cpp's trunk, like ours, never runs them.

At position p the layer takes the trunk's final row h_p (after the output norm, as vLLM
and SGLang feed it) and the embedding of the token at p + 1, joined as
eh_proj([enorm(embed(t[p+1])) | hnorm(h_p)]), runs one decoder layer with a KV of its
own, and reads its output through its own norm and the trunk's head: a guess at the token
after next. After a step the row at the lane's end gives the first proposal; each further
one runs the layer on its own output and the proposal before it (the depth-k use vLLM
makes of one layer), rows forgotten afterwards.

Proposals decide only how many tokens a verify step may emit, never which
(mesh/control/speculation.py), so nothing here needs a numeric reference. A row stays
while the tokens it was made from stand (t[0..p+1]); a row the layer cannot make (a warm
request's trunk does not recompute the rows before its start) is left out, and the layer
sees a slightly shorter context (its positions count its own rows), never a wrong one.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from skippy.topology.model_config import ModelConfig

from .ffn import make_ffn
from .kv import LaneKv
from .linear import Embeddings, make_head, make_linear
from .mla import MlaAttention, YarnRope, latent_kv_shape
from .norms import Norm, make_norm
from .transformer import DecoderLayer, Segment
from .weights import StageTensors

MAX_DEPTH = 8  # proposals a step may ask for


@dataclass
class _Lane:
    kv: LaneKv
    positions: list[int] = field(default_factory=list)  # each KV row's trunk position
    tokens: list[int] = field(default_factory=list)     # the tokens the rows were made of
    last: torch.Tensor | None = None                    # the layer's output at its last row


class NextN:
    """The proposer's weights and one lane per trunk lane."""

    def __init__(self, cfg: ModelConfig, t: StageTensors, fmt: str, head, output_norm: Norm,
                 chunk: int, n_ctx: int):
        i, self.cfg = cfg.n_layers, cfg
        p = f"blk.{i}.nextn."
        self.eh_proj = make_linear(t.matrix(p + "eh_proj.weight"), fmt)
        self.enorm = make_norm(cfg, t, p + "enorm.weight")
        self.hnorm = make_norm(cfg, t, p + "hnorm.weight")
        self.head_norm = make_norm(cfg, t, p + "shared_head_norm.weight")
        own = p + "embed_tokens.weight"
        table = own if own in t.names else "token_embd.weight"
        self.embed = Embeddings(t.matrix(table, q6k=True), t.table_rows(table))
        own = p + "shared_head_head.weight"
        self.head = make_head(t.matrix(own, q6k=True), fmt, 1) if own in t.names else head
        self.output_norm = output_norm
        mixer = MlaAttention(i, 0, cfg, t, fmt, YarnRope(cfg.rope_dim, cfg.mla.rope))
        self.layer = DecoderLayer(i, cfg, t, mixer, make_ffn(i, cfg, t, fmt))
        self.chunk, self.n_ctx = chunk, n_ctx
        self._lanes: dict[int, _Lane] = {}

    def _new_lane(self) -> _Lane:
        heads, k_dim, v_dim = latent_kv_shape(self.cfg.mla)
        return _Lane(LaneKv(1, heads, k_dim, v_dim, self.chunk, self.n_ctx))

    def free(self, lane: int) -> None:
        self._lanes.pop(lane, None)

    def extend(self, lane: int, seq: Sequence[int], start: int, trunk: torch.Tensor) -> None:
        """The rows of trunk positions [start, start + n): `trunk` the trunk's final rows
        there (before the output norm), `seq` the tokens through position start + n."""
        st = self._lanes.get(lane) or self._new_lane()
        self._lanes[lane] = st
        common = 0
        for a, b in zip(st.tokens, seq):  # (-1: a token this lane never saw)
            if a != b:
                break
            common += 1
        # a row at p stands while tokens [0, p + 1] do; rows from start are made again
        self._append(st, bisect.bisect_right(st.positions, min(common - 2, start - 1)),
                     seq, start, trunk)

    def step(self, lane: int, length: int, token: int, emitted: Sequence[int],
             trunk: torch.Tensor) -> None:
        """A decode step's accepted rows: `token` at position `length`, the tokens it and
        its accepted proposals drew (`emitted`), the trunk's rows of those positions."""
        st = self._lanes.get(lane)
        n = 0 if st is None else len(st.tokens)
        if st is not None and (n < length + 1 or (n == length + 1 and st.tokens[-1] == token)):
            # the same sequence on: steps it skipped (no proposals asked) are left out
            seq = [*st.tokens[:length], *[-1] * (length - n), int(token), *emitted]
            self._append(st, len(st.positions), seq, length, trunk)
        else:  # the lane's rows are another sequence's, or it has none
            self.extend(lane, [-1] * length + [int(token), *emitted], length, trunk)

    def _append(self, st: _Lane, keep: int, seq: Sequence[int], start: int,
                trunk: torch.Tensor) -> None:
        n = trunk.shape[0]
        if keep + n > self.n_ctx:  # its own rows fill the context: start over
            keep = 0
        del st.positions[keep:]
        ids = torch.tensor([int(t) for t in seq[start + 1:start + n + 1]], dtype=torch.long)
        h = self.hnorm(self.output_norm(trunk[:, :self.cfg.hidden]))
        st.last = self._rows(st, keep, ids, h)[-1:]
        st.positions += range(start, start + n)
        st.tokens = [int(t) for t in seq[:start + n + 1]]

    def _rows(self, st: _Lane, at: int, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The layer over rows at KV rows [at, at + n): token ids and normed hidden rows."""
        n = ids.shape[0]
        x = self.eh_proj(torch.cat([self.enorm(self.embed(ids)), h], dim=1))
        st.kv.ensure(at + n)
        return self.layer.forward(x, torch.arange(at, at + n), [Segment(st.kv, 0, n, at)])

    def propose(self, lane: int, k: int) -> list[int]:
        """Up to k tokens to follow the lane's last token (none before a row exists)."""
        st = self._lanes.get(lane)
        if st is None or st.last is None:
            return []
        out, x, at = [], st.last, len(st.positions)
        for depth in range(min(k, MAX_DEPTH, self.n_ctx - at)):
            if depth:  # the layer again, on its own output and the guess before
                x = self._rows(st, at + depth - 1, torch.tensor([out[-1]]), self.hnorm(x))
            out.append(int(torch.argmax(self.head(self.head_norm(x))[0])))
        return out

