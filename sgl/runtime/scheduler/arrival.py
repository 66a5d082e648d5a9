"""Arrival of requests at the scheduler: uid and seed, token healing, the storage lookup,
then the grammar compile wait or the prefill queue (or the PD decode role). A request whose
arrival raises ends alone; the rest of its call and the loop go on. `s` is the Scheduler
(typed Any: it imports this module)."""

from __future__ import annotations

import logging
import time
from typing import Any

from sgl.runtime.constrained.healing import HealingGrammar, plan_healing
from sgl.runtime.scheduler.req import Req

log = logging.getLogger("sgl.scheduler")


def admit_new(s: Any, req: Req) -> None:
    """A request from the inbox: its uid, then `_start`; one that raises ends alone."""
    s.stats["num_requests_total"] += 1
    req.uid = s._next_uid
    s._next_uid += 1
    s._live[req.uid] = req
    try:
        _start(s, req)
    except Exception as e:  # this request fails; the others in its call and in the loop go on
        log.exception("could not admit request %s", req.rid)
        s._finish(req, {"type": "abort", "message": f"internal error admitting the request: {e}",
                        "status_code": 500})


def _start(s: Any, req: Req) -> None:
    """Seed, token healing, the storage lookup, then the grammar wait or the queue."""
    p = req.params
    if req.seed is None and not p.is_greedy:
        if p.seed is not None:
            req.seed = p.seed
        else:
            req.seed = s.cfg.random_seed * 1_000_003 + s._seed_counter
            s._seed_counter += 1
    if p.token_healing and p.max_new_tokens > 0 and not req.output_ids and not req.healed_tokens:
        _heal(s, req)
    if s.kv.hicache is not None:  # the storage lookup overlaps a grammar's compile
        s.kv.hicache.on_arrival(req)
    if p.constraint is not None and req.grammar is None:
        if s.grammar_compiler is None:
            s._finish(req, {"type": "abort", "message": "constrained decoding is not available"})
            return
        kind, spec = p.constraint
        req.grammar_future = s.grammar_compiler.submit(kind, spec)
        req.created_at = time.monotonic()
        s.grammar_wait.append(req)
        return
    _enqueue(s, req)


def _heal(s: Any, req: Req) -> None:
    """Back the prompt up for token healing; an unconstrained request gets the healing
    grammar now, a constrained one when its grammar is compiled (poll_grammars)."""
    tok = getattr(s.grammar_compiler, "tok", None)
    if tok is None:  # no vocabulary tables here (a fake tokenizer): nothing to heal with
        return
    plan = plan_healing(req.input_ids, tok)
    if plan is None:
        return
    req.input_ids = plan.kept
    req.heal_prefix, req.heal_text, req.healed_tokens = plan.prefix, plan.text, plan.num_removed
    # Prompt logprobs cover the backed-up prompt only (the removed tokens are output now).
    req.logprob_start_len = min(req.logprob_start_len, len(plan.kept) - 1)
    if req.params.constraint is None:
        req.grammar = HealingGrammar(plan.prefix, None, tok)


def _enqueue(s: Any, req: Req) -> None:
    """Queue for prefill, unless the PD role takes the request (a decode worker's
    request waits for its KV instead)."""
    if s.pd is not None and req.bootstrap is not None and s.pd.takes(req):
        return
    s.waiting.append(req)


def poll_grammars(s: Any) -> None:
    """Requests whose grammar compiled (or failed, or timed out) leave the grammar wait."""
    for req in list(s.grammar_wait):
        fut = req.grammar_future
        if not fut.done():
            if time.monotonic() - req.created_at > s.cfg.grammar_compile_timeout:
                fut.cancel()
                s.grammar_wait.remove(req)
                s._finish(req, {"type": "abort", "message":
                                f"grammar compile timed out after {s.cfg.grammar_compile_timeout:.0f}s"})
            continue
        s.grammar_wait.remove(req)
        try:
            req.grammar = fut.result()
            if req.heal_prefix:
                req.grammar = HealingGrammar(req.heal_prefix, req.grammar, s.grammar_compiler.tok)
        except Exception as e:
            kind = (req.params.constraint or ("constraint",))[0]
            s._finish(req, {"type": "abort", "message": f"invalid {kind}: {e}"})
            continue
        req.grammar_future = None
        try:
            if s.cfg.enable_jump_forward:
                s.out.jump_forward(req)
        except Exception as e:  # out of the queues already: it must end here, not vanish
            log.exception("jump-forward failed for request %s", req.rid)
            s._finish(req, {"type": "abort", "message": f"internal error after the grammar compiled: {e}",
                            "status_code": 500})
            continue
        if req.finished:
            s._finish(req, req.finish_reason)
        else:
            _enqueue(s, req)
