"""`python -m sgl.launch_router`: one HTTP front for N sgl (or SGLang) workers.

    python -m sgl.launch_router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 \\
        --policy cache_aware --port 30000

Flags are generated from `sgl.router.config.RouterConfig` (sglang-router's names where the
concept is the same). SIGINT/SIGTERM stop accepting connections and let in-flight
requests finish for a few seconds.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

from sgl.router.config import RouterConfig, add_cli_args, from_args

GRACEFUL_SHUTDOWN_SECS = 10

EPILOG = """PD (prefill/decode) disaggregation, as sglang-router spells it:

  python -m sgl.launch_router --pd-disaggregation \\
      --prefill http://10.0.0.1:30001 8998 --prefill http://10.0.0.2:30001 \\
      --decode http://10.0.0.3:30002 --decode http://10.0.0.4:30002 \\
      --prefill-policy cache_aware --decode-policy round_robin

Each generation request goes to one prefill and one decode worker, the same body to both
with bootstrap_host (the prefill URL's host), bootstrap_port (the number after its URL, or
null) and a fresh random bootstrap_room added; the client gets the decode worker's answer.
A pair that fails before any byte reached the client is retried with new rooms (the other
side's request is closed), up to --retry-max-retries attempts."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl.launch_router", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    return p


def parse(argv: list[str] | None = None) -> RouterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = from_args(args)
        from sgl.router.state import policy_options

        policy_options(cfg)  # the policy's own checks (cache_threshold in [0, 1], ...) as usage errors
    except ValueError as e:
        parser.error(str(e))
    return cfg


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    level = "warning" if cfg.log_level == "warn" else cfg.log_level
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per proxied call would cost more than the proxying; the router logs failures itself.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import prometheus_client

    prometheus_client.disable_created_metrics()  # no *_created series: dashboards do not read them
    import uvicorn

    from sgl.router.app import create_app

    app = create_app(cfg)
    log = logging.getLogger("sgl.router")
    if cfg.pd_disaggregation:
        policies = cfg.role_policies()
        log.info("router in PD mode on http://%s:%d: %d prefill (%s), %d decode (%s) worker(s)", cfg.host, cfg.port,
                 len(cfg.prefill), policies["prefill"], len(cfg.decode), policies["decode"])
    else:
        log.info("router (%s) on http://%s:%d in front of %d worker(s)", cfg.policy, cfg.host, cfg.port,
                 len(cfg.worker_urls))
    if not cfg.api_key and not _loopback(cfg.host):
        log.warning("the router listens on %s without --api-key: anyone who reaches it can add workers "
                    "(/add_worker) and send it requests", cfg.host)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=level, access_log=False, log_config=None,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECS)


if __name__ == "__main__":
    main()
