"""ctypes binding of the native grammar engine (grammar.h and its four C files).

`NativeEngine` is one compiled grammar: machines set from regex text (or tables), then
`finalize`, then steps, masks, end tests and forced bytes on flat configurations: the
int32 words `n_stacks, len_0, m, s, ..., len_1, ...` (pushdown_walk.c) as `bytes`, which
hash, compare, and, unlike tuples, are not tracked by Python's cycle collector (masks
cache thousands of configurations; tracked keys made full collections of ~10 ms
frequent). Where the C library cannot be built, `available()` is False and callers keep
the numpy backends.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import numpy as np

from sgl.runtime.native.build import build_library

from ..base import GrammarError


class GrammarOutOfMemory(GrammarError, MemoryError):
    """The C engine could not allocate for this grammar (a huge automaton)."""

_DIR = Path(__file__).parent
_SOURCES = [_DIR / n for n in ("grammar.h", "pushdown.h", "regex_nfa.c", "lazy_dfa.c", "pushdown_walk.c",
                               "mask_walk.c", "token_slices.c", "engine_api.c")]
OK, UNSUPPORTED, TOO_LARGE, EMPTY, NOMEM, EMPTY_SUB, TOO_MANY, BAD_CONFIG, SETS_TOO_LARGE = range(9)
_ERR_BUFFER = 100
RE_CALLS = 1
Config = bytes  # flat configuration, int32 words
_lib: list[ctypes.CDLL | None] = []
_P = ctypes.c_void_p
_I32, _I64 = ctypes.c_int32, ctypes.c_int64


def _library() -> ctypes.CDLL | None:
    if not _lib:
        lib = build_library("grammar", _SOURCES)
        if lib is not None:
            sig = {
                "sgl_gram_new": (_P, [_I32, _I32, _I32, _I64, _I64]),
                "sgl_gram_free": (None, [_P]),
                "sgl_gram_set_regex": (_I32, [_P, _I32, ctypes.c_char_p, _I64, _P, _I32, _I32, _I32, _I64,
                                              ctypes.c_char_p, _I32]),
                "sgl_gram_set_table": (_I32, [_P, _I32, _P, _P, _I32, _P, _P, _P, _I32, _I32]),
                "sgl_gram_set_intersect": (_I32, [_P, _I32, _P, _I32]),
                "sgl_gram_finalize": (_I32, [_P, _I32, ctypes.c_char_p, _I32]),
                "sgl_gram_set_trie": (None, [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I32, _I32, _I32]),
                "sgl_gram_slices_new": (_P, [_I32]),
                "sgl_gram_slices_free": (None, [_P]),
                "sgl_gram_expand_all": (_I64, [_P, _I32]),
                "sgl_gram_export": (_I32, [_P, _I32, _P, _P]),
                "sgl_gram_stats": (None, [_P, _P]),
                "sgl_gram_machine_states": (_I64, [_P, _I32]),
                "sgl_gram_frame_info": (None, [_P, _I32, _I32, _P]),
                "sgl_gram_bits_or": (None, [_P, _P, _I64]),
                "sgl_gram_step": (_I64, [_P, ctypes.c_char_p, _I64, ctypes.c_char_p, _I64, _P, _I64]),
                "sgl_gram_can_end": (_I32, [_P, ctypes.c_char_p, _I64]),
                "sgl_gram_mask": (_I64, [_P, ctypes.c_char_p, _I64, _P]),
                "sgl_gram_forced": (_I64, [_P, ctypes.c_char_p, _I64, _P, _I64]),
            }
            for name, (res, args) in sig.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
        _lib.append(lib)
    return _lib[0]


def available() -> bool:
    return _library() is not None


def config_of(words: Sequence[int]) -> Config:
    return np.asarray(words, dtype=np.int32).tobytes()


def words_of(cfg: Config) -> list[int]:
    return np.frombuffer(cfg, dtype=np.int32).tolist()


MAX_STATES = 400_000  # DFA states one grammar's engine builds lazily, over all its machines
MAX_SET_BYTES = 256 << 20  # and the bytes of those states' NFA member sets


class NativeEngine:
    """One grammar's machines in C. `json_mode`: more than `max_stacks` parallel stacks is
    an error (an ambiguous schema); otherwise (CFGs) the shortest are kept and idempotent
    frames folded. `max_states` (default MAX_STATES) bounds the DFA states built lazily,
    over all machines, and `max_set_bytes` (default MAX_SET_BYTES) their member sets.
    Passing either is a sticky error: paths through states already built still work, new
    ones fail (`failed()`)."""

    def __init__(self, n_machines: int, kind: str, *, json_mode: bool = True, max_stacks: int = 256,
                 max_states: int | None = None, max_set_bytes: int | None = None) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the native grammar engine is not available (no C compiler)")
        self._lib = lib
        self.kind = kind
        self.json_mode = json_mode
        self.n_machines = n_machines
        self.max_states = max_states = MAX_STATES if max_states is None else max_states
        self.max_set_bytes = max_set_bytes = MAX_SET_BYTES if max_set_bytes is None else max_set_bytes
        self._h = lib.sgl_gram_new(n_machines, int(json_mode), max_stacks, max_states, max_set_bytes)
        if not self._h:
            raise MemoryError("sgl_gram_new: out of memory")
        self._keep: list[object] = []  # arrays the engine borrows
        self._out_size = 64  # ints; grown when a configuration does not fit

    def __del__(self) -> None:
        h, self._h = getattr(self, "_h", None), None
        if h:
            self._lib.sgl_gram_free(h)

    def _fail(self, status: int, what: str = "") -> GrammarError:
        if status == TOO_LARGE:
            return GrammarError(f"{self.kind}: the grammar's automaton exceeds {self.max_states:,} states{what}")
        if status == EMPTY:
            return GrammarError(f"{self.kind}: the grammar matches nothing")
        if status == SETS_TOO_LARGE:
            b = self.max_set_bytes
            size = f"{b >> 20:,} MB" if b >= 1 << 20 else f"{b >> 10:,} KB" if b >= 1 << 10 else f"{b:,} bytes"
            return GrammarError(f"{self.kind}: the grammar's automaton needs more than {size} of DFA state sets{what}")
        if status == TOO_MANY:
            return GrammarError(f"{self.kind}: too many parallel parses (ambiguous schema)")
        if status == NOMEM:  # this grammar's request fails, not the whole batch it is in
            return GrammarOutOfMemory(f"{self.kind}: the grammar engine ran out of memory")
        return GrammarError(f"{self.kind}: native grammar engine error {status}{what}")

    # -- building ---------------------------------------------------------------------
    def set_regex(self, m: int, regex: str, *, calls: bool, uni: np.ndarray | None,
                  hidden: bool = False, no_empty: bool = False, max_nfa_states: int = 4_000_000) -> bool:
        """Machine m from regex text; False where the C parser does not read the syntax."""
        try:
            data = regex.encode("utf-8")
        except UnicodeEncodeError:
            return False
        err = ctypes.create_string_buffer(200)
        rc = self._lib.sgl_gram_set_regex(self._h, m, data, len(data), None if uni is None else uni.ctypes.data,
                                          RE_CALLS if calls else 0, int(hidden), int(no_empty), max_nfa_states,
                                          err, len(err))
        if rc == UNSUPPORTED:
            return False
        if rc == TOO_LARGE:
            raise GrammarError(f"{self.kind}: cannot compile regex (its NFA exceeds {max_nfa_states:,} states)")
        if rc != OK:
            raise self._fail(rc)
        return True

    def set_table(self, m: int, trans: np.ndarray, accept: np.ndarray,
                  calls: Sequence[tuple[int, int, int]] = (), hidden: bool = False) -> None:
        """Machine m as a DFA table; calls are (state, callee, return state)."""
        t = np.ascontiguousarray(trans, dtype=np.int32)
        a = np.ascontiguousarray(accept, dtype=np.uint8)
        if t.ndim != 2 or t.shape[1] != 256 or a.shape != (t.shape[0],):  # the C side reads n x 256 and n
            raise GrammarError(f"{self.kind}: table machine {m} has rows {t.shape} and accept {a.shape}; "
                               "expected [n, 256] and [n]")
        cs = np.array(sorted(calls), dtype=np.int32).reshape(-1, 3)
        src, callee, ret = (np.ascontiguousarray(cs[:, k]) for k in range(3))
        rc = self._lib.sgl_gram_set_table(self._h, m, t.ctypes.data, a.ctypes.data, t.shape[0], src.ctypes.data,
                                          callee.ctypes.data, ret.ctypes.data, cs.shape[0], int(hidden))
        if rc != OK:
            raise self._fail(rc, f" (table machine {m})")

    def set_intersect(self, m: int, parts: Sequence[int]) -> None:
        p = np.array(parts, dtype=np.int32)
        rc = self._lib.sgl_gram_set_intersect(self._h, m, p.ctypes.data, p.size)
        if rc != OK:
            raise self._fail(rc)

    def finalize(self, root: int = 0) -> None:
        err = ctypes.create_string_buffer(200)
        rc = self._lib.sgl_gram_finalize(self._h, root, err, len(err))
        if rc == EMPTY_SUB:
            raise GrammarError(f"{self.kind}: {err.value.decode()}")
        if rc != OK:
            raise self._fail(rc)

    def set_trie(self, node: np.ndarray, nxt: np.ndarray, tok_start: np.ndarray, tok_ids: np.ndarray,
                 sub_bytes: np.ndarray, height: np.ndarray, level_nodes: np.ndarray, level_off: np.ndarray,
                 slices: "TokenSlices", max_depth: int, vocab_size: int) -> None:
        """The vocabulary's byte trie (token_trie.py) and its slice table; the engine
        borrows them."""
        self._keep += [node, nxt, tok_start, tok_ids, sub_bytes, height, level_nodes, level_off, slices]
        self._lib.sgl_gram_set_trie(self._h, node.ctypes.data, nxt.ctypes.data, tok_start.ctypes.data,
                                    tok_ids.ctypes.data, sub_bytes.ctypes.data, height.ctypes.data,
                                    level_nodes.ctypes.data, level_off.ctypes.data, slices.handle, node.size,
                                    max_depth, vocab_size)

    # -- running ----------------------------------------------------------------------
    def step(self, cfg: Config, data: bytes) -> Config | None:
        """The configuration after `data`, or None when no stack survives."""
        while True:  # a buffer per call: the C call drops the GIL, another thread may step too
            out = np.empty(self._out_size, dtype=np.int32)
            n = self._lib.sgl_gram_step(self._h, cfg, len(cfg) // 4, data, len(data), out.ctypes.data, out.size)
            if n == -_ERR_BUFFER:
                self._out_size *= 4
                continue
            if n < 0:
                raise self._fail(int(-n))
            return out[:n].tobytes() if n else None

    def can_end(self, cfg: Config) -> bool:
        r = self._lib.sgl_gram_can_end(self._h, cfg, len(cfg) // 4)
        if r < 0:
            raise self._fail(-r)
        return bool(r)

    def mask_bits(self, cfg: Config, vocab_size: int) -> np.ndarray:
        """The tokens a stack can take whole, packed: uint64 words, token t at bit t % 64
        of word t // 64."""
        out = np.zeros((vocab_size + 63) // 64, dtype=np.uint64)
        r = self._lib.sgl_gram_mask(self._h, cfg, len(cfg) // 4, out.ctypes.data)
        if r < 0:
            raise self._fail(int(-r))
        return out

    def mask_into(self, cfg: Config, out: np.ndarray) -> None:
        """out[t] = True for every token t a stack can take whole (bool [vocab])."""
        bits_or(self.mask_bits(cfg, out.size), out)

    def forced(self, cfg: Config, cap: int) -> bytes:
        buf = ctypes.create_string_buffer(cap)
        n = self._lib.sgl_gram_forced(self._h, cfg, len(cfg) // 4, buf, cap)
        if n < 0:
            raise self._fail(int(-n))
        return buf.raw[:n]

    def export(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Every reachable state of machine m expanded: (trans [S, 256], accept [S])."""
        n = self._lib.sgl_gram_expand_all(self._h, m)
        if n < 0:
            raise self._fail(int(-n))
        trans = np.empty((n, 256), dtype=np.int32)
        accept = np.empty(n, dtype=np.uint8)
        rc = self._lib.sgl_gram_export(self._h, m, trans.ctypes.data, accept.ctypes.data)
        if rc != OK:
            raise self._fail(rc)
        return trans, accept.astype(bool)

    def stats(self) -> dict[str, int]:
        """DFA states built so far (all machines), frame masks cached, frame walks made."""
        out = np.zeros(5, dtype=np.int64)
        self._lib.sgl_gram_stats(self._h, out.ctypes.data)
        return {"states": int(out[0]), "status": int(out[2]), "frame_masks": int(out[3]),
                "frame_walks": int(out[4])}

    def failed(self) -> bool:
        """Whether the engine has met a sticky error (its state bound, out of memory)."""
        return self.stats()["status"] != OK

    def num_states(self) -> int:
        return self.stats()["states"]

    def frame_info(self, m: int, s: int) -> tuple[bool, int]:
        """(is the frame mask of (m, s) cached, how many exits it has)."""
        out = np.zeros(2, dtype=np.int64)
        self._lib.sgl_gram_frame_info(self._h, m, s, out.ctypes.data)
        return bool(out[0]), int(out[1])


class TokenSlices:
    """One vocabulary's token-slice table (native/token_slices.c), shared by every engine
    over its trie; built lazily in C, freed with this object (engines keep it alive)."""

    def __init__(self, vocab_size: int) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the native grammar library is not built")
        self._lib = lib
        self.handle = lib.sgl_gram_slices_new(vocab_size)
        if not self.handle:
            raise MemoryError("sgl_gram_slices_new: out of memory")

    def __del__(self) -> None:
        h, self.handle = getattr(self, "handle", None), None
        if h:
            self._lib.sgl_gram_slices_free(h)


def bits_or(bits: np.ndarray, out: np.ndarray) -> None:
    """out[t] |= bit t of the packed mask `bits`, in place (out: bool/uint8, contiguous).
    Entries past the mask's bits (a logits row padded past the vocabulary) are untouched."""
    lib = _library()
    assert lib is not None and out.flags.c_contiguous and out.itemsize == 1 and bits.flags.c_contiguous
    lib.sgl_gram_bits_or(bits.ctypes.data, out.ctypes.data, min(out.size, bits.nbytes // 8 * 64))
