"""Scheduler tests with a fake executor that answers token ids (and, for the executor
seam, the real executor over a fake model runner's logits): batching, chunking, prefix
sharing, eviction and retraction under memory pressure, aborts, stop conditions,
jump-forward, a plan and result of plain data — and no KV slot ever lost."""

from __future__ import annotations

import dataclasses
import random
from concurrent.futures import Future
from typing import Any

import pytest

from sgl.radix import RadixTree
from sgl.runtime.executor.plan import StepPlan, StepResult
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.req import Req, ReqOutput
from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.fakes import EOS, CharTokenizer, FakeExecutor, FakeRunner, expected_output, next_token

# "fake": the scheduler against FakeExecutor (token ids, no logits); "runner": the real
# executor (ForwardBatch, sampler, prompt logprobs) over FakeRunner's logits.
EXECUTORS = ["fake", "runner"]


def make(num_slots: int = 4096, disable: bool = False, policy: str = "lpm", chunk: int = 2048,
         max_running: int = 64, mixed: bool = False, executor: str = "fake",
         grammar_compiler: Any = None) -> tuple[Scheduler, FakeExecutor | FakeRunner]:
    kv = KVCache(RadixTree(disable=disable), SlotAllocator(num_slots),
                 ReqToTokenPool(max_running + Scheduler.REQ_TABLE_SLACK, 1024))
    cfg = SchedulerConfig(schedule_policy=policy, chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 512),
                          max_running_requests=max_running, check_invariants_when_idle=True,
                          enable_mixed_chunk=mixed)
    if executor == "runner":
        runner = FakeRunner()
        return Scheduler(cfg, runner, kv, CharTokenizer(), {EOS}, grammar_compiler), runner
    fake = FakeExecutor(kv.req_to_token.table)
    return Scheduler(cfg, None, kv, CharTokenizer(), {EOS}, grammar_compiler, executor=fake), fake


def submit(s: Scheduler, rid: str, prompt: list[int], max_new: int, results: dict, **params) -> Req:
    p = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0, **params})
    req = Req(rid=rid, input_ids=prompt, params=p, on_output=lambda o: results.__setitem__(o.rid, o))
    s.submit(req)
    return req


def run_all(s: Scheduler, limit: int = 10000) -> None:
    for _ in range(limit):
        s.step()
        s.check_invariants()
        if not s.has_work() and s.inbox.empty():
            return
    raise AssertionError("scheduler did not drain")


def assert_all_free(s: Scheduler) -> None:
    assert s.kv.flush()
    assert s.kv.allocator.num_free == s.kv.allocator.capacity
    assert s.kv.req_to_token.num_free == s.kv.req_to_token.max_reqs


@pytest.mark.parametrize("executor", EXECUTORS)
def test_requests_finish_with_expected_tokens(executor: str) -> None:
    s, _ = make(executor=executor)
    rng = random.Random(0)
    results: dict[str, ReqOutput] = {}
    prompts = {f"r{i}": [rng.randrange(3, 60) for _ in range(rng.randrange(1, 40))] for i in range(20)}
    for rid, p in prompts.items():
        submit(s, rid, p, 12, results)
    run_all(s)
    for rid, p in prompts.items():
        out = results[rid]
        assert out.finished and out.meta_info["finish_reason"] == {"type": "length", "length": 12}
        assert out.output_ids == expected_output(p, 12)
    assert_all_free(s)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_memory_pressure_evicts_and_retracts_yet_all_finish(executor: str) -> None:
    s, _ = make(num_slots=160, max_running=16, executor=executor)
    rng = random.Random(1)
    results: dict[str, ReqOutput] = {}
    prompts = {f"r{i}": [rng.randrange(3, 60) for _ in range(30)] for i in range(10)}
    for rid, p in prompts.items():
        submit(s, rid, p, 40, results)
    run_all(s)
    assert s.stats["num_retractions_total"] > 0, "the pool was too small; retraction must have happened"
    for rid, p in prompts.items():
        assert results[rid].meta_info["finish_reason"]["type"] == "length"
        assert results[rid].output_ids == expected_output(p, 40)
    assert_all_free(s)


def test_tree_eviction_makes_room_for_new_requests() -> None:
    s, _ = make(num_slots=120)
    results: dict[str, ReqOutput] = {}
    for i in range(8):  # each leaves 60 tokens in the tree; the pool holds 119
        submit(s, f"r{i}", [3 + i] * 50, 10, results)
        run_all(s)
    assert len(results) == 8 and all(o.meta_info["finish_reason"]["type"] == "length" for o in results.values())
    assert s.kv.tree.total_size() <= 119
    assert_all_free(s)


