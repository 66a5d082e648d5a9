"""Shared fixtures: one real engine per test session (the embedded model, bf16).

Triton decides between compiling and interpreting when it is first imported, so the
interpreter mode (kernel checks on the CPU) is set here, before any test imports it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def engine():
    from sgl.runtime.engine import Engine

    eng = Engine(max_total_tokens=32768)
    yield eng
    eng.shutdown()
