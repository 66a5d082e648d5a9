"""The router's options: one frozen `RouterConfig` whose fields (help text, default, CLI
group) generate `python -m sgl.launch_router`'s flags, so each option is declared once.

Flag names are sglang-router's where the concept is the same (`--worker-urls`,
`--cache-threshold`, `--retry-max-retries`, `--cb-failure-threshold`, ...); defaults are
sglang-router 0.3.2's except where a field's help says otherwise (`--host` binds loopback,
the Prometheus port is off unless given: /metrics is always on the main port).

    field `retry_max_retries` -> flag `--retry-max-retries`

List fields take several values (`--worker-urls A B`); `selector` takes `key=value` pairs.
Switches (`disable_*`, `service_discovery`, `pd_disaggregation`) are `store_true` flags.
PD mode's worker lists are repeatable flags, as sglang-router spells them:
`--prefill URL [BOOTSTRAP_PORT]` (a port number, `none`, or nothing: no port, the decode
worker's own default is used) and `--decode URL`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from sgl.router.policies import POLICY_NAMES
from sgl.router.policies.options import PolicyOptions

LOG_LEVELS = ("debug", "info", "warn", "warning", "error", "critical")
DEFAULT_REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")


def _f(default: Any, help: str, group: str, choices: tuple[Any, ...] | None = None) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default),
                     metadata={"help": help, "group": group, "choices": choices})
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


W, P, L, S, R, RT, CB, H, M, D, PD = ("workers", "routing policy", "admission (rate limiting)", "service discovery",
                                      "requests", "retries", "circuit breaker", "health checks", "metrics and logging",
                                      "security", "PD (prefill/decode) disaggregation")
_POLICY_OR_NONE = (None, *POLICY_NAMES)


@dataclass(frozen=True)
class RouterConfig:
    """Everything one router process is built from."""

    # workers
    worker_urls: list[str] = _f([], "worker URLs (http://host:port ...) routed to at startup", W)
    host: str = _f("127.0.0.1", "address the router binds (sglang-router's default is 0.0.0.0)", W)
    port: int = _f(30000, "port the router binds", W)
    worker_startup_timeout_secs: float = _f(1800.0, "seconds a starting or added worker gets to pass its first "
                                                    "health check; at startup the router serves once one listed "
                                                    "worker passed, the others join when they pass", W)
    # routing policy
    policy: str = _f("cache_aware", "how a worker is picked for a request", P, POLICY_NAMES)
    policy_options: PolicyOptions = field(default_factory=PolicyOptions, metadata={
        "help": "the policies' knobs; one flag per PolicyOptions field (--cache-threshold, ...)", "group": P,
        "nested": PolicyOptions})
    # service discovery
    service_discovery: bool = _f(False, "find workers as Kubernetes pods (needs the kubernetes package)", S)
    selector: dict[str, str] = _f({}, "pod label selector for service discovery: key=value ...", S)
    service_discovery_namespace: str | None = _f(None, "namespace to watch (default: all namespaces)", S)
    service_discovery_port: int = _f(80, "port of the worker in each discovered pod", S)
    # admission
    max_concurrent_requests: int = _f(-1, "most generation requests proxied at once; -1: no limit", L)
    queue_size: int = _f(100, "generation requests that may wait for a slot when the limit is reached "
                              "(0: answer 429 at once); beyond it, 429", L)
    queue_timeout_secs: float = _f(60.0, "seconds a request waits in the queue before a 408", L)
    # requests
    request_timeout_secs: float = _f(1800.0, "seconds a proxied request may take (a stream: between two chunks)", R)
    request_id_headers: list[str] = _f(list(DEFAULT_REQUEST_ID_HEADERS),
                                       "headers that carry a client's request id (the first present is used, "
                                       "forwarded to the worker and echoed as x-request-id)", R)
    # retries
    retry_max_retries: int = _f(5, "most attempts of one request (the first included) on connection errors "
                                    "and 408/429/5xx answers, before any byte reached the client", RT)
    retry_initial_backoff_ms: int = _f(50, "delay before the first retry", RT)
    retry_max_backoff_ms: int = _f(30000, "cap on the delay between retries", RT)
    retry_backoff_multiplier: float = _f(1.5, "growth of the delay per retry", RT)
    retry_jitter_factor: float = _f(0.2, "random spread of each delay, as a fraction (0..1)", RT)
    disable_retries: bool = _f(False, "one attempt per request (same as --retry-max-retries 1)", RT)
    # circuit breaker
    cb_failure_threshold: int = _f(10, "consecutive failures (within the window) that open a worker's circuit", CB)
    cb_success_threshold: int = _f(3, "successes in the half-open state that close the circuit again", CB)
    cb_timeout_duration_secs: float = _f(60.0, "seconds an open circuit waits before letting a trial request "
                                               "through (half-open)", CB)
    cb_window_duration_secs: float = _f(120.0, "failures older than this no longer count toward opening", CB)
    disable_circuit_breaker: bool = _f(False, "never take a worker out of rotation for failed requests", CB)
    # health checks
    health_failure_threshold: int = _f(3, "consecutive failed checks that take a worker out of rotation", H)
    health_success_threshold: int = _f(2, "consecutive passed checks that bring it back", H)
    health_check_timeout_secs: float = _f(5.0, "seconds one check may take", H)
    health_check_interval_secs: float = _f(60.0, "seconds between checks of each worker", H)
    health_check_endpoint: str = _f("/health", "worker path that answers 200 when healthy", H)
    disable_health_check: bool = _f(False, "no health checks, at startup or periodic (workers leave rotation "
                                           "only by their circuit breaker)", H)
    # metrics and logging
    prometheus_port: int | None = _f(None, "also serve /metrics on this port, without auth (default: only on "
                                           "the main port; sglang-router's default is 29000)", M)
    prometheus_host: str = _f("127.0.0.1", "address of the --prometheus-port listener", M)
    log_level: str = _f("info", "log level", M, LOG_LEVELS)
    # security
    api_key: str | None = _f(None, "require 'Authorization: Bearer <key>' on every path but /health, and send "
                                   "the same key to the workers", D)
    # PD disaggregation
    pd_disaggregation: bool = _f(False, "PD mode: every generation request goes to a (prefill, decode) pair, the "
                                        "same body to both with bootstrap_host/port/room added; the client gets "
                                        "the decode worker's answer (needs --prefill and --decode, not "
                                        "--worker-urls)", PD)
    prefill: list[tuple[str, int | None]] = field(default_factory=list, metadata={
        "help": "a prefill worker: --prefill URL [BOOTSTRAP_PORT]; repeat the flag for more. BOOTSTRAP_PORT is "
                "the prefill's --disaggregation-bootstrap-port: a number, 'none' or omitted (null: the decode "
                "worker uses its own --disaggregation-bootstrap-port). bootstrap_host is the URL's host, so it "
                "must be an address the decode workers reach", "group": PD, "choices": None,
        "cli": {"action": "append", "nargs": "+", "metavar": ("URL", "BOOTSTRAP_PORT")}})
    decode: list[str] = field(default_factory=list, metadata={
        "help": "a decode worker: --decode URL; repeat the flag for more", "group": PD, "choices": None,
        "cli": {"action": "append", "nargs": "+", "metavar": "URL"}})
    prefill_policy: str | None = _f(None, "policy over the prefill workers (default: --policy); cache_aware or "
                                          "kv_aware keep a prompt's prefix where it was computed", PD,
                                    _POLICY_OR_NONE)
    decode_policy: str | None = _f(None, "policy over the decode workers (default: --policy); cache_aware keeps "
                                         "a conversation on the decode worker that holds its earlier turns", PD,
                                   _POLICY_OR_NONE)
    pd_wait_for_prefill: bool = _f(False, "hold the decode worker's stream until the prefill worker's answer has "
                                          "fully arrived, as sglang-router 0.3.2 does (default: pass it on from "
                                          "its first chunk, which the decode worker can only send once the KV "
                                          "has arrived)", PD)

    def resolved(self) -> "RouterConfig":
        """Validate; ValueError names the flag."""
        for f in dataclasses.fields(self):
            allowed, value = f.metadata.get("choices"), getattr(self, f.name)
            if allowed and value not in allowed:
                names = ", ".join(str(a) for a in allowed if a is not None)
                raise ValueError(f"--{flag_name(f.name)} must be one of {names}; got {value!r}")
        positive = ("retry_max_retries", "cb_failure_threshold", "cb_success_threshold", "health_failure_threshold",
                    "health_success_threshold", "health_check_timeout_secs", "health_check_interval_secs",
                    "request_timeout_secs", "worker_startup_timeout_secs", "queue_timeout_secs",
                    "retry_backoff_multiplier")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{flag_name(name)} must be > 0; got {getattr(self, name)}")
        for name in ("queue_size", "retry_initial_backoff_ms", "retry_max_backoff_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{flag_name(name)} must be >= 0; got {getattr(self, name)}")
        if not 0 <= self.retry_jitter_factor <= 1:
            raise ValueError(f"--retry-jitter-factor must be in [0, 1]; got {self.retry_jitter_factor}")
        if self.max_concurrent_requests == 0 or self.max_concurrent_requests < -1:
            raise ValueError("--max-concurrent-requests must be -1 (no limit) or >= 1")
        for url in self.worker_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--worker-urls: {url!r} must start with http:// or https://")
        if self.service_discovery and not self.selector:
            raise ValueError("--service-discovery needs --selector key=value ...")
        if not self.health_check_endpoint.startswith("/"):
            raise ValueError("--health-check-endpoint must start with '/'")
        prefill, decode = self._check_pd()
        return dataclasses.replace(self, worker_urls=[normalize_url(u) for u in self.worker_urls],
                                   request_id_headers=[h.lower() for h in self.request_id_headers],
                                   prefill=prefill, decode=decode)

    def _check_pd(self) -> tuple[list[tuple[str, int | None]], list[str]]:
        """PD mode's flags, checked; returns the normalized prefill and decode lists."""
        if not self.pd_disaggregation:
            for name in ("prefill", "decode", "prefill_policy", "decode_policy"):
                if getattr(self, name):
                    raise ValueError(f"--{flag_name(name)} needs --pd-disaggregation")
            return [], []
        if not self.prefill or not self.decode:
            raise ValueError("--pd-disaggregation needs at least one --prefill URL and one --decode URL")
        if self.worker_urls:
            raise ValueError("--worker-urls is for regular mode; in PD mode list workers with --prefill and --decode")
        if self.service_discovery:
            raise ValueError("--service-discovery is not supported in PD mode; list workers with --prefill and "
                             "--decode")
        prefill = [(normalize_url(url), bootstrap_port(port, "--prefill")) for url, port in self.prefill]
        decode = [normalize_url(u) for u in self.decode]
        seen: set[str] = set()
        for flag, url in [("--prefill", u) for u, _ in prefill] + [("--decode", u) for u in decode]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{flag}: {url!r} must start with http:// or https://")
            if url in seen:
                raise ValueError(f"{flag}: {url} is listed twice (a worker has one role)")
            seen.add(url)
        return prefill, decode

    def role_policies(self) -> dict[str, str]:
        """The policy of each worker set: {"worker": --policy}, or PD mode's prefill and decode."""
        if not self.pd_disaggregation:
            return {"worker": self.policy}
        return {"prefill": self.prefill_policy or self.policy, "decode": self.decode_policy or self.policy}

    @property
    def max_attempts(self) -> int:
        return 1 if self.disable_retries else self.retry_max_retries

    def public(self) -> dict[str, Any]:
        """The options as plain data for /get_server_info (the API key masked)."""
        out = dataclasses.asdict(self)
        if out["api_key"]:
            out["api_key"] = "***"
        return out