def test_shared_prefix_is_computed_once() -> None:
    s, runner = make()
    results: dict[str, ReqOutput] = {}
    prefix = list(range(3, 63)) * 3  # 180 tokens
    for i in range(8):
        submit(s, f"f{i}", prefix + [10 + i], 4, results)
    run_all(s)
    cached = sorted(o.meta_info["cached_tokens"] for o in results.values())
    assert cached[0] == 0 and all(c >= 180 for c in cached[1:]), cached
    # 8 x 181 prompt tokens, but the prefix is computed once: 181 + 7 x 1 + decode steps
    assert runner.tokens_computed == 181 + 7 + 8 * 3


def test_flush_with_the_radix_cache_disabled_leaves_live_requests_alone() -> None:
    s, _ = make(disable=True)
    results: dict[str, ReqOutput] = {}
    submit(s, "a", [5, 6, 7], 10, results)
    submit(s, "b", [8, 9], 10, results)
    s.step()
    s.step()
    assert s.kv.flush()
    run_all(s)
    assert results["a"].output_ids == expected_output([5, 6, 7], 10)
    assert results["b"].output_ids == expected_output([8, 9], 10)
    assert_all_free(s)


def test_disabled_radix_cache_recomputes_but_matches() -> None:
    s, runner = make(disable=True)
    results: dict[str, ReqOutput] = {}
    prefix = list(range(3, 63)) * 2
    for i in range(4):
        submit(s, f"d{i}", prefix + [5], 6, results)
    run_all(s)
    assert all(o.meta_info["cached_tokens"] == 0 for o in results.values())
    assert all(o.output_ids == expected_output(prefix + [5], 6) for o in results.values())
    assert s.kv.allocator.num_free == s.kv.allocator.capacity


@pytest.mark.parametrize("executor", EXECUTORS)
def test_chunked_prefill_gives_same_output_and_prompt_logprobs(executor: str) -> None:
    s, runner = make(chunk=16, executor=executor)
    results: dict[str, ReqOutput] = {}
    prompt = [5] + expected_output([5], 59) + [3 + (i * 5) % 50 for i in range(40)]  # 59 predictable, 40 not
    p = SamplingParams.from_dict({"max_new_tokens": 5, "temperature": 0})
    s.submit(Req(rid="c", input_ids=prompt, params=p, return_logprob=True, logprob_start_len=0,
                 on_output=lambda o: results.__setitem__(o.rid, o)))
    run_all(s)
    out = results["c"]
    assert out.output_ids == expected_output(prompt, 5)
    lps = out.meta_info["input_token_logprobs"]
    assert len(lps) == 100 and lps[0][0] is None
    assert [t for _, t, _ in lps] == prompt
    if executor == "fake":  # each position scored once, against the right prompt token, across chunks
        assert [lp for lp, _, _ in lps[1:]] == [0.0 if prompt[k] == next_token(prompt[k - 1], k - 1) else -1.0
                                                for k in range(1, 100)]
    assert max(b.num_tokens for b in runner.batches) <= 16


def test_abort_waiting_and_running_frees_everything() -> None:
    s, _ = make(max_running=2)
    results: dict[str, ReqOutput] = {}
    for i in range(5):
        submit(s, f"a{i}", [4 + i] * 20, 50, results)
    for _ in range(5):
        s.step()
    s.abort("a0")  # running
    s.abort("a4")  # still waiting (max_running=2)
    run_all(s)
    assert results["a0"].meta_info["finish_reason"]["type"] == "abort"
    assert results["a4"].meta_info["finish_reason"]["type"] == "abort"
    assert results["a4"].output_ids == []
    assert results["a1"].meta_info["finish_reason"]["type"] == "length"
    assert_all_free(s)


def test_a_stream_never_shows_the_start_of_a_stop_string_it_then_cuts() -> None:
    s, _ = make()
    prompt = [5, 6, 7]
    text = CharTokenizer().decode(expected_output(prompt, 20))
    stop = text[6:9]
    seen: list[ReqOutput] = []
    p = SamplingParams.from_dict({"max_new_tokens": 20, "temperature": 0, "stop": [stop]})
    s.submit(Req(rid="s", input_ids=prompt, params=p, stream=True, on_output=seen.append))
    run_all(s)
    final = seen[-1]
    assert final.finished and final.text == text[:text.find(stop)]
    assert len(seen) > 3
    for o in seen[:-1]:  # every streamed text is a prefix of the final one: nothing to take back
        assert final.text.startswith(o.text), (o.text, final.text)


