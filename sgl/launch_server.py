"""`python -m sgl.launch_server`: start the HTTP server (SGLang's flag names).

Engine flags (--model-path, --dtype, --max-total-tokens, --schedule-policy,
--disable-radix-cache, --chunked-prefill-size, --max-running-requests,
--attention-backend, --disable-jump-forward, --random-seed, --context-length, ...) and
process-wide settings (--regex-backend, --disable-cpu-ops, --no-grammar-disk-cache, ...)
are generated from `sgl.runtime.config`; a setting given here is exported as its
environment variable, so every module of this process reads it through `settings()`.
Server flags are --host, --port, --api-key, --served-model-name, --log-level. Without
--model-path the embedded SmolLM2-135M-Instruct is served. `--dp-size N` starts N such
servers on --port+1 .. --port+N and a router on --port (sgl/server/replica_set.py).
SIGINT/SIGTERM stop accepting connections, let in-flight requests finish for
--graceful-shutdown-timeout seconds, abort the rest, then stop the engine and its worker
processes. If a worker dies, in-flight requests fail with
its cause, /health answers 503, and the server exits non-zero after a few seconds.
Multi-node: `--nnodes N --node-rank K --dist-init-addr HOST:PORT` on every machine;
node 0 serves HTTP, the others only host their tensor-parallel ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from typing import Any

from sgl.runtime.config import EngineConfig, Settings, add_cli_args, export, given
from sgl.server import replica_set


# Seconds a server whose worker died keeps answering 503 before it exits.
WORKER_DEATH_GRACE_S = 5.0


class _JsonAccessFormatter(logging.Formatter):
    # Access lines are already JSON; everything else keeps a plain readable format.
    def format(self, record: logging.LogRecord) -> str:
        if record.name == "sgl.server.access":
            return record.getMessage()
        return super().format(record)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl.launch_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=30000, help="port to bind")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' (all paths but /health)")
    p.add_argument("--served-model-name", default=None,
                   help="model id in the OpenAI API and metrics (default: a short name from the model path, "
                        "e.g. SmolLM2-135M-Instruct for SmolLM2-135M-Instruct.Q4_1.gguf)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before being aborted")
    p.add_argument("--no-access-log", action="store_true", help="do not log one JSON line per request")
    add_cli_args(p)
    replica_set.add_cli_args(p)
    return p


def setup_logging(level: str, access_log: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonAccessFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("sgl.server.access").setLevel(logging.INFO if access_log else logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    kwargs, process_wide = given(args, EngineConfig), given(args, Settings)
    export(process_wide)  # the flag wins over its variable in the whole process
    try:  # bad SGL_* variables or option values: a usage error, before the model loads
        EngineConfig.from_kwargs(**kwargs)
    except ValueError as e:
        parser.error(str(e))
    setup_logging(args.log_level, not args.no_access_log)
    if args.dp_size != 1:  # N workers and a router, each its own process (sgl/server/replica_set.py)
        sys.exit(replica_set.run(args, sys.argv[1:] if argv is None else argv, parser))
    cfg = EngineConfig.from_kwargs(**kwargs)
    if cfg.disaggregation_mode != "null" and not cfg.disaggregation_worker_id:
        from sgl.runtime.disaggregation import default_worker_id  # how PD peers name this worker

        kwargs["disaggregation_worker_id"] = default_worker_id(cfg.disaggregation_mode, args.host, args.port)
        cfg = EngineConfig.from_kwargs(**kwargs)
    if cfg.node_rank != 0:  # this machine only hosts ranks; node 0 serves HTTP
        sys.exit(run_worker_node(cfg))
    import uvicorn

    from sgl.runtime.engine import Engine
    from sgl.server.app import create_app

    log = logging.getLogger("sgl.server")
    log.info("starting engine with %s", json.dumps({**process_wide, **kwargs}))
    engine = Engine(**kwargs)
    app = create_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                     server_args={"host": args.host, "port": args.port, **process_wide, **kwargs})
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=int(args.graceful_shutdown_timeout), log_config=None)
    server = uvicorn.Server(config)
    log.info("serving %s on http://%s:%d", app.state.served_model_name, args.host, args.port)
    died: list[str] = []
    threading.Thread(target=_exit_when_workers_die, args=(engine, server, died), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
    if died:  # non-zero, so a supervisor (systemd, Kubernetes) restarts the server
        log.critical("exiting because the engine's worker died: %s", died[0])
        sys.exit(1)


def _exit_when_workers_die(engine: Any, server: Any, died: list[str]) -> None:
    """Once a worker is dead, keep answering (/health 503, in-flight requests get their
    errors) for WORKER_DEATH_GRACE_S, so probes and routers see it; then stop the server."""
    while not server.should_exit:
        try:
            engine.check_alive()
        except Exception as e:  # noqa: BLE001 - any death reason ends the server
            died.append(str(e))
            time.sleep(WORKER_DEATH_GRACE_S)
            server.should_exit = True
            return
        time.sleep(0.5)


def run_worker_node(cfg: EngineConfig) -> int:
    """Node n > 0 of a multi-node launch: host this node's ranks until they stop."""
    from sgl.runtime.models.loader import resolve_model_dir
    from sgl.runtime.worker.launch import run_node

    hf_dir, _ = resolve_model_dir(cfg.model_path, cfg.cache_dir)
    logging.getLogger("sgl.server").info("node %d of %d: hosting tensor-parallel ranks, no HTTP",
                                         cfg.node_rank, cfg.nnodes)
    return run_node(cfg, str(hf_dir))


if __name__ == "__main__":
    main()
