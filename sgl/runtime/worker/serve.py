"""Rank 0's side of the API <-> worker link: feed the scheduler from the API process's
messages and send its outputs back.

Two threads. The reader thread pulls `ToWorker` messages (ipc/messages.py) and puts them
in the scheduler's inbox; it also notices a vanished parent (the worker then stops). The
scheduler thread runs the loop and, after every iteration, sends what it produced: one
`Outputs` message for all the requests that emitted, and the replies to control calls.
Only that thread touches the outgoing socket. With KV events on, the same thread hands
the iteration's page events to the publisher (one batch per iteration that had any) and
closes it on the way out; the `snapshot` call reports where they are published
(`kv_events`, null when off).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from sgl.runtime.ipc.messages import (Abort, Call, Crashed, Generate, Output, Outputs, Ready, Reply,
                                      decode_to_worker, encode)
from sgl.runtime.scheduler.req import Req, ReqOutput

log = logging.getLogger("sgl.worker")

POLL_MS = 500



def _cpu_decode_steps(scheduler: Any) -> int:
    """Decode steps the C decode kernel ran (0 where it does not apply): which path served."""
    decoder = getattr(scheduler.runner, "cpu_decoder", None)
    return int(decoder.steps) if decoder is not None else 0


def _quantization(scheduler: Any) -> dict[str, Any]:
    """The decode step's weights: `quantization` (gguf or none), the model file's matrices
    per type as they run (`quantized_weights`, e.g. {"Q4_1": 210, "Q8_0": 1}) and the bytes
    of blocks held besides the bf16 weights (`quantized_weight_bytes`)."""
    decoder = getattr(scheduler.runner, "cpu_decoder", None)
    if decoder is None or decoder.quantization == "none":
        return {"quantization": "none", "quantized_weights": {}, "quantized_weight_bytes": 0}
    return {"quantization": decoder.quantization, "quantized_weights": decoder.weight_types(),
            "quantized_weight_bytes": decoder.blocks.nbytes()}


def _cpu_paths(scheduler: Any) -> dict[str, Any] | None:
    """The calibrated CPU paths (tuning/choice.py) and where each came from, or None."""
    paths = getattr(scheduler.runner, "paths", None)
    return paths.info() if paths is not None else None


def inject_fault(scheduler: Any, point: str, once: bool) -> None:
    """For fault tests: once requests are decoding, fail at `point` of the loop ("loop":
    the loop dies; "step": one step fails) or die of a segfault ("segv", on the scheduler
    thread, as a bad native kernel would)."""
    fired: list[bool] = []

    def hook(where: str) -> None:
        if not scheduler.running or (once and fired):
            return
        if point == "segv" and where == "step":
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if where == point:
            fired.append(True)
            raise RuntimeError("injected fault")

    scheduler.fault_hook = hook


# Control calls the API process may make, by name: (scheduler, *args) -> plain value.
CALLS: dict[str, Callable[..., Any]] = {
    "flush_cache": lambda s: bool(s.kv.flush()),
    # A future (the clear runs on the storage writer thread) that ends in True, or False:
    # a call may hand its work on this way, and the reply waits for it.
    "clear_hicache_storage": lambda s: s.clear_hicache_storage(),
    "snapshot": lambda s: {**s.snapshot(), "cpu_decode_steps": _cpu_decode_steps(s), **_quantization(s),
                           "cpu_paths": _cpu_paths(s)},
    "check_invariants": lambda s: s.check_invariants(),
    "inject_fault": inject_fault,
    "clear_fault": lambda s: setattr(s, "fault_hook", None),
    # PD tests: a fault of the prefill/decode role ("hold_sends": pulled rooms are never
    # sent; None clears it), and nothing else.
    "pd_fault": lambda s, name: setattr(s.pd, "fault", name) if s.pd is not None else None,
}


class Outbox:
    """Outputs and replies of one scheduler iteration, sent together by `flush`."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()  # replies may be queued from the reader thread
        self._outputs: list[Output] = []
        self._replies: list[Reply] = []
        self._sent: dict[str, tuple[int, int]] = {}  # rid -> (ids sent, the last of them)

    def output(self, out: ReqOutput) -> None:
        ids = out.output_ids
        n_sent, last = self._sent.get(out.rid, (0, -1))
        if n_sent > len(ids) or (n_sent and ids[n_sent - 1] != last):
            n_sent = 0  # the ids changed under what was sent: send them all again
        if out.finished:
            self._sent.pop(out.rid, None)
        elif ids:
            self._sent[out.rid] = (len(ids), ids[-1])
        item = Output(out.rid, n_sent, ids[n_sent:], out.finished, out.meta_info, out.text)
        with self._lock:
            self._outputs.append(item)

    def reply(self, reply: Reply) -> None:
        with self._lock:
            self._replies.append(reply)

    def flush(self) -> None:
        with self._lock:
            outputs, self._outputs = self._outputs, []
            replies, self._replies = self._replies, []
        if outputs:
            self.sock.send(encode(Outputs(outputs)))
        for r in replies:
            self.sock.send(encode(r))


