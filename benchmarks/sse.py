"""Streamed responses for the benchmarks: one reader of `data:` frames, so every
benchmark treats an HTTP error, an SSE error event and the `[DONE]` marker alike."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


class StreamFailed(Exception):
    """The request failed: a non-200 answer or an SSE error event (the message says which)."""


async def sse_frames(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST `body` with streaming and yield each JSON frame until `[DONE]`."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise StreamFailed(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            frame = json.loads(line[5:])
            if "error" in frame:
                raise StreamFailed(str(frame["error"])[:200])
            yield frame
