"""Starting the worker processes of this machine: the ranks it hosts, each a fresh
interpreter (`python -m sgl.runtime.worker.process`, spawn semantics without re-running
the caller's `__main__`), and where they meet.

Node n of `nnodes` hosts ranks [n*k, (n+1)*k), k = tp_size / nnodes. Node 0's API
process starts its ranks itself (client.py); `run_node` is what `launch_server` runs on
the other nodes: start the ranks, wait, and stop them all when one fails or on SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from sgl.runtime.config import EngineConfig
from sgl.runtime.ipc.messages import WorkerSpec, encode_spec
from sgl.runtime.worker.process import init_method

log = logging.getLogger("sgl.worker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_dist_addr(cfg: EngineConfig) -> EngineConfig:
    """One machine and no address given: a free loopback port for the ranks to meet."""
    if cfg.tp_size > 1 and not cfg.dist_init_addr:
        from dataclasses import replace

        return replace(cfg, dist_init_addr=f"127.0.0.1:{free_port()}")
    return cfg


def local_ranks(cfg: EngineConfig) -> range:
    k = cfg.tp_size // cfg.nnodes
    return range(cfg.node_rank * k, (cfg.node_rank + 1) * k)


def start_rank(cfg: EngineConfig, hf_dir: str, rank: int, parent_pid: int, in_addr: str = "",
               out_addr: str = "") -> subprocess.Popen:
    spec = WorkerSpec(config=asdict(cfg), hf_dir=hf_dir, rank=rank,
                      dist_init_method=init_method(cfg) if cfg.tp_size > 1 else "",
                      in_addr=in_addr, out_addr=out_addr, parent_pid=parent_pid,
                      log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    return subprocess.Popen([sys.executable, "-m", "sgl.runtime.worker.process", encode_spec(spec)])


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Kill what is still running (workers ignore SIGTERM: see process.py) and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def describe_exit(rank: int, p: subprocess.Popen) -> str:
    code = p.returncode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    return f"worker rank {rank} (pid {p.pid}) died ({how})"


def run_node(cfg: EngineConfig, hf_dir: str) -> int:
    """Host this node's ranks (not node 0) until they end; the worst exit code wins."""
    import os

    procs = [start_rank(cfg, hf_dir, r, os.getpid()) for r in local_ranks(cfg)]
    log.info("node %d: ranks %s started (pids %s)", cfg.node_rank, list(local_ranks(cfg)), [p.pid for p in procs])
    stopping: list[Any] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    while not stopping and all(p.poll() is None for p in procs):
        time.sleep(0.5)
    failed = [describe_exit(r, p) for r, p in zip(local_ranks(cfg), procs) if p.poll() not in (None, 0)]
    for line in failed:
        log.error("%s", line)
    stop_all(procs)
    return 1 if failed else 0
