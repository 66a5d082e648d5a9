"""Speculative decoding on the scheduler's side: drafts in, accepted tokens out.

Before a decode step (`add_drafts`) each running request gets up to k drafts from the
proposer, cut where its grammar would refuse them and to what is worth verifying (the
draft policy: acceptance so far against the measured cost of a row), and KV slots for
them written to its table row after its own:

    slots:        0 ................................ fill_len      (KV of fill_ids, + pending)
    draft_slots:                                     | d_0 .. d_{k-1} |   this step only

After the step (`apply`) the accepted drafts' slots join `slots` and the rest are freed;
then the accepted tokens and the target's own token are appended one by one, as plain
decode steps would have appended them (stop checks, grammar, jump-forward). Appending
stops at a finish or when jump-forward rewrites the tail; KV is then kept only for the
prefix of computed tokens still in fill_ids, and short of its last token while it runs.
"""

from __future__ import annotations

from typing import Any

from sgl.runtime.executor.plan import RowResult
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.output import OutputProcessor
from sgl.runtime.scheduler.req import Req
from sgl.runtime.speculative.policy import DraftPolicy
from sgl.runtime.speculative.proposer import Proposer, SpecOptions, clip_to_grammar


class Speculator:
    def __init__(self, opts: SpecOptions, proposer: Proposer) -> None:
        self.opts = opts
        self.proposer = proposer
        self.policy = DraftPolicy(opts.row_cost)
        self.stats = {"spec_verify_steps_total": 0, "spec_draft_tokens_total": 0, "spec_accepted_tokens_total": 0}

    def budget(self, req: Req, table_width: int) -> int:
        """Most drafts worth proposing: the accepted ones plus the target's own token must
        fit in max_new_tokens, the drafts in the table row; none before min_new_tokens (its
        eos ban is planned for the first row only)."""
        p = req.params
        n_out = len(req.output_ids)
        if n_out < p.min_new_tokens:
            return 0
        return max(0, min(self.opts.num_draft_tokens, p.max_new_tokens - n_out - 1, table_width - req.fill_len))

    def add_drafts(self, kv: KVCache, batch: list[tuple[Req, int]], decode: list[Req]) -> None:
        """Give the step's decode requests their drafts and draft slots."""
        if not decode:
            return
        for req in decode:
            req.spec_verify_ct += 1
        self.stats["spec_verify_steps_total"] += len(decode)
        room = None if self.opts.max_step_rows is None else self.opts.max_step_rows - sum(n for _, n in batch)
        if room is not None and room <= 0:  # the step already fills the rows of its fast path
            return
        width = kv.req_to_token.max_context
        budgets = [self.budget(r, width) for r in decode]
        # Ask only for what is worth verifying: a draft model's forward is not free either.
        worth = self.policy.lengths([r.uid for r in decode], budgets)
        if room is not None:
            worth = [min(n, room) for n in worth]
        proposals = self.proposer.propose(decode, worth) if any(worth) else [[] for _ in decode]
        for req, drafts, n in zip(decode, proposals, worth):
            drafts = drafts[: n if room is None else min(n, room)]  # the step's free rows, in request order
            if drafts and req.grammar is not None:
                drafts = clip_to_grammar(req.grammar, drafts)
            if not drafts:
                continue
            slots = kv.alloc(len(drafts))
            if slots is None:  # no room: this step decodes plainly
                continue
            assert req.req_pool_idx is not None
            kv.req_to_token.write(req.req_pool_idx, len(req.slots), slots)
            req.draft_ids, req.draft_slots = drafts, slots
            if room is not None:
                room -= len(drafts)
            req.spec_draft_tokens += len(drafts)
            self.stats["spec_draft_tokens_total"] += len(drafts)

    def apply(self, kv: KVCache, out: OutputProcessor, req: Req, res: RowResult) -> None:
        """Settle a drafted request after its step: keep accepted KV, append tokens."""
        drafts, slots = req.draft_ids, req.draft_slots
        req.draft_ids, req.draft_slots = [], []
        a = len(res.accepted)
        base = len(req.slots)
        req.slots.extend(slots[:a])  # the table holds them already, right after `slots`
        kv.allocator.free(slots[a:])
        req.spec_accepted_tokens += a
        self.stats["spec_accepted_tokens_total"] += a
        self.policy.observe(req.uid, len(drafts), a)
        for r in res.accepted + [res]:
            n0 = len(req.output_ids)
            out.append_token(req, r.token_id, r.logprob, r.top_logprobs)
            if req.finished or len(req.output_ids) != n0 + 1 or req.output_ids[n0] != r.token_id:
                break  # finished, or jump-forward rewrote the tail: what follows was computed for other tokens
        now = req.fill_slice(base, base + a)
        keep = 0
        while keep < min(a, len(now)) and now[keep] == drafts[keep]:
            keep += 1
        # A running request keeps its last token pending: the next step needs its logits
        # (jump-forward can end fill_ids exactly on an accepted draft).
        kv.truncate(req, base + keep if req.finished else min(base + keep, req.fill_len - 1))

    def release(self, req: Req) -> None:
        self.proposer.release(req.uid)
        self.policy.release(req.uid)

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        steps, drafted = s["spec_verify_steps_total"], s["spec_draft_tokens_total"]
        return {
            **s,
            "spec_algorithm": self.opts.algorithm,
            "spec_num_draft_tokens": self.opts.num_draft_tokens,
            "spec_row_cost": self.opts.row_cost,  # None: every proposed draft is verified
            "spec_accept_rate": s["spec_accepted_tokens_total"] / drafted if drafted else 0.0,
            # tokens one request's decode step yields on average (1.0: no gain)
            "spec_accept_length": 1.0 + s["spec_accepted_tokens_total"] / steps if steps else 0.0,
        }