def test_stop_conditions() -> None:
    s, _ = make()
    results: dict[str, ReqOutput] = {}
    prompt = [5, 6, 7]
    ref = expected_output(prompt, 20)
    submit(s, "tok", prompt, 20, results, stop_token_ids=[ref[4]])
    text = CharTokenizer().decode(ref)
    submit(s, "str", prompt, 20, results, stop=[text[6:8]])
    submit(s, "min", prompt, 20, results, stop_token_ids=[ref[0]], min_new_tokens=3)
    submit(s, "zero", prompt, 0, results)
    run_all(s)
    assert results["tok"].output_ids == ref[:5]
    assert results["tok"].meta_info["finish_reason"] == {"type": "stop", "matched": ref[4]}
    assert results["str"].text == text[:text.find(text[6:8])]
    assert results["str"].meta_info["finish_reason"]["matched"] == text[6:8]
    assert len(results["min"].output_ids) >= 3
    assert results["zero"].output_ids == [] and results["zero"].meta_info["finish_reason"]["type"] == "length"
    assert_all_free(s)


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_policies_finish_everything(policy: str) -> None:
    s, _ = make(policy=policy, max_running=4)
    results: dict[str, ReqOutput] = {}
    rng = random.Random(2)
    bases = [[rng.randrange(3, 60) for _ in range(40)] for _ in range(3)]
    prompts = {f"p{i}": bases[i % 3] + [rng.randrange(3, 60) for _ in range(5)] for i in range(12)}
    for rid, p in prompts.items():
        submit(s, rid, p, 6, results)
    run_all(s)
    assert {rid: results[rid].output_ids for rid in prompts} == {rid: expected_output(p, 6) for rid, p in prompts.items()}
    assert_all_free(s)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("num_slots", [4096, 200])
def test_mixed_chunk_decodes_during_prefill(num_slots: int, executor: str) -> None:
    s, runner = make(num_slots=num_slots, chunk=16, mixed=True, max_running=8, executor=executor)
    results: dict[str, ReqOutput] = {}
    rng = random.Random(3)
    prompts = {f"m{i}": [rng.randrange(3, 60) for _ in range(rng.randrange(5, 60))] for i in range(8)}
    for rid, p in prompts.items():
        submit(s, rid, p, 20, results)
    run_all(s)
    for rid, p in prompts.items():
        assert results[rid].output_ids == expected_output(p, 20)
    if num_slots == 4096:  # with room to spare some step must carry both kinds of rows
        assert any(1 in b.extend_lens_cpu and max(b.extend_lens_cpu) > 1 and b.prefix_lens_cpu[
            b.extend_lens_cpu.index(1)] > 0 for b in runner.batches)
    assert_all_free(s)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_prompts_that_fit_the_pool_only_one_at_a_time_all_finish_when_chunked(seed: int, mixed: bool) -> None:
    # Each prompt + output fits the pool alone, two do not: admitting a second chunked
    # prompt for its first chunk only used to leave both stuck (or abort a running one).
    s, _ = make(num_slots=100, chunk=16, mixed=mixed, max_running=8)
    results: dict[str, ReqOutput] = {}
    rng = random.Random(seed)
    prompts = {f"c{i}": [rng.randrange(3, 60) for _ in range(rng.randrange(40, 90))] for i in range(4)}
    for rid, p in prompts.items():
        submit(s, rid, p, 100 - len(p) - rng.randrange(0, 4), results)
    run_all(s)
    for rid, p in prompts.items():
        assert results[rid].meta_info["finish_reason"]["type"] == "length", results[rid].meta_info
        assert results[rid].output_ids == expected_output(p, len(results[rid].output_ids))
    assert_all_free(s)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_chunked_prompt_gives_way_to_a_running_request_that_outgrew_its_reserve(executor: str) -> None:
    # R fits the pool alone; P was admitted with R's decode reserve at its floor, and R's
    # decode then grows into the room P's later chunks need. P goes back to the queue (its
    # prompt logprobs recomputed once); R is not aborted as too big for the pool.
    s, _ = make(num_slots=100, chunk=2, mixed=True, max_running=4, executor=executor)
    results: dict[str, ReqOutput] = {}
    submit(s, "R", [3, 4, 5, 6], 90, results)
    for _ in range(4):
        s.step()
    assert [r.rid for r in s.running] == ["R"]
    s.new_token_ratio = 0.1  # as after a long run without retractions
    p_prompt = [3 + (i * 7) % 50 for i in range(70)]
    s.submit(Req(rid="P", input_ids=p_prompt, params=SamplingParams.from_dict({"max_new_tokens": 2, "temperature": 0}),
                 return_logprob=True, logprob_start_len=0, on_output=lambda o: results.__setitem__(o.rid, o)))
    run_all(s)
    assert results["R"].meta_info["finish_reason"] == {"type": "length", "length": 90}
    assert results["R"].output_ids == expected_output([3, 4, 5, 6], 90)
    assert results["P"].output_ids == expected_output(p_prompt, 2)
    assert [t for _, t, _ in results["P"].meta_info["input_token_logprobs"]] == p_prompt
    assert s.stats["num_retractions_total"] >= 1
    assert_all_free(s)


