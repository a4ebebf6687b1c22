"""Whether the gateway takes a request now, and whether it is ready at all.

At most `max_concurrent_requests` requests run at once; as many more wait briefly in a
bounded queue (`queue_timeout_s`), then get a 503 with Retry-After, as does a busy engine.
While the engine says no pipeline can serve, /ready is 503, /health still 200 but
"degraded" (a restarted gateway would not bring the stages back sooner, so liveness
probes should not kill it), and requests get a 503. Neither says why to whoever asks:
the reason is logged. Every request ends by its deadline (`request_timeout_s`: a 504).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from skippy.topology.errors import OverCapacity, one_line

from ..control.admission import LaneAdmission
from ..control.engine import Engine, GenerationRequest
from .http_errors import unavailable
from .limits import GatewayLimits
from .openai_api import ApiError

log = logging.getLogger(__name__)

READY_PROBE_INTERVAL_S = 5.0   # /ready probes the engine at most this often


class RequestAdmission:
    """The gateway's concurrent-request slots and its word on readiness."""

    def __init__(self, engine: Engine, limits: GatewayLimits, probe_ids: tuple[int, ...],
                 slots: LaneAdmission | None = None):
        """`slots`: the gateway's (shared by the models it serves; new by default)."""
        self.engine, self.limits = engine, limits
        self.slots = slots or request_slots(limits)
        self._probe_ids = probe_ids  # a 1-token probe's prompt
        self._ready_at = 0.0
        self._ready_lock = asyncio.Lock()
        self._said_down = ""  # the last reason logged for not serving

    def serving(self) -> bool:
        """The engine's word on whether a pipeline can serve; one that cannot say cannot.
        Why not is logged (once per reason), never told to the caller."""
        try:
            status = self.engine.status()
            serving, detail = bool(status["serving"]), str(status.get("detail", ""))
        except Exception as e:  # noqa: BLE001
            serving, detail = False, f"the engine's status failed: {one_line(e)}"
        if not serving and detail != self._said_down:
            log.warning("no pipeline can serve: %s", detail)
        self._said_down = "" if serving else detail
        return serving

    async def admit(self, lanes: int) -> Callable[[], None]:
        """A slot among the concurrent requests (waiting for one a short while), then
        every choice's lane at once (a request never waits holding some of them), or a
        503; returns what ends both (idempotent: each release is)."""
        if not self.serving():
            raise unavailable("no pipeline can serve right now; retry later", "unavailable")
        try:
            slot = await self.slots.hold()
        except OverCapacity:
            raise unavailable(f"this server is at its limit of "
                              f"{self.limits.max_concurrent_requests} concurrent requests; "
                              f"retry later", "server_busy") from None
        try:
            held = await self.engine.reserve(lanes)
        except BaseException:
            slot()
            raise

        def release() -> None:
            try:
                held()
            finally:
                slot()
        return release

    def health(self) -> dict:
        return {"status": "ok" if self.serving() else "degraded"}

    async def ready(self) -> bool:
        """Ready while the engine says a pipeline can serve and it answers a 1-token probe
        (no cache read or written), probed at most every READY_PROBE_INTERVAL_S."""
        if not self.serving():
            self._ready_at = 0.0
            return False
        async with self._ready_lock:
            if time.monotonic() - self._ready_at > READY_PROBE_INTERVAL_S:
                probe = GenerationRequest(self._probe_ids, 1, probe=True)
                try:  # a probe is a request too: it ends by the deadline
                    async with asyncio.timeout(self.limits.request_timeout_s):
                        async for _ in self.engine.generate(probe):
                            pass
                except Exception as e:  # noqa: BLE001
                    self._ready_at = 0.0
                    log.warning("readiness probe failed: %s", one_line(e))
                    return False
                self._ready_at = time.monotonic()
        return True

    def timed_out(self) -> ApiError:
        return timed_out(self.limits)


def request_slots(limits: GatewayLimits) -> LaneAdmission:
    """The gateway's concurrent-request slots, and as many places to wait for one."""
    n = limits.max_concurrent_requests
    return LaneAdmission(n, queue=n, wait_s=limits.queue_timeout_s)


def timed_out(limits: GatewayLimits) -> ApiError:
    # 504, not 408: 408 says the client was slow to send its request (and invites it
    # to resend at once); here the stages did not finish in time. OpenAI's clients
    # raise their InternalServerError for it, which callers already handle and the
    # clients retry with backoff, as for OpenAI's own timeouts.
    return ApiError(504, f"the request did not finish within this server's limit of "
                         f"{limits.request_timeout_s:g} s", code="timeout")

