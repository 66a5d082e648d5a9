"""The prefill worker's side of PD disaggregation, run on the scheduler thread.

A request with a bootstrap room runs at once as a normal prefill (it does not wait for
the decode worker's Pull: the two overlap). At its first sampled token it finishes
(`take_first_token`: the grammar mask already made that token obey) and its prompt KV
stays locked in the radix tree (`hold`), the response held back. When both the prefill
is done and the Pull for its room has arrived, whichever came second, the K/V of tokens
[prefix_len, n) is gathered into one buffer, the tree lock is dropped (the buffer is
independent of the pool), and the buffer goes out with the first token; the response is
released once the transport has handed it over (or failed).

Rooms and their ends (each ends the held response, with the KV unlocked):

    prefilling --prefill done--> ready --Pull--> sending --SendDone ok--> done (response)
         |                         |                        \\-- error --> 502 (decode gone)
         |                         +-- no Pull within the timeout --> 504
         +-- prefill failed / aborted --> its own error, and Failed to a decode that pulled
    any state: Cancel from the decode, a Pull from a newer incarnation of the decode that
    pulled it (it restarted), or an abort of the request --> dropped with an error

A Pull may arrive before its request (kept up to the timeout, then answered Failed), or
after the request already failed (answered Failed from a short memory of failed rooms).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sgl.runtime.disaggregation.kv_copy import gather, layout_of, payload_nbytes
from sgl.runtime.disaggregation.protocol import (Cancel, Failed, KVReady, KVSender, Pull, PullReceived, SendDone,
                                                 tokens_hash)
from sgl.runtime.disaggregation.stats import PDStats
from sgl.runtime.scheduler.req import Req

log = logging.getLogger("sgl.pd")


@dataclass(eq=False)
class _Room:
    room: int
    req: Req
    state: str = "prefilling"  # prefilling | ready | sending
    pull: tuple[Any, Pull] | None = None
    node: Any = None  # the locked radix node covering the prompt's KV while ready
    slots: list[int] = field(default_factory=list)
    n: int = 0  # tokens with KV: the prompt (and any grammar-forced prefix)
    ids_hash: str = ""
    first: tuple[int, float | None, Any] | None = None
    ready_at: float = 0.0
    sent: tuple[int, int] = (0, 0)  # bytes, tokens


class PrefillRole:
    mode = "prefill"

    def __init__(self, sender: KVSender, pool: Any, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sender = sender
        self.pool = pool
        self.layout = layout_of(pool)
        self.timeout = timeout
        self.clock = clock
        self.sched: Any = None
        self.rooms: dict[int, _Room] = {}
        self.early: dict[int, tuple[Any, Pull, float]] = {}  # Pulls ahead of their request
        self.failed: dict[int, tuple[str, float]] = {}  # recently failed rooms, for late Pulls
        self.incarnations: dict[str, int] = {}  # decode worker -> newest incarnation seen
        self.stats = PDStats(self.mode)
        self.fault: str | None = None  # tests: "hold_sends" keeps pulled rooms from being sent

    def attach(self, sched: Any) -> None:
        self.sched = sched

    # -- scheduler hooks ------------------------------------------------------------------
    def takes(self, req: Req) -> bool:
        """Register the request's room; it then queues for prefill as usual (False)."""
        b = req.bootstrap
        if req.params.max_new_tokens == 0:  # nothing to hand over: answered like any request
            return False
        if b.room in self.rooms:
            self.sched._finish(req, {"type": "abort", "status_code": 400, "message":
                                     f"bootstrap_room {b.room} is already in use on this prefill worker"})
            return True
        r = self.rooms[b.room] = _Room(b.room, req)
        early = self.early.pop(b.room, None)
        if early is not None:
            r.pull = (early[0], early[1])
        return False

    def take_first_token(self, req: Req, res: Any) -> bool:
        """The first sampled token ends a PD prefill (True: the scheduler finishes it)."""
        r = self.rooms.get(req.bootstrap.room)
        if r is None or r.req is not req or r.first is not None:
            return False
        r.first = (res.token_id, res.logprob, res.top_logprobs)
        if req.first_token_at is None:
            req.first_token_at = self.clock()
        req.output_ids.append(res.token_id)
        if req.return_logprob:
            req.output_logprobs.append((res.logprob if res.logprob is not None else float("nan"), res.token_id))
            req.output_top_logprobs.append(res.top_logprobs)
        req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        return True

    def hold(self, req: Req) -> bool:
        """Called as the request finishes, before its KV is released: True keeps the
        prompt's KV locked for the room and holds the response back."""
        b = req.bootstrap
        r = self.rooms.get(b.room)
        reason = req.finish_reason or {}
        if r is None or r.req is not req:  # ended before registering (bad grammar, duplicate room)
            if r is None:
                self._remember_failure(b.room, str(reason.get("message") or "the prefill request ended early"))
            return False
        if r.first is None or reason.get("type") == "abort":
            del self.rooms[b.room]
            message = str(reason.get("message") or "the prefill request ended before its first token")
            if r.pull is not None:
                self.sender.send(r.pull[0], r.room, Failed(r.room, message))
            else:
                self._remember_failure(b.room, message)
            self.stats.failure("prefill_failed")
            return False
        n = req.num_tree_tokens
        assert n == req.num_computed, "a finished PD prefill has KV outside the tree"
        self.sched.kv.tree.inc_lock_ref(req.last_node)
        r.node, r.slots, r.n = req.last_node, list(req.slots[:n]), n
        r.ids_hash = tokens_hash(req.fill_ids[:n])
        r.state, r.ready_at = "ready", self.clock()
        if r.pull is not None:
            self._send(r)
        return True

    def poll(self) -> None:
        for ev in self.sender.poll():
            if isinstance(ev, SendDone):
                self._send_done(ev)
            elif isinstance(ev.msg, Pull):
                self._pull(ev)
            elif isinstance(ev.msg, Cancel):
                self._cancel(ev.msg)
        self._expire(self.clock())

    def abort(self, rid: str) -> bool:
        for r in list(self.rooms.values()):
            if r.req.rid == rid and r.state != "prefilling":
                self._drop(r, "aborted", "aborted", None)
                return True
        return False

    def live(self) -> list[Req]:
        return []  # a held room's KV belongs to the tree (locked), not to the request

    def has_work(self) -> bool:
        return bool(self.rooms)

    def fail_all(self, message: str) -> int:
        held = [r for r in self.rooms.values() if r.state != "prefilling"]
        for r in held:
            self._drop(r, "aborted", message, None)
        return len(held)

    def snapshot(self) -> dict[str, Any]:
        pulled = sum(1 for r in self.rooms.values() if r.pull is not None)
        return {**self.stats.snapshot(len(self.rooms)), "pd_rooms_pulled": pulled}

    def close(self) -> None:
        self.sender.close()

    # -- internals ------------------------------------------------------------------------
    def _pull(self, ev: PullReceived) -> None:
        msg: Pull = ev.msg  # type: ignore[assignment]
        if not self._fresh(msg.decode_id, msg.incarnation):
            return  # from an incarnation that has since restarted: nobody waits for it
        r = self.rooms.get(msg.room)
        if r is None:
            failed = self.failed.get(msg.room)
            if failed is not None:
                self.sender.send(ev.peer, msg.room, Failed(msg.room, failed[0]))
            else:
                self.early[msg.room] = (ev.peer, msg, self.clock())
            return
        if r.pull is not None:
            self.sender.send(ev.peer, msg.room, Failed(msg.room, "room already pulled by another decode worker"))
            return
        r.pull = (ev.peer, msg)
        if r.state == "ready":
            self._send(r)

    def _cancel(self, msg: Cancel) -> None:
        if not self._fresh(msg.decode_id, msg.incarnation):
            return
        early = self.early.get(msg.room)
        if early is not None and early[1].decode_id == msg.decode_id:
            del self.early[msg.room]
        r = self.rooms.get(msg.room)
        if r is not None and r.pull is not None and r.pull[1].decode_id == msg.decode_id:
            text = f"the decode worker {msg.decode_id} gave up on room {msg.room}"
            if msg.reason:
                text += f": {msg.reason}"
            self._drop(r, "cancelled", text, 502)

    def _fresh(self, decode_id: str, incarnation: int) -> bool:
        """Note decode_id's incarnation; a newer one drops every room its old self pulled
        (a restarted decode worker will never take them). False: a stale message."""
        known = self.incarnations.get(decode_id)
        if known is not None and incarnation < known:
            return False
        if known is None or incarnation > known:
            self.incarnations[decode_id] = incarnation
            if known is not None:
                for r in list(self.rooms.values()):
                    if r.pull is not None and r.pull[1].decode_id == decode_id and r.pull[1].incarnation < incarnation:
                        self._drop(r, "decode_restarted", f"the decode worker {decode_id} restarted", 502)
                for room, (_, p, _) in list(self.early.items()):
                    if p.decode_id == decode_id and p.incarnation < incarnation:
                        del self.early[room]
        return True

    def _send(self, r: _Room) -> None:
        if self.fault == "hold_sends" or r.pull is None:
            return
        peer, pull = r.pull
        if pull.n_tokens != r.n or pull.tokens_hash != r.ids_hash or not 0 <= pull.prefix_len <= r.n:
            text = (f"room {r.room}: the decode worker has {pull.n_tokens} tokens, this prefill {r.n}, or they "
                    "differ (tokenizer or model mismatch between the workers?)")
            self.sender.send(peer, r.room, Failed(r.room, text))
            self._drop(r, "mismatch", text, 502)
            return
        started = time.time()
        try:
            buf = gather(self.pool, r.slots[pull.prefix_len : r.n])
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for a long prompt's buffer
            log.warning("room %d: reading its KV failed", r.room, exc_info=True)
            self._drop(r, "gather_failed", f"reading room {r.room}'s KV for the decode worker failed: {e}", 500)
            return
        self._unlock(r)
        tok, lp, top = r.first  # type: ignore[misc]
        msg = KVReady(r.room, pull.prefix_len, r.n, self.layout, tok, lp, top, r.req.num_cached_tokens,
                      self.sender.address, started)
        r.sent = (payload_nbytes(self.layout, r.n - pull.prefix_len), r.n - pull.prefix_len)
        r.state = "sending"
        self.sender.send(peer, r.room, msg, buf)

    def _send_done(self, ev: SendDone) -> None:
        r = self.rooms.get(ev.room)
        if r is None or r.state != "sending":
            return  # a Failed message went out, or the room was dropped meanwhile
        if not ev.ok:
            self._drop(r, "unreachable", f"could not send room {r.room} to the decode worker: {ev.error}", 502)
            return
        del self.rooms[r.room]
        self.stats.transfer(r.sent[0], r.sent[1], self.clock() - r.ready_at)
        r.req.pd_meta = {"bootstrap_room": r.room, "kv_transfer_bytes": r.sent[0],
                            "kv_transfer_tokens": r.sent[1]}
        self._respond(r.req)

    def _expire(self, now: float) -> None:
        for r in list(self.rooms.values()):
            if r.state == "ready" and r.pull is not None and self.fault is None:
                self._send(r)  # held back by a test fault that has been cleared since
            elif r.state == "ready" and r.pull is None and now - r.ready_at > self.timeout:
                self._drop(r, "timeout", f"no decode worker pulled room {r.room} within "
                           f"{self.timeout:g}s (--disaggregation-timeout)", 504)
        for room, (peer, _, t) in list(self.early.items()):
            if now - t > self.timeout:
                del self.early[room]
                self.sender.send(peer, room, Failed(room, f"this prefill worker got no request for room {room} "
                                                          f"within {self.timeout:g}s"))
                self.stats.failure("no_request")
        for room, (_, t) in list(self.failed.items()):
            if now - t > self.timeout:
                del self.failed[room]

    def _remember_failure(self, room: int, message: str) -> None:
        self.failed[room] = (message, self.clock())
        early = self.early.pop(room, None)
        if early is not None:
            self.sender.send(early[0], room, Failed(room, message))

    def _unlock(self, r: _Room) -> None:
        if r.node is not None:
            self.sched.kv.tree.dec_lock_ref(r.node)
            r.node = None

    def _drop(self, r: _Room, kind: str, message: str, status: int | None) -> None:
        """End room r with an error: unlock its KV, end its request (or its held response)."""
        self.rooms.pop(r.room, None)
        self._unlock(r)
        self.stats.failure(kind)
        reason: dict[str, Any] = {"type": "abort", "message": message}
        if status is not None:
            reason["status_code"] = status
        if r.state == "prefilling":
            if r.pull is not None:
                self.sender.send(r.pull[0], r.room, Failed(r.room, message))
            self.sched._finish(r.req, reason)  # hold() no longer finds the room
            return
        if r.state == "ready" and r.pull is not None and kind not in ("decode_restarted", "cancelled"):
            self.sender.send(r.pull[0], r.room, Failed(r.room, message))
        elif r.pull is None:  # a Pull that comes later is answered at once, not after the timeout
            self._remember_failure(r.room, message)
        r.req.finish_reason = reason
        self.sched.stats["num_aborted_total"] += 1
        self._respond(r.req)

    def _respond(self, req: Req) -> None:
        if req.on_output is not None:
            req.on_output(self.sched.out.make_output(req))