def assert_plain(x: Any, path: str = "plan") -> None:
    """Only ints, floats, strings, lists, tuples and dataclasses of them (the grammar aside)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            assert_plain(v, f"{path}[{i}]")
        return
    assert dataclasses.is_dataclass(x), f"{path} is a {type(x).__name__}, not plain data"
    for f in dataclasses.fields(x):
        if f.name != "grammar":  # the documented in-process exception
            assert_plain(getattr(x, f.name), f"{path}.{f.name}")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_plan_and_result_are_plain_data(executor: str) -> None:
    s, _ = make(chunk=16, executor=executor)
    seen: list[tuple[StepPlan, StepResult]] = []
    inner = s.executor.execute

    def spy(plan: StepPlan) -> StepResult:
        res = inner(plan)
        seen.append((plan, res))
        return res

    s.executor.execute = spy  # type: ignore[method-assign]
    results: dict[str, ReqOutput] = {}
    prompt = [3 + i % 50 for i in range(40)]
    s.submit(Req(rid="lp", input_ids=prompt, params=SamplingParams.from_dict({"max_new_tokens": 4, "temperature": 0}),
                 return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                 on_output=lambda o: results.__setitem__(o.rid, o)))
    submit(s, "pen", prompt[:7], 4, results, temperature=0.7, seed=5, frequency_penalty=0.5, min_new_tokens=2)
    run_all(s)
    assert len(results) == 2 and len(seen) >= 4
    for plan, res in seen:
        assert_plain(plan)
        assert_plain(res, "result")
        assert len(res.rows) == len(plan.rows)
    rows = [r for plan, _ in seen for r in plan.rows if r.sample is not None]
    assert any(r.sample.penalty_output_ids is not None and r.sample.banned == [EOS] for r in rows)
    assert any(r.prompt_lp_next_ids for plan, _ in seen for r in plan.rows)
    # finished requests are released to the executor exactly once
    released = [u for plan, _ in seen for u in plan.released_uids] + s._released
    assert sorted(released) == [0, 1]


class Scripted:
    """An executor that answers every sampled row with the next id of a script."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = iter(ids)
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return StepResult.of_tokens([next(self.ids) if r.sample is not None else -1 for r in plan.rows])


def test_update_appends_the_token_ids_it_is_given() -> None:
    s, _ = make()
    ex = s.executor = Scripted([40, 41, EOS, 42, EOS, 43])
    results: dict[str, ReqOutput] = {}
    submit(s, "a", [5, 6, 7], 10, results, min_new_tokens=4)  # the first EOS is too early to stop
    run_all(s)
    out = results["a"]
    assert out.output_ids == [40, 41, EOS, 42, EOS]
    assert out.meta_info["finish_reason"] == {"type": "stop", "matched": EOS}
    banned = [p.rows[0].sample.banned for p in ex.plans]
    assert banned == [[EOS], [EOS], [EOS], [EOS], None]
    assert s.stats["generation_tokens_total"] == 5 and s.stats["num_forward_passes"] == 5
    assert_all_free(s)


