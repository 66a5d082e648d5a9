"""Shared fixtures: one real engine per test session (the embedded model, bf16)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine():
    from sgl.runtime.engine import Engine

    eng = Engine(max_total_tokens=32768)
    yield eng
    eng.shutdown()
