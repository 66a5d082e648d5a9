"""Server-sent events and client-disconnect handling for engine calls.

Two jobs: format SSE frames (`data: {json}\\n\\n`, ending with `data: [DONE]`), and make
sure a client that goes away aborts its engine request so its KV is freed. Streaming
responses are cancelled by Starlette when the client disconnects; `guarded_stream` turns
that cancellation into an engine abort. Non-streaming calls are raced against the ASGI
`http.disconnect` message by `await_or_disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from fastapi import Request

from sgl.server.errors import ClientDisconnected

logger = logging.getLogger("sgl.server")

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One SSE frame carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def await_or_disconnect(request: Request, aw: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await `aw`; if the client disconnects first, cancel it, call `on_disconnect`, raise.

    The body has already been read when a handler runs, so the next ASGI message is either
    nothing (the client waits) or `http.disconnect`.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        _safe(on_disconnect)
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    _safe(on_disconnect)
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


def _safe(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # an abort of a finished request may complain; nothing to do then
        logger.debug("abort callback failed", exc_info=True)


async def guarded_stream(frames: AsyncIterator[bytes], on_close: Callable[[], None],
                         closers: Iterable[AsyncIterator[Any]] = ()) -> AsyncIterator[bytes]:
    """Yield `frames`; however the stream ends (done, error, cancel), run `on_close`.

    `closers` are engine iterators to close if still open: closing one aborts its
    request in the engine. On cancellation we cannot await in `finally` (the cancel
    scope re-cancels), so closing is scheduled as a task.
    """
    try:
        async for frame in frames:
            yield frame
    finally:
        _safe(on_close)
        for it in closers:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):
                    asyncio.get_running_loop().create_task(_quiet(aclose()))


async def _quiet(aw: Awaitable[Any]) -> None:
    with contextlib.suppress(BaseException):
        await aw


_END = object()


async def merge_streams(iters: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagged with their index.

    Closing the merged iterator cancels the pumps, which closes (and so aborts) the
    engine streams underneath.
    """
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for x in it:
                await queue.put((i, x, None))
            await queue.put((i, _END, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surface the error to the consumer, in order
            await queue.put((i, _END, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iters)]
    try:
        remaining = len(tasks)
        while remaining:
            i, x, err = await queue.get()
            if err is not None:
                raise err
            if x is _END:
                remaining -= 1
                continue
            yield i, x
    finally:
        for t in tasks:
            t.cancel()
