"""The API process's handle on its workers: start them, send requests, turn their outputs
into `ReqOutput`s (detokenizing here), and notice when they die.

A reader thread receives `FromWorker` messages and calls each request's callback; between
messages it checks that every local worker process is alive. When one dies (killed, OOM,
a crash it reported), `crash_reason` says why, every request in flight ends with an abort
naming it, the remaining workers are stopped, and later calls raise in the Engine.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from sgl.runtime.config import EngineConfig
from sgl.runtime.constrained.healing import strip_healed
from sgl.runtime.ipc.messages import (Abort, Call, Crashed, Generate, Outputs, Ready, Reply, Request,
                                      decode_from_worker, encode)
from sgl.runtime.scheduler.detokenize import REPLACEMENT, DecodeState
from sgl.runtime.scheduler.req import ReqOutput
from sgl.runtime.worker.launch import describe_exit, local_ranks, start_rank, stop_all

log = logging.getLogger("sgl.engine")

POLL_MS = 250


class WorkerDiedError(RuntimeError):
    """The workers are gone; the message names the cause."""


@dataclass
class _Track:
    """One request in flight: where its outputs go, and its text so far."""

    on_output: Callable[[ReqOutput], None]
    skip_special_tokens: bool
    num_prompt_tokens: int
    ids: list[int] = field(default_factory=list)
    detok: DecodeState = field(default_factory=DecodeState)


class WorkerClient:
    def __init__(self, cfg: EngineConfig, hf_dir: str, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.crash_reason: str | None = None
        self._closing = False
        self._stopping = False  # shutdown asked the workers to exit: exits are not deaths
        self._ipc_dir = tempfile.mkdtemp(prefix="sgl-ipc-")
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(f"ipc://{self._ipc_dir}/in")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._ipc_dir}/out")
        self._send_lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        ranks = list(local_ranks(cfg))
        self.ranks = ranks
        self.procs: list[subprocess.Popen] = []
        try:
            for r in ranks:
                addrs = (f"ipc://{self._ipc_dir}/in", f"ipc://{self._ipc_dir}/out") if r == 0 else ("", "")
                self.procs.append(start_rank(cfg, hf_dir, r, os.getpid(), *addrs))
            self.ready = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read, name="sgl-engine-reader", daemon=True)
        self._reader.start()

    # -- start-up ---------------------------------------------------------------------
    def _wait_ready(self) -> Ready:
        while True:
            if self._pull.poll(POLL_MS):
                msg = decode_from_worker(self._pull.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, Crashed):
                    raise RuntimeError(f"the engine's worker failed to start: {msg.reason}")
                continue
            dead = self._dead_process()
            if dead is not None:
                raise RuntimeError(f"the engine's worker failed to start: {dead} (its log is above)")

    def _dead_process(self) -> str | None:
        for r, p in zip(self.ranks, self.procs):
            if p.poll() is not None:
                return describe_exit(r, p)
        return None

    # -- requests ---------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        with self._send_lock:
            self._push.send(encode(msg))

    def submit(self, reqs: list[Request], on_output: list[Callable[[ReqOutput], None]]) -> None:
        """Send the requests of one generate call together; outputs go to their callbacks."""
        rids = [r.rid for r in reqs]
        taken = sorted({rid for rid, k in Counter(rids).items() if k > 1 or rid in self._tracks})
        if taken:  # its outputs would go to the other caller, and the other would hang
            raise ValueError(f"rid {taken[0]!r} is already in use by a request that has not finished; "
                             "give every request its own rid")
        for r, cb in zip(reqs, on_output):
            self._tracks[r.rid] = _Track(cb, r.params.skip_special_tokens, len(r.input_ids))
        if self.crash_reason is not None:  # raced with a death: end them like the others
            for r in reqs:
                track = self._tracks.pop(r.rid, None)  # the reader thread may have ended it already
                if track is not None:
                    self._fail(track, r.rid)
            return
        self._send(Generate(reqs))

    def active_rids(self) -> list[str]:
        """The rids whose outputs are still awaited."""
        return list(self._tracks)

    def abort(self, rid: str) -> None:
        if self.crash_reason is None and not self._closing:
            self._send(Abort(rid))

    def call(self, name: str, *args: Any) -> Future:
        """Run a named control call in the worker (worker/serve.py CALLS); a Future of its value."""
        fut: Future = Future()
        if self.crash_reason is not None:
            fut.set_exception(WorkerDiedError(self.crash_reason))
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._send(Call(call_id, name, list(args)))
        return fut

    # -- reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        while not self._closing:
            try:
                if not self._pull.poll(POLL_MS):
                    dead = self._dead_process()
                    if dead is not None and self._stopping:  # killed while shutting down: stop waiting
                        for fut in list(self._calls.values()):
                            fut.set_exception(WorkerDiedError(dead))
                        self._calls.clear()
                        return
                    if dead is not None and not self._closing:
                        self._died(dead)
                        return
                    continue
                msg = decode_from_worker(self._pull.recv())
            except zmq.ZMQError:
                return  # closed under us at shutdown
            if isinstance(msg, Outputs):
                for item in msg.items:
                    self._deliver(item)
            elif isinstance(msg, Reply):
                pending = self._calls.pop(msg.call_id, None)
                if pending is not None:
                    if msg.error is None:
                        pending.set_result(msg.value)
                    else:
                        pending.set_exception(RuntimeError(msg.error))
            elif isinstance(msg, Crashed):
                self._died(f"the scheduler crashed ({msg.reason})")
                return

    def _deliver(self, item: Any) -> None:
        t = self._tracks.get(item.rid)
        if t is None:
            return
        del t.ids[item.ids_from:]
        t.ids.extend(item.ids)
        if item.text is not None:
            text = item.text
        else:
            t.detok.update(self.tokenizer, t.ids, t.skip_special_tokens)
            text = t.detok.text()
            if not item.finished:
                text = text.rstrip(REPLACEMENT)
            healed = item.meta_info.get("healed_prefix")
            if healed:
                text = strip_healed(text, healed)
        if item.finished:
            del self._tracks[item.rid]
        t.on_output(ReqOutput(item.rid, text, list(t.ids), item.finished, item.meta_info))

    def _died(self, reason: str) -> None:
        self.crash_reason = reason
        log.critical("%s; failing every request in flight", reason)
        for rid in list(self._tracks):
            track = self._tracks.pop(rid, None)
            if track is not None:
                self._fail(track, rid)
        for fut in list(self._calls.values()):
            fut.set_exception(WorkerDiedError(reason))
        self._calls.clear()
        stop_all(self.procs)  # ranks left without their peers would only wait

    def _fail(self, t: _Track, rid: str) -> None:
        meta = {"id": rid, "finish_reason": {"type": "abort", "message": f"the engine's worker died: {self.crash_reason}"},
                "prompt_tokens": t.num_prompt_tokens, "completion_tokens": len(t.ids), "cached_tokens": 0}
        t.on_output(ReqOutput(rid, self.tokenizer.decode(t.ids) if t.ids else "", list(t.ids), True, meta))

    # -- shutdown ---------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, stop every worker process, release the sockets."""
        if self._closing:
            return
        if self.crash_reason is None:
            try:
                fut = self.call("shutdown")
                self._stopping = True
                fut.result(timeout=timeout)
            except Exception:  # a wedged or dead worker must not block shutdown
                log.warning("the worker did not stop cleanly; terminating it", exc_info=True)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.close()

    def close(self) -> None:
        """Stop everything now (no waiting for in-flight work)."""
        self._closing = True
        stop_all(self.procs)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=2)  # it polls the socket we are about to close
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def alive_pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]
