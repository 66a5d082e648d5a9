"""Real PD workers and the real sglang-router in PD mode, for tests/test_pd_*.py.

`start_pd_workers` starts servers in parallel (each its own `python -m sgl.launch_server`
with `--max-total-tokens 4096` and `--enable-debug-calls`), `PDRouter` runs
sglang-router 0.3.2 (installed as tests/test_server_router_compat.py installs it) with
`--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`. `server_info`,
`worker_call` and `assert_kv_free` read a worker's state the way the tests assert it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.server_proc import ServerProc, free_port, group_pids, start_server

BASE = ("--max-total-tokens", "4096", "--enable-debug-calls")


def start_pd_workers(*specs: tuple[str, ...]) -> list[ServerProc]:
    """One server per spec (extra flags), started together; all or none."""
    with ThreadPoolExecutor(len(specs)) as ex:
        futs = [ex.submit(start_server, *BASE, *spec) for spec in specs]
        out, err = [], None
        for f in futs:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - stop the others, then raise
                err = e
    if err is not None:
        for s in out:
            s.stop()
        raise err
    return out


def prefill_flags(bport: int, *extra: str) -> tuple[str, ...]:
    return ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport), *extra)


def decode_flags(bport: int, *extra: str) -> tuple[str, ...]:
    return ("--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", str(bport), *extra)


def server_info(s: ServerProc) -> dict[str, Any]:
    r = httpx.get(s.url + "/get_server_info", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def worker_call(s: ServerProc, name: str, *args: Any) -> Any:
    r = httpx.post(s.url + "/debug/worker_call", json={"name": name, "args": list(args)}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["value"]


def assert_kv_free(s: ServerProc) -> dict[str, Any]:
    """Nothing running or held: every KV slot is free or only cached (evictable), no room
    is held, and the worker's invariant check (no slot leaked or double-owned) passes."""
    worker_call(s, "check_invariants")
    info = server_info(s)
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0, info
    assert info.get("pd_rooms_held", 0) == 0, info
    assert info["kv_used_tokens"] == info["kv_evictable_tokens"], info
    return info


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def kill_group(s: ServerProc) -> None:
    """kill -9 the server and its worker process (a crash, not a shutdown)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(s.proc.pid, signal.SIGKILL)
    s.proc.wait(timeout=30)


class PDRouter:
    """sglang-router in PD mode, in its own process group, log to a file."""

    def __init__(self, pkg_dir: str, prefill: ServerProc, bport: int | None, decode: ServerProc) -> None:
        self.port, self.prom_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.NamedTemporaryFile(prefix="sglang-router-pd-", suffix=".log", delete=False).name
        args = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", prefill.url, *([str(bport)] if bport else []), "--decode", decode.url,
                "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(self.prom_port), "--prometheus-host", "127.0.0.1"]
        env = dict(os.environ, PYTHONPATH=pkg_dir)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(self.url + "/readiness", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"router not ready in {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=15)
        for pid in group_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
