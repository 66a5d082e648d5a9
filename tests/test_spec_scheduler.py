"""Speculative decoding in the scheduler, against the fake model (next token a pure
function of the previous token and its position): outputs are exactly those of plain
decoding whatever the drafts, a step yields several tokens when drafts are right, KV
invariants hold after every step (no slot of a rejected draft kept or lost), and stop
conditions, max_new_tokens, retraction, step-row caps and grammars all behave."""

from __future__ import annotations

import random
from typing import Any, Sequence

import pytest

from sgl.radix import RadixTree
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.req import ReqOutput
from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from sgl.runtime.scheduler.speculate import Speculator
from sgl.runtime.speculative.ngram import NgramProposer
from sgl.runtime.speculative.proposer import SpecOptions
from tests.fakes import EOS, CharTokenizer, FakeExecutor, FakeRunner, expected_output, next_token
from tests.test_scheduler import EXECUTORS, LiteralCompiler, assert_all_free, run_all, submit


class OracleProposer:
    """Proposes the fake model's true continuation, wrong at a varying position (or never),
    so full, partial and zero acceptance all happen."""

    def __init__(self, wrong_every: int = 3) -> None:
        self.calls = 0
        self.wrong_every = wrong_every
        self.released: list[int] = []

    def propose(self, reqs: Sequence[Any], budgets: Sequence[int]) -> list[list[int]]:
        out = []
        for req, b in zip(reqs, budgets):
            self.calls += 1
            seq = list(req.fill_ids)
            drafts = []
            for _ in range(b):
                drafts.append(next_token(seq[-1], len(seq) - 1))
                seq.append(drafts[-1])
            bad = (self.calls + req.uid) % (b + self.wrong_every) if b else 0
            if bad < b:
                drafts[bad] = 3 + (drafts[bad] + 1 - 3) % 61  # another valid token, never EOS
            out.append(drafts)
        return out

    def release(self, uid: int) -> None:
        self.released.append(uid)


def make_spec(proposer: Any, k: int = 4, num_slots: int = 4096, executor: str = "fake", max_step_rows: int | None = None,
              max_running: int = 64, grammar_compiler: Any = None) -> tuple[Scheduler, Any]:
    kv = KVCache(RadixTree(), SlotAllocator(num_slots), ReqToTokenPool(max_running + Scheduler.REQ_TABLE_SLACK, 1024))
    cfg = SchedulerConfig(max_running_requests=max_running, check_invariants_when_idle=True)
    spec = Speculator(SpecOptions("ngram", num_draft_tokens=k, max_step_rows=max_step_rows), proposer)
    if executor == "runner":
        runner = FakeRunner()
        return Scheduler(cfg, runner, kv, CharTokenizer(), {EOS}, grammar_compiler, speculator=spec), runner
    fake = FakeExecutor(kv.req_to_token.table, track_kv=True)
    return Scheduler(cfg, None, kv, CharTokenizer(), {EOS}, grammar_compiler, executor=fake, speculator=spec), fake


def prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, 60) for _ in range(rng.randrange(1, 30))] for i in range(n)}


def run_plain_outputs(s: Scheduler, ps: dict[str, list[int]], max_new: int) -> None:
    """Submit every prompt, drain (invariants after each step), and check each output is
    exactly the fake model's plain greedy continuation."""
    results: dict[str, ReqOutput] = {}
    for rid, p in ps.items():
        submit(s, rid, p, max_new, results)
    run_all(s)
    for rid, p in ps.items():
        assert results[rid].output_ids == expected_output(p, max_new), rid


@pytest.mark.parametrize("executor", EXECUTORS)
def test_outputs_equal_plain_decoding_and_steps_yield_several_tokens(executor: str) -> None:
    prop = OracleProposer()
    s, ex = make_spec(prop, executor=executor)
    ps = prompts(12)
    results: dict[str, ReqOutput] = {}
    reqs = {rid: submit(s, rid, p, 24, results) for rid, p in ps.items()}
    run_all(s)  # check_invariants after every step
    for rid, p in ps.items():
        out = results[rid]
        assert out.output_ids == expected_output(p, 24), rid
        m = out.meta_info
        assert m["finish_reason"] == {"type": "length", "length": 24}
        assert m["spec_accepted_tokens"] <= m["spec_draft_tokens"]
        assert m["spec_accept_length"] == 24 / m["spec_verify_ct"]
        assert m["spec_verify_ct"] < 23  # several tokens per decode step
    snap = s.snapshot()
    assert 0 < snap["spec_accept_rate"] < 1  # some drafts were wrong, some right
    assert snap["spec_accept_length"] > 1.5
    assert sorted(prop.released) == sorted(r.uid for r in reqs.values())
    assert all(not r.draft_slots and not r.draft_ids for r in reqs.values())
    assert s.stats["num_forward_passes"] < 12 * 23
    assert_all_free(s)


