"""`python -m sgl.launch_server --dp-size N` (sgl/server/replica_set.py): N workers and a router.

End to end with real processes: a replica set of two workers (small KV pools) behind the
router answers /generate and chat on --port, each worker on its documented port serves part
of the traffic, and SIGTERM to the launcher leaves no process of its group. A child that
dies takes the set down with a non-zero exit; ports in use are refused before anything starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from argparse import Namespace

import httpx
import pytest

from sgl.launch_server import build_parser
from sgl.server.replica_set import plan, worker_argv
from tests.server_proc import REPO, group_pids

pytestmark = pytest.mark.server


def test_worker_argv_drops_launcher_flags_in_every_spelling():
    parser = build_parser()
    argv = ["--dp-size", "2", "--max-total-tokens", "4096", "--port=31000", "--host", "0.0.0.0",
            "--router-policy", "kv_aware", "--router-args=--prometheus-port 9100", "--disable-radix-cache",
            "--dp", "3"]  # argparse accepts unique prefixes, so must we
    assert worker_argv(argv, parser) == ["--max-total-tokens", "4096", "--disable-radix-cache"]


def test_plan_ports_ranks_and_router_command():
    parser = build_parser()
    argv = ["--dp-size", "3", "--port", "40000", "--host", "0.0.0.0", "--max-total-tokens", "4096",
            "--router-args", "--prometheus-port 9100 --cache-threshold 0.3"]
    args = parser.parse_args(argv)
    p = plan(args, argv, parser)
    assert p["urls"] == ["http://127.0.0.1:40001", "http://127.0.0.1:40002", "http://127.0.0.1:40003"]
    for k, cmd in enumerate(p["workers"]):
        assert cmd[1:3] == ["-m", "sgl.launch_server"]
        assert "--dp-size" not in cmd and "--router-args" not in cmd
        assert cmd[cmd.index("--port") + 1] == str(40001 + k) and cmd[cmd.index("--host") + 1] == "0.0.0.0"
        assert cmd[cmd.index("--max-total-tokens") + 1] == "4096"
    assert p["router"][1:3] == ["-m", "sgl.launch_router"]
    r = p["router"]
    assert r[r.index("--port") + 1] == "40000" and r[r.index("--policy") + 1] == "cache_aware"
    assert r[r.index("--prometheus-port") + 1] == "9100" and r[r.index("--worker-urls") + 1:] == p["urls"]
    # each worker is told its replica index when the engine has the option (KV event ports, batches)
    ranked = plan(Namespace(**{**vars(args), "data_parallel_rank": None}), argv, parser)
    assert [cmd[cmd.index("--data-parallel-rank") + 1] for cmd in ranked["workers"]] == ["0", "1", "2"]
    assert "--api-key" not in r


def test_api_key_guards_the_router_too_and_policy_is_checked(capsys):
    parser = build_parser()
    argv = ["--dp-size", "2", "--port", "40000", "--api-key", "sekrit"]
    p = plan(parser.parse_args(argv), argv, parser)
    r = p["router"]
    assert r[r.index("--api-key") + 1] == "sekrit"  # the router is not left open, and authenticates to workers
    assert all(cmd[cmd.index("--api-key") + 1] == "sekrit" for cmd in p["workers"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--dp-size", "2", "--router-policy", "fastest"])
    assert "--router-policy" in capsys.readouterr().err


def _free_run(n: int) -> int:
    """A base port with n consecutive free ports on loopback."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def _launch(*extra: str, port: int) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile(prefix="sgl-dp-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "sgl.launch_server", "--host", "127.0.0.1", "--port", str(port), *extra]
    # its own process group, so the test can find everything it started
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    return proc, log.name


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _wait_gone(proc: subprocess.Popen, timeout: float) -> int:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the launcher has reaped its children; give killed grandchildren a moment to be reaped
    for _ in range(100):
        if not group_pids(proc.pid):
            break
        time.sleep(0.1)
    return rc


def _cleanup(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    for pid in group_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def replica_set():
    port = _free_run(3)
    proc, log = _launch("--dp-size", "2", "--max-total-tokens", "4096", "--router-policy", "round_robin",
                        port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"launcher exited with {proc.returncode}:\n{_read(log)[-4000:]}")
            if "replica set ready" in _read(log):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"replica set not ready in 600s:\n{_read(log)[-4000:]}")
        yield proc, url, port, log
    finally:
        _cleanup(proc)


def _generation_tokens(worker_url: str) -> float:
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    m = re.search(r"^sgl_generation_tokens_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_router_on_port_and_workers_on_the_next_ports_share_the_work(replica_set):
    _, url, port, _ = replica_set
    workers = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    before = [_generation_tokens(w) for w in workers]
    for i in range(4):  # round robin: two requests per worker
        r = httpx.post(url + "/generate", json={"text": f"Count to {i}:",
                                                "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
    after = [_generation_tokens(w) for w in workers]
    assert [a - b for a, b in zip(after, before)] == [8.0, 8.0]
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    chat = httpx.post(url + "/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.slow
def test_ports_in_use_are_refused_before_anything_starts(replica_set):
    _, _, port, _ = replica_set  # its ports are taken now
    proc, log = _launch("--dp-size", "2", port=port)
    try:
        assert _wait_gone(proc, 60) == 2
    finally:
        _cleanup(proc)
    out = _read(log)
    assert f"in use: {port}, {port + 1}, {port + 2}" in out
    assert "starting engine" not in out


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_process_of_the_group(replica_set):
    proc, url, _, log = replica_set
    assert len(group_pids(proc.pid)) >= 6  # launcher, router, 2 servers, their 2 engine processes
    proc.send_signal(signal.SIGTERM)
    assert _wait_gone(proc, 120) == 0, _read(log)[-4000:]
    assert group_pids(proc.pid) == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


@pytest.mark.slow
def test_a_worker_that_dies_takes_the_set_down_with_a_non_zero_exit():
    port = _free_run(3)
    proc, log = _launch("--dp-size", "2", "--model-path", "/nonexistent/model.gguf", port=port)
    try:
        assert _wait_gone(proc, 300) == 1, _read(log)[-4000:]
        assert group_pids(proc.pid) == []
    finally:
        _cleanup(proc)
    out = _read(log)
    assert re.search(r"replica set: worker \d exited with \d+; stopped the rest", out), out[-4000:]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


@pytest.mark.slow
def test_a_worker_killed_while_serving_takes_the_set_down_and_its_engine_processes_with_it():
    port = _free_run(3)
    proc, log = _launch("--dp-size", "2", "--max-total-tokens", "4096", port=port)
    try:
        deadline = time.time() + 600
        while "replica set ready" not in _read(log):
            assert proc.poll() is None and time.time() < deadline, _read(log)[-4000:]
            time.sleep(0.5)
        (victim,) = [p for p in group_pids(proc.pid)
                     if _cmdline(p)[1:3] == ["-m", "sgl.launch_server"] and str(port + 2) in _cmdline(p)]
        os.kill(victim, signal.SIGKILL)  # its engine process is orphaned: the launcher must reap it
        assert _wait_gone(proc, 120) == 1, _read(log)[-4000:]
        assert group_pids(proc.pid) == []
    finally:
        _cleanup(proc)
    assert "worker 1 exited with -9; stopped the rest" in _read(log)