class LiteralGrammar:
    """`free` tokens of anything, then exactly the text `forced`, then the end: a grammar
    whose jump-forward string is the rest of `forced`."""

    def __init__(self, free: int, forced: str) -> None:
        self.free, self.forced, self.hist = free, forced, []
        self.tok = CharTokenizer()

    def _text(self) -> str:
        return self.tok.decode(self.hist[self.free:])

    def fill_mask(self, mask_row: Any) -> None:
        mask_row[:] = True

    def accept_token(self, token_id: int) -> None:
        if len(self.hist) >= self.free and not self.forced.startswith(self._text() + self.tok.decode([token_id])):
            raise ValueError(f"token {token_id} leaves the literal")
        self.hist.append(token_id)

    def rollback(self, num_tokens: int) -> None:
        del self.hist[len(self.hist) - num_tokens:]

    def is_terminated(self) -> bool:
        return len(self.hist) >= self.free and self._text() == self.forced

    def jump_forward_string(self) -> str | None:
        return (self.forced[len(self._text()):] or None) if len(self.hist) >= self.free else None


class LiteralCompiler:
    def submit(self, kind: str, spec: str) -> Future:
        fut: Future = Future()
        free, forced = spec.split(":")
        fut.set_result(LiteralGrammar(int(free), forced))
        return fut


@pytest.mark.parametrize("executor", EXECUTORS)
def test_jump_forward_at_start_and_after_a_sampled_token(executor: str) -> None:
    s, runner = make(executor=executor, grammar_compiler=LiteralCompiler())
    tok = CharTokenizer()
    results: dict[str, ReqOutput] = {}
    submit(s, "start", [5, 6], 20, results, regex="0:xyzw").return_logprob = True
    submit(s, "after", [5, 6], 20, results, regex="1:xyz")
    submit(s, "short", [5, 6], 2, results, regex="1:xyz")  # the forced text is cut at max_new_tokens
    run_all(s)
    start, after, short = results["start"], results["after"], results["short"]
    assert start.output_ids == tok.encode("xyzw") and start.meta_info["jump_forward_tokens"] == 4
    assert start.meta_info["finish_reason"]["type"] == "stop"
    assert [lp for lp, _, _ in start.meta_info["output_token_logprobs"]] == [None] * 4  # forced, not sampled
    first = expected_output([5, 6], 1)[0]  # sampled, then retokenized with the forced text
    assert after.output_ids == tok.encode(tok.decode([first]) + "xyz") and after.text == tok.decode([first]) + "xyz"
    assert after.meta_info["jump_forward_tokens"] == 3 and after.meta_info["finish_reason"]["type"] == "stop"
    assert short.output_ids == tok.encode(tok.decode([first]) + "x")
    assert short.meta_info["finish_reason"] == {"type": "length", "length": 2}
    assert s.stats["num_forward_passes"] == 1  # "start" never ran; the others finished on their first token
    assert_all_free(s)


class BrokenCompiler(LiteralCompiler):
    """Raises in submit for the spec "boom" (a bug below the scheduler), else literal grammars."""

    def submit(self, kind: str, spec: str) -> Future:
        if spec == "boom":
            raise RuntimeError("compiler bug")
        return super().submit(kind, spec)


def test_a_request_whose_admission_raises_ends_alone_with_an_error() -> None:
    s, _ = make(grammar_compiler=BrokenCompiler())
    results: dict[str, ReqOutput] = {}

    def req(rid: str, **params: Any) -> Req:
        p = SamplingParams.from_dict({"max_new_tokens": 4, "temperature": 0, **params})
        return Req(rid=rid, input_ids=[5, 6, 7], params=p, on_output=lambda o: results.__setitem__(o.rid, o))

    submit(s, "running", [8, 9], 30, results)
    s.step()
    s.submit_many([req("before"), req("bad", regex="boom"), req("after", regex="0:ab")])
    run_all(s)
    bad = results["bad"].meta_info["finish_reason"]
    assert bad["type"] == "abort" and bad["status_code"] == 500 and "compiler bug" in bad["message"]
    assert results["before"].output_ids == expected_output([5, 6, 7], 4)
    assert results["after"].output_ids == CharTokenizer().encode("ab")
    assert results["running"].meta_info["finish_reason"]["type"] == "length"
    assert_all_free(s)


def test_fill_slice_equals_slicing_fill_ids():
    """The plan takes each step's tokens with fill_slice instead of building fill_ids."""
    from sgl.runtime.sampling_params import SamplingParams

    r = Req(rid="x", input_ids=[1, 2, 3, 4], params=SamplingParams())
    r.output_ids = [5, 6, 7]
    for lo in range(9):
        for hi in range(lo, 9):
            assert r.fill_slice(lo, hi) == r.fill_ids[lo:hi], (lo, hi)
