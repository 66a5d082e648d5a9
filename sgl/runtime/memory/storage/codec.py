"""Page framing and key naming for the storage tier: what a stored page looks like on the
wire and on disk, and which key it is stored under.

Frame (little-endian, 24-byte header, then the payload)::

    offset  size  field
    0       4     magic  b"SGLK"
    4       1     version (2)
    5       1     flags (0; reserved)
    6       2     reserved (0)
    8       8     payload length in bytes
    16      8     XXH3-64 of the payload
    24      n     payload (the KV page as the host tier lays it out; opaque here)

The checksum guards against torn and corrupted pages, not against forgery (a store is
trusted like the cache folder). XXH3 runs at memory speed where zlib's CRC-32 took ~2x
as long as reading the page (version 1 used CRC-32: its pages are keyed `kv1.` and so
never read by this version).

`decode_page` answers None on a wrong magic, version, flags or reserved field, a length that does not match the
blob (a truncated or padded page) or a checksum mismatch; the caller then deletes the
page and recomputes (`PageStore.get` does both).

Keys: ``<namespace>/<page hash as 16 lowercase hex digits>``. The page hash is the chained
hash of `sgl.kv_events.hashing.page_hashes(tokens, page_size)`, so a key names a page *and
everything before it*. The namespace (`namespace_for`) is::

    kv2.<model slug>.<12 hex of BLAKE2b(model identity)>.<dtype>.p<page_size>.tp<rank>of<size>
    e.g. kv2.smollm2-135m-instruct.3f2a9c01d4e5.bfloat16.p16.tp0of1

It uses only ``[a-z0-9._-]`` (safe as a directory name and free of Redis glob characters),
the version prefix changes when the page layout does, and two different models, dtypes,
page sizes or TP layouts never share a key (the model identity is hashed in full; the slug
is only for people reading a directory listing).
"""

from __future__ import annotations

import hashlib
import re
import struct

import xxhash

MAGIC = b"SGLK"
VERSION = 2
_HEADER = struct.Struct("<4sBBHQQ")
HEADER_SIZE = _HEADER.size  # 24
LAYOUT_VERSION = "kv2"  # bump when the payload layout or the frame changes: old pages then never match
_SAFE = re.compile(r"[^a-z0-9]+")
NAMESPACE_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def encode_page(payload: bytes | bytearray | memoryview) -> bytes:
    """The framed page: header (magic, version, length, checksum) + payload, copied once."""
    view = memoryview(payload).cast("B")
    return b"".join((_HEADER.pack(MAGIC, VERSION, 0, 0, view.nbytes, xxhash.xxh3_64_intdigest(view)), view))


def decode_page(blob: bytes | bytearray | memoryview | None) -> memoryview | None:
    """The payload of a framed page (a view into `blob`: pages are ~0.4 MB, and copying
    one cost as much as reading it), or None if it is missing, truncated, padded or corrupt."""
    if blob is None:
        return None
    view = memoryview(blob).cast("B")
    if view.nbytes < HEADER_SIZE:
        return None
    magic, version, flags, reserved, length, crc = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION or flags or reserved or view.nbytes != HEADER_SIZE + length:
        return None
    payload = view[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(payload) != crc:
        return None
    return payload


def _slug(text: str, limit: int = 40) -> str:
    return _SAFE.sub("-", text.lower()).strip("-")[:limit].strip("-") or "model"


def namespace_for(model_identity: str, dtype: str, page_size: int, tp_size: int, tp_rank: int) -> str:
    """The key namespace of one TP rank of one model (format in the module docstring).

    `model_identity` should name the weights exactly (a resolved path or hub id plus
    revision, or a digest of the config); `dtype` is the KV cache dtype ("bfloat16",
    "torch.float16" and "float16" are the same).
    """
    if page_size <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad page/TP layout: page_size={page_size} tp_size={tp_size} tp_rank={tp_rank}")
    if not model_identity:
        raise ValueError("model_identity must be non-empty")
    base = model_identity.rstrip("/").rsplit("/", 1)[-1]
    digest = hashlib.blake2b(model_identity.encode(), digest_size=6).hexdigest()
    dt = _slug(dtype.removeprefix("torch."), 16)
    return f"{LAYOUT_VERSION}.{_slug(base)}.{digest}.{dt}.p{page_size}.tp{tp_rank}of{tp_size}"


def page_key(namespace: str, page_hash: int) -> str:
    """The storage key of one page: ``<namespace>/<16 hex digits>``."""
    return f"{namespace}/{page_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def check_namespace(namespace: str) -> str:
    """`namespace` if it is safe as a directory name and a Redis SCAN prefix, else ValueError."""
    if not NAMESPACE_RE.match(namespace) or ".." in namespace:
        raise ValueError(f"storage namespace {namespace!r} must match {NAMESPACE_RE.pattern} (see namespace_for)")
    return namespace
