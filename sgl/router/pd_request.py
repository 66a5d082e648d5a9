"""PD mode's request and answer rewriting (plain data, no I/O): the bootstrap fields added to
a body, the logprob merge of the two answers, and spotting an error event in an answer.

Bootstrap fields, as sglang-router 0.3.2 sends them (so SGLang's workers and ours read the
same shapes): `bootstrap_host` is the prefill URL's host, verbatim; `bootstrap_port` the
prefill's configured port or null (the decode worker then uses its own default);
`bootstrap_room` a fresh random integer in [0, 2**63) per request *and per attempt*. They
are scalars, except for requests that carry several prompts or choices, where each is a
list with one entry (and one distinct room) per item:

    /generate              text: [k strings] or input_ids: [[...] x k]    -> lists of k
                           anything else (sampling_params.n > 1 included) -> scalars
    /v1/completions        prompt: [k strings] or [[ids] x k]               -> lists of k
                           a single prompt (n > 1 included)                 -> scalars
    /v1/chat/completions   n = k > 1                                        -> lists of k
                           n absent or 1                                    -> scalars

(sglang-router rejects a /generate `text` list with 422; we send lists of k, the shape
the same router uses for an `input_ids` batch.) Client-sent bootstrap fields are replaced.
"""

from __future__ import annotations

import json
import random
from typing import Any

ROOM_LIMIT = 2**63  # rooms are non-negative int64s: SGLang's workers parse them as such

_rng = random.Random()  # seeded from the OS; rooms need to be distinct, not secret


def batch_size(endpoint: str, body: dict[str, Any]) -> int | None:
    """How many bootstrap entries the request needs as lists, or None for scalars."""
    if endpoint == "/generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
        return None
    if endpoint == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return len(prompt)
        return None
    if endpoint == "/v1/chat/completions":
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return n
    return None


def new_rooms(k: int) -> list[int]:
    """k distinct random rooms in [0, 2**63)."""
    rooms: list[int] = []
    while len(rooms) < k:
        room = _rng.randrange(ROOM_LIMIT)
        if room not in rooms:
            rooms.append(room)
    return rooms


def with_bootstrap(endpoint: str, body: dict[str, Any], host: str, port: int | None) -> dict[str, Any]:
    """`body` (not modified) plus fresh bootstrap fields for the prefill at `host`/`port`."""
    k = batch_size(endpoint, body)
    if k is None:
        return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_rooms(1)[0]}
    return {**body, "bootstrap_host": [host] * k, "bootstrap_port": [port] * k, "bootstrap_room": new_rooms(k)}


def rooms_of(body: dict[str, Any]) -> list[Any]:
    """The bootstrap rooms a rewritten body carries (for logs and tests)."""
    room = body.get("bootstrap_room")
    return list(room) if isinstance(room, list) else [room]


def merge_input_logprobs(prefill: bytes, decode: bytes) -> bytes | None:
    """Decode's answer with prefill's `meta_info.input_token_logprobs` put before its own, as
    sglang-router does for a non-streamed `return_logprob` request (the prefill worker
    computed the prompt's logprobs; the decode worker sends an empty or partial list).
    A batch (a JSON array on both sides, of the same length) is merged item by item. None
    when there is nothing to merge (either side lacks the list, or the shapes differ): the
    caller then sends decode's bytes unchanged."""
    try:
        p, d = json.loads(prefill), json.loads(decode)
    except ValueError:
        return None
    if isinstance(p, dict) and isinstance(d, dict):
        pairs = [(p, d)]
    elif isinstance(p, list) and isinstance(d, list) and len(p) == len(d):
        pairs = list(zip(p, d))
    else:
        return None
    merged = False
    for pi, di in pairs:
        pm = pi.get("meta_info") if isinstance(pi, dict) else None
        dm = di.get("meta_info") if isinstance(di, dict) else None
        if not isinstance(pm, dict) or not isinstance(dm, dict):
            continue
        pl, dl = pm.get("input_token_logprobs"), dm.get("input_token_logprobs")
        if isinstance(pl, list) and isinstance(dl, list):
            dm["input_token_logprobs"] = pl + dl
            merged = True
    return json.dumps(d, separators=(",", ":")).encode() if merged else None


def error_event(data: bytes) -> str | None:
    """The message of the first SSE `data: {"error": ...}` frame in `data`, else None. A worker
    that fails after its 200 head (a PD transfer that timed out, an abort) says so this way."""
    for frame in data.split(b"\n\n"):
        frame = frame.strip()
        if not frame.startswith(b"data: {") or b'"error"' not in frame:
            continue
        try:
            obj = json.loads(frame[len(b"data: "):])
        except ValueError:
            continue
        if isinstance(obj, dict) and "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            return str(msg if msg is not None else err)
    return None
