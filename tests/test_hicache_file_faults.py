"""The file storage tier's faults on a real server (issue 14): a corrupted page file is a
miss and is deleted, and the output is unchanged; a storage directory that becomes
unwritable mid-run stops storage writes with a warning while serving goes on. One server
(`python -m sgl.launch_server`, small pool, timeout prefetch policy), with KV events on
too (the two coexist: events follow the device tree, tested in test_hicache.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.server_proc import free_port, start_server
from tests.hicache_http import PAGE, flush, generate, info, prompt, wait_for, written

pytestmark = pytest.mark.slow  # multi-process set: `make test-slow`



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hicache-file")
    store = root / "store"
    extra = {"path": str(store), "prefetch_timeout": 60, "retry_interval_s": 0.5}
    events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}", "enable_kv_cache_events": True}
    srv = start_server("--kv-events-config", json.dumps(events),"--max-total-tokens", "4096", "--page-size", str(PAGE), "--enable-hierarchical-cache",
                       "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "timeout",
                       "--hicache-storage-backend-extra-config", json.dumps(extra))
    try:
        yield srv, store
    finally:
        srv.stop()


def page_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.page"))


def test_corrupted_page_is_a_miss_and_deleted(server) -> None:
    srv, store = server
    ids = prompt(11, 640)
    ref = generate(srv, ids)
    wait_for("pages on disk", lambda: written(srv, len(ids) // PAGE))
    files = page_files(store)
    assert len(files) >= len(ids) // PAGE
    for i, f in enumerate(files):  # whichever is the prompt's first page is damaged
        data = bytearray(f.read_bytes())
        if i % 2:
            data = data[: len(data) // 2]  # truncated
        else:
            data[len(data) // 2] ^= 0xFF  # same size, wrong checksum
        f.write_bytes(bytes(data))
    flush(srv)  # device and host tiers: the prompt can only come back from storage
    again = generate(srv, ids)
    assert again["text"] == ref["text"]
    d = again["meta_info"]["cached_tokens_details"]
    assert d["device"] == 0 and d["storage"] == 0, d  # a damaged page is a miss
    state = info(srv)
    assert state["kv_events"]["page_size"] == PAGE and state["hicache_enabled"]
    corrupt = state["storage_corrupt_pages"]
    assert corrupt >= 1
    assert len(page_files(store)) == len(files) - corrupt  # deleted (this process never rewrites them)


def test_unwritable_directory_serving_goes_on(server) -> None:
    srv, store = server
    ids = prompt(12, 400)
    ref = generate(srv, ids)
    wait_for("pages on disk", lambda: written(srv, len(ids) // PAGE))
    moved = store.with_name("store.moved")
    os.rename(store, moved)
    store.write_text("not a directory")  # every write under it now fails (even as root)
    try:
        flush(srv)
        errors_before = info(srv).get("storage_write_errors", 0)
        fresh = generate(srv, prompt(13, 400))  # its write-through fails in the background
        assert fresh["meta_info"]["completion_tokens"] > 0
        again = generate(srv, ids)  # storage reads fail too: recomputed, same output
        assert again["text"] == ref["text"]
        assert again["meta_info"]["cached_tokens_details"]["storage"] == 0
        wait_for("a failed write", lambda: info(srv).get("storage_write_errors", 0) > errors_before)
        assert "cannot write" in srv.log() and "serving goes on" in srv.log()
    finally:
        store.unlink()
        os.rename(moved, store)