def normalize_url(url: str) -> str:
    return url.strip().rstrip("/")


def bootstrap_port(value: object, flag: str = "--prefill") -> int | None:
    """A prefill's bootstrap port: a number in 1..65535, or None for 'none' / null / omitted."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    try:
        port = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{flag}: bootstrap port {value!r} must be a number or 'none'") from None
    if isinstance(value, bool) or not 1 <= port <= 65535:
        raise ValueError(f"{flag}: bootstrap port {value!r} must be in 1..65535")
    return port


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


# ---- CLI, generated from the fields ------------------------------------------------------------

def _field_type(cls: type, name: str) -> Any:
    t = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return t if typing.get_origin(t) in (list, dict) else (args[0] if args else t)


def _parse_selector(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--selector: {item!r} is not key=value")
        out[key] = value
    return out


def _parse_prefill(values: list[str]) -> tuple[str, int | None]:
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT]; got {' '.join(values)!r} (repeat --prefill for "
                         "each prefill worker)")
    return values[0], bootstrap_port(values[1] if len(values) == 2 else None)


def _cli_fields() -> list[tuple[type, dataclasses.Field[Any], str]]:
    """(dataclass, field, group) for every flag: RouterConfig's fields, with the nested
    PolicyOptions spliced in field by field (its fields are the policies' one home)."""
    out: list[tuple[type, dataclasses.Field[Any], str]] = []
    for f in dataclasses.fields(RouterConfig):
        nested = f.metadata.get("nested")
        if nested is None:
            out.append((RouterConfig, f, f.metadata["group"]))
        else:
            out += [(nested, g, f.metadata["group"]) for g in dataclasses.fields(nested) if g.metadata.get("cli", True)]
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per RouterConfig (and PolicyOptions) field, grouped as the fields are."""
    groups: dict[str, Any] = {}
    for cls, f, group_name in _cli_fields():
        group = groups.get(group_name) or parser.add_argument_group(group_name)
        groups[group_name] = group
        t = _field_type(cls, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        shown = " ".join(default) if isinstance(default, list) else default
        help = f"{f.metadata['help']} (default: {shown if shown not in ('', {}, None) else 'none'})"
        flag = "--" + flag_name(f.name)
        custom = f.metadata.get("cli")
        if isinstance(custom, dict):  # a repeatable flag (--prefill URL [PORT] --prefill URL ...)
            group.add_argument(flag, dest=f.name, default=None, help=help, **custom)
        elif t is bool:
            group.add_argument(flag, dest=f.name, action="store_true", default=None, help=help)
        elif typing.get_origin(t) in (list, dict):
            group.add_argument(flag, dest=f.name, nargs="*", default=None, metavar=f.name.upper(), help=help)
        else:
            allowed = f.metadata.get("choices")
            allowed = tuple(a for a in allowed if a is not None) if allowed else None
            group.add_argument(flag, dest=f.name, type=t, default=None, choices=allowed, help=help,
                               metavar="{" + ",".join(allowed) + "}" if allowed else f.name.upper())


def from_args(args: argparse.Namespace) -> RouterConfig:
    """The config from parsed flags (unset flags keep their defaults); ValueError on a bad value."""
    values: dict[str, Any] = {}
    policy_values: dict[str, Any] = {}
    for cls, f, _ in _cli_fields():
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if f.name == "selector":
            try:
                v = _parse_selector(v)
            except argparse.ArgumentTypeError as e:
                raise ValueError(str(e)) from None
        elif f.name == "prefill":
            v = [_parse_prefill(group) for group in v]
        elif f.name == "decode":
            v = [url for group in v for url in group]
        (policy_values if cls is PolicyOptions else values)[f.name] = v
    try:
        values["policy_options"] = PolicyOptions(**policy_values)
    except ValueError as e:  # its messages start with the field's name: say the flag instead
        msg = str(e)
        name = msg.split(" ", 1)[0]
        raise ValueError(f"--{flag_name(name)}{msg[len(name):]}" if name in policy_values else msg) from None
    return RouterConfig(**values).resolved()
