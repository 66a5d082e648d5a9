"""vLLM's KV-event wire format, so Dynamo / llm-d style consumers read our workers as-is.

Transport: a ZMQ PUB socket sends multipart messages ``(topic, seq, payload)`` where
``seq`` is an 8-byte big-endian unsigned sequence number (one per batch, from 0) and
``payload`` is one msgpack-encoded `KVEventBatch`. Structs are msgspec "array-like"
(encoded as msgpack arrays, fields in declaration order) and events are tagged unions
(the tag is the class name, first element of the array), exactly as vLLM declares them.

Block hashes are unsigned 64-bit ints (see `hashing.py`); `medium` is "GPU" for vLLM's
device pool, here "CPU" or "GPU" for where the worker's KV pool lives.

`BlockStored` carries `lora_name` as a 7th element (vLLM added it as a required field;
decoders of the 6-field form ignore a trailing element). Reading, both of vLLM's forms are
accepted: arrays (6 or 7 fields, later ones optional) and the field-name maps newer vLLM
sends, so the router indexes any vLLM worker.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds; the msgpack tag is the subclass name."""


class BlockStored(KVCacheEvent, omit_defaults=False):  # lora_name is sent even when None
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch):
    events: list[KVEvent]  # type: ignore[assignment]


class _MapEvent(msgspec.Struct, gc=False, tag=True):
    """The same events as field-name maps ({"type": "BlockStored", ...}), newer vLLM's form."""


class _MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[Union[_MapStored, _MapRemoved, _MapCleared]]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_map_decoder = msgspec.msgpack.Decoder(_MapBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch in either of vLLM's forms; msgspec.DecodeError (a ValueError) if neither."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as array_error:
        try:
            m = _map_decoder.decode(payload)
        except msgspec.DecodeError:
            raise array_error from None
    return KVEventBatch(ts=m.ts, events=[_from_map(e) for e in m.events], data_parallel_rank=m.data_parallel_rank)


def _from_map(e: _MapEvent) -> KVEvent:
    if isinstance(e, _MapStored):
        return BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash, token_ids=e.token_ids,
                           block_size=e.block_size, lora_id=e.lora_id, medium=e.medium, lora_name=e.lora_name)
    if isinstance(e, _MapRemoved):
        return BlockRemoved(block_hashes=e.block_hashes, medium=e.medium)
    return AllBlocksCleared()


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)
