"""The scheduler loop: receive requests, pick a prefill or decode batch, hand the
executor a plain `StepPlan`, and `update` the requests from its `StepResult` (token ids,
logprobs): append tokens, advance grammars, finish requests, emit outputs. Runs in a
thread of the worker process (worker/serve.py), fed through the thread-safe inbox by the
thread that reads the API process's messages; outputs leave through per-request
callbacks carrying plain `ReqOutput`s. Tests drive `step()` directly with a fake
executor that returns token ids.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sgl.runtime.executor.plan import FatalExecutorError, StepPlan, StepResult
from sgl.runtime.executor.step import Executor, ModelRunner, StepExecutor
from sgl.runtime.scheduler.arrival import admit_new, poll_grammars
from sgl.runtime.scheduler.decode import schedule_decode
from sgl.runtime.scheduler.snapshot import scheduler_snapshot
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.output import OutputProcessor
from sgl.runtime.scheduler.plan import make_plan
from sgl.runtime.scheduler.prefill import PrefillLimits, schedule_prefill
from sgl.runtime.scheduler.req import Req
from sgl.runtime.scheduler.speculate import Speculator

log = logging.getLogger("sgl.scheduler")

# new_token_ratio: the fraction of the running requests' remaining max_new_tokens kept
# free when admitting prefills. Few requests run to max_new_tokens, so reserving all of it
# would starve admission; reserving none would retract often. It starts in between, jumps
# up after a retraction (the pool was overcommitted) and decays each step back towards
# the floor while decoding goes well.
NEW_TOKEN_RATIO_INIT = 0.5
NEW_TOKEN_RATIO_RETRACT_STEP = 0.2
NEW_TOKEN_RATIO_DECAY = 0.002
NEW_TOKEN_RATIO_MIN = 0.1


@dataclass(frozen=True)
class SchedulerConfig:
    schedule_policy: str = "lpm"
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    enable_jump_forward: bool = True
    jump_forward_healing: bool = True  # hold back a forced tail the model would extend (healing.py)
    random_seed: int = 0
    grammar_compile_timeout: float = 30.0
    check_invariants_when_idle: bool = False
    enable_mixed_chunk: bool = False
    detokenize_outputs: bool = True  # False: outputs carry ids only (the API process decodes)


class Scheduler:
    # Rows of the request -> token table to give beyond max_running_requests. Admission
    # counts prefilling + running requests against max_running_requests and every finish
    # or retraction frees its row at once, so this is a margin, not a need: a missing row
    # only makes admission wait (attach_row fails softly), it never crashes a step.
    REQ_TABLE_SLACK = 8

    def __init__(self, cfg: SchedulerConfig, runner: ModelRunner | None, kv: KVCache, tokenizer: Any,
                 eos_ids: set[int], grammar_compiler: Any = None, device: str | torch.device = "cpu",
                 executor: Executor | None = None, speculator: Speculator | None = None) -> None:
        """Give a model runner (wrapped in the in-process StepExecutor) or an executor;
        a speculator (scheduler/speculate.py) turns speculative decoding on."""
        self.cfg = cfg
        self.runner = runner
        if executor is None:
            assert runner is not None, "a scheduler needs a model runner or an executor"
            executor = StepExecutor(runner, kv.req_to_token.table, device)
        self.executor = executor
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.grammar_compiler = grammar_compiler
        self.device = device
        self.spec = speculator
        vocab = (lambda: getattr(self.grammar_compiler, "tok", None)) if cfg.jump_forward_healing else None
        self.out = OutputProcessor(tokenizer, self.eos_ids, cfg.enable_jump_forward, cfg.detokenize_outputs, vocab)
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.waiting: list[Req] = []
        self.grammar_wait: list[Req] = []
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._seed_counter = 0
        # Set when the loop itself dies (see run_forever); callers read it to raise.
        self.crash_reason: str | None = None
        # Fault injection for tests: called with "loop" at the top of each iteration
        # (outside the per-step recovery: raising there kills the loop) and "step" just
        # before each step (a failed step: the requests it held are aborted, the loop lives).
        self.fault_hook: Callable[[str], None] | None = None
        self._next_uid = 0
        self._live: dict[int, Req] = {}  # uid -> request, from admission to finish
        self._released: list[int] = []  # uids finished since the last plan
        self._stored_pages: list[tuple[int, int]] = []  # (host page, hash) stored by the plan being run
        # PD disaggregation role (sgl/runtime/disaggregation/__init__.py lists its hooks), or None.
        self.pd: Any = None
        self.stats: dict[str, float] = {
            "num_requests_total": 0, "num_finished_total": 0, "num_aborted_total": 0,
            "prompt_tokens_total": 0, "cached_tokens_total": 0, "generation_tokens_total": 0,
            "jump_forward_tokens_total": 0, "num_retractions_total": 0, "num_forward_passes": 0,
        }

    # -- thread-safe entry points -------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.inbox.put(("req", req))

    def submit_many(self, reqs: list[Req]) -> None:
        """Requests that arrive together (one generate call) are admitted in the same step."""
        self.inbox.put(("reqs", reqs))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def attach_pd(self, role: Any) -> None:
        """Make this a prefill or decode worker (role: disaggregation.build_role)."""
        self.pd = role
        role.attach(self)

    def wake(self) -> None:
        """Thread-safe: end the loop's idle wait now (the PD transport has news)."""
        self.inbox.put(("wake",))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn inside the scheduler thread between steps (flush, invariants, stats)."""
        fut: Future = Future()
        self.inbox.put(("call", fn, fut))
        return fut

    # -- loop ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.grammar_wait
                    or (self.pd is not None and self.pd.has_work()))

    def run_forever(self, stop: threading.Event, after_iteration: Callable[[], None] | None = None) -> None:
        """Loop until `stop` is set. `after_iteration` runs after every iteration, busy or
        idle, in this thread (the worker sends the iteration's outputs there)."""
        try:
            while not stop.is_set():
                if self.fault_hook is not None:
                    self.fault_hook("loop")
                try:
                    if self.fault_hook is not None:
                        self.fault_hook("step")
                    if not self.step():
                        self._drain_inbox(timeout=0.02)
                except FatalExecutorError:
                    raise
                except Exception:  # never let one bad batch kill the loop
                    log.exception("scheduler step failed; aborting the requests it held")
                    for r in self.prefilling + self.running:
                        self._finish(r, {"type": "abort", "message": "internal error while running the model",
                                         "status_code": 500})
                if after_iteration is not None:
                    after_iteration()
        except BaseException as e:  # the loop itself died: nobody may wait on it forever
            self._fail_everything(e)

    def _fail_everything(self, exc: BaseException) -> None:
        """Record why the loop died and finish every request it knew of with an abort
        (the engine turns those into SchedulerCrashedError). Best effort per request:
        the state that killed the loop may also break freeing a request's KV."""
        self.crash_reason = f"{type(exc).__name__}: {exc}"
        log.critical("the scheduler loop died (%s); failing every request", self.crash_reason, exc_info=exc)
        message = f"the scheduler crashed: {self.crash_reason}"
        live = self.grammar_wait + self.waiting + self.prefilling + self.running
        while True:  # requests and calls not yet taken from the inbox
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "req":
                live.append(msg[1])
            elif msg[0] == "reqs":
                live.extend(msg[1])
            elif msg[0] == "call":
                msg[2].set_exception(RuntimeError(message))
        for r in live:
            try:
                self._finish(r, {"type": "abort", "message": message})
            except Exception:
                log.exception("could not free request %s after the crash", r.rid)
                if r.on_output is not None:
                    r.finish_reason = {"type": "abort", "message": message}
                    r.on_output(self.out.make_output(r))
        if self.pd is not None:
            try:
                self.pd.fail_all(message)
            except Exception:
                log.exception("could not end the PD requests after the crash")

    def step(self) -> bool:
        """One iteration; False when there was nothing to run."""
        self._drain_inbox(timeout=None)
        poll_grammars(self)
        if self.pd is not None:
            self.pd.poll()
        plan = self.schedule()
        if plan is None:
            if self.kv.hicache is not None and self.kv.hicache.has_copies():
                self._run_copies(StepPlan(rows=[]))  # idle: write through now, not at the next batch
            if not self.has_work() and self.cfg.check_invariants_when_idle:
                self.check_invariants()
            return False
        try:
            result = self.executor.execute(plan)
        except BaseException:
            self._undo_step(plan)
            raise
        self._after_copies(plan)
        self.stats["num_forward_passes"] += 1
        self.update(plan, result)
        return True

    def _undo_step(self, plan: StepPlan) -> None:
        """The step failed: its new slots and host copies may hold nothing. Its requests are
        then aborted, and KV that was never computed must not enter the tree (later prompts
        would reuse it) nor stay named in the host tier."""
        try:
            for row in plan.rows:
                req = self._live.get(row.uid)
                if req is not None and len(req.slots) > row.prefix_len:
                    self.kv.allocator.free(req.slots[row.prefix_len :])
                    del req.slots[row.prefix_len :]
            hc = self.kv.hicache
            if hc is not None:
                hc.host.discard([page for page, _ in plan.kv_stores] + [page for page, _ in plan.kv_fills])
            self._stored_pages = []
        except Exception:  # the abort that follows still frees what it can
            log.exception("could not undo the failed step's allocations")

    def _run_copies(self, plan: StepPlan) -> None:
        self._attach_copies(plan)
        plan.table_writes = self.kv.req_to_token.take_journal()
        self.executor.execute(plan)
        self._after_copies(plan)

    def _attach_copies(self, plan: StepPlan) -> None:
        hc = self.kv.hicache
        if hc is not None:
            plan.kv_stores, plan.kv_loads, plan.kv_fills, stored = hc.take_copies()
            self._stored_pages = stored

    def _after_copies(self, plan: StepPlan) -> None:
        """Pages just written to the host tier go on to storage (in the background)."""
        hc = self.kv.hicache
        if hc is not None and hc.storage is not None and self._stored_pages:
            hc.storage.write_through(self._stored_pages)
        self._stored_pages = []

    def schedule(self) -> StepPlan | None:
        """Pick this step's batch (allocating its KV slots); None when nothing can run."""
        batch = schedule_prefill(self.kv, self.cfg.schedule_policy, self.waiting, self.prefilling,
                                 len(self.running), self._limits())
        if not batch and self.prefilling:
            self._unblock_prefilling()
            batch = schedule_prefill(self.kv, self.cfg.schedule_policy, self.waiting, self.prefilling,
                                     len(self.running), self._limits())
        # Mixed chunk: running requests decode in the same step as a prefill instead of
        # pausing for it (lower inter-token latency while long prompts arrive); only when
        # they fit as they are, so a prefill never causes a retraction.
        mix = (self.cfg.enable_mixed_chunk and bool(batch)
               and self.kv.available() >= sum(r.num_pending for r in self.running))
        if (not batch or mix) and self.running:
            decode_batch, retracted = schedule_decode(self.kv, self.running, self.waiting)
            batch = batch + decode_batch
            if self.spec is not None:
                self.spec.add_drafts(self.kv, batch, [r for r, _ in decode_batch])
            for r in retracted:
                self.stats["num_retractions_total"] += 1
                if r.num_retractions < 0:
                    self._finish(r, {"type": "abort", "message": "the KV pool is too small for this request"})
            if retracted:
                self.new_token_ratio = min(1.0, self.new_token_ratio + NEW_TOKEN_RATIO_RETRACT_STEP)
        if not batch:
            return None
        self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        plan = make_plan(batch, self.eos_ids, self._released)
        plan.table_writes = self.kv.req_to_token.take_journal()
        self._attach_copies(plan)
        self._released = []
        return plan

    def _unblock_prefilling(self) -> None:
        """No chunk could be allocated: running requests' decodes grew into the room their
        admission counted on. Prompts being chunked hold KV nobody can evict, so the newest
        give theirs back to the tree (evictable) and queue again, until the running
        requests' next tokens fit and at most one prompt is left chunking: nothing waits
        on itself, and no running request is aborted as too big while it fits alone."""
        while self.prefilling and (len(self.prefilling) > 1 or
                                   self.kv.available() < sum(r.num_pending for r in self.running)):
            victim = self.prefilling.pop()
            self.kv.release(victim)
            victim.input_logprobs, victim.input_top_logprobs = [], []  # computed again from the start
            victim.num_retractions += 1
            self.waiting.insert(0, victim)
            self.stats["num_retractions_total"] += 1

    def _limits(self) -> PrefillLimits:
        remaining = sum(max(0, r.params.max_new_tokens - len(r.output_ids)) for r in self.running)
        return PrefillLimits(
            max_prefill_tokens=self.cfg.max_prefill_tokens,
            chunk_size=self.cfg.chunked_prefill_size,
            max_running=self.cfg.max_running_requests,
            decode_reserve=int(self.new_token_ratio * remaining),
        )

    # -- inbox ----------------------------------------------------------------------------
    def _drain_inbox(self, timeout: float | None) -> None:
        block = timeout is not None
        while True:
            try:
                msg = self.inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            kind = msg[0]
            if kind == "req":
                admit_new(self, msg[1])
            elif kind == "reqs":
                for req in msg[1]:
                    admit_new(self, req)
            elif kind == "abort":
                self._abort(msg[1])
            elif kind == "wake":  # only ends the idle wait
                pass
            elif kind == "call":
                fn, fut = msg[1], msg[2]
                try:
                    fut.set_result(fn())
                except Exception as e:  # reported to the caller, not fatal here
                    fut.set_exception(e)

    def abort_all(self, message: str) -> int:
        """Finish every live request with an abort (engine shutdown); returns how many."""
        live = self.grammar_wait + self.waiting + self.prefilling + self.running
        for r in live:
            self._finish(r, {"type": "abort", "message": message})
        return len(live) + (self.pd.fail_all(message) if self.pd is not None else 0)

    def _abort(self, rid: str) -> None:
        for lst in (self.grammar_wait, self.waiting, self.prefilling, self.running):
            for r in lst:
                if r.rid == rid:
                    self._finish(r, {"type": "abort", "message": "aborted"})
                    return
        if self.pd is not None:
            self.pd.abort(rid)

    # -- results --------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Apply one step's result: move finished prefills on, append sampled tokens
        (which advances grammars and may finish requests), emit stream outputs."""
        for row, res in zip(plan.rows, result.rows):
            req = self._live.get(row.uid)
            if req is None:  # finished since the plan was made
                continue
            self.out.record_prompt_logprobs(req, row, res)
            if req in self.prefilling:
                self.kv.cache_unfinished(req)
                if req.num_pending > 0:  # more prompt chunks to go
                    continue
                self.prefilling.remove(req)
                req.input_logprobs_done = True
                if req.params.max_new_tokens == 0 or len(req.output_ids) >= req.params.max_new_tokens:
                    self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
                    continue
                self.running.append(req)
            if row.sample is None:
                continue
            if req.bootstrap is not None and self.pd is not None and self.pd.take_first_token(req, res):
                self._finish(req, req.finish_reason)
                continue
            if self.spec is not None and row.sample.draft_ids:
                self.spec.apply(self.kv, self.out, req, res)
            else:
                self.out.append_token(req, res.token_id, res.logprob, res.top_logprobs)
            if req.finished:
                self._finish(req, req.finish_reason)
            elif req.stream and req.on_output is not None:
                req.on_output(self.out.make_output(req))

    def _finish(self, req: Req, reason: dict[str, Any] | None) -> None:
        req.finish_reason = reason
        if self._live.pop(req.uid, None) is not None:
            self._released.append(req.uid)
        for lst in (self.grammar_wait, self.waiting, self.prefilling, self.running):
            if req in lst:
                lst.remove(req)
        if req.grammar_future is not None:
            req.grammar_future.cancel()
        # A PD prefill keeps its prompt's KV locked for its room, its response held back.
        held = self.pd is not None and req.bootstrap is not None and self.pd.hold(req)
        if req.req_pool_idx is not None or req.last_node is not None:
            self.kv.release(req)
        if self.kv.hicache is not None:
            self.kv.hicache.on_finish(req)
        if self.spec is not None:
            self.spec.release(req)
        s = self.stats
        s["num_finished_total"] += 1
        if reason is not None and reason.get("type") == "abort":
            s["num_aborted_total"] += 1
        s["prompt_tokens_total"] += len(req.input_ids)
        s["cached_tokens_total"] += req.num_cached_tokens
        s["generation_tokens_total"] += len(req.output_ids)
        s["jump_forward_tokens_total"] += req.jump_forward_tokens
        if held:
            return
        if req.on_output is not None:
            req.on_output(self.out.make_output(req))

    # -- introspection (call from the scheduler thread, e.g. via call()) ------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants(self.prefilling + self.running + (self.pd.live() if self.pd is not None else []))

    def close(self) -> None:
        """Stop background work (the storage tier's threads, after their queued writes)."""
        hc = self.kv.hicache
        if hc is not None and hc.storage is not None:
            hc.storage.close()
        if self.pd is not None:
            self.pd.close()

    def clear_hicache_storage(self) -> Future[bool] | bool:
        """Drop every page of the storage tier (this model's namespace): a future that ends
        when they are gone (the clear runs off this thread), or False when there is none."""
        hc = self.kv.hicache
        if hc is None or hc.storage is None:
            return False
        return hc.storage.clear()

    def snapshot(self) -> dict[str, Any]:
        """Counters and the current load as plain data (scheduler/snapshot.py)."""
        return scheduler_snapshot(self)
