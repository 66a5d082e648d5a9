"""Shared fixtures: one real engine per test session (the embedded model, bf16).

Triton decides between compiling and interpreting when it is first imported, so the
interpreter mode (kernel checks on the CPU) is set here, before any test imports it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see sgl/runtime/__init__.py; before torch loads

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def engine():
    from sgl.runtime.engine import Engine

    eng = Engine(max_total_tokens=32768)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def tok():
    """Tokenizer info of the embedded model's GGUF, for the grammar tests."""
    from sgl.runtime.constrained.vocab import cached_gguf_tokenizer_info
    from tests.grammar_helpers import GGUF

    return cached_gguf_tokenizer_info(GGUF)


@pytest.fixture
def no_grammar_disk_cache(monkeypatch):
    """Compile grammars afresh: the on-disk cache could serve tables of an older converter."""
    monkeypatch.setenv("SGL_GRAMMAR_DISK_CACHE", "0")


@pytest.fixture(params=["native", "lazy"])
def regex_backend(request, monkeypatch):
    """Run a grammar test on both backends of our engine: the native one (C, the default)
    and the numpy one (where no C compiler builds it)."""
    monkeypatch.setenv("SGL_REGEX_BACKEND", request.param)
    return request.param
