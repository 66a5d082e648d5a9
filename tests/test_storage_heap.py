"""The storage tier's malloc settings (memory/storage/heap.py): page-sized buffers are
reused from the heap instead of being mapped, faulted in and unmapped for every page."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
from sgl.runtime.memory.storage.heap import keep_page_buffers_in_heap

def faults(rounds=5, pages=94, size=368_640):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):  # a document's pages read (each written once), then all dropped
        held = [b"\\x01" * size for _ in range(pages)]
        del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults(1)
plain = faults()
applied = keep_page_buffers_in_heap()
faults(1)
print(json.dumps({"plain": plain, "applied": applied, "tuned": faults()}))
"""


def test_page_buffers_are_reused_without_new_page_faults():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc malloc settings: Linux only")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["applied"]:
        pytest.skip("this C library has no mallopt (not glibc)")
    # 5 rounds of 94 buffers of 90 pages each: mapped afresh every round, ~42,000 faults;
    # kept in the heap after the first round, ~none
    assert r["plain"] > 20_000, r
    assert r["tuned"] < r["plain"] / 20, r