class Serve:
    """Run `scheduler` for the API process at (in_addr, out_addr) until told to stop."""

    def __init__(self, scheduler: Any, in_addr: str, out_addr: str, parent_pid: int,
                 peers: Any = None) -> None:
        self.scheduler = scheduler
        self.peers = peers
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(in_addr)
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 5000)  # the last outputs and the crash reason must get out
        out.connect(out_addr)
        self.outbox = Outbox(out)
        self.stop = threading.Event()
        self.kv_events: Any = None  # kv_events/stream.KVEventStream when --kv-events-config is on

    def send_now(self, msg: Ready | Crashed) -> None:
        self.outbox.sock.send(encode(msg))

    def run(self) -> int:
        """Serve until shutdown (0) or until the scheduler loop dies (1)."""
        reader = threading.Thread(target=self._read, name="sgl-worker-reader", daemon=True)
        reader.start()
        self.scheduler.run_forever(self.stop, after_iteration=self._after_iteration)
        self.scheduler.close()  # the storage tier finishes its queued writes
        reason = self.scheduler.crash_reason
        self.close_kv_events()
        if reason is None:
            self.outbox.flush()
        else:  # the API process fails every request itself: aborts sent first would race it
            self.send_now(Crashed(reason))
        if self.peers is not None:
            self.peers.stop()
        self.stop.set()
        reader.join(timeout=2)
        self.ctx.destroy(linger=5000)
        return 1 if reason is not None else 0

    def close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def _after_iteration(self) -> None:
        if self.kv_events is not None:  # before the outputs: a router sees the pages before the reply
            self.kv_events.flush()
        self.outbox.flush()
        if self.peers is not None:  # time-gated inside; also while requests wait on a grammar
            self.peers.keepalive()

    # -- reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        while not self.stop.is_set():
            if not self.inbox.poll(POLL_MS):
                if os.getppid() != self.parent_pid:
                    log.warning("the API process (pid %d) is gone; stopping", self.parent_pid)
                    self.stop.set()
                continue
            try:
                msg = decode_to_worker(self.inbox.recv())
            except Exception:  # a malformed message is the sender's bug; keep serving
                log.exception("dropping an undecodable message")
                continue
            if isinstance(msg, Generate):
                self.scheduler.submit_many([Req(
                    rid=r.rid, input_ids=r.input_ids, params=r.params, return_logprob=r.return_logprob,
                    logprob_start_len=r.logprob_start_len, top_logprobs_num=r.top_logprobs_num,
                    stream=r.stream, bootstrap=r.bootstrap, on_output=self.outbox.output) for r in msg.reqs])
            elif isinstance(msg, Abort):
                self.scheduler.abort(msg.rid)
            elif isinstance(msg, Call):
                self._call(msg)

    def _snapshot(self) -> dict[str, Any]:
        # kv_events belongs to the worker, not the scheduler: where its pages are published.
        events = self.kv_events
        return {**CALLS["snapshot"](self.scheduler), "kv_events": None if events is None else events.info()}

    def _call(self, msg: Call) -> None:
        if msg.name == "shutdown":
            def shutdown() -> int:
                n = self.scheduler.abort_all("the engine was shut down")
                self.stop.set()
                return n
            fn: Callable[[], Any] = shutdown
        elif msg.name == "snapshot":
            fn = self._snapshot
        elif msg.name in CALLS:
            fn = lambda: CALLS[msg.name](self.scheduler, *msg.args)  # noqa: E731
        else:
            self.outbox.reply(Reply(msg.call_id, error=f"unknown call {msg.name!r}"))
            return
        fut = self.scheduler.call(fn)

        def done(f: Future) -> None:
            err = f.exception()
            if err is None and isinstance(f.result(), Future):  # work handed on to another thread
                f.result().add_done_callback(done)
                return
            self.outbox.reply(Reply(msg.call_id, None if err else f.result(),
                                    None if err is None else f"{type(err).__name__}: {err}"))
        fut.add_done_callback(done)
