"""One stage, whatever carries its calls: the runtime, its exact caches, its compute loop,
and the link to the next stage. The gRPC service (mesh/stage/grpc_service.py) and the
in-process engine (mesh/control/local.py) both serve requests through `open_session`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from functools import partial

from skippy.cache.blocks import BlockError, BlockStore
from skippy.cache.config import CacheConfig
from skippy.stages.factory import make_runtime
from skippy.stages.runtime import StageSpec
from skippy.stages.runtime_kind import TORCH, RuntimeKind
from skippy.stages.stage_cache import StageCache
from skippy.topology.errors import RequestError

from ..token_mask import Vocabulary
from ..tokenizer import Tokenizer
from .loop import Row, StageLoop
from .replies import ReplyStreams
from .session import LinkDown, StageSession
from .state_pull import StatePuller
from .turns import Turn


class StageServer:
    def __init__(self, spec: StageSpec, cache: CacheConfig, policy: str,
                 runtime: RuntimeKind = TORCH, *, burst_threads: int | None = None,
                 turn: str | None = None,
                 store: BlockStore | None = None, cold_store: BlockStore | None = None):
        """`store`: where this stage's state blocks live (default: its own, in memory;
        a stage actor shares its node's, mesh/stage/node_store.py); `cold_store`: the
        disk tier's (none: no disk tier); `turn`: the name of the turn this stage takes
        with the others of its pipeline on its node (mesh/stage/turns.py)."""
        self.spec = spec
        self.loop = StageLoop(self._step, check=self._check_row, threads=spec.threads)
        self.runtime = self.loop.call(make_runtime, spec, runtime)
        if self.runtime.thread_invariant:
            # A stage sharing its node's cores may take its pipeline's cores while one
            # session alone keeps the stages computing in turn, or at every step where
            # they take turns (same bits on any count).
            self.loop.allow_burst(burst_threads, Turn.named(turn, spec.stage_index,
                                                               spec.is_last))
        self.cache = self.loop.call(StageCache, self.runtime, cache, policy=policy,
                                    store=store, cold_store=cold_store)
        self._next: Callable[[], object] | None = None  # opens a link to the next stage
        self._lock = threading.Lock()
        self.lane_freed = threading.Condition()  # a session waiting for a lane hears it
        # A test hook: raises for a row that must fail (fault isolation is tested with it).
        self.fault: Callable[[Row], None] | None = None
        # Pulls state from peer stages (set where the stage network exists).
        self.puller: StatePuller | None = None
        # The grammar engine's view of the model's tokens: the last stage masks
        # constrained requests' logits with it (built on the first such request).
        self.vocabulary = Vocabulary(partial(Tokenizer, spec.model_path))
        # The drivers' reply streams (the last stage answers decode steps there)
        self.replies = ReplyStreams()
        self.local_streams = 0  # session and reply streams taken over its socket (local_link)
        # The last stage's verify steps: tokens proposed, and those its draws accepted
        self.speculation = {"verify_steps": 0, "proposed_tokens": 0, "accepted_tokens": 0}

    # -- the chain -----------------------------------------------------------------------
    def link_next(self, opener: Callable[[], object] | None) -> None:
        """How this stage opens a session at the next one (None: the last stage). Sessions
        already open keep the link they have until they end; the old opener's idle
        streams end now."""
        with self._lock:
            old, self._next = self._next, opener
        if old is not None and hasattr(old, "close"):
            old.close()

    def open_downstream(self):
        with self._lock:
            opener = self._next
        if opener is None:
            raise LinkDown(f"stage {self.spec.stage_index} does not know the next stage")
        return opener()

    def open_session(self) -> StageSession:
        return StageSession(self)

    # -- what the loop runs --------------------------------------------------------------
    def _step(self, rows: list[tuple[int, object]]) -> list:
        return self.runtime.decode(rows)

    def _check_row(self, row: Row) -> None:
        if self.fault is not None:
            self.fault(row)
        if self.runtime.lane_length(row.lane) >= self.spec.n_ctx:
            # the request asked for more than its context holds: its fault, never retried
            raise RequestError(f"the context of {self.spec.n_ctx} tokens is full",
                               "max_tokens", "context_length_exceeded")

    def speculated(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome (on the loop thread)."""
        self.speculation["verify_steps"] += 1
        self.speculation["proposed_tokens"] += proposed
        self.speculation["accepted_tokens"] += accepted

    # -- blocks and figures --------------------------------------------------------------
    def blocks(self, hashes: Iterable[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """Each asked block's bytes, empty where this stage's store lacks it (the asker
        then recomputes): state shared between nodes by hash."""
        store = self.cache.store
        for h in hashes:
            try:
                data = store.get(h) if store is not None else b""
            except BlockError:  # absent or corrupt here
                data = b""
            yield h, data

    def export(self, tokens: list[int], limit: int, after: int, namespace: str) -> bytes:
        """A peer's ask for this stage's state of a prefix: its payload manifest (the
        blocks wait in the store for GetBlocks), empty when nothing longer is held."""
        manifest = self.loop.call(self.cache.peers.export, tokens, limit, after,
                                  self.cache.scope(namespace))
        return b"" if manifest is None else manifest.to_bytes()

    def stats(self) -> dict:
        s = self.loop.call(self.cache.stats)
        if self.puller is not None:
            s["pulls"] = self.puller.stats()
        if self.spec.is_last:
            s["speculation"] = dict(self.speculation)
            s["direct_replies"] = self.replies.sent
        with self._lock:
            idle = getattr(self._next, "idle", None)
        if idle is not None:  # requests that took an idle stream to the next stage
            s["streams_reused"] = idle.reused
        s["local_streams"] = self.local_streams
        s.update(stage_index=self.spec.stage_index,
                 layers=[self.spec.layer_start, self.spec.layer_end],
                 weight_format=self.spec.weight_format, **self.loop.figures())
        return s
