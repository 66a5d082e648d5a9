"""The scheduler loop: receive requests, pick a prefill or decode batch, run the model,
sample, emit outputs. Runs in a background thread of the engine process (torch releases
the GIL inside its kernels, and the engine talks to it only through the thread-safe
inbox and per-request callbacks carrying plain `ReqOutput`s, so moving it to its own
process later changes only the transport). Tests drive `step()` directly with a fake
model runner.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sgl.runtime.executor.sampler import SampleRow, prompt_logprobs, sample
from sgl.runtime.scheduler.decode import schedule_decode
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.output import OutputProcessor
from sgl.runtime.scheduler.prefill import PrefillLimits, schedule_prefill
from sgl.runtime.scheduler.req import Req
from sgl.runtime.scheduler.step import ModelRunner, RowMap, build_batch

log = logging.getLogger("sgl.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    schedule_policy: str = "lpm"
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    enable_jump_forward: bool = True
    random_seed: int = 0
    grammar_compile_timeout: float = 30.0
    check_invariants_when_idle: bool = False
    enable_mixed_chunk: bool = False


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, runner: ModelRunner, kv: KVCache, tokenizer: Any,
                 eos_ids: set[int], grammar_compiler: Any = None, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg
        self.runner = runner
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.grammar_compiler = grammar_compiler
        self.device = device
        self.out = OutputProcessor(tokenizer, self.eos_ids, cfg.enable_jump_forward)
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.waiting: list[Req] = []
        self.grammar_wait: list[Req] = []
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = 0.5
        self._seed_counter = 0
        # Set when the loop itself dies (see run_forever); callers read it to raise.
        self.crash_reason: str | None = None
        # Fault injection for tests: called with "loop" at the top of each iteration
        # (outside the per-step recovery: raising there kills the loop) and "step" just
        # before each step (a failed step: the requests it held are aborted, the loop lives).
        self.fault_hook: Callable[[str], None] | None = None
        self.stats: dict[str, float] = {
            "num_requests_total": 0, "num_finished_total": 0, "num_aborted_total": 0,
            "prompt_tokens_total": 0, "cached_tokens_total": 0, "generation_tokens_total": 0,
            "jump_forward_tokens_total": 0, "num_retractions_total": 0, "num_forward_passes": 0,
        }

    # -- thread-safe entry points -------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.inbox.put(("req", req))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn inside the scheduler thread between steps (flush, invariants, stats)."""
        fut: Future = Future()
        self.inbox.put(("call", fn, fut))
        return fut

    # -- loop ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.grammar_wait)

    def run_forever(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                if self.fault_hook is not None:
                    self.fault_hook("loop")
                try:
                    if self.fault_hook is not None:
                        self.fault_hook("step")
                    if not self.step():
                        self._drain_inbox(timeout=0.02)
                except Exception:  # never let one bad batch kill the loop
                    log.exception("scheduler step failed; aborting the requests it held")
                    for r in self.prefilling + self.running:
                        self._finish(r, {"type": "abort", "message": "internal error while running the model"})
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

    def step(self) -> bool:
        """One iteration; False when there was nothing to run."""
        self._drain_inbox(timeout=None)
        self._poll_grammars()
        plan = schedule_prefill(self.kv, self.cfg.schedule_policy, self.waiting, self.prefilling,
                                len(self.running), self._limits())
        # Mixed chunk: running requests decode in the same step as a prefill instead of
        # pausing for it (lower inter-token latency while long prompts arrive); only when
        # they fit as they are, so a prefill never causes a retraction.
        mix = (self.cfg.enable_mixed_chunk and bool(plan)
               and self.kv.available() >= sum(r.num_pending for r in self.running))
        if (not plan or mix) and self.running:
            decode_plan, retracted = schedule_decode(self.kv, self.running, self.waiting)
            plan = plan + decode_plan
            for r in retracted:
                self.stats["num_retractions_total"] += 1
                if r.num_retractions < 0:
                    self._finish(r, {"type": "abort", "message": "the KV pool is too small for this request"})
            if retracted:
                self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        if not plan:
            if not self.has_work() and self.cfg.check_invariants_when_idle:
                self.check_invariants()
            return False
        self.new_token_ratio = max(0.1, self.new_token_ratio - 0.002)
        fb, rm = build_batch(plan, self.kv.req_to_token.table, self.device)
        logits = self.runner.forward(fb)
        self.stats["num_forward_passes"] += 1
        self._process(plan, rm, logits)
        return True

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
                self._admit_new(msg[1])
            elif kind == "abort":
                self._abort(msg[1])
            elif kind == "call":
                fn, fut = msg[1], msg[2]
                try:
                    fut.set_result(fn())
                except Exception as e:  # reported to the caller, not fatal here
                    fut.set_exception(e)

    def _admit_new(self, req: Req) -> None:
        self.stats["num_requests_total"] += 1
        p = req.params
        if req.generator is None and not p.is_greedy:
            g = torch.Generator()
            if p.seed is not None:
                g.manual_seed(p.seed)
            else:
                g.manual_seed(self.cfg.random_seed * 1_000_003 + self._seed_counter)
                self._seed_counter += 1
            req.generator = g
        if p.constraint is not None and req.grammar is None:
            if self.grammar_compiler is None:
                self._finish(req, {"type": "abort", "message": "constrained decoding is not available"})
                return
            kind, spec = p.constraint
            req.grammar_future = self.grammar_compiler.submit(kind, spec)
            req.created_at = time.monotonic()
            self.grammar_wait.append(req)
            return
        self.waiting.append(req)

    def _poll_grammars(self) -> None:
        for req in list(self.grammar_wait):
            fut = req.grammar_future
            if not fut.done():
                if time.monotonic() - req.created_at > self.cfg.grammar_compile_timeout:
                    fut.cancel()
                    self.grammar_wait.remove(req)
                    self._finish(req, {"type": "abort", "message":
                                       f"grammar compile timed out after {self.cfg.grammar_compile_timeout:.0f}s"})
                continue
            self.grammar_wait.remove(req)
            try:
                req.grammar = fut.result()
            except Exception as e:
                self._finish(req, {"type": "abort", "message": f"invalid {req.params.constraint[0]}: {e}"})
                continue
            req.grammar_future = None
            if self.cfg.enable_jump_forward:
                self._jump_forward_at_start(req)
            if req.finished:
                self._finish(req, req.finish_reason)
            else:
                self.waiting.append(req)

    def _jump_forward_at_start(self, req: Req) -> None:
        forced = req.grammar.jump_forward_string()
        if not forced or req.output_ids:
            return
        ids = self.tokenizer.encode(forced, add_special_tokens=False)
        if self.tokenizer.decode(ids) != forced:
            return
        ids = ids[: req.params.max_new_tokens]
        for n, t in enumerate(ids):
            try:
                req.grammar.accept_token(t)
            except ValueError:
                req.grammar.rollback(n)
                return
        req.output_ids.extend(ids)
        if req.return_logprob:
            req.output_logprobs.extend((float("nan"), t) for t in ids)
            req.output_top_logprobs.extend([None] * len(ids))
        req.jump_forward_tokens += len(ids)
        if req.grammar.is_terminated():  # the forced text completes the grammar: no forward needed
            req.finish_reason = {"type": "stop", "matched": ids[-1]}
        elif len(req.output_ids) >= req.params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": req.params.max_new_tokens}

    def abort_all(self, message: str) -> int:
        """Finish every live request with an abort (engine shutdown); returns how many."""
        live = self.grammar_wait + self.waiting + self.prefilling + self.running
        for r in live:
            self._finish(r, {"type": "abort", "message": message})
        return len(live)

    def _abort(self, rid: str) -> None:
        for lst in (self.grammar_wait, self.waiting, self.prefilling, self.running):
            for r in lst:
                if r.rid == rid:
                    self._finish(r, {"type": "abort", "message": "aborted"})
                    return

    # -- results --------------------------------------------------------------------------
    def _process(self, plan: list[tuple[Req, int]], rm: RowMap, logits: torch.Tensor) -> None:
        rows: list[SampleRow] = []
        row_reqs: list[Req] = []
        row_idx: list[int] = []
        for i, (req, n) in enumerate(plan):
            self._record_prompt_logprobs(req, n, rm.lp_rows[i], logits)
            if req in self.prefilling:
                if req.num_pending == 0:
                    self.prefilling.remove(req)
                    req.input_logprobs_done = True
                    self.kv.cache_unfinished(req)
                    if req.params.max_new_tokens == 0 or len(req.output_ids) >= req.params.max_new_tokens:
                        self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
                        continue
                    self.running.append(req)
                else:
                    self.kv.cache_unfinished(req)
            if rm.sample_rows[i] >= 0 and not req.finished:
                p = req.params
                banned = None
                if len(req.output_ids) < p.min_new_tokens:
                    banned = sorted((set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids))
                mask = None
                if req.grammar is not None:
                    mask = torch.zeros(logits.shape[1], dtype=torch.bool)
                    req.grammar.fill_mask(mask)
                rows.append(SampleRow(params=p, output_ids=req.output_ids, prompt_ids=req.input_ids,
                                      generator=req.generator, mask=mask, banned=banned,
                                      top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                                      want_logprob=req.return_logprob))
                row_reqs.append(req)
                row_idx.append(rm.sample_rows[i])
        if rows:
            # Usually every logits row is sampled, in order: skip the gather copy (64 x vocab
            # floats per wide decode step). sample() may edit its input; logits is not read after.
            if row_idx == list(range(logits.shape[0])):
                res = sample(logits.float(), rows)
            else:
                res = sample(logits[torch.tensor(row_idx)].float(), rows)
            for j, req in enumerate(row_reqs):
                self.out.append_token(req, res.token_ids[j], res.logprobs[j], res.top_logprobs[j])
                if req.finished:
                    self._finish(req, req.finish_reason)
                elif req.stream and req.on_output is not None:
                    req.on_output(self.out.make_output(req))

    def _record_prompt_logprobs(self, req: Req, n: int, lp: tuple[int, int, int], logits: torch.Tensor) -> None:
        if not req.wants_input_logprobs:
            return
        c0 = req.num_computed - n
        if c0 <= req.first_logprob_row() < c0 + n and req.logprob_start_len == 0:
            req.input_logprobs.append((None, req.input_ids[0]))
            req.input_top_logprobs.append(None)
        row0, pos0, cnt = lp
        if cnt == 0:
            return
        nxt = [req.input_ids[p + 1] for p in range(pos0, pos0 + cnt)]
        lps, tops = prompt_logprobs(logits[row0 : row0 + cnt], nxt, req.top_logprobs_num)
        req.input_logprobs.extend(zip(lps, nxt))
        req.input_top_logprobs.extend(tops)

    def _finish(self, req: Req, reason: dict[str, Any] | None) -> None:
        req.finish_reason = reason
        for lst in (self.grammar_wait, self.waiting, self.prefilling, self.running):
            if req in lst:
                lst.remove(req)
        if req.grammar_future is not None:
            req.grammar_future.cancel()
        if req.req_pool_idx is not None or req.last_node is not None:
            self.kv.release(req)
        s = self.stats
        s["num_finished_total"] += 1
        if reason is not None and reason.get("type") == "abort":
            s["num_aborted_total"] += 1
        s["prompt_tokens_total"] += len(req.input_ids)
        s["cached_tokens_total"] += req.num_cached_tokens
        s["generation_tokens_total"] += len(req.output_ids)
        s["jump_forward_tokens_total"] += req.jump_forward_tokens
        if req.on_output is not None:
            req.on_output(self.out.make_output(req))

    # -- introspection (call from the scheduler thread, e.g. via call()) ------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants(self.prefilling + self.running)

    def snapshot(self) -> dict[str, Any]:
        kv = self.kv
        total = kv.allocator.capacity
        free = kv.allocator.num_free
        prompt = self.stats["prompt_tokens_total"]
        return {
            **self.stats,
            "num_running_reqs": len(self.running) + len(self.prefilling),
            "num_waiting_reqs": len(self.waiting) + len(self.grammar_wait),
            "max_total_tokens": total,
            "kv_total_tokens": total,
            "kv_free_tokens": free,
            "kv_used_tokens": total - free,
            "kv_cached_tokens": kv.tree.total_size(),
            "kv_evictable_tokens": kv.tree.evictable_size(),
            "kv_usage": (total - free) / total if total else 0.0,
            "cache_hit_rate": (self.stats["cached_tokens_total"] / prompt) if prompt else 0.0,
        }
