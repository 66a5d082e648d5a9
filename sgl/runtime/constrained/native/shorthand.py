"""Rust's \\d, \\s and \\w as code point ranges, the tables regex_nfa.c reads.

Read off Rust's own DFAs for the three classes through the outlines-core route
(dfa_rust.py), so `\\d` is the Unicode digit set Rust uses, not this Python's older
`unicodedata`; cached on disk per outlines-core version (reading them takes ~1 s).
"""

from __future__ import annotations

import os

import numpy as np

from sgl.runtime.config import cache_dir

from ..byte_dfa import ByteDFA

_tables: list[np.ndarray] = []


def _utf8_table(cps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes [N, 4] (zero-padded) and lengths of the code points `cps`."""
    n = np.where(cps < 0x80, 1, np.where(cps < 0x800, 2, np.where(cps < 0x10000, 3, 4)))
    lead = np.array([0, 0, 0xC0, 0xE0, 0xF0])[n]
    b = np.zeros((cps.size, 4), dtype=np.int64)
    for k in range(4):
        shift = 6 * np.maximum(n - 1 - k, 0)
        byte = lead | (cps >> shift) if k == 0 else 0x80 | ((cps >> shift) & 0x3F)
        b[:, k] = np.where(k < n, byte, 0)
    return b, n


def _accepted_ranges(dfa: ByteDFA) -> list[tuple[int, int]]:
    """The code points (one character each) `dfa` accepts, as ranges."""
    cps = np.arange(0x110000, dtype=np.int64)
    cps = cps[(cps < 0xD800) | (cps > 0xDFFF)]
    b, n = _utf8_table(cps)
    st = np.zeros(cps.size, dtype=np.int64)
    for k in range(4):
        on = (k < n) & (st >= 0)
        st[on] = dfa.trans[st[on], b[on, k]]
    ok = cps[(st >= 0) & dfa.accept[np.maximum(st, 0)]]
    if not ok.size:
        return []
    cut = np.nonzero(np.diff(ok) != 1)[0]
    return list(zip(ok[np.r_[0, cut + 1]].tolist(), ok[np.r_[cut, ok.size - 1]].tolist()))


def shorthand_tables() -> np.ndarray:
    """int32 [nd, ns, nw, then lo/hi pairs of \\d, \\s, \\w]."""
    if not _tables:
        import outlines_core

        path = cache_dir() / "grammars" / f"shorthand-{getattr(outlines_core, '__version__', 'x')}.npy"
        try:
            _tables.append(np.load(path))
        except (OSError, ValueError):
            from ..dfa_rust import build_rust

            sets = [_accepted_ranges(build_rust(c, "regex")) for c in (r"\d", r"\s", r"\w")]
            flat = [len(r) for r in sets] + [x for r in sets for lo, hi in r for x in (lo, hi)]
            table = np.array(flat, dtype=np.int32)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, table)
            os.replace(tmp, path)
            _tables.append(table)
    return _tables[0]
