"""The decode worker's side of PD disaggregation, run on the scheduler thread.

A request with a bootstrap room never enters a prefill batch. It waits for its KV:

    queued --slots reserved, Pull sent--> pulling --KVReady--> running (a normal decode)
       \\________________________________/    \\--Failed / mismatch / prefill lost--> 502
                 deadline (arrival + --disaggregation-timeout) --> 504, Cancel sent

Admission (`_admit`, FIFO, before each step's batch is chosen): match the decode's own
radix tree (L tokens, locked; a second chat turn finds turn one's prompt and answer
there), reserve slots for tokens [L, n) and a request->token row under the same KV
budget a prefill would need, then Pull tokens [L, n) of the room. On KVReady the payload
is written into those slots on this thread (so no forward pass can read them half
written, and a late payload for a room given up never lands in reused slots), the tokens
go into the tree like a finished prefill, and the prefill's first token is appended as
the first output, which advances this worker's grammar matcher and runs jump-forward
exactly as on a colocated worker. The request then decodes like any other; if it is
later retracted it is recomputed locally (its bootstrap is cleared).

On failure the slots it reserved are freed without entering the tree (they hold no
valid KV), the prefix is unlocked, and the request ends with an abort carrying an HTTP
status (5xx, so a router retries).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from sgl.runtime.disaggregation.kv_copy import layout_of, payload_nbytes, scatter
from sgl.runtime.disaggregation.protocol import (Bootstrap, Cancel, Failed, KVReady, KVReceiver, PeerLost, Pull,
                                                 Received, tokens_hash)
from sgl.runtime.disaggregation.stats import PDStats
from sgl.runtime.scheduler.req import Req

log = logging.getLogger("sgl.pd")


@dataclass(eq=False)
class _Wait:
    req: Req
    boot: Bootstrap
    deadline: float
    state: str = "queued"  # queued | pulling
    prefix_len: int = 0  # L: tokens this worker had cached
    n: int = 0  # tokens whose KV the request needs
    pulled_at: float = 0.0


class DecodeRole:
    mode = "decode"

    def __init__(self, receiver: KVReceiver, pool: Any, timeout: float, decode_id: str, incarnation: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.receiver = receiver
        self.pool = pool
        self.layout = layout_of(pool)
        self.timeout = timeout
        self.decode_id = decode_id
        self.incarnation = incarnation
        self.clock = clock
        self.sched: Any = None
        self.waits: dict[int, _Wait] = {}  # room -> request waiting for its KV (arrival order)
        self.stats = PDStats(self.mode)
        self.fault: str | None = None

    def attach(self, sched: Any) -> None:
        self.sched = sched

    # -- scheduler hooks ------------------------------------------------------------------
    def takes(self, req: Req) -> bool:
        b = req.bootstrap
        if req.params.max_new_tokens == 0:  # nothing to decode: runs here like any request
            return False
        if b.room in self.waits:
            self.sched._finish(req, {"type": "abort", "status_code": 400, "message":
                                     f"bootstrap_room {b.room} is already in use on this decode worker"})
            return True
        self.waits[b.room] = _Wait(req, b, self.clock() + self.timeout)
        return True

    def take_first_token(self, req: Req, res: Any) -> bool:
        return False

    def hold(self, req: Req) -> bool:
        return False

    def poll(self) -> None:
        now = self.clock()
        self._admit(now)
        for ev in self.receiver.poll():
            if isinstance(ev, PeerLost):
                self._lost(ev.addr, ev.at)
            else:
                self._received(ev, now)
        for w in list(self.waits.values()):
            if now > w.deadline:
                what = "the KV transfer" if w.state == "pulling" else "room for the KV"
                self._fail(w, "timeout", f"waited {self.timeout:g}s for {what} of room {w.boot.room} from the "
                           f"prefill worker {w.boot.addr} (--disaggregation-timeout)", 504)

    def abort(self, rid: str) -> bool:
        for w in list(self.waits.values()):
            if w.req.rid == rid:
                self._fail(w, "aborted", "aborted", None)
                return True
        return False

    def live(self) -> list[Req]:
        return [w.req for w in self.waits.values() if w.state == "pulling"]

    def has_work(self) -> bool:
        return bool(self.waits)

    def fail_all(self, message: str) -> int:
        waits = list(self.waits.values())
        for w in waits:
            self._fail(w, "aborted", message, None)
        return len(waits)

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot(len(self.waits))

    def close(self) -> None:
        self.receiver.close()

    # -- internals ------------------------------------------------------------------------
    def _admit(self, now: float) -> None:
        s = self.sched
        kv = s.kv
        pulling = sum(1 for w in self.waits.values() if w.state == "pulling")
        for w in list(self.waits.values()):
            if w.state != "queued":
                continue
            if len(s.running) + len(s.prefilling) + pulling >= s.cfg.max_running_requests:
                return
            req = w.req
            n = req.fill_len
            cached = kv.match_and_lock(req, n)
            need = n - cached
            busy = bool(s.running or s.prefilling or pulling)
            slots = None
            if kv.available() >= need + s._limits().decode_reserve or not busy:
                slots = kv.alloc(need)
            if slots is None or not kv.attach_row(req):
                if slots is not None:
                    kv.allocator.free(slots)
                kv.tree.dec_lock_ref(req.last_node)
                req.last_node, req.slots, req.num_tree_tokens = None, [], 0
                return  # FIFO: later requests wait behind this one
            kv.extend(req, slots)
            w.state, w.prefix_len, w.n, w.pulled_at = "pulling", cached, n, now
            pulling += 1
            self.receiver.pull((w.boot.host, w.boot.port), Pull(
                w.boot.room, cached, n, tokens_hash(req.fill_ids[:n]), self.decode_id, self.incarnation))

    def _lost(self, addr: tuple[str, int], at: float) -> None:
        for w in list(self.waits.values()):
            if w.state == "pulling" and (w.boot.host, w.boot.port) == addr and w.pulled_at <= at:
                self._fail(w, "prefill_lost", f"lost the connection to the prefill worker {w.boot.addr} while "
                           f"waiting for room {w.boot.room} (the prefill worker died or restarted)", 502,
                           cancel=False)

    def _received(self, ev: Received, now: float) -> None:
        msg = ev.msg
        w = self.waits.get(msg.room)
        if w is None or w.state != "pulling":
            return  # given up on already (timeout, abort): its slots may be someone else's now
        if isinstance(msg, Failed):
            self._fail(w, "prefill_failed", f"the prefill worker {w.boot.addr} failed room {msg.room}: "
                       f"{msg.reason}", 502, cancel=False)
            return
        assert isinstance(msg, KVReady)
        nbytes = payload_nbytes(self.layout, w.n - w.prefix_len)
        if (msg.prefix_len, msg.n_tokens, msg.layout) != (w.prefix_len, w.n, self.layout) or (
                ev.payload is not None and len(ev.payload) != nbytes):
            self._fail(w, "mismatch", f"the prefill worker {w.boot.addr} sent room {msg.room} in another shape "
                       f"(tokens [{msg.prefix_len}, {msg.n_tokens}) of {msg.layout}; expected [{w.prefix_len}, "
                       f"{w.n}) of {self.layout})", 502)
            return
        req, s = w.req, self.sched
        if ev.payload is not None:
            try:
                scatter(self.pool, req.slots[w.prefix_len : w.n], ev.payload, self.layout)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory staging a long prompt
                log.warning("room %d: writing the received KV failed", msg.room, exc_info=True)
                self._fail(w, "copy_failed", f"writing room {msg.room}'s KV into the pool failed: {e}", 500,
                           cancel=False)
                return
        del self.waits[msg.room]
        copy_ms = max(0.0, time.time() - msg.gather_started) * 1000 if msg.gather_started else None
        s.kv.cache_unfinished(req)
        req.input_logprobs_done = True  # prompt logprobs are the prefill's (the router merges them)
        req.num_cached_tokens = msg.cached_tokens
        req.admitted_once = True
        elapsed = now - w.pulled_at
        self.stats.transfer(nbytes, w.n - w.prefix_len, elapsed)
        req.pd_meta = {"prefill_worker": msg.prefill_worker, "bootstrap_room": msg.room,
                       "kv_transfer_ms": round(elapsed * 1000, 3), "kv_copy_ms": copy_ms and round(copy_ms, 3),
                       "kv_transfer_bytes": nbytes,
                       "kv_transfer_tokens": w.n - w.prefix_len, "decode_cached_tokens": w.prefix_len}
        req.bootstrap = None  # from here on an ordinary request (a retraction recomputes locally)
        s.running.append(req)
        s.out.append_token(req, msg.first_token, msg.first_logprob, msg.first_top_logprobs)
        if req.finished:
            s._finish(req, req.finish_reason)
        elif req.stream and req.on_output is not None:
            req.on_output(s.out.make_output(req))

    def _fail(self, w: _Wait, kind: str, message: str, status: int | None, cancel: bool = True) -> None:
        self.waits.pop(w.boot.room, None)
        req = w.req
        if w.state == "pulling":
            kv = self.sched.kv
            kv.allocator.free(req.slots[req.num_tree_tokens :])  # never valid KV: not for the tree
            del req.slots[req.num_tree_tokens :]
            if cancel:
                self.receiver.cancel((w.boot.host, w.boot.port),
                                     Cancel(w.boot.room, self.decode_id, self.incarnation, kind))
        self.stats.failure(kind)
        reason: dict[str, Any] = {"type": "abort", "message": message}
        if status is not None:
            reason["status_code"] = status
        self.sched._finish(req, reason)
