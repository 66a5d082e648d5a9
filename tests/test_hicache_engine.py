"""Hierarchical KV cache on the real embedded model (CPU): a small device pool forces
demotion to the host tier and promotion back, and greedy outputs stay identical to a run
without it; the file storage tier survives a restart."""

from __future__ import annotations

import random

import pytest

from sgl.runtime.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 8}
WORDS = ("river stone cloud paper window garden silver orange thunder basket mirror candle forest "
         "pencil harbor lantern meadow copper violet anchor").split()


def doc(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload() -> list[str]:
    docs = [doc(i, 330) for i in range(3)]  # ~400+ tokens each; the pool holds two at most
    order = [0, 1, 2, 0, 1, 2, 0]
    return [f"{docs[d]}\nQuestion {k}: which word comes first?" for k, d in enumerate(order)]


def run(engine: Engine, prompts: list[str]) -> list[dict]:
    return [engine.generate(p, GREEDY) for p in prompts]


def test_outputs_identical_with_host_tier_and_host_hits_reported() -> None:
    prompts = workload()
    with Engine(max_total_tokens=1024) as plain:
        ref = run(plain, prompts)
    with Engine(max_total_tokens=1024, enable_hierarchical_cache=True, page_size=16) as eng:
        got = run(eng, prompts)
        info = eng.get_server_info()
        eng.check_invariants()
    assert [r["text"] for r in got] == [r["text"] for r in ref]
    details = [r["meta_info"]["cached_tokens_details"] for r in got]
    for r, d in zip(got, details):
        assert sum(d.values()) == r["meta_info"]["cached_tokens"]
    assert sum(d["host"] for d in details) > 0, details
    assert info["hicache_enabled"] and info["hicache_host_hit_tokens"] == sum(d["host"] for d in details)
    assert info["hicache_pages_loaded"] > 0 and info["hicache_bytes_loaded"] > 0


def test_file_storage_survives_restart(tmp_path) -> None:
    prompt = doc(7, 650) + "\nQuestion: which word comes first?"
    cfg = dict(max_total_tokens=1024, enable_hierarchical_cache=True, page_size=16,
               hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
               hicache_storage_backend_extra_config='{"path": "%s"}' % tmp_path)
    other = doc(8, 650) + "\nQuestion: how many words are there?"
    number = {**GREEDY, "regex": "[0-9]+"}
    with Engine(**cfg) as first:
        a = first.generate(prompt, GREEDY)
        c = first.generate(other, number)
    n_prompt = a["meta_info"]["prompt_tokens"]
    assert n_prompt > 600
    with Engine(**cfg) as second:
        b = second.generate(prompt, GREEDY)
        d = second.generate(other, number)  # a constrained request looks storage up too
        info = second.get_server_info()
        assert second.clear_hicache_storage_backend()
        assert second.flush_cache()  # device and host tiers: the prompt must come from storage or nowhere
        e = second.generate(prompt, GREEDY)
    assert e["meta_info"]["cached_tokens_details"]["storage"] == 0 and e["text"] == a["text"], e["meta_info"]
    assert b["text"] == a["text"] and d["text"] == c["text"]
    assert b["meta_info"]["cached_tokens_details"]["storage"] >= 0.9 * n_prompt, b["meta_info"]
    assert d["meta_info"]["cached_tokens_details"]["storage"] >= 0.9 * d["meta_info"]["prompt_tokens"], d["meta_info"]
    assert info["storage_pages_prefetched"] > 0