def test_rejected_drafts_never_leave_their_kv_behind() -> None:
    """The fake KV holds, per slot, the token sequence it was computed for; every step
    asserts each attended slot matches the request's real tokens (FakeExecutor.track_kv),
    so a kept slot of a rejected draft fails the next step."""
    s, ex = make_spec(OracleProposer(wrong_every=1), k=5)
    ps = prompts(6, seed=3)
    run_plain_outputs(s, ps, 30)
    assert ex.attended  # rows were checked
    assert_all_free(s)


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 7])
def test_max_new_tokens_is_exact(max_new: int) -> None:
    s, ex = make_spec(OracleProposer(wrong_every=10**6), k=4)  # drafts always right
    results: dict[str, ReqOutput] = {}
    submit(s, "a", [5, 6, 7], max_new, results)
    run_all(s)
    assert results["a"].output_ids == expected_output([5, 6, 7], max_new)
    for plan in ex.plans:
        for r in plan.rows:
            if r.sample is not None and r.sample.draft_ids:
                assert len(r.sample.draft_ids) <= max_new - 1
    assert_all_free(s)


def test_stop_token_inside_accepted_drafts_cuts_there() -> None:
    p = [9, 10, 11]
    full = expected_output(p, 20)
    stop_at = 6
    assert full[stop_at] not in full[:stop_at]
    s, _ = make_spec(OracleProposer(wrong_every=10**6), k=5)
    results: dict[str, ReqOutput] = {}
    submit(s, "a", p, 20, results, stop_token_ids=[full[stop_at]])
    run_all(s)
    out = results["a"]
    assert out.output_ids == full[: stop_at + 1]
    assert out.meta_info["finish_reason"] == {"type": "stop", "matched": full[stop_at]}
    assert_all_free(s)


def test_memory_pressure_retracts_with_drafts_and_all_finish() -> None:
    s, _ = make_spec(OracleProposer(), k=4, num_slots=160)
    ps = prompts(10, seed=5)
    run_plain_outputs(s, ps, 20)
    assert s.stats["num_retractions_total"] > 0
    assert_all_free(s)


def test_step_rows_are_capped() -> None:
    s, ex = make_spec(OracleProposer(wrong_every=10**6), k=4, max_step_rows=5)
    ps = prompts(3, seed=7)
    run_plain_outputs(s, ps, 16)
    decode_steps = [b for b in ex.batches if all(x > 0 for x in b.prefix_lens_cpu)]
    assert decode_steps and all(b.num_tokens <= 5 for b in decode_steps)
    assert any(b.num_tokens > b.batch_size for b in decode_steps)  # drafts did run
    assert_all_free(s)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_grammar_clips_drafts_and_output_matches_plain_decoding(executor: str) -> None:
    """A grammar forcing a literal after 2 free tokens: drafts that leave the literal are
    cut before verification, jump-forward still fires, outputs equal spec off."""
    from tests.test_scheduler import make

    def run(spec: bool) -> dict[str, ReqOutput]:
        if spec:
            s, _ = make_spec(OracleProposer(), k=4, executor=executor, grammar_compiler=LiteralCompiler())
        else:
            s, _ = make(executor=executor, grammar_compiler=LiteralCompiler())
        results: dict[str, ReqOutput] = {}
        submit(s, "g", [5, 6], 20, results, regex="3:xyzwxyz")
        submit(s, "h", [7, 8, 9], 20, results, regex="6:abc")
        run_all(s)
        assert_all_free(s)
        return results

    plain, spec = run(False), run(True)
    for rid in ("g", "h"):
        assert spec[rid].output_ids == plain[rid].output_ids, f"{rid} {spec[rid].output_ids} {plain[rid].output_ids}"
        assert spec[rid].meta_info["finish_reason"] == plain[rid].meta_info["finish_reason"]


