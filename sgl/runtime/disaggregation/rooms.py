"""The bootstrap room of every sample of a request: one rule, used by the HTTP layer and
the engine on both the prefill and the decode worker, so both derive the same rooms
from the same body.

The router sends `bootstrap_host`, `bootstrap_port` and `bootstrap_room` as scalars or
lists. For a request of `num_prompts` prompts with `n` samples each, sample i of prompt p
gets:

    scalar room r                     -> (r + p * n + i) mod 2**63
    list of num_prompts rooms         -> (rooms[p] + i) mod 2**63
    list of num_prompts * n rooms     -> rooms[p * n + i]   (a chat with n choices: one each)

Hosts and ports follow the same indexing (a scalar is shared); a null port means this
worker's own `--disaggregation-bootstrap-port` (how sglang-router says "the default").
Every room of one request must be distinct (SGLang's n > 1 hangs came from reused rooms).
"""

from __future__ import annotations

from typing import Any

from sgl.runtime.disaggregation.protocol import Bootstrap

ROOM_MOD = 2**63


class BootstrapError(ValueError):
    """A bad bootstrap field; `param` names it (the HTTP layer answers 400 with it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pick(value: Any, name: str, num_prompts: int, n: int, p: int, i: int) -> Any:
    if not isinstance(value, list):
        return value
    if len(value) == num_prompts:
        return value[p]
    if len(value) == num_prompts * n:
        return value[p * n + i]
    raise BootstrapError(f"{name} has {len(value)} entries; expected 1 per prompt ({num_prompts}) or 1 per "
                         f"sample ({num_prompts * n})", name)


def expand_bootstrap(host: Any, port: Any, room: Any, num_prompts: int, n: int,
                     default_port: int) -> list[list[Bootstrap]] | None:
    """Per prompt, per sample: its Bootstrap; None when no room is given (BootstrapError
    names the field that is malformed)."""
    if room is None or (isinstance(room, list) and all(r is None for r in room)):
        return None
    out: list[list[Bootstrap]] = []
    seen: set[int] = set()
    for p in range(num_prompts):
        row = []
        for i in range(n):
            r = _pick(room, "bootstrap_room", num_prompts, n, p, i)
            if not _is_int(r) or not 0 <= r < ROOM_MOD:
                raise BootstrapError(f"bootstrap_room must be an integer in [0, 2**63), got {r!r}", "bootstrap_room")
            if not isinstance(room, list):
                r = (r + p * n + i) % ROOM_MOD
            elif len(room) == num_prompts:
                r = (r + i) % ROOM_MOD
            h = _pick(host, "bootstrap_host", num_prompts, n, p, i)
            if not isinstance(h, str) or not h:
                raise BootstrapError(f"bootstrap_host must be a non-empty string, got {h!r}", "bootstrap_host")
            pt = _pick(port, "bootstrap_port", num_prompts, n, p, i)
            if pt is None:
                pt = default_port
            if not _is_int(pt) or not 0 < pt < 65536:
                raise BootstrapError(f"bootstrap_port must be a port number or null, got {pt!r}", "bootstrap_port")
            if r in seen:
                raise BootstrapError(f"bootstrap_room {r} is used by two samples of this request", "bootstrap_room")
            seen.add(r)
            row.append(Bootstrap(h, pt, r))
        out.append(row)
    return out
