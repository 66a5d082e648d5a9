"""`python -m sgl.launch_server --dp-size N`: N worker servers and a router, as one unit.

Ports: the router binds --host:--port (what clients call, as with one server); worker k
(k = 0 .. N-1) is its own `python -m sgl.launch_server` with the same engine flags on
--host:(--port + 1 + k), and gets `--data-parallel-rank k`, which puts k into its KV event
batches and adds k to its KV event ports (vLLM's rule), so one --kv-events-config serves
the whole set. The router is `python -m sgl.launch_router --worker-urls ... --policy
--router-policy` (and the workers' `--api-key`, which then guards the router too) plus any
--router-args; it starts once every worker answers /health.
SGLang's in-process data-parallel balancer has `--load-balance-method`; here the balancing
is the router's, so its flag is named like sglang-router's own launch_server (`--router-*`).

The launcher supervises: SIGINT/SIGTERM are passed to every child as SIGTERM (a terminal's
Ctrl+C also reaches them directly; two SIGINTs would make a server skip its graceful
drain), and if any child exits unasked the others are stopped and the launcher exits 1.
Children stay in the launcher's process group; the launcher is also a child subreaper, so
the engine processes of a worker that was killed are reparented to it and killed at the end:
once the launcher has exited, nothing it started is left.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from sgl.router.policies import POLICY_NAMES

log = logging.getLogger("sgl.server.replica_set")

# Seconds for every worker (model load, warm-up) and then the router to answer /health.
STARTUP_TIMEOUT_S = 900.0
# Seconds past --graceful-shutdown-timeout that children get to exit before SIGKILL.
STOP_SLACK_S = 15.0
POLL_S = 0.2
# Launcher-only flags: they never reach a worker (each gets its own --host/--port).
_OWN_FLAGS = {"--dp-size": True, "--router-policy": True, "--router-args": True, "--host": True,
              "--port": True, "--data-parallel-rank": True}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replica set (--dp-size N: N workers behind a router; ports --port, --port+1..+N)")
    g.add_argument("--dp-size", type=int, default=1,
                   help="start this many worker servers on ports --port+1 .. --port+N and a router on --port")
    g.add_argument("--router-policy", default="cache_aware", choices=POLICY_NAMES,
                   help="with --dp-size: the router's --policy")
    g.add_argument("--router-args", default="",
                   help="with --dp-size: more flags for `python -m sgl.launch_router`, as one shell-quoted string")


def worker_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` without the launcher-only flags (exact, `--flag=value` and abbreviated forms)."""
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]

    def own(token: str) -> bool:
        name = token.split("=", 1)[0]
        if name in options:
            return name in _OWN_FLAGS
        matches = [o for o in options if o.startswith(name)]  # argparse's abbreviations
        return len(matches) == 1 and matches[0] in _OWN_FLAGS

    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--") and own(tok):
            i += 1 if "=" in tok else 2  # every launcher flag takes one value
            continue
        out.append(tok)
        i += 1
    return out


