"""Engine-level properties of the native grammar engine (native/*.c through binding.py):
one compiled grammar stepped and masked from several threads, error paths that must
raise GrammarError and leave the engine usable (bad configurations, refused tables,
intersections of visible machines, finalize twice), the DFA state bound (an error that
sticks to the engine and ends only the request that meets it), and stacks deeper than
the C stack could recurse.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from sgl.runtime.constrained import registry
from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.native.binding import NativeEngine, available, config_of, words_of
from sgl.runtime.constrained.native.compiled import CompiledNative
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.output import OutputProcessor
from sgl.runtime.scheduler.req import Req

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: the native engine is off")

START = config_of([1, 2, 0, 0])
SCHEMA = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"type": "string"}},
    "kids": {"type": "array", "items": {"$ref": "#"}}, "n": {"type": "integer"}}}


@pytest.fixture
def native(monkeypatch, no_grammar_disk_cache):
    monkeypatch.setenv("SGL_REGEX_BACKEND", "native")


def _regex_engine(rx: str, **kw) -> NativeEngine:
    eng = NativeEngine(1, "regex", **kw)
    assert eng.set_regex(0, rx, calls=False, uni=None)
    eng.finalize()
    return eng


def _observe(c: CompiledNative, cfg: bytes, vocab: int) -> tuple[bytes, bool, bytes]:
    m = np.zeros(vocab, dtype=np.uint8)
    c.engine.mask_into(cfg, m)
    return np.packbits(m).tobytes(), c.engine.can_end(cfg), c.engine.forced(cfg, 64)


# ---------------------------------------------------------------------- threads
def test_threads_share_one_engine(tok, native):
    """Token walks chosen on one engine, replayed by four threads at once on a cold one
    (whose states are built lazily, concurrently): the same masks, ends, forced bytes.
    State numbers differ between the two engines, so configurations are not compared."""
    ref = registry.compile_tables("json_schema", SCHEMA, tok, use_cache=False)
    r = random.Random(0)
    plans = []
    for _ in range(8):
        cfg, path, seen = ref.initial, [], []
        for _ in range(25):
            seen.append(_observe(ref, cfg, tok.vocab_size))
            ids = np.nonzero(np.unpackbits(np.frombuffer(seen[-1][0], np.uint8), count=tok.vocab_size))[0]
            if not ids.size:
                break
            path.append(int(r.choice(ids.tolist())))
            cfg = ref.engine.step(cfg, tok.token_bytes[path[-1]])
        plans.append((path, seen))
    cold = registry.compile_tables("json_schema", SCHEMA, tok, use_cache=False)
    assert cold.num_states < ref.num_states
    failures: list[object] = []

    def replay(i: int) -> None:
        try:
            order = list(range(len(plans)))
            random.Random(i).shuffle(order)
            for j in order:
                path, seen = plans[j]
                cfg = cold.initial
                for k, want in enumerate(seen):
                    if _observe(cold, cfg, tok.vocab_size) != want:
                        failures.append((i, j, k))
                        break
                    if k < len(path):
                        cfg = cold.engine.step(cfg, tok.token_bytes[path[k]])
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append((i, repr(e)))

    threads = [threading.Thread(target=replay, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert cold.num_states == ref.num_states  # the same states, built once each


# ---------------------------------------------------------------------- bad input
BAD_CONFIGS = [[], [1], [1, 2], [1, 2, 0], [1, 2, 1, 0], [1, 2, 0, 99], [1, 2, -1, 0], [1, 2, 0, -1],
               [1, 3, 0, 0, 0], [1, 0], [2, 2, 0, 0], [1, 1 << 30, 0, 0], [1, -2, 0, 0]]


@pytest.mark.parametrize("words", BAD_CONFIGS)
def test_bad_configs_are_errors(words):
    eng = _regex_engine("ab(?:c|d)*")
    cfg = config_of(words)
    for op in (lambda: eng.step(cfg, b"a"), lambda: eng.can_end(cfg), lambda: eng.forced(cfg, 8),
               lambda: eng.mask_into(cfg, np.zeros(8, np.uint8))):
        with pytest.raises(GrammarError, match="engine error 7"):
            op()
    assert eng.can_end(eng.step(START, b"abcd")) and eng.step(START, b"ax") is None  # still usable


def test_garbage_configs_never_crash():
    eng = NativeEngine(3, "i")
    eng.set_regex(1, "a+", calls=False, uni=None, hidden=True)
    eng.set_regex(2, "a{2}", calls=False, uni=None, hidden=True)
    eng.set_intersect(0, [1, 2])
    eng.finalize()
    r = random.Random(0)
    ok = 0
    for _ in range(2000):
        cfg = config_of([r.randint(-2, 4) for _ in range(r.randint(0, 12))])
        try:
            eng.step(cfg, b"a")
            eng.can_end(cfg)
            eng.forced(cfg, 4)
            eng.mask_into(cfg, np.zeros(4, np.uint8))
            ok += 1
        except GrammarError:
            pass
    assert 100 < ok < 1900
    assert eng.can_end(eng.step(START, b"aa")) and eng.step(START, b"aaa") is None


def test_no_stacks_is_a_dead_end():
    eng = _regex_engine("ab")
    none = config_of([0])
    assert eng.step(none, b"a") is None and not eng.can_end(none) and eng.forced(none, 8) == b""


def test_refused_table_leaves_machine_unset():
    eng = NativeEngine(1, "t")
    t = np.full((2, 256), -1, np.int32)
    t[0, ord("a")], t[1, ord("b")] = 1, 5
    with pytest.raises(GrammarError):  # target 5 of a 2-state table
        eng.set_table(0, t, np.array([0, 1]))
    with pytest.raises(GrammarError):  # return state out of range
        eng.set_table(0, t * 0 - 1, np.array([0, 1]), [(0, 1, 7)])
    t[1, ord("b")] = 1
    eng.set_table(0, t, np.array([0, 1]))
    assert eng._lib.sgl_gram_machine_states(eng._h, 0) == 2  # nothing left of the refused ones
    eng.finalize()
    assert words_of(eng.step(START, b"abb")) == [1, 2, 0, 1] and eng.can_end(eng.step(START, b"a"))


def test_table_state_bound():
    eng = NativeEngine(1, "t", max_states=3)
    with pytest.raises(GrammarError, match="exceeds 3 states"):
        eng.set_table(0, np.full((4, 256), -1, np.int32), np.zeros(4))
    eng.set_table(0, np.full((2, 256), -1, np.int32), np.array([1, 0]))


def test_calls_to_missing_machines_are_dropped():
    eng = NativeEngine(2, "t")
    t = np.full((2, 256), -1, np.int32)
    t[0, ord("a")] = 1
    eng.set_table(0, t, np.array([0, 1]), [(0, 1, 1), (0, 99, 1)])  # machine 99 does not exist
    eng.set_regex(1, "x", calls=False, uni=None)
    eng.finalize()
    assert eng.can_end(eng.step(START, b"x")) and eng.can_end(eng.step(START, b"a"))
    assert eng.step(START, b"y") is None


def test_intersection_parts_must_be_hidden():
    eng = NativeEngine(3, "i")
    eng.set_regex(1, "a+", calls=False, uni=None)
    eng.set_regex(2, "a{2}", calls=False, uni=None)
    eng.set_intersect(0, [1, 2])
    with pytest.raises(GrammarError, match="engine error 7"):
        eng.finalize()
    eng = NativeEngine(3, "i")
    eng.set_regex(1, "a+", calls=False, uni=None, hidden=True)
    eng.set_intersect(0, [1, 7])  # no machine 7
    with pytest.raises(GrammarError, match="engine error 7"):
        eng.finalize()


def test_setup_after_finalize_is_an_error():
    eng = _regex_engine("abc")
    with pytest.raises(GrammarError, match="engine error 7"):
        eng.finalize()
    with pytest.raises(GrammarError, match="engine error 7"):
        eng.set_regex(0, "x", calls=False, uni=None)
    with pytest.raises(GrammarError, match="engine error 7"):
        eng.export(5)


def test_table_of_the_wrong_shape_is_refused():
    """The C side reads n x 256 targets and n accept flags: a table of another shape is a
    GrammarError, never a read past the arrays."""
    eng = NativeEngine(1, "regex")
    trans = np.full((3, 256), -1, dtype=np.int32)
    with pytest.raises(GrammarError, match="expected \\[n, 256\\] and \\[n\\]"):
        eng.set_table(0, trans[:, :100], np.ones(3, dtype=bool))
    with pytest.raises(GrammarError, match="expected"):
        eng.set_table(0, trans, np.ones(2, dtype=bool))
    with pytest.raises(GrammarError, match="expected"):
        eng.set_table(0, trans.reshape(-1), np.ones(3, dtype=bool))
    eng.set_table(0, trans, np.ones(3, dtype=bool))  # the machine is still settable


# ---------------------------------------------------------------------- the state bound
def _bounded(tok, max_states: int) -> CompiledNative:
    return CompiledNative(_regex_engine("x[a-z]{0,5000}", max_states=max_states), tok, "regex")


def _token(tok, text: bytes) -> int:
    return next(i for i, b in enumerate(tok.token_bytes) if b == text)


def test_state_bound_is_a_sticky_engine_error(tok):
    c = _bounded(tok, 300)
    eng, cfg = c.engine, c.initial
    x, ab = _token(tok, b"x"), _token(tok, b"ab")
    with pytest.raises(GrammarError, match="exceeds 300 states"):
        for _ in range(1000):
            cfg = eng.step(cfg, b"ab" if cfg != c.initial else b"x")
    assert c.num_states == 300
    # Paths through states already built still work, for any request; new ones do not.
    g = c.new_matcher()
    for t in [x] + [ab] * 20:
        g.accept_token(t)
    with pytest.raises(GrammarError, match="exceeds 300 states"):
        for _ in range(1000):
            g.accept_token(ab)


def test_state_sets_have_a_byte_budget(tok):
    """Each DFA state of x(?:[a-z]?){2000} holds ~2,000 NFA members (8 KB): a budget on
    those bytes, not only on the state count, stops such a grammar long before the
    states would (a nested repeat makes each state hold millions: GBs per request).
    Like the state bound, it is a sticky error with its own message."""
    c = CompiledNative(_regex_engine("x(?:[a-z]?){2000}", max_set_bytes=64 << 10), tok, "regex")
    eng, cfg = c.engine, c.initial
    assert not c.failed
    with pytest.raises(GrammarError, match="more than 64 KB of DFA state sets"):
        cfg = eng.step(cfg, b"x")
        for _ in range(100):
            cfg = eng.step(cfg, b"a")
    assert c.failed and 2 <= c.num_states <= 12  # 64 KB / 8 KB per state, not 100 states
    with pytest.raises(GrammarError, match="DFA state sets"):  # sticky: the next walk fails at the same frontier
        eng.step(c.initial, b"x" + b"a" * 100)
    # A small NFA never comes near the default budget.
    small = CompiledNative(_regex_engine("x[a-z]{0,50}"), tok, "regex")
    cfg = small.engine.step(small.initial, b"x" + b"a" * 50)
    assert small.engine.can_end(cfg) and not small.failed


def test_state_bound_ends_only_the_request(tok):
    """Masks, end tests and jump-forward of a request that meets the bound answer
    harmlessly and record the error; its next accept_token raises it, which the
    scheduler turns into this request's abort (the loop and other requests go on)."""
    c = _bounded(tok, 400)
    x, ab = _token(tok, b"x"), _token(tok, b"ab")
    out = OutputProcessor(tokenizer=None, eos_ids=set(tok.eos_token_ids), enable_jump_forward=True)
    req = Req(rid="r", input_ids=[1], params=SamplingParams(max_new_tokens=10_000), grammar=c.new_matcher())
    row = torch.zeros(tok.vocab_size, dtype=torch.bool)
    for k in range(1000):
        row.zero_()
        req.grammar.fill_mask(row)
        if req.grammar.error is not None:
            break
        assert not row.all()
        out.append_token(req, x if k == 0 else ab, None, None)  # must not raise
        assert req.finish_reason is None
    else:
        pytest.fail("the bound was never met")
    assert row.all()  # every token let through once
    assert not req.grammar.is_terminated() and req.grammar.jump_forward_string() is None
    out.append_token(req, ab, None, None)
    assert req.finish_reason["type"] == "abort" and "exceeds 400 states" in req.finish_reason["message"]