def test_ngram_proposer_in_the_loop() -> None:
    s, _ = make_spec(NgramProposer(1, 4), k=3)
    ps = prompts(8, seed=11)
    run_plain_outputs(s, {rid: p * 3 for rid, p in ps.items()}, 24)  # repetitive: the index finds matches
    assert s.snapshot()["spec_draft_tokens_total"] > 0
    assert_all_free(s)


class SegmentsGrammar:
    """Alternating segments "2:xy:2:zw": 2 free tokens, the literal "xy", 2 free, "zw",
    then the end. Jump-forward fires in the middle of a request, not only at its end."""

    def __init__(self, spec: str) -> None:
        parts = spec.split(":")
        self.segs: list[int | str] = [int(p) if p.isdigit() else p for p in parts]
        self.hist: list[int] = []
        self.tok = CharTokenizer()

    def _where(self, hist: list[int]) -> tuple[int, int] | None:
        """(segment, offset inside it) after `hist`, or None past the end."""
        i = 0
        for seg_i, seg in enumerate(self.segs):
            n = seg if isinstance(seg, int) else len(seg)
            if len(hist) - i < n:
                return seg_i, len(hist) - i
            i += n
        return None

    def fill_mask(self, mask_row: Any) -> None:
        w = self._where(self.hist)
        if w is None:
            mask_row[EOS] = True
            return
        seg = self.segs[w[0]]
        if isinstance(seg, int):
            mask_row[3:] = True
        else:
            mask_row[self.tok.encode(seg[w[1]])[0]] = True

    def accept_token(self, token_id: int) -> None:
        w = self._where(self.hist)
        if w is None:
            raise ValueError("the grammar has ended")
        seg = self.segs[w[0]]
        if isinstance(seg, str) and self.tok.encode(seg[w[1]])[0] != token_id:
            raise ValueError(f"token {token_id} leaves the literal {seg!r}")
        self.hist.append(token_id)

    def rollback(self, num_tokens: int) -> None:
        del self.hist[len(self.hist) - num_tokens:]

    def is_terminated(self) -> bool:
        return self._where(self.hist) is None

    def jump_forward_string(self) -> str | None:
        w = self._where(self.hist)
        if w is None or isinstance(self.segs[w[0]], int):
            return None
        return str(self.segs[w[0]])[w[1]:]


class SegmentsCompiler:
    def submit(self, kind: str, spec: str) -> Any:
        from concurrent.futures import Future

        fut: Future = Future()
        fut.set_result(SegmentsGrammar(spec))
        return fut


class ReplayProposer:
    """Drafts the known plain-decoding output: every draft right, runs cross literals."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]) -> None:
        self.outputs = outputs

    def propose(self, reqs: Sequence[Any], budgets: Sequence[int]) -> list[list[int]]:
        return [self.outputs[tuple(r.input_ids)][len(r.output_ids): len(r.output_ids) + b]
                for r, b in zip(reqs, budgets)]

    def release(self, uid: int) -> None:
        pass


def test_jump_forward_inside_accepted_drafts() -> None:
    """With the real verifier (masks per draft row), drafts that run through a literal are
    accepted; the literal is appended by jump-forward after the free token before it, and
    the drafts after that point are not appended twice."""
    from tests.test_scheduler import make

    prompts_ = {"g": [5, 6], "h": [7, 8, 9]}
    specs = {"g": "2:xy:3:zw:1", "h": "1:abc:2:d:2"}

    def run(proposer: Any) -> dict[str, ReqOutput]:
        if proposer is None:
            s, _ = make(executor="runner", grammar_compiler=SegmentsCompiler())
        else:
            s, _ = make_spec(proposer, k=6, executor="runner", grammar_compiler=SegmentsCompiler())
        results: dict[str, ReqOutput] = {}
        for rid, p in prompts_.items():
            submit(s, rid, p, 30, results, regex=specs[rid])
        run_all(s)
        assert_all_free(s)
        return results

    plain = run(None)
    spec = run(ReplayProposer({tuple(prompts_[r]): plain[r].output_ids for r in prompts_}))
    for rid in prompts_:
        assert plain[rid].meta_info["finish_reason"]["type"] == "stop"
        assert spec[rid].output_ids == plain[rid].output_ids, f"{rid} {spec[rid].output_ids} {plain[rid].output_ids}"
        assert spec[rid].meta_info["finish_reason"] == plain[rid].meta_info["finish_reason"]
        assert spec[rid].meta_info["spec_accepted_tokens"] > 0
