"""Prefill/decode disaggregation (`--disaggregation-mode prefill|decode`).

protocol.py is the seam (messages, the KVSender / KVReceiver transports), tcp.py the
ZMQ transport, rooms.py the rule giving every sample its bootstrap room, kv_copy.py the
pool <-> buffer copies, prefill.py / decode.py the per-role room bookkeeping the
scheduler drives, stats.py the counters. The scheduler holds one role object (or none on
a colocated worker) and calls it at a few points of its loop:

    takes(req)              a request with a bootstrap room is about to queue for prefill;
                            True: the role took it (decode: it waits for its KV instead)
    take_first_token(req, res)  a PD prefill sampled its first token: True ends it
    hold(req)               the request is finishing, KV not released yet: True keeps
                            it locked and holds its response back (prefill)
    poll()                  once per iteration: transport events, admissions, timeouts
    abort(rid), fail_all(message), live(), has_work(), snapshot(), close()
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def default_worker_id(mode: str, host: str | None, port: int | None) -> str:
    """This worker's name to its PD peers when --disaggregation-worker-id is not given. A
    prefill binds its bootstrap socket on the HOST part, so it is the server's --host. A
    decode's id is only a name, and prefills take a known name with a newer incarnation for
    a restart of that worker: decodes on several machines all listening on 0.0.0.0:30000
    (or engines in containers with one PID) must not share one, so the machine's hostname
    stands in for a wildcard or loopback host (a restarted pod keeps its hostname)."""
    if mode == "prefill":
        return f"{host or '127.0.0.1'}:{port if port is not None else 'pid' + str(os.getpid())}"
    name = host if host not in _WILDCARDS and host not in ("127.0.0.1", "localhost", None) else socket.gethostname()
    return f"{name}:{port if port is not None else 'pid' + str(os.getpid())}"


def idle_close_s(timeout: float) -> float:
    """How long a decode's connection to a prefill may sit idle before it is closed: past
    every room's deadline (`timeout` from arrival; each pull is sent after arrival)."""
    return timeout + 60.0


def build_role(cfg: Any, pool: Any, wake: Any) -> Any:
    """The role for cfg.disaggregation_mode over `pool` (None when "null"); `wake()`
    nudges the scheduler loop when the transport has news."""
    mode = cfg.disaggregation_mode
    if mode == "null":
        return None
    worker_id = cfg.disaggregation_worker_id or default_worker_id(mode, None, None)
    host = worker_id.rpartition(":")[0] or "127.0.0.1"
    if mode == "prefill":
        from sgl.runtime.disaggregation.prefill import PrefillRole
        from sgl.runtime.disaggregation.tcp import TcpKVSender

        return PrefillRole(TcpKVSender(host, cfg.disaggregation_bootstrap_port, wake), pool,
                           cfg.disaggregation_timeout)
    from sgl.runtime.disaggregation.decode import DecodeRole
    from sgl.runtime.disaggregation.tcp import TcpKVReceiver

    incarnation = time.time_ns()
    receiver = TcpKVReceiver(worker_id, incarnation, wake, idle_close_s=idle_close_s(cfg.disaggregation_timeout))
    return DecodeRole(receiver, pool, cfg.disaggregation_timeout, worker_id, incarnation)