def test_bound_met_by_an_end_test_is_recorded(tok):
    c = _bounded(tok, 400)
    g = c.new_matcher()
    g.accept_token(_token(tok, b"x"))
    while c.num_states < 330:  # steps alone, no masks: 2 states per "ab"
        g.accept_token(_token(tok, b"ab"))
    assert g.can_end()
    assert g.is_terminated() is False  # its mask walk would pass the bound
    assert g.error is not None and g.jump_forward_string() is None
    with pytest.raises(GrammarError, match="exceeds 400 states"):
        g.accept_token(_token(tok, b"ab"))


def test_bound_met_by_jump_forward_is_recorded(tok):
    c = CompiledNative(_regex_engine("x-{1000}y", max_states=400), tok, "regex")
    g = c.new_matcher()
    g.accept_token(_token(tok, b"x"))
    assert g.jump_forward_string() is None  # 1000 forced bytes would pass the bound
    assert g.error is not None and not g.is_terminated()
    with pytest.raises(GrammarError, match="exceeds 400 states"):
        g.accept_token(_token(tok, b"-"))


def test_cached_grammar_whose_engine_failed_is_compiled_afresh(tok, native, monkeypatch):
    """States accumulate over every request sharing a cached grammar: once they pass the
    bound, the cache must not keep handing out that engine (every new path would fail
    until restart). The next request compiles the spec afresh; in-flight requests keep
    the old engine. The bound is lowered so the test builds 300 states, not 400,000."""
    from sgl.runtime.constrained.native import binding

    monkeypatch.setattr(binding, "MAX_STATES", 300)
    registry.clear_memory_cache()
    try:
        rx = "x[a-z]{0,5000}"
        first = registry.compile_tables("regex", rx, tok)
        assert isinstance(first, CompiledNative) and not first.failed
        assert registry.compile_tables("regex", rx, tok) is first  # a healthy engine is reused
        old = first.new_matcher()
        x, ab = _token(tok, b"x"), _token(tok, b"ab")
        old.accept_token(x)
        with pytest.raises(GrammarError, match="exceeds 300 states"):
            for _ in range(1000):
                old.accept_token(ab)
        assert first.failed
        fresh = registry.compile_tables("regex", rx, tok)
        assert fresh is not first and not fresh.failed and fresh.num_states < 300
        g = fresh.new_matcher()  # the same walk now gets 100 steps in before its own bound
        g.accept_token(x)
        for _ in range(100):
            g.accept_token(ab)
        assert registry.compile_tables("regex", rx, tok) is fresh
        # The background compiler takes the same rule.
        with pytest.raises(GrammarError, match="exceeds 300 states"):
            for _ in range(1000):
                g.accept_token(ab)
        compiler = registry.GrammarCompiler(tok)
        try:
            m = compiler.submit("regex", rx).result(timeout=60)
        finally:
            compiler.shutdown()
        assert m.compiled is not fresh and not m.compiled.failed
    finally:
        registry.clear_memory_cache()


# ---------------------------------------------------------------------- deep stacks
def test_pop_chain_deeper_than_the_c_stack(tok, native):
    """A byte that closes 200k accepting frames at once (CFG mode keeps them: the return
    state after `r?` still allows "b", so it is not idempotent)."""
    c = registry.compile_tables("ebnf", 'root ::= r "c"\nr ::= "a" r? "b"?\n', tok, use_cache=False)
    cfg = c.initial
    for _ in range(3):
        cfg = c.step_bytes(cfg, b"a")
    w = words_of(cfg)  # [1, len, root frame, (r's return frame) x 2, r's top]
    assert w[0] == 1 and w[4:6] == w[6:8]
    frame, top = w[4:6], w[-2:]
    deep = w[2:4] + frame * 200_000 + top
    deep_cfg = config_of([1, len(deep)] + deep)
    end = c.step_bytes(deep_cfg, b"c")
    assert end is not None and c.can_end(end)
    assert c.step_bytes(deep_cfg, b"b") is not None and c.step_bytes(deep_cfg, b"x") is None
    assert not c.can_end(deep_cfg)
