"""Start the router (`python -m sgl.launch_router`) as a subprocess for tests.

Like tests/server_proc.py: a free loopback port, its own process group (cleaned by group
on stop), output in a log file. Ready when /workers answers (the router's /health is 503
until a worker is healthy, which some tests want).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import httpx

from tests.server_proc import REPO, ServerProc, free_port


def start_router(*args: str, api_key: str | None = None, timeout: float = 60) -> ServerProc:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="sgl-router-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "sgl.launch_router", "--host", "127.0.0.1", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = ServerProc(proc, f"http://127.0.0.1:{port}", log.name, api_key)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{srv.log()[-4000:]}")
        try:
            if httpx.get(srv.url + "/workers", headers=srv.headers(), timeout=2).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    srv.stop()
    raise RuntimeError(f"router did not start in {timeout}s:\n{srv.log()[-4000:]}")
