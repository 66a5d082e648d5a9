"""`--kv-events-config`: the JSON object that switches KV cache events on, parsed into
plain settings. The keys are vLLM's / SGLang's `KVEventsConfig` (the same JSON works on
all three servers); unknown keys, wrong types and an unknown publisher are errors that
name the flag.

Events are on when the object is given, unless it says `"enable_kv_cache_events": false`
or `"publisher": "null"` (SGLang's rule: passing the flag is the switch; vLLM users who
always write `enable_kv_cache_events` get what they expect too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FLAG = "--kv-events-config"
PUBLISHERS = ("zmq", "null")
HEARTBEAT_S = 1.0  # an idle stream sends an empty batch this often (see publisher.py)


@dataclass(frozen=True)
class KVEventsSettings:
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"  # PUB socket: bound for a wildcard host / ipc / inproc, else connected
    replay_endpoint: str | None = None  # ROUTER socket (always bound) answering replay requests
    topic: str = "kv-events"
    enable_kv_cache_events: bool = True
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark of the PUB socket, in messages
    max_queue_size: int = 100_000  # batches waiting for the sender thread before the oldest is dropped
    connect: bool | None = None  # ours: force connect (true) or bind (false); null = by the endpoint's host

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_TYPES: dict[str, tuple[type, ...]] = {
    "publisher": (str, type(None)), "endpoint": (str,), "replay_endpoint": (str, type(None)), "topic": (str,),
    "enable_kv_cache_events": (bool,), "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
    "connect": (bool, type(None)),
}


def parse_kv_events_config(text: str | None) -> KVEventsSettings | None:
    """The settings, or None when events are off; ValueError naming the flag when bad."""
    if text is None or not text.strip():
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG} must be a JSON object: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_TYPES))
    if unknown:
        raise ValueError(f"{FLAG}: unknown key(s) {unknown}; known: {sorted(_TYPES)}")
    for key, value in raw.items():
        ok = _TYPES[key]
        # bool is an int in Python; a count given as true/false is a mistake.
        if not isinstance(value, ok) or (bool not in ok and isinstance(value, bool)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in ok)
            raise ValueError(f"{FLAG}: {key} must be {names}, got {value!r}")
    if raw.get("publisher", "zmq") is None:  # vLLM's "pick for me"
        del raw["publisher"]
    s = KVEventsSettings(**raw)
    if s.publisher not in PUBLISHERS:
        raise ValueError(f"{FLAG}: unknown publisher {s.publisher!r}; expected one of {', '.join(PUBLISHERS)}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(s, key) < 1:
            raise ValueError(f"{FLAG}: {key} must be >= 1, got {getattr(s, key)}")
    for key in ("endpoint", "replay_endpoint"):
        ep = getattr(s, key)
        if ep is not None and "://" not in ep:
            raise ValueError(f"{FLAG}: {key} must be a ZMQ address like tcp://*:5557, got {ep!r}")
    return s if s.enabled else None


def offset_endpoint(endpoint: str | None, dp_rank: int | None) -> str | None:
    """vLLM's rule for replica sets sharing one config: data-parallel rank k publishes on
    the configured port + k (inproc/ipc names get a `_dp{k}` suffix)."""
    if not endpoint or not dp_rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port):  # a wildcard port (0 or *) stays one
            return f"{base}:{int(port) + dp_rank}"
        return endpoint
    return f"{endpoint}_dp{dp_rank}"
