"""The PD (prefill/decode disaggregation) transfer seam: what crosses between a prefill
worker and a decode worker, and the two transport interfaces a backend implements.

One request's journey, keyed by its `bootstrap_room` (the router sends the same body to
both workers; rooms.py expands the room per sample):

    decode worker                                   prefill worker
    admit: match own radix tree (L tokens, locked),  runs the request at once as a normal
    reserve slots for tokens [L, n)                  prefill; stops at the first sampled
      -- Pull(room, prefix_len=L, n_tokens=n) -->    token; keeps the prompt's KV locked
                                                     when (prefill done and Pull arrived):
      <-- KVReady(first token, meta) + payload --    gather K/V of [L, n), send, unlock
    write payload into the reserved slots, insert
    into the tree, append the first token, decode
      <-- Failed(reason) --  (prefill failed / aborted / token mismatch / no such room)
      -- Cancel(room) -->    (decode gave up: timeout, client gone)

`KVSender` (prefill side) and `KVReceiver` (decode side) move these messages and the KV
bytes; all room bookkeeping (timeouts, locks, which request owns which slots) lives in
prefill.py / decode.py on the scheduler thread, which only polls plain data from the
transport. A TCP/ZMQ transport is in tcp.py. An RDMA backend (Mooncake, NIXL) would
implement the same two classes: its `Pull` would also carry the destination slots'
addresses, its sender would write into them directly, and its receiver would report a
`Received` with `payload=None` (the KV is already in place); nothing else changes.

Payload layout (one contiguous buffer, the pool's dtype): [2 (K, V), num_layers,
n_tokens - prefix_len, num_kv_heads, head_dim], described by `KVLayout`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec


class Bootstrap(msgspec.Struct, frozen=True):
    """Where one sample's KV comes from: the prefill's bootstrap address and the room."""

    host: str
    port: int
    room: int

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


class KVLayout(msgspec.Struct, frozen=True):
    """The shape of one token's KV in a pool; both sides must agree to exchange pages."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


class Pull(msgspec.Struct, tag="pull"):
    """Decode -> prefill: send room's KV for tokens [prefix_len, n_tokens)."""

    room: int
    prefix_len: int
    n_tokens: int
    tokens_hash: str  # of the n token ids: both sides must be about the same sequence
    decode_id: str  # the decode worker's stable name (HOST:PORT)
    incarnation: int  # grows when that decode worker restarts


class Cancel(msgspec.Struct, tag="cancel"):
    """Decode -> prefill: the decode side gave up on room (timeout, client gone)."""

    room: int
    decode_id: str
    incarnation: int
    reason: str = ""


class KVReady(msgspec.Struct, tag="kv"):
    """Prefill -> decode: the KV of room follows as the payload frame."""

    room: int
    prefix_len: int
    n_tokens: int
    layout: KVLayout
    first_token: int
    first_logprob: float | None
    first_top_logprobs: list[tuple[float, int]] | None
    cached_tokens: int  # the prefill's own prefix-cache hit for this prompt
    prefill_worker: str  # HOST:PORT of the prefill's bootstrap socket
    # time.time() on the prefill just before it gathered the pages: the decode's copy-in
    # end minus this is the transfer alone (gather, wire, scatter), clocks of one host or
    # NTP-synced ones
    gather_started: float = 0.0


class Failed(msgspec.Struct, tag="failed"):
    """Prefill -> decode: room will never be sent; `reason` says why."""

    room: int
    reason: str


ToPrefill = Pull | Cancel
ToDecode = KVReady | Failed

_enc = msgspec.msgpack.Encoder()
_to_prefill = msgspec.msgpack.Decoder(ToPrefill)
_to_decode = msgspec.msgpack.Decoder(ToDecode)


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_to_prefill(data: bytes | memoryview) -> ToPrefill:
    return _to_prefill.decode(data)


def decode_to_decode(data: bytes | memoryview) -> ToDecode:
    return _to_decode.decode(data)


def tokens_hash(ids: list[int]) -> str:
    """A short digest of a token sequence (equal sequences on both sides, equal digests)."""
    return hashlib.blake2b(msgspec.msgpack.encode(ids), digest_size=12).hexdigest()


# ---- transport events, polled by the scheduler thread ------------------------------------

@dataclass
class PullReceived:
    """Prefill side: a Pull or Cancel arrived from `peer` (an opaque reply handle)."""

    peer: Any
    msg: ToPrefill


@dataclass
class SendDone:
    """Prefill side: the KVReady / Failed for `room` was handed to the network (ok) or
    could not be (the decode worker is gone: `error`)."""

    room: int
    ok: bool
    error: str = ""


@dataclass
class Received:
    """Decode side: KVReady (with its payload, or None where the backend wrote the KV in
    place) or Failed for a room."""

    msg: ToDecode
    payload: Any = None  # a buffer of the payload layout (module docstring)


@dataclass
class PeerLost:
    """Decode side: the connection to the prefill at addr (host, port) broke; rooms
    pulled from it before now will not arrive (the prefill worker died or restarted)."""

    addr: tuple[str, int]
    at: float  # time.monotonic() when it was noticed: later pulls went to a new connection


class KVSender(Protocol):
    """Prefill side: serve rooms to decode workers."""

    address: str  # HOST:PORT decode workers reach this sender at (the bootstrap address)

    def poll(self) -> list[PullReceived | SendDone]:
        """Events since the last poll (never blocks)."""

    def send(self, peer: Any, room: int, msg: KVReady | Failed, payload: Any = None) -> None:
        """Queue msg (+ payload, a contiguous CPU tensor of the payload layout that this
        call now owns) to `peer`; the outcome comes back as a SendDone for `room`."""

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """Decode side: pull rooms from prefill workers."""

    def pull(self, addr: tuple[str, int], msg: Pull) -> None:
        """Ask the prefill at addr (host, bootstrap port) for msg.room (never blocks)."""

    def cancel(self, addr: tuple[str, int], msg: Cancel) -> None: ...

    def poll(self) -> list[Received | PeerLost]:
        """Rooms that arrived or failed, and prefills lost, since the last poll (never blocks)."""

    def close(self) -> None: ...