def _connect_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def plan(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The commands to run (plain data): {"workers": [argv, ...], "urls": [...], "router": argv}."""
    base = worker_argv(argv, parser)
    host, n = _connect_host(args.host), args.dp_size
    urls = [f"http://{host}:{args.port + 1 + k}" for k in range(n)]
    workers = []
    for k in range(n):
        cmd = [sys.executable, "-m", "sgl.launch_server", *base, "--host", args.host, "--port", str(args.port + 1 + k)]
        if hasattr(args, "data_parallel_rank"):  # the engine knows its replica index (KV events)
            cmd += ["--data-parallel-rank", str(k)]
        workers.append(cmd)
    # The workers' --api-key guards the router too, which also sends it to the workers.
    key = ["--api-key", args.api_key] if getattr(args, "api_key", None) else []
    router = [sys.executable, "-m", "sgl.launch_router", "--host", args.host, "--port", str(args.port),
              "--policy", args.router_policy, *key, *shlex.split(args.router_args), "--worker-urls", *urls]
    return {"workers": workers, "urls": urls, "router": router}


class _Stop(Exception):
    pass


class ReplicaSet:
    def __init__(self, commands: dict[str, Any], grace_s: float):
        self.commands = commands
        self.grace_s = grace_s
        self.children: dict[str, subprocess.Popen] = {}
        self.stop_signal: int | None = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_signal is None:
            log.info("replica set: got %s, stopping every child", signal.Signals(signum).name)
        self.stop_signal = signum

    def _check(self) -> None:
        """Raise _Stop when asked to stop or when a child has exited."""
        if self.stop_signal is not None:
            raise _Stop("signal")
        for name, p in self.children.items():
            if p.poll() is not None:
                raise _Stop(f"{name} exited with {p.returncode}")

    def _wait_healthy(self, name: str, url: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise _Stop(f"{name} did not answer {url}/health within {STARTUP_TIMEOUT_S:.0f}s")

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        _become_subreaper()
        reason = "signal"
        try:
            for k, cmd in enumerate(self.commands["workers"]):
                self.children[f"worker {k}"] = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
            for k, url in enumerate(self.commands["urls"]):
                self._wait_healthy(f"worker {k}", url)
            self.children["router"] = subprocess.Popen(self.commands["router"], preexec_fn=_die_with_parent)
            router_url = f"http://{_connect_host(self._router_host())}:{self._router_port()}"
            self._wait_healthy("router", router_url)
            log.info("replica set ready: router %s in front of %s", router_url, " ".join(self.commands["urls"]))
            while True:
                self._check()
                time.sleep(POLL_S)
        except _Stop as e:
            reason = str(e)
        finally:
            self._stop_all()
        if reason == "signal":
            return 0
        log.error("replica set: %s; stopped the rest", reason)
        return 1

    def _router_host(self) -> str:
        cmd = self.commands["router"]
        return cmd[cmd.index("--host") + 1]

    def _router_port(self) -> str:
        cmd = self.commands["router"]
        return cmd[cmd.index("--port") + 1]

    def _stop_all(self) -> None:
        # The router first, so it stops taking requests for workers that are going away.
        order = sorted(self.children.items(), key=lambda kv: kv[0] != "router")
        for _, p in order:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + STOP_SLACK_S
        for name, p in order:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica set: %s did not stop in time; killing it", name)
                p.kill()
                p.wait()
        _kill_descendants()


def _prctl(option: int, arg: int) -> None:
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _die_with_parent() -> None:
    # In the child before exec: a SIGKILLed launcher still takes its children with it.
    _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _become_subreaper() -> None:
    # Orphans of our children (engine processes of a SIGKILLed worker) then become ours.
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def _kill_descendants() -> None:
    """SIGKILL and reap every live descendant of this process (from /proc)."""
    me = os.getpid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    mine, todo = set(), [me]
    while todo:
        pid = todo.pop()
        kids = [c for c, pp in parents.items() if pp == pid and c not in mine]
        mine.update(kids)
        todo += kids
    for pid in mine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in mine:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails now (as uvicorn binds: SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def run(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Run the replica set until a signal or a child's exit; the launcher's exit status."""
    if args.dp_size < 1:
        parser.error("--dp-size must be >= 1")
    # Checked before anything starts: a foreign server on a worker's port would otherwise
    # answer our health checks and be put behind the router.
    busy = [p for p in range(args.port, args.port + args.dp_size + 1) if port_in_use(args.host, p)]
    if busy:
        parser.error(f"--dp-size {args.dp_size} --port {args.port} needs ports {args.port}..{args.port + args.dp_size} "
                     f"free on {args.host} (router, then one per worker); in use: {', '.join(map(str, busy))}")
    commands = plan(args, argv, parser)
    log.info("replica set: %d workers on %s, router on %s:%d (policy %s)", args.dp_size,
             " ".join(commands["urls"]), args.host, args.port, args.router_policy)
    return ReplicaSet(commands, grace_s=args.graceful_shutdown_timeout).run()
