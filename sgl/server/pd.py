"""The HTTP side of PD disaggregation: the bootstrap fields of a request.

sglang-router in PD mode sends the same body to a prefill and a decode worker, with
`bootstrap_host`, `bootstrap_port` and `bootstrap_room` added (scalars or lists; see
sgl/runtime/disaggregation/rooms.py for the per-sample rule both workers apply). On a
prefill or decode worker every generation request must carry a room (400 naming
`bootstrap_room` otherwise); on a colocated worker the fields are ignored.
"""

from __future__ import annotations

from typing import Any

from sgl.runtime.disaggregation.protocol import Bootstrap
from sgl.runtime.disaggregation.rooms import BootstrapError, expand_bootstrap
from sgl.server.errors import bad_request


def mode_of(engine: Any) -> str:
    cfg = getattr(engine, "config", None)
    return str(getattr(cfg, "disaggregation_mode", "null") or "null")


def bootstraps(engine: Any, host: Any, port: Any, room: Any, num_prompts: int,
               n: int) -> list[list[Bootstrap]] | None:
    """Per prompt, per sample: its Bootstrap on a PD worker; None on a colocated one."""
    mode = mode_of(engine)
    if mode == "null":
        return None
    default_port = int(getattr(engine.config, "disaggregation_bootstrap_port", 8998))
    try:
        out = expand_bootstrap(host, port, room, num_prompts, n, default_port)
    except BootstrapError as e:
        raise bad_request(str(e), e.param) from None
    if out is None:
        raise bad_request(f"this is a {mode} worker (--disaggregation-mode {mode}): requests need bootstrap_room "
                          "(and bootstrap_host, bootstrap_port), as a PD router sends them", "bootstrap_room")
    return out


def engine_kwargs(samples: list[Bootstrap] | None) -> dict[str, Any]:
    """The engine's SGLang-style arguments for one prompt's samples (one room each)."""
    if not samples:
        return {}
    return {"bootstrap_host": [b.host for b in samples], "bootstrap_port": [b.port for b in samples],
            "bootstrap_room": [b.room for b in samples]}
