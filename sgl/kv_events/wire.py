"""vLLM's KV-event wire format, so Dynamo / llm-d style consumers read our workers as-is.

Transport: a ZMQ PUB socket sends multipart messages ``(topic, seq, payload)`` where
``seq`` is an 8-byte big-endian unsigned sequence number (one per batch, from 0) and
``payload`` is one msgpack-encoded `KVEventBatch`. Structs are msgspec "array-like"
(encoded as msgpack arrays, fields in declaration order) and events are tagged unions
(the tag is the class name, first element of the array), exactly as vLLM declares them.

Block hashes are unsigned 64-bit ints (see `hashing.py`); `medium` is "GPU"-style free
text in vLLM, here "cpu" for the worker's KV pool.
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


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch):
    events: list[KVEvent]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)
