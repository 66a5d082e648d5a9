"""Grammar registry: spec -> compiled tables -> fresh matcher, plus the async compiler.

`compile_grammar(kind, spec, tok)` is the one entry point the scheduler and the public
matcher use. Kinds: "regex", "json_schema", "choices" (regex family), "ebnf" (GBNF) and
"lark". By default (regex_backend "native") the regex family, JSON Schema machines and
general CFGs run on the native engine (native/: regex text parsed to NFAs in C, DFA
states built the first time a text reaches them, masks by walking the vocabulary's
byte trie; compile is the parse). A json_schema whose conversion needs sub-machines
(recursive $refs, free-form values, very large subschemas) becomes a pushdown of
machines calling each other; GBNF takes the general CFG route (cfg_machines.py: any
context-free grammar as such machines); Lark takes our LALR(1) engine (lark_grammar.py)
and, when Lark reports an LALR conflict, the general route (cfg_lark.py). Where no C
compiler builds the engine, or with SGL_REGEX_BACKEND=lazy, the numpy backends do the
same work (lazy_regex.py, pushdown.py: whole byte DFAs at compile, disk-cached);
SGL_REGEX_BACKEND=outlines asks for a full outlines-core Index. Compiled grammars are
cached in memory (LRU); every call returns a new matcher at the start state sharing
them. Backends are imported lazily so that a server that never sees a CFG never imports
lark.

The grammar_backend setting (--grammar-backend, SGLang's flag) swaps the whole engine:
"ours" (the above, default), "llguidance" (llg.py), "xgrammar" (xgr.py, if installed)
or "outlines" (outlines-core for the regex family; CFG kinds are refused with a message).

`GrammarCompiler` runs compiles on a worker thread so the decode loop keeps going; its
futures fail with GrammarError on bad specs and on timeout.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
from typing import Any

from ..config import Settings, settings
from ..lru import LRU
from .base import Grammar, GrammarError
from .cache import DiskCache, cache_key
from .kinds import CONSTRAINT_KINDS as KINDS
from .vocab import TokenizerInfo

_INDEX_KINDS = ("regex", "json_schema", "choices")
# Whitespace a JSON Schema constraint allows between JSON tokens and before the value on
# our and the outlines backends (outlines' own default between tokens): the model spells
# `{"answer": 8}` and, after a prompt ending in ":", ` {"`; compact JSON forces it off
# its own tokens (README, "Structured output: boundary accuracy").
DEFAULT_JSON_WHITESPACE = r"[ ]?"

log = logging.getLogger(__name__)
_memory: LRU[str, Any] = LRU(settings().grammar_cache_entries)


def _settings() -> Settings:
    # A bad variable fails the compile (and so only its request), not the decode loop.
    try:
        return settings()
    except ValueError as e:
        raise GrammarError(str(e)) from None


def _disk() -> DiskCache | None:
    return DiskCache() if _settings().grammar_disk_cache else None


def normalize_spec(kind: str, spec: Any) -> str:
    """Canonical string form of a spec (the cache key); validates kind and type."""
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {list(KINDS)}")
    if kind == "choices":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                raise GrammarError("choices: expected a list of strings or its JSON text") from None
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
            raise GrammarError("choices: expected a non-empty list of strings")
        return json.dumps(list(spec), ensure_ascii=False)
    if kind == "json_schema" and isinstance(spec, dict):
        return json.dumps(spec)  # key order matters: properties are emitted in order
    if not isinstance(spec, str) or not spec.strip():
        raise GrammarError(f"{kind}: expected a non-empty string spec")
    return spec


def regex_backend() -> str:
    """"native" (default), "lazy" or "outlines", the regex_backend setting
    (SGL_REGEX_BACKEND); "outlines" when the whole grammar backend is outlines, "lazy"
    for "native" where the C library does not build."""
    s = _settings()
    if s.grammar_backend == "outlines":
        return "outlines"
    if s.regex_backend == "native":
        from .native.binding import available

        return "native" if available() else "lazy"
    return s.regex_backend


def grammar_backend() -> str:
    """"ours" (default), "llguidance", "outlines" or "xgrammar" (SGL_GRAMMAR_BACKEND,
    --grammar-backend)."""
    return _settings().grammar_backend


def json_whitespace() -> str | None:
    """The JSON whitespace setting: "" compact (constrained_json_disable_any_whitespace),
    the constrained_json_whitespace_pattern regex, or None (the backend's default:
    DEFAULT_JSON_WHITESPACE on ours and outlines, llguidance's and xgrammar's own)."""
    s = _settings()
    return "" if s.constrained_json_disable_any_whitespace else s.constrained_json_whitespace_pattern


def _our_json_whitespace() -> str:
    ws = json_whitespace()
    return DEFAULT_JSON_WHITESPACE if ws is None else ws


def _memory_key(kind: str, spec_s: str, tok: TokenizerInfo) -> str:
    # The backends are part of the key so flipping a backend never serves another's tables,
    # and so is the JSON whitespace setting.
    tag = f"{kind}@{regex_backend()}"
    if kind == "json_schema":
        tag += f"/ws={json_whitespace()!r}"
    return cache_key(f"{tag}/{grammar_backend()}", spec_s, tok.hash)


def _cached(key: str) -> Any | None:
    """The compiled grammar cached under `key`, unless its engine has failed: a native
    engine that met its state bound (states accumulate over every request that shares
    it) would fail each new path for good, so the next request compiles it afresh."""
    hit = _memory.get(key)
    if hit is not None and getattr(hit, "failed", False):
        log.info("grammar %s: its cached engine failed (state bound or out of memory); compiling afresh", key[:12])
        return None
    return hit


def compile_tables(kind: str, spec: Any, tok: TokenizerInfo, *, use_cache: bool = True) -> Any:
    """Compiled (shareable) tables for a spec; raises GrammarError for bad specs."""
    spec_s = normalize_spec(kind, spec)
    key = _memory_key(kind, spec_s, tok)
    if use_cache:
        hit = _cached(key)
        if hit is not None:
            return hit
    compiled = _build(kind, spec_s, tok, key, use_cache)
    if use_cache:
        _memory.put(key, compiled)
    return compiled


def compile_grammar(kind: str, spec: Any, tok: TokenizerInfo) -> Grammar:
    """A fresh matcher at the start state for `spec` (see module doc for kinds)."""
    return compile_tables(kind, spec, tok).new_matcher()


def _build(kind: str, spec: str, tok: TokenizerInfo, key: str, use_disk: bool) -> Any:
    backend = grammar_backend()
    if backend == "llguidance":
        from .llg import CompiledLLG

        return CompiledLLG(kind, spec, tok, json_whitespace())
    if backend == "xgrammar":
        from .xgr import CompiledXGR

        return CompiledXGR(kind, spec, tok, json_whitespace() != "")
    if backend == "outlines" and kind not in _INDEX_KINDS:
        raise GrammarError(f"{kind}: the outlines grammar backend supports regex, json_schema and choices "
                           "only; use --grammar-backend ours (or llguidance, xgrammar) for CFGs")
    if kind in _INDEX_KINDS:
        from .regex_grammar import (CompiledRegex, build_index, choices_to_regex,
                                    json_schema_to_regex)

        # The disk entry is keyed by the final regex, not the spec: converting is cheap,
        # and a changed converter must never be served an index built by the old one.
        disk = _disk() if use_disk else None
        if kind == "json_schema" and regex_backend() != "outlines":
            machines = _schema_machines(spec, _our_json_whitespace(), regex_backend() == "native")
            if machines.subs:  # recursion, free-form values or size: the pushdown backend
                return _build_pushdown(machines, tok, kind, disk)
            return _build_lazy(machines.root, tok, kind, disk)
        if kind == "regex":
            regex = spec
        elif kind == "choices":
            regex = choices_to_regex(json.loads(spec))
        else:
            regex = json_schema_to_regex(spec, _our_json_whitespace(), leading=True)
        if regex_backend() != "outlines":
            return _build_lazy(regex, tok, kind, disk)
        disk_key = cache_key("regex", regex, tok.hash)
        index = disk.get(disk_key) if disk is not None else None
        if index is None:
            index = build_index(regex, tok, kind)
            if disk is not None:
                disk.put(disk_key, index)
        return CompiledRegex(index, tok, kind)
    disk = _disk() if use_disk else None
    if kind == "ebnf":
        from .cfg_machines import compile_cfg
        from .gbnf import parse_gbnf

        return compile_cfg(parse_gbnf(spec), tok, kind, lambda rx: _cached_dfa(rx, kind, disk),
                           native=regex_backend() == "native")
    return _build_lark(spec, tok, disk)


def _build_lark(spec: str, tok: TokenizerInfo, disk: DiskCache | None) -> Any:
    """LALR(1) with our lexer when Lark's table has no conflict; any other CFG goes the
    general route (cfg_lark.py -> pushdown machines)."""
    from .lark_grammar import CompiledLark

    if not _lalr_conflict(spec):
        return CompiledLark(spec, tok, kind="lark")
    from .cfg_lark import ROOT, lark_rules
    from .cfg_machines import compile_cfg

    return compile_cfg(lark_rules(spec), tok, "lark", lambda rx: _cached_dfa(rx, "lark", disk), root=ROOT,
                       native=regex_backend() == "native")


def _lalr_conflict(spec: str) -> bool:
    """Does Lark's LALR(1) table have a shift/reduce or reduce/reduce conflict? Lark
    resolves shift/reduce silently (by shifting), which can drop valid strings, so
    strict mode tells. Other errors are left to the real build to report."""
    import lark

    try:
        lark.Lark(spec, parser="lalr", strict=True)
    except lark.exceptions.GrammarError as e:
        msg = str(e)
        return "Shift/Reduce" in msg or "Reduce/Reduce" in msg
    except Exception:  # noqa: BLE001 - lexer collisions, syntax errors: not a table conflict
        return False
    return False


def _build_lazy(regex: str, tok: TokenizerInfo, kind: str, disk: DiskCache | None) -> Any:
    if regex_backend() == "native":
        from .native.compiled import from_regex

        return from_regex(regex, tok, kind, lambda rx: _cached_dfa(rx, kind, disk))
    from .lazy_regex import CompiledLazyRegex

    return CompiledLazyRegex(_cached_dfa(regex, kind, disk), tok, kind)


def dfa_disk_key(regex: str) -> str:
    """The disk-cache key of a regex's byte DFA. A byte DFA does not depend on the
    vocabulary: one entry serves every tokenizer."""
    from . import dfa_build

    return cache_key(f"{dfa_build.DFA_VERSION}/{dfa_build.dfa_engine()}", regex, "bytes")


def _cached_dfa(regex: str, kind: str, disk: DiskCache | None) -> Any:
    from . import dfa_build
    from .byte_dfa import ByteDFA

    disk_key = dfa_disk_key(regex)
    dfa = disk.get(disk_key) if disk is not None else None
    if not isinstance(dfa, ByteDFA) or not dfa.well_formed():
        dfa = dfa_build.build_byte_dfa(regex, kind)
        if disk is not None:
            disk.put(disk_key, dfa)
    return dfa


def _schema_machines(spec: str, whitespace: str, lazy_dfa: bool) -> Any:
    """The json_schema converter in machine mode (`whitespace` between JSON tokens and
    before the value; counting as the native engine affords where `lazy_dfa`, else as
    whole-DFA backends do); GrammarError for anything it refuses."""
    from .json_schema import LAZY_DFA, WHOLE_DFA, schema_to_machines

    try:
        return schema_to_machines(json.loads(spec), whitespace=whitespace, leading=True,
                                  limits=LAZY_DFA if lazy_dfa else WHOLE_DFA)
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema: not valid JSON ({e})") from None
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - any converter failure is a refusal, not a crash
        raise GrammarError(f"json_schema: cannot convert schema ({e})") from None


def _build_pushdown(machines: Any, tok: TokenizerInfo, kind: str, disk: DiskCache | None) -> Any:
    """Machine regexes -> the native engine's machines; or (numpy backend) byte DFAs
    (each disk-cached like a lazy regex's; an Intersect sub's product DFA cached under
    its parts) -> pushdown."""
    if regex_backend() == "native":
        from .native.compiled import from_machines

        return from_machines(machines.root, machines.subs, tok, kind, lambda rx: _cached_dfa(rx, kind, disk))
    from . import dfa_build
    from .byte_dfa import ByteDFA
    from .pushdown import CompiledPushdown
    from .pushdown_build import build_tables, intersect_dfa

    built: dict[str, Any] = {}

    def build(regex: str) -> Any:
        if regex not in built:
            built[regex] = _cached_dfa(regex, kind, disk)
        return built[regex]

    def build_intersect(sub: Any) -> Any:
        tag = f"{dfa_build.DFA_VERSION}/{dfa_build.dfa_engine()}/intersect"
        disk_key = cache_key(tag, "\0".join(sub.parts), "bytes")
        dfa = disk.get(disk_key) if disk is not None else None
        if not isinstance(dfa, ByteDFA):
            dfa = intersect_dfa(sub, build)
            if disk is not None:
                disk.put(disk_key, dfa)
        return dfa

    # Sub-machines are built on first use unless SGL_PUSHDOWN_LAZY=0 (all at compile).
    tables = build_tables(machines.root, machines.subs, build, kind, build_intersect, _settings().pushdown_lazy)
    return CompiledPushdown(tables, tok, kind)


def clear_memory_cache() -> None:
    _memory.clear()


def memory_cache_stats() -> dict[str, int]:
    return {"entries": len(_memory), "hits": _memory.hits, "misses": _memory.misses}


class GrammarCompiler:
    """Background compile service for one tokenizer.

    `submit` returns at once with a Future[Grammar]; cache hits come back already done.
    A compile that runs past `timeout_s` fails its future with GrammarError; the worker
    thread itself cannot be interrupted and finishes (its result still fills the cache).
    """

    def __init__(self, tok: TokenizerInfo, max_workers: int = 1, timeout_s: float = 60.0) -> None:
        self.tok = tok
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sgl-grammar")

    def submit(self, kind: str, spec: Any) -> "cf.Future[Grammar]":
        out: cf.Future[Grammar] = cf.Future()
        out.set_running_or_notify_cancel()
        try:
            key = _memory_key(kind, normalize_spec(kind, spec), self.tok)
        except GrammarError as e:
            out.set_exception(e)
            return out
        hit = _cached(key)
        if hit is not None:
            out.set_result(hit.new_matcher())
            return out

        lock = threading.Lock()

        def finish(fn: str, value: Any) -> None:
            with lock:
                if not out.done():
                    getattr(out, fn)(value)

        def on_done(f: cf.Future[Grammar]) -> None:
            e = f.exception()
            if e is not None and not isinstance(e, GrammarError):
                e = GrammarError(f"{kind}: compile failed ({type(e).__name__}: {e})")
            finish("set_exception", e) if e is not None else finish("set_result", f.result())

        inner = self._pool.submit(compile_grammar, kind, spec, self.tok)
        inner.add_done_callback(on_done)
        if self.timeout_s and self.timeout_s > 0:
            timer = threading.Timer(self.timeout_s, finish, args=(
                "set_exception", GrammarError(f"{kind}: compile timed out after {self.timeout_s:g}s")))
            timer.daemon = True
            timer.start()
            out.add_done_callback(lambda _f: timer.cancel())
        return out

    def shutdown(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)
