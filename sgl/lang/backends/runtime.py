"""Runtime: launch an `sgl` HTTP server as a subprocess and talk to it (`sgl.Runtime(...)`).

Starts `python -m sgl.launch_server --model-path ... --host 127.0.0.1 --port P` with any
extra server options as `--flag value`, waits for GET /health, and exposes `.endpoint`
(a RuntimeEndpoint). Usable as a context manager; `shutdown()` stops the process.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from sgl.lang.backends.http import RuntimeEndpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli_args(server_args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in server_args.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


class Runtime:
    def __init__(self, model_path: str | None = None, port: int | None = None, launch_timeout: float = 300.0,
                 log_level: str = "error", api_key: str | None = None, **server_args: Any):
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = {"model_path": model_path, "host": "127.0.0.1", "port": self.port, "api_key": api_key,
                **server_args}
        if log_level:
            args["log_level"] = log_level
        cmd = [sys.executable, "-m", "sgl.launch_server", *_cli_args(args)]
        self.proc: subprocess.Popen | None = subprocess.Popen(cmd, start_new_session=True)
        atexit.register(self.shutdown)
        deadline = time.monotonic() + launch_timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"sgl server exited with code {code} during startup: {' '.join(cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"sgl server did not become healthy within {launch_timeout:.0f}s")
            time.sleep(0.5)
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)

    def shutdown(self) -> None:
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            endpoint.shutdown()
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        # The server was started in its own session, so its process group holds exactly
        # the server and the workers it spawned.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def get_server_info(self) -> dict:
        return self.endpoint.get_server_info()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
