"""Start the real server (`python -m sgl.launch_server`) as a subprocess for tests.

Used by the tests/test_server_*.py modules, each through one module-scoped fixture.
The server binds a free loopback port; its stderr (including the JSON access log) goes
to a file the tests can read.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    proc: subprocess.Popen
    url: str
    log_path: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM the server, wait, then kill whatever of its group is left (a test that
        checks for leftovers does so before calling this)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in group_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (zombies excluded), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def start_server(*extra: str, api_key: str | None = None, timeout: float = 300, port: int | None = None) -> ServerProc:
    """`port`: a given one (a test restarting a server where it was), else a free one."""
    port = port or free_port()
    log = tempfile.NamedTemporaryFile(prefix="sgl-server-", suffix=".log", delete=False)
    args = [sys.executable, "-m", "sgl.launch_server", "--host", "127.0.0.1", "--port", str(port), *extra]
    if api_key:
        args += ["--api-key", api_key]
    # Its own process group, so a test can signal it like a terminal would and find
    # every process it left behind (the worker processes are in it too).
    proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = ServerProc(proc, f"http://127.0.0.1:{port}", log.name, api_key)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log()[-4000:]}")
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    srv.stop()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{srv.log()[-4000:]}")
