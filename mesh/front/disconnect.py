"""A client that goes away stops its request's work at once.

Once a request's body is read, the only message its ASGI `receive()` can still bring is
`http.disconnect`. Waiting on it beside the work tells us the client left while its
choices wait for lanes, prefill or decode, and the work is cancelled there, which closes
the engine iterations and frees the lanes. A stream is watched this way until its
response starts; from then on Starlette's StreamingResponse listens for the disconnect
itself (ASGI spec before 2.4, as uvicorn speaks) and cancels the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": what the metrics count


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_client_leaves(receive: Callable[[], Awaitable[dict]],
                               work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (and has
    run its cleanup) and ClientGone is raised. `receive` must not be read elsewhere
    meanwhile: call this once the body is read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        task.cancel()  # nothing when it is done
        # a cancelled task's finally blocks (lanes, slots) have run when this returns
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass  # an empty trailing body message: keep listening
