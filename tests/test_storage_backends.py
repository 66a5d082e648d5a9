"""Storage tier (L3) backends, for real: the page codec and key namespaces, the file backend
on a real directory (atomic writes, LRU bound, restart, unwritable / full disk, corrupt
pages) and the redis backend against a real redis-server (tests/redis_proc.py): shared by
two workers, down at start, killed mid-use and restarted, namespace-scoped clear."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from sgl.kv_events.hashing import page_hashes
from sgl.runtime.memory.storage import PageStore, make_backend
from sgl.runtime.memory.storage.codec import HEADER_SIZE, decode_page, encode_page, namespace_for, page_key
from tests.redis_proc import RedisProc, free_port, start_redis

NS = namespace_for("test/model-a", "bfloat16", 4, 1, 0)
NS_B = namespace_for("test/model-b", "bfloat16", 4, 1, 0)


def keys_of(tokens: list[int], ns: str = NS, page_size: int = 4) -> list[str]:
    return [page_key(ns, h) for h in page_hashes(tokens, page_size)]


def pages(n: int, size: int = 100, seed: int = 0) -> list[bytes]:
    return [bytes((seed + i + j) % 251 for j in range(size)) for i in range(n)]


# ---------------------------------------------------------------------------------- codec
@pytest.mark.parametrize("payload", [b"", b"x", os.urandom(10_000), bytearray(b"kv" * 50)])
def test_codec_round_trip(payload):
    blob = encode_page(payload)
    assert len(blob) == HEADER_SIZE + len(payload)
    assert decode_page(blob) == bytes(payload)
    assert decode_page(memoryview(blob)) == bytes(payload)


def test_codec_rejects_corruption_and_truncation():
    payload = os.urandom(300)
    blob = encode_page(payload)
    for i in list(range(HEADER_SIZE)) + [HEADER_SIZE, HEADER_SIZE + 150, len(blob) - 1]:
        bad = bytearray(blob)
        bad[i] ^= 0x01
        assert decode_page(bytes(bad)) is None, f"flipped byte {i} accepted"
    for n in range(len(blob)):
        assert decode_page(blob[:n]) is None, f"truncated to {n} accepted"
    assert decode_page(blob + b"\0") is None
    assert decode_page(None) is None


def test_namespace_is_stable_and_separates_layouts():
    ns = namespace_for("HuggingFaceTB/SmolLM2-135M-Instruct", "torch.bfloat16", 16, 2, 1)
    assert ns == namespace_for("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 16, 2, 1)
    assert ns.startswith("kv2.smollm2-135m-instruct.") and ns.endswith(".bfloat16.p16.tp1of2")
    # pinned: the format is a persistent contract (pages on disk / in Redis outlive a process)
    assert ns == "kv2.smollm2-135m-instruct." + __import__("hashlib").blake2b(
        b"HuggingFaceTB/SmolLM2-135M-Instruct", digest_size=6).hexdigest() + ".bfloat16.p16.tp1of2"
    variants = {
        namespace_for("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 16, 2, 1),
        namespace_for("other-org/SmolLM2-135M-Instruct", "bfloat16", 16, 2, 1),  # same slug, other model
        namespace_for("HuggingFaceTB/SmolLM2-135M-Instruct", "float16", 16, 2, 1),
        namespace_for("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 32, 2, 1),
        namespace_for("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 16, 2, 0),
        namespace_for("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 16, 4, 1),
    }
    assert len(variants) == 6
    tokens = list(range(40))
    assert set(keys_of(tokens, NS)).isdisjoint(keys_of(tokens, NS_B))
    # keys chain: a prompt sharing the first 2 pages shares exactly those keys
    other = tokens[:8] + [999] + tokens[9:]
    assert keys_of(other)[:2] == keys_of(tokens)[:2] and keys_of(other)[2] != keys_of(tokens)[2]
    with pytest.raises(ValueError):
        namespace_for("m", "bfloat16", 16, 2, 2)


def test_weights_fingerprint_follows_content_not_path(tmp_path):
    from sgl.runtime.models.loader import weights_fingerprint

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"x": 1}')
        (d / "model.safetensors").write_bytes(bytes(range(256)) * 20000)  # > 2 MiB: head and tail
    assert weights_fingerprint(str(a)) == weights_fingerprint(str(b))  # a copy elsewhere: shared
    (b / "model.safetensors").write_bytes(bytes(range(256)) * 19999 + bytes(255) + b"\x01")
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(b))  # replaced in place: not
    (b / "model.safetensors").write_bytes(bytes(range(256)) * 20000)
    (b / "config.json").write_text('{"x": 2}')
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(b))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    assert weights_fingerprint(str(gguf)) != weights_fingerprint(str(a))
    assert weights_fingerprint(None) == weights_fingerprint(None)  # the embedded model


def test_kv_identity_separates_quantization_and_weights(tmp_path):
    from types import SimpleNamespace

    from sgl.runtime.config import EngineConfig
    from sgl.runtime.worker.build import kv_identity

    cfg = EngineConfig()

    def rank(blocks):
        return SimpleNamespace(model=SimpleNamespace(gguf_blocks=blocks), config="LlamaConfig(...)")

    native, dequantized = kv_identity(cfg, rank(object())), kv_identity(cfg, rank(None))
    assert native != dequantized and native == kv_identity(cfg, rank(object()))
    assert namespace_for(native, "bfloat16", 16, 1, 0) != namespace_for(dequantized, "bfloat16", 16, 1, 0)
    assert namespace_for(native, "bfloat16", 16, 1, 0).startswith("kv2.embedded-smollm2-135m-instruct.")


@pytest.mark.parametrize(("name", "config", "needle"), [
    ("mooncake", {}, "--hicache-storage-backend"),
    ("file", {"pth": "/tmp"}, "'pth'"),
    ("file", {"max_bytes": "1GB"}, "'max_bytes'"),
    ("file", {"max_bytes": -1}, "'max_bytes'"),
    ("file", {"fsync": 1}, "'fsync'"),
    ("redis", {}, "'url'"),
    ("redis", {"url": "127.0.0.1:6379"}, "'url'"),
    ("redis", {"url": "redis://h:1", "ttl": 5}, "'ttl'"),
    ("file", ["path"], "--hicache-storage-backend-extra-config"),
])
def test_make_backend_rejects_bad_config(name, config, needle):
    with pytest.raises(ValueError) as e:
        make_backend(name, config, NS)
    assert needle in str(e.value)
    assert "--hicache-storage-backend" in str(e.value)


# ----------------------------------------------------------------------------------- file
def file_store(tmp_path: Path, **config) -> PageStore:
    return PageStore(make_backend("file", {"path": str(tmp_path), **config}, NS))


def page_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.page"))


def test_file_set_get_exists_consecutive(tmp_path):
    store = file_store(tmp_path)
    keys = keys_of(list(range(20)))  # 5 pages
    data = pages(5)
    assert store.set([keys[0], keys[1], keys[3]], [data[0], data[1], data[3]]) == [True] * 3
    assert store.exists(keys) == 2
    assert store.exists(keys[3:4]) == 1
    assert store.get(keys) == [data[0], data[1], None, data[3], None]
    assert store.get_prefix(keys) == data[:2]
    assert store.exists([]) == 0 and store.get([]) == []
    store.delete([keys[0]])
    assert store.exists(keys) == 0
    # layout: <path>/<namespace>/<2 hex>/<16 hex>.page
    files = page_files(tmp_path)
    assert len(files) == 2 and all(f.parent.parent == tmp_path / NS for f in files)
    with pytest.raises(ValueError):
        store.get([page_key(NS_B, 1)])  # another namespace's key is a programming error


def test_file_default_path_is_under_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path / "cache"))  # config.cache_dir() reads it per call
    store = PageStore(make_backend("file", {}, NS))
    key = keys_of(list(range(4)))
    assert store.set(key, [b"page"]) == [True]
    assert len(page_files(tmp_path / "cache" / "hicache" / NS)) == 1


def test_file_partial_temp_file_is_never_read_and_is_cleaned_at_start(tmp_path):
    store = file_store(tmp_path)
    keys = keys_of(list(range(8)))
    assert store.set(keys[:1], [b"good page"]) == [True]
    # a writer that died mid-page: a half-written temp file where page 1 would go
    final = Path(store.backend._path(keys[1]))  # noqa: SLF001 - where the page file would be
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.dead1234.tmp"
    tmp.write_bytes(encode_page(b"x" * 100)[:50])
    assert store.exists(keys) == 1
    assert store.get(keys) == [b"good page", None]
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    restarted = file_store(tmp_path)
    assert not tmp.exists()
    assert restarted.get(keys) == [b"good page", None]
    assert restarted.stats()["pages"] == 1


def test_file_stray_files_are_not_pages_and_never_stop_a_start(tmp_path):
    size = HEADER_SIZE + 100
    store = file_store(tmp_path, max_bytes=2 * size)
    keys = keys_of(list(range(4 * 3)))
    assert store.set(keys, pages(3)) == [True] * 3
    sub = Path(store.backend._path(keys[0])).parent  # noqa: SLF001 - a page folder
    stray = sub / "notes by hand.page"  # not a page name: left alone, never indexed
    stray.write_bytes(b"x" * 10 * size)
    restarted = file_store(tmp_path, max_bytes=2 * size)  # over the limit at start: evicts pages only
    assert stray.exists() and restarted.stats()["pages"] <= 2


def test_file_lru_eviction_at_max_bytes(tmp_path):
    size = HEADER_SIZE + 100
    store = file_store(tmp_path, max_bytes=5 * size)
    keys = keys_of(list(range(4 * 7)))
    data = pages(7)
    assert store.set(keys[:5], data[:5]) == [True] * 5
    assert store.get(keys[0:1]) == data[0:1]  # page 0 is now the most recently used
    assert store.set(keys[5:6], data[5:6]) == [True]  # evicts page 1, the least recently used
    present = [k for k in keys[:6] if store.exists([k])]
    assert present == [keys[0], keys[2], keys[3], keys[4], keys[5]]
    st = store.stats()
    assert st["bytes_used"] <= 5 * size and st["evictions"] == 1 and st["pages"] == 5
    assert len(page_files(tmp_path)) == 5
    assert store.set(keys[6:7], [b"z" * (6 * size)]) == [False]  # larger than the whole bound


def test_file_survives_restart_with_its_lru_order(tmp_path):
    size = HEADER_SIZE + 100
    keys = keys_of(list(range(4 * 6)))
    data = pages(6)
    first = file_store(tmp_path)
    assert first.set(keys, data) == [True] * 6
    assert first.get(keys[0:1]) == data[0:1]  # recently used before the "restart"
    first.close()
    second = file_store(tmp_path)
    assert second.exists(keys) == 6  # exists does not count as a use
    assert second.stats()["pages"] == 6 and second.stats()["bytes_used"] == 6 * size
    second.close()
    # a smaller bound at the next start evicts by the LRU order the files carry (mtime)
    third = file_store(tmp_path, max_bytes=3 * size)
    kept = [i for i, k in enumerate(keys) if third.exists([k])]
    assert kept == [0, 4, 5] and third.stats()["evictions"] == 3  # pages 1-3: least recently used
    assert third.get([keys[i] for i in kept]) == [data[i] for i in kept]


def test_file_unwritable_dir_stops_writes_with_one_warning_then_resumes(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    keys = keys_of(list(range(8)))
    with caplog.at_level(logging.WARNING, logger="sgl.runtime.memory.storage.file"):
        store = file_store(blocker / "cache", retry_interval_s=0.05)  # mkdir fails: ENOTDIR
        for _ in range(5):
            assert store.set(keys, pages(2)) == [False, False]
            assert store.exists(keys) == 0 and store.get(keys) == [None, None]
            time.sleep(0.06)  # past the back-off, so later calls really retry (and fail again)
    warnings = [r for r in caplog.records if "writes paused" in r.getMessage()]
    assert len(warnings) == 1
    assert store.stats()["writes_paused"] == 1 and store.stats()["write_errors"] >= 2
    blocker.unlink()  # the disk is writable again
    deadline = time.monotonic() + 30
    while store.set(keys, pages(2)) != [True, True]:
        assert time.monotonic() < deadline, "writes never resumed"
        time.sleep(0.05)
    assert store.get(keys) == pages(2) and store.stats()["writes_paused"] == 0


def test_file_disk_full_mid_use_answers_false_and_keeps_serving(tmp_path):
    """A real write error (EFBIG under RLIMIT_FSIZE) in a child process: no exception, no
    temp file left, the pages already stored still load."""
    script = textwrap.dedent(f"""
        import json, resource, signal
        from sgl.runtime.memory.storage import PageStore, make_backend, page_key
        store = PageStore(make_backend("file", {{"path": {str(tmp_path)!r}}}, {NS!r}))
        keys = [page_key({NS!r}, i) for i in range(1, 5)]
        out = {{"small": store.set(keys[:1], [b"s" * 10])}}
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.RLIM_INFINITY))
        out["big"] = store.set(keys[1:3], [b"b" * 1000, b"c" * 1000])
        out["after"] = store.set(keys[3:4], [b"d" * 10])
        out["read"] = [bytes(p).decode() if p else None for p in store.get(keys)]
        out["stats"] = store.stats()
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["small"] == [True]
    assert out["big"] == [False, False]
    assert out["after"] == [False]  # writes paused after the error, not hammering the disk
    assert out["read"] == ["s" * 10, None, None, None]
    assert out["stats"]["writes_paused"] == 1
    assert "writes paused" in proc.stderr  # the one warning
    assert not list(tmp_path.rglob("*.tmp")) and len(page_files(tmp_path)) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_file_corrupt_page_is_a_miss_and_deleted(tmp_path, damage):
    store = file_store(tmp_path)
    keys = keys_of(list(range(12)))
    data = pages(3)
    assert store.set(keys, data) == [True] * 3
    victim = Path(store.backend._path(keys[1]))  # noqa: SLF001
    blob = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]))
    elif damage == "truncate":
        victim.write_bytes(blob[: len(blob) // 2])
    else:
        victim.write_bytes(b"")
    assert store.get(keys) == [data[0], None, data[2]]
    assert not victim.exists()
    assert store.exists(keys) == 1
    assert store.stats()["corrupt_pages"] == 1
    assert store.set(keys[1:2], data[1:2]) == [True] and store.get(keys) == data  # recomputed, stored again


def test_file_clear_touches_only_its_namespace(tmp_path):
    a = file_store(tmp_path)
    b = PageStore(make_backend("file", {"path": str(tmp_path)}, NS_B))
    tokens = list(range(8))
    assert a.set(keys_of(tokens, NS), pages(2)) == [True, True]
    assert b.set(keys_of(tokens, NS_B), pages(2)) == [True, True]
    a.clear()
    assert a.exists(keys_of(tokens, NS)) == 0 and a.stats()["pages"] == 0
    assert b.exists(keys_of(tokens, NS_B)) == 2 and b.get(keys_of(tokens, NS_B)) == pages(2)
    assert a.set(keys_of(tokens, NS), pages(2)) == [True, True]  # usable after clear


# ---------------------------------------------------------------------------------- redis
@pytest.fixture(scope="module")
def redis_srv():
    srv = start_redis()
    yield srv
    srv.stop()


def redis_store(url: str, ns: str = NS, **config) -> PageStore:
    return PageStore(make_backend("redis", {"url": url, **config}, ns))


def test_redis_set_get_exists_consecutive(redis_srv):
    store = redis_store(redis_srv.url)
    store.clear()
    keys = keys_of(list(range(20)))
    data = pages(5, size=4096)
    assert store.set([keys[0], keys[1], keys[3]], [data[0], data[1], data[3]]) == [True] * 3
    assert store.exists(keys) == 2
    assert store.get(keys) == [data[0], data[1], None, data[3], None]
    store.delete([keys[1]])
    assert store.exists(keys) == 1
    st = store.stats()
    assert st["connected"] == 1 and st["writes"] == 3 and st["hits"] == 3
    long_keys = keys_of(list(range(4 * 300)))  # more keys than one round-trip chunk
    assert store.set(long_keys, pages(300, size=16)) == [True] * 300
    assert store.exists(long_keys) == 300 and store.get(long_keys) == pages(300, size=16)
    store.close()


def test_redis_two_workers_share_pages(redis_srv):
    worker_a = redis_store(redis_srv.url)
    worker_b = redis_store(redis_srv.url)
    tokens = list(range(1000, 1040))
    keys = keys_of(tokens)
    assert worker_b.exists(keys) == 0
    assert worker_a.set(keys, pages(10, seed=7)) == [True] * 10
    assert worker_b.exists(keys) == 10 and worker_b.get(keys) == pages(10, seed=7)
    # B extends A's prefix; A then finds the longer run
    longer = keys_of(tokens + list(range(5000, 5008)))
    assert worker_b.set(longer[10:], pages(2, seed=9)) == [True, True]
    assert worker_a.exists(longer) == 12
    # another model on the same server sees none of it
    assert redis_store(redis_srv.url, NS_B).exists(keys_of(tokens, NS_B)) == 0


def test_redis_clear_touches_only_its_namespace(redis_srv):
    a = redis_store(redis_srv.url)
    b = redis_store(redis_srv.url, NS_B)
    raw = redis.Redis.from_url(redis_srv.url)
    raw.set("unrelated-app-key", b"keep me")
    tokens = list(range(3000, 3040))
    assert a.set(keys_of(tokens, NS), pages(10)) == [True] * 10
    assert b.set(keys_of(tokens, NS_B), pages(10)) == [True] * 10
    a.clear()
    assert a.exists(keys_of(tokens, NS)) == 0
    assert not list(raw.scan_iter(match=NS + "/*"))
    assert b.get(keys_of(tokens, NS_B)) == pages(10)
    assert raw.get("unrelated-app-key") == b"keep me"


def test_redis_corrupt_page_is_a_miss_and_deleted(redis_srv):
    store = redis_store(redis_srv.url)
    raw = redis.Redis.from_url(redis_srv.url)
    keys = keys_of(list(range(4000, 4012)))
    assert store.set(keys, pages(3)) == [True] * 3
    raw.set(keys[1], raw.get(keys[1])[:-10])  # truncated
    assert store.get(keys) == [pages(3)[0], None, pages(3)[2]]
    assert raw.exists(keys[1]) == 0 and store.stats()["corrupt_pages"] == 1


def test_redis_ttl_and_max_bytes_reach_the_server(redis_srv):
    store = redis_store(redis_srv.url, ttl_s=600, max_bytes=64 * 2**20)
    keys = keys_of(list(range(6000, 6004)))
    assert store.set(keys, [b"p"]) == [True]
    raw = redis.Redis.from_url(redis_srv.url)
    assert 0 < raw.pttl(keys[0]) <= 600_000
    assert raw.config_get("maxmemory")["maxmemory"] == str(64 * 2**20)
    assert raw.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"


def test_redis_unreachable_at_start_misses_without_touching_the_network(caplog):
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="sgl.runtime.memory.storage.redis"):
        store = redis_store(url, retry_interval_s=3600)
        keys = keys_of(list(range(40)))
        for _ in range(50):
            assert store.exists(keys) == 0
            assert store.get(keys) == [None] * 10
            assert store.set(keys, pages(10)) == [False] * 10
            store.delete(keys)
            store.clear()
    st = store.stats()
    assert st["connected"] == 0
    assert st["connect_attempts"] == 1  # every later call answered from the back-off, no socket
    assert len([r for r in caplog.records if "storage tier is off" in r.getMessage()]) == 1


def test_redis_killed_mid_use_then_restarted_reconnects(caplog):
    srv = start_redis()
    try:
        store = redis_store(srv.url, retry_interval_s=0.05)
        keys = keys_of(list(range(7000, 7040)))
        assert store.set(keys[:5], pages(5)) == [True] * 5
        srv.stop()  # SIGKILL: a crash mid-run
        with caplog.at_level(logging.WARNING, logger="sgl.runtime.memory.storage.redis"):
            for _ in range(20):
                assert store.exists(keys) == 0
                assert store.get(keys[:5]) == [None] * 5
                assert store.set(keys[5:], pages(5)) == [False] * 5
        assert store.stats()["connected"] == 0
        assert len([r for r in caplog.records if "storage tier is off" in r.getMessage()]) == 1
        srv.start()  # same port, empty (no persistence)
        deadline = time.monotonic() + 30
        while store.set(keys, pages(10)) != [True] * 10:
            assert time.monotonic() < deadline, "never reconnected"
            time.sleep(0.05)
        assert store.get(keys) == pages(10) and store.exists(keys) == 10
        st = store.stats()
        assert st["connected"] == 1 and st["reconnects"] >= 1
    finally:
        srv.stop()


def test_redis_max_bytes_reaches_a_server_that_came_up_late_and_one_that_restarted():
    srv = start_redis()
    srv.stop()  # unreachable at start
    try:
        limit = str(48 * 2**20)
        store = redis_store(srv.url, max_bytes=int(limit), retry_interval_s=0.05)
        keys = keys_of(list(range(8000, 8008)))
        assert store.set(keys, pages(2)) == [False] * 2
        for restart in range(2):  # it comes up; then it restarts, forgetting CONFIG SET
            srv.start()
            deadline = time.monotonic() + 30
            while store.set(keys, pages(2)) != [True] * 2:
                assert time.monotonic() < deadline, "never reconnected"
                time.sleep(0.05)
            raw = redis.Redis.from_url(srv.url)
            assert raw.config_get("maxmemory")["maxmemory"] == limit, f"after start {restart}"
            assert raw.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
            raw.close()
            srv.stop()
    finally:
        srv.stop()


def test_redis_proc_is_real():
    srv = start_redis()
    try:
        assert isinstance(srv, RedisProc) and srv.ping()
        info = redis.Redis.from_url(srv.url).info("server")
        assert "redis_version" in info or "valkey_version" in info
    finally:
        srv.stop()
    assert not srv.ping()
