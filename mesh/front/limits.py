"""What one gateway admits, and where it listens by default: the limits and the port
`skippy serve` takes as flags.

Kept apart from the gateway so that the command line can show the defaults without
importing the HTTP stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from skippy.topology.errors import UserError

DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_CONCURRENT_REQUESTS = 256
DEFAULT_MAX_REQUEST_TOKENS = 65536  # n x max_tokens, summed over a request's choices
DEFAULT_QUEUE_TIMEOUT_S = 10.0      # how long a request waits for a slot before a 503
DEFAULT_REQUEST_TIMEOUT_S = 600.0   # arrival to last byte; OpenAI's clients wait as long
DEFAULT_READ_TIMEOUT_S = 30.0       # a connection's headers and body, however slow they come
DEFAULT_MAX_CONNECTIONS = 4096      # open at once; beyond, a 503 at once
DEFAULT_BODY_BYTES_PER_S = 8 * 2**20  # a caller's request bodies a second (body_budget.py)


@dataclass(frozen=True)
class GatewayLimits:
    """Beyond max_concurrent_requests running, as many again wait up to queue_timeout_s
    for a slot; the rest get a 503 with Retry-After. A request's choices may ask for at
    most max_request_tokens new tokens together (a 400 beyond). Every request ends within
    request_timeout_s of its arrival (a 504, or an error event in a stream), so no
    request holds lanes without end. Before that, a connection has read_timeout_s to send
    a request's headers and body, and at most max_connections are open
    (mesh/front/connections.py); a caller sends at most body_bytes_per_s of request
    bodies a second, in bursts of twice max_body_bytes (a 429 beyond)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    body_bytes_per_s: int = DEFAULT_BODY_BYTES_PER_S

    def __post_init__(self):
        for name in ("max_body_bytes", "max_concurrent_requests", "max_request_tokens",
                     "max_connections", "body_bytes_per_s"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not 0 <= self.queue_timeout_s < math.inf:
            raise UserError(f"the queue timeout must be >= 0 seconds and finite, not "
                            f"{self.queue_timeout_s}")
        for what, value in (("request", self.request_timeout_s),
                            ("read", self.read_timeout_s)):
            if not 0 < value < math.inf:
                raise UserError(f"the {what} timeout must be > 0 seconds and finite, not "
                                f"{value}")
