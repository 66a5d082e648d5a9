"""Output processing: append a sampled token, advance the grammar, detokenize
(incrementally: scheduler/detokenize.py), check stop conditions, jump forward over
grammar-forced strings (one routine, at the start of a grammar and after each sampled
token), record prompt logprobs, build meta_info.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

from sgl.runtime.constrained.healing import grammar_extends, jump_forward_holdback
from sgl.runtime.constrained.healing import settle as settle_healing
from sgl.runtime.constrained.healing import strip_healed
from sgl.runtime.executor.plan import PlanRow, RowResult
from sgl.runtime.scheduler.detokenize import REPLACEMENT
from sgl.runtime.scheduler.req import Req, ReqOutput



def hold_back_stop_prefix(text: str, stops: list[str]) -> str:
    """`text` without its longest tail that begins a stop string: a stream must not show
    "Observ" of a stop "Observation:" that the finished text will cut (OpenAI and vLLM
    hold it back too); it is shown once the next text proves it is not a stop."""
    longest = max((len(s) for s in stops), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return text[:-k]
    return text


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: set[int], enable_jump_forward: bool,
                 detokenize_outputs: bool = True, vocab: Callable[[], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.enable_jump_forward = enable_jump_forward
        # The vocabulary as bytes (constrained/vocab.py TokenizerInfo), or None: then
        # jump-forward forces its whole text, holding no tail back (healing.py).
        self.vocab = vocab
        # False in a worker process: the API process decodes the ids it receives, so the
        # worker decodes only for stop strings (and sends the text when one matched).
        self.detokenize_outputs = detokenize_outputs

    def detokenize(self, req: Req) -> None:
        """Bring req.detok up to the output ids (O(1) per new token)."""
        req.detok.update(self.tokenizer, req.output_ids, req.params.skip_special_tokens)

    def decode(self, req: Req) -> str:
        """The text of all output ids (partial UTF-8 at the end shows as U+FFFD)."""
        self.detokenize(req)
        return req.detok.text()

    def append_token(self, req: Req, token: int, logprob: float | None,
                     top: list[tuple[float, int]] | None) -> None:
        """Record one sampled token and decide whether the request is finished."""
        p = req.params
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.output_ids.append(token)
        if req.return_logprob:
            req.output_logprobs.append((logprob if logprob is not None else float("nan"), token))
            req.output_top_logprobs.append(top)
        n_out = len(req.output_ids)
        if req.grammar is not None:
            try:
                req.grammar.accept_token(token)
            except ValueError as e:
                req.finish_reason = {"type": "abort", "message": f"grammar rejected token {token}: {e}"}
                return
            if req.heal_prefix:
                req.grammar = settle_healing(req.grammar)
        past_min = n_out >= p.min_new_tokens
        if token in self.eos_ids and not p.ignore_eos and past_min:
            req.finish_reason = {"type": "stop", "matched": token}
        elif token in p.stop_token_ids and past_min:
            req.finish_reason = {"type": "stop", "matched": token}
        elif req.grammar is not None and req.grammar.is_terminated():
            req.finish_reason = {"type": "stop", "matched": token}
        # Stop strings need the text here; a stream's text only where outputs carry text
        # (in a worker the API process decodes it: doing it here too would be done twice).
        stream_text = req.stream and self.detokenize_outputs
        if req.finish_reason is None and (p.stop or p.stop_regex or stream_text):
            self.detokenize(req)
            if stream_text:  # a stream output carries the whole text; stop checks need only its end
                req.text = req.detok.text()
            if past_min:
                self._check_stop_strings(req)
        if req.finish_reason is None and n_out >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": p.max_new_tokens}
        if req.finish_reason is None and req.grammar is not None and self.enable_jump_forward:
            self.jump_forward(req)

    def _check_stop_strings(self, req: Req) -> None:
        """Scan the text added since the last check (plus the longest stop string's
        length before it, for matches that straddle tokens); offsets are in the text."""
        p = req.params
        longest = max([len(s) for s in p.stop] + [0])
        # A healed prefix is prompt text the user already has: never a stop match.
        scan_from = max(len(req.heal_text), req.stop_check_from - longest)
        recent = req.detok.text_from(scan_from)
        best: tuple[int, int, str] | None = None  # (start, end, matched)
        for s in p.stop:
            k = recent.find(s)
            if k >= 0 and (best is None or scan_from + k < best[0]):
                best = (scan_from + k, scan_from + k + len(s), s)
        for pattern in p.stop_regex:
            m = re.search(pattern, recent)
            if m and (best is None or scan_from + m.start() < best[0]):
                best = (scan_from + m.start(), scan_from + m.end(), m.group(0))
        req.stop_check_from = len(req.detok)
        if best is not None:
            start, end, matched = best
            text = req.detok.text()
            req.text = text[:end] if p.no_stop_trim else text[:start]
            req.finish_reason = {"type": "stop", "matched": matched}

    def jump_forward(self, req: Req) -> None:
        """Append the string the grammar forces. After a sampled token, that token is
        retokenized together with the forced text so the model sees canonical tokens
        (the next step extends the KV over all of them in one forward pass); before any
        output (a fresh grammar) the forced text alone is tokenized. A tail the model
        could spell with a longer token the grammar allows (`"` of `{"answer"`, where
        the model writes `":`) is held back for the model to sample under the mask
        (healing.py's jump-forward boundary)."""
        g = req.grammar
        forced = g.jump_forward_string()
        if not forced:
            return
        out = req.output_ids
        head_ids = out[-1:]  # the last sampled token, if any
        head = self.tokenizer.decode(head_ids) if head_ids else ""
        if REPLACEMENT in head:
            return
        new_ids = self.tokenizer.encode(head + forced, add_special_tokens=False)
        if len(new_ids) <= len(head_ids) or self.tokenizer.decode(new_ids) != head + forced:
            return
        start = len(out) - len(head_ids)  # output_ids[start:] is replaced by new_ids
        new_ids = new_ids[: req.params.max_new_tokens - start]
        g.rollback(len(head_ids))
        accepted = 0
        try:
            for t in new_ids:
                g.accept_token(t)
                accepted += 1
        except ValueError:
            g.rollback(accepted)
            for t in head_ids:
                g.accept_token(t)
            return
        new_ids = self._hold_back(g, new_ids, len(head_ids))
        if new_ids == head_ids:  # everything forced is held back: the grammar is where it was
            return
        out[start:] = new_ids
        if req.return_logprob:  # forced tokens carry no sampled logprob
            req.output_logprobs[start:] = [(float("nan"), t) for t in new_ids]
            req.output_top_logprobs[start:] = [None] * len(new_ids)
        req.jump_forward_tokens += len(new_ids) - len(head_ids)
        if g.is_terminated():  # the forced text completes the grammar: no forward needed
            req.finish_reason = {"type": "stop", "matched": new_ids[-1]}
        elif len(out) >= req.params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": req.params.max_new_tokens}

    def _hold_back(self, g: Any, new_ids: list[int], num_head: int) -> list[int]:
        """`new_ids` (all accepted by `g`) short of a tail the grammar lets a longer token
        spell; `g` is rolled back to match."""
        tok = self.vocab() if self.vocab is not None else None
        if tok is None:
            return new_ids
        cut, held = jump_forward_holdback(new_ids, num_head, tok)
        if cut == len(new_ids):
            return new_ids
        g.rollback(len(new_ids) - cut)
        if grammar_extends(g, held, tok):
            return new_ids[:cut]
        for t in new_ids[cut:]:  # no allowed token is longer: forcing the tail loses nothing
            g.accept_token(t)
        return new_ids

    @staticmethod
    def record_prompt_logprobs(req: Req, row: PlanRow, res: RowResult) -> None:
        """Prompt logprobs of one step's rows (the executor computed them); the first
        prompt token has none, and is recorded as (None, id) when the range starts there."""
        if not req.wants_input_logprobs:
            return
        c0 = row.prefix_len
        if c0 <= req.first_logprob_row() < c0 + row.extend_len and req.logprob_start_len == 0:
            req.input_logprobs.append((None, req.input_ids[0]))
            req.input_top_logprobs.append(None)
        req.input_logprobs.extend(zip(res.prompt_logprobs, row.prompt_lp_next_ids))
        req.input_top_logprobs.extend(res.prompt_top_logprobs)

    def make_output(self, req: Req) -> ReqOutput:
        reason = req.finish_reason
        finished = reason is not None
        stop_trimmed = reason is not None and reason.get("type") == "stop" and isinstance(reason.get("matched"), str)
        text: str | None
        if stop_trimmed:
            text = req.text
        elif not self.detokenize_outputs:
            text = None
        else:
            if finished or not (req.params.stop or req.params.stop_regex):
                req.text = self.decode(req)
            text = req.text if finished else req.text.rstrip(REPLACEMENT)
            if not finished and req.params.stop:
                text = hold_back_stop_prefix(text, req.params.stop)
        if text is not None and req.heal_text:
            text = strip_healed(text, req.heal_text)
        return ReqOutput(rid=req.rid, text=text, output_ids=list(req.output_ids), finished=finished,
                         meta_info=self.meta_info(req))

    @staticmethod
    def meta_info(req: Req) -> dict[str, Any]:
        m: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.num_cached_tokens,
            "cached_tokens_details": req.cached_tokens_details
            or {"device": req.num_cached_tokens, "host": 0, "storage": 0},
            "jump_forward_tokens": req.jump_forward_tokens,
            "e2e_latency": time.monotonic() - req.created_at,
        }
        if req.healed_tokens:  # prompt_tokens counts the backed-up prompt (what was prefilled)
            m["healed_tokens"] = req.healed_tokens
            m["healed_prefix"] = req.heal_text
        if req.first_token_at is not None:
            m["ttft"] = req.first_token_at - req.created_at
        if req.spec_verify_ct:
            m["spec_verify_ct"] = req.spec_verify_ct
            # SGLang's measure: completion tokens per decode forward pass of this request
            m["spec_accept_length"] = len(req.output_ids) / req.spec_verify_ct
            m["spec_draft_tokens"] = req.spec_draft_tokens
            m["spec_accepted_tokens"] = req.spec_accepted_tokens
        if req.pd_meta:
            m.update(req.pd_meta)
        if req.return_logprob:
            m["input_token_logprobs"] = [(lp, t, None) for lp, t in req.input_logprobs]
            m["output_token_logprobs"] = [(None if lp != lp else lp, t, None) for lp, t in req.output_logprobs]
            m["input_top_logprobs"] = [None if x is None else [(lp, t, None) for lp, t in x]
                                       for x in req.input_top_logprobs]
            m["output_top_logprobs"] = [None if x is None else [(lp, t, None) for lp, t in x]
                                        for x in req.output_top_logprobs]
        return m
