"""HTTP helpers for the hierarchical-cache tests over real servers: token-id prompts,
greedy /generate, /get_server_info, /flush_cache, and polling a condition."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx

from tests.server_proc import ServerProc

PAGE = 16
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def generate(srv: ServerProc, ids: list[int], max_new: int = 8) -> dict[str, Any]:
    r = httpx.post(srv.url + "/generate", json={"input_ids": ids, "sampling_params": {**GREEDY,
                   "max_new_tokens": max_new}}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def info(srv: ServerProc) -> dict[str, Any]:
    return httpx.get(srv.url + "/get_server_info", timeout=60).json()


def wait_for(what: str, cond: Any, timeout: float = 60.0, poke: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if poke is not None:
            poke()
        time.sleep(0.3)


def flush(srv: ServerProc) -> None:
    assert httpx.post(srv.url + "/flush_cache", timeout=60).status_code == 200


def written(srv: ServerProc, pages: int) -> bool:
    """The storage tier has written at least `pages` pages (writes are in the background)."""
    return info(srv).get("storage_pages_written", 0) >= pages
