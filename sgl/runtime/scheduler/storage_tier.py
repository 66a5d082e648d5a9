"""The storage tier (L3) as the scheduler sees it: pages written through from the host
tier and prefetched for arriving requests, each on its own background thread, so the
scheduler never waits on a disk or a network (except where the prefetch policy says so).

Writes: after a plan has stored pages into the host tier, `write_through` reads their
bytes (on the scheduler thread: the executor is idle then) and queues them; the writer
thread frames and stores them (`PageStore`). A full queue drops writes (counted).
Prefetch: when a request arrives, the reader thread looks up its prompt's pages beyond
those already in the host tier (`exists`, then `get` in batches) and appends each
verified page as it arrives. At admission `take` hands over what has arrived (the
hierarchical cache fills host pages with it and loads them); `must_wait` applies the
policy: best_effort never waits, wait_complete waits for the lookup to finish, timeout
waits at most `prefetch_timeout` seconds. When the last queued lookup finishes, the reader
calls `on_prefetch_done` (the scheduler's wake: an idle loop would otherwise sleep out its
20 ms poll before admitting the requests that waited). A failing backend answers misses,
so a request only ever loses its hit, never fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from sgl.runtime.memory.storage import PageStore, page_key
from sgl.runtime.memory.storage.codec import HEADER_SIZE

log = logging.getLogger("sgl.hicache")

GET_BATCH = 16  # pages per backend get: what has arrived is usable between batches
MAX_QUEUED_WRITES = 256  # write batches; beyond this, writes are dropped (storage is best effort)
MAX_QUEUED_WRITE_BYTES = 1 << 30  # and frames' bytes: a slow backend must not fill the RAM
MAX_PREFETCHED_BYTES = 1 << 30  # pages fetched and not yet taken, over all waiting requests
WAIT_COMPLETE_LIMIT_S = 30.0  # wait_complete still never waits longer (a hung disk or network)


@dataclass
class Prefetch:
    start: int  # first page index looked up
    keys: list[str]
    hashes: list[int]  # the keys' page hashes
    started_at: float = field(default_factory=time.monotonic)
    pages: list[memoryview] = field(default_factory=list)  # verified payloads, in order, as they arrive
    done: bool = False
    cancelled: bool = False


class StorageTier:
    def __init__(self, store: PageStore, namespace: str, page_nbytes: int, read_page: Callable[[int], memoryview],
                 prefetch_policy: str = "best_effort", prefetch_timeout: float = 1.0) -> None:
        self.store = store
        self.namespace = namespace
        self.page_nbytes = page_nbytes
        self.read_page = read_page
        self.policy = prefetch_policy
        self.timeout = prefetch_timeout
        self._prefetches: dict[int, Prefetch] = {}  # request uid -> its prefetch
        # Page hashes this process stored or queued (skip rewriting them); a failed write or a
        # lookup that finds one missing (evicted, deleted as corrupt) takes it out again, or
        # the chain would keep a hole at it for good (`exists` counts hits up to the first miss).
        self._written: set[int] = set()
        # Write batches, and clears (in order with the writes). Bounded by count in
        # write_through, not here, so that a clear always gets in.
        self._writes: queue.Queue[tuple[list[str], list[bytes], list[int]] | Future[bool] | None] = queue.Queue()
        self._reads: queue.Queue[Prefetch | None] = queue.Queue()
        self._queued_bytes = 0  # frames in the write queue
        self._held_bytes = 0  # pages in Prefetch.pages not yet taken or forgotten
        self._lock = threading.Lock()
        self.on_prefetch_done: Callable[[], None] | None = None  # thread-safe; set by the worker build
        self.stats: dict[str, float] = {
            "storage_pages_written": 0, "storage_bytes_written": 0, "storage_writes_dropped": 0,
            "storage_pages_prefetched": 0, "storage_bytes_loaded": 0, "storage_prefetch_seconds": 0.0,
        }
        self._threads = [threading.Thread(target=self._write_loop, name="sgl-hicache-writer", daemon=True),
                         threading.Thread(target=self._read_loop, name="sgl-hicache-reader", daemon=True)]
        for t in self._threads:
            t.start()

    # -- scheduler thread ------------------------------------------------------------------
    def key(self, page_hash: int) -> str:
        return page_key(self.namespace, page_hash)

    def write_through(self, stored: list[tuple[int, int]]) -> None:
        """(host page, page hash) just written to the host tier: send them on to storage."""
        with self._lock:
            todo = [(p, h) for p, h in stored if h not in self._written]
        if not todo:
            return
        keys = [self.key(h) for _, h in todo]
        hashes = [h for _, h in todo]
        # Framed here, while the host page still holds these bytes (the frame is the copy).
        frames = [self.store.frame(self.read_page(p)) for p, _ in todo]
        size = sum(len(f) for f in frames)
        with self._lock:
            room = (self._queued_bytes + size <= MAX_QUEUED_WRITE_BYTES
                    and self._writes.qsize() < MAX_QUEUED_WRITES)
            if not room:
                self.stats["storage_writes_dropped"] += len(keys)
                return
            self._queued_bytes += size
            # Marked before the writer can see the batch: a failed write unmarks it after.
            if len(self._written) > 1_000_000:
                self._written.clear()
            self._written.update(hashes)
        self._writes.put_nowait((keys, frames, hashes))

    def start_prefetch(self, uid: int, hashes: list[int], start: int) -> None:
        if start >= len(hashes):
            return
        p = Prefetch(start, [self.key(h) for h in hashes[start:]], list(hashes[start:]))
        self._prefetches[uid] = p
        self._reads.put(p)

    def must_wait(self, uid: int) -> bool:
        p = self._prefetches.get(uid)
        if p is None or p.done or self.policy == "best_effort":
            return False
        waited = time.monotonic() - p.started_at
        if self.policy == "wait_complete":
            return waited < WAIT_COMPLETE_LIMIT_S
        return waited < self.timeout

    def take(self, uid: int, from_page: int) -> list[memoryview]:
        """Pages from index `from_page` on that have arrived for request `uid` (once)."""
        p = self._prefetches.pop(uid, None)
        if p is None:
            return []
        self._cancel(p)
        if from_page < p.start:
            return []  # a page before the prefetched run is missing: the chain is broken
        return list(p.pages[from_page - p.start :])

    def forget(self, uid: int) -> None:
        p = self._prefetches.pop(uid, None)
        if p is not None:
            self._cancel(p)

    def _cancel(self, p: Prefetch) -> None:
        """The reader stops adding to `p`; its pages leave the budget (the caller may still
        hold the ones it took, as the host tier's fills)."""
        with self._lock:
            p.cancelled = True
            self._held_bytes -= sum(len(g) for g in p.pages)

    def clear(self) -> Future[bool]:
        """Drop every page of this namespace. On the writer thread, so a large store never
        holds up the scheduler, and in order with the writes queued before (those go too);
        the future ends (True) with the clear."""
        done: Future[bool] = Future()
        with self._lock:  # now, not when the clear runs: pages stored meanwhile must be written again
            self._written.clear()
        self._writes.put_nowait(done)
        return done

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.stats)
            out["storage_prefetch_bytes_held"] = self._held_bytes
            out["storage_write_queue_bytes"] = self._queued_bytes
        out["storage_backend"] = self.store.name
        try:
            out.update({f"storage_{k}": v for k, v in self.store.stats().items()})
        except Exception:  # numbers only; a failing backend must not break /get_server_info
            log.debug("storage stats failed", exc_info=True)
        return out

    def close(self) -> None:
        self._writes.put(None)
        self._reads.put(None)
        for t in self._threads:  # a thread stuck on a hung backend is a daemon: left behind
            t.join(timeout=5)
        self.store.close()

    # -- background threads ----------------------------------------------------------------
    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            if isinstance(job, Future):
                self._clear(job)
                continue
            keys, frames, hashes = job
            try:
                ok = self.store.set_framed(keys, frames)
            except Exception:
                log.warning("storage %s: write failed; going on without it", self.store.name, exc_info=True)
                ok = [False] * len(keys)
            with self._lock:
                self._queued_bytes -= sum(len(f) for f in frames)
                self._written.difference_update(h for h, k in zip(hashes, ok) if not k)
                self.stats["storage_pages_written"] += sum(ok)
                # payload bytes, as storage_bytes_loaded counts them
                self.stats["storage_bytes_written"] += sum(len(f) - HEADER_SIZE for f, k in zip(frames, ok) if k)

    def _clear(self, done: Future[bool]) -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            self.store.clear()
        except Exception as e:  # the caller hears of it; writing goes on
            done.set_exception(e)
            return
        done.set_result(True)

    def _read_loop(self) -> None:
        owed = False  # a request's lookup finished since the last wake
        while (p := self._reads.get()) is not None:
            t0 = time.perf_counter()
            try:
                self._prefetch(p)
            except Exception:
                log.warning("storage %s: prefetch failed; recomputing", self.store.name, exc_info=True)
            finally:
                p.done = True
                with self._lock:
                    self.stats["storage_prefetch_seconds"] += time.perf_counter() - t0
                # Requests that arrived together (clients whose previous requests finished in
                # one step) are woken for together, once the last of their lookups is done,
                # so they share one extend step instead of taking one each.
                owed = owed or not p.cancelled
                if owed and self.on_prefetch_done is not None and self._reads.empty():
                    owed = False
                    self.on_prefetch_done()

    def _prefetch(self, p: Prefetch) -> None:
        if p.cancelled:
            return
        n = self.store.exists(p.keys)
        if n < len(p.keys):  # missing here: the next store of this page writes it again
            with self._lock:
                self._written.discard(p.hashes[n])
        for lo in range(0, n, GET_BATCH):
            with self._lock:
                if p.cancelled or self._held_bytes >= MAX_PREFETCHED_BYTES:
                    return  # over budget: this request recomputes the rest
            got = self.store.get_prefix(p.keys[lo : min(n, lo + GET_BATCH)])
            good: list[memoryview] = []
            for g in got:
                if len(g) != self.page_nbytes:  # a page of another layout is a miss
                    break
                good.append(g)
            with self._lock:
                if p.cancelled:
                    return
                p.pages.extend(good)
                self._held_bytes += sum(len(g) for g in good)
                self.stats["storage_pages_prefetched"] += len(good)
                self.stats["storage_bytes_loaded"] += sum(len(g) for g in good)
            if len(good) < min(n, lo + GET_BATCH) - lo:
                return
