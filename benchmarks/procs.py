"""Benchmark subprocesses: a server, worker or router started in its own process group.

`Proc` starts a command, waits for its health URL to answer 200, and on exit stops the
whole group (SIGTERM, then SIGKILL after a grace period), so a launcher's children never
outlive it and steal the next measurement's cores. Its output goes to a log file whose
tail is attached to failures.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

STOP_GRACE_S = 30.0


class ProcFailed(RuntimeError):
    """A process did not come up or died; the message carries its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, cmd: list[str], health_url: str, *, cwd: Path, env: dict[str, str] | None = None,
                 start_timeout: float = 300.0) -> None:
        self.name, self.cmd, self.health_url, self.cwd = name, cmd, health_url, cwd
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        fd, log = tempfile.mkstemp(prefix=f"sgl-bench-{name}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Proc:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if exc[0] is None:
            self.log.unlink(missing_ok=True)

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        with httpx.Client(trust_env=False, timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ProcFailed(f"{self.name}: exited with code {self.proc.returncode} while starting\n"
                                     f"{self.tail()}")
                try:
                    if c.get(self.health_url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(0.5)
        raise ProcFailed(f"{self.name}: {self.health_url} not healthy within {self.start_timeout:.0f} s\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None or (self.proc.returncode is not None and not group_alive(self.proc.pid)):
            return
        signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"  {self.name}: still running {STOP_GRACE_S:.0f} s after SIGTERM to its group; SIGKILL")
        signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last {len(text)} lines of {self.log} ---\n" + "\n".join(text)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
