"""/metrics series of the hierarchical cache (sgl/server/hicache_metrics.py), rendered from
a real scheduler's snapshot after a workload that demotes and promotes: our `sgl_hicache_*`
names and SGLang's agree with the snapshot, and nothing is emitted when the cache is off."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from sgl.server.metrics import Metrics
from tests.test_hicache import make, run_one, workload


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_hicache_series_follow_the_snapshot() -> None:
    s, _ = make(num_slots=160, host_pages=64)
    for i, prompt in enumerate(workload()):
        run_one(s, f"r{i}", prompt)
    info = s.snapshot()
    assert info["hicache_host_hit_tokens"] > 0
    got = samples(Metrics("m").render(info))
    m = (("model_name", "m"),)
    assert got[("sgl_hicache_enabled", ())] == 1
    assert got[("sgl_hicache_host_tokens_used", ())] == info["hicache_host_tokens_used"] > 0
    assert got[("sglang:hicache_host_used_tokens", m)] == info["hicache_host_tokens_used"]
    assert got[("sglang:hicache_host_total_tokens", m)] == info["hicache_host_tokens_total"] == 64 * 4
    for tier in ("device", "host", "storage"):
        assert got[("sgl_hicache_hit_tokens_total", (("tier", tier),))] == info[f"hicache_{tier}_hit_tokens"]
    assert got[("sglang:load_back_tokens_total", m)] == info["hicache_host_hit_tokens"]
    assert got[("sgl_hicache_bytes_loaded_total", (("tier", "host"),))] == info["hicache_bytes_loaded"]
    assert got[("sgl_hicache_bytes_stored_total", (("tier", "host"),))] == info["hicache_bytes_stored"]
    # no storage tier: none of its series
    assert not any(name.startswith(("sglang:prefetched", "sglang:backuped", "sgl_hicache_storage"))
                   for name, _ in got)


def test_storage_series_and_load_time() -> None:
    info = {"hicache_enabled": True, "hicache_page_size": 16, "hicache_host_tokens_used": 32,
            "hicache_host_tokens_total": 64, "hicache_host_hit_tokens": 16, "hicache_storage_hit_tokens": 48,
            "hicache_load_seconds": 0.25, "storage_backend": "file", "storage_pages_prefetched": 3,
            "storage_pages_written": 5, "storage_prefetch_seconds": 0.5, "storage_corrupt_pages": 1.0}
    got = samples(Metrics("m").render(info))
    m = (("model_name", "m"),)
    assert got[("sglang:prefetched_tokens_total", m)] == 48
    assert got[("sglang:backuped_tokens_total", m)] == 80
    assert got[("sglang:load_back_tokens_total", m)] == 64
    assert got[("sgl_hicache_load_seconds_total", (("tier", "host"),))] == 0.25
    assert got[("sgl_hicache_load_seconds_total", (("tier", "storage"),))] == 0.5
    assert got[("sgl_hicache_storage_corrupt_pages_total", ())] == 1


def test_nothing_when_off() -> None:
    text = Metrics().render({"hicache_enabled": False, "num_running_reqs": 0}).decode()
    assert "hicache" not in text and "load_back" not in text
