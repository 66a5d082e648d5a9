"""Sampler: logits rows -> next token ids (+ logprobs), one vectorized pass per batch.

Order per row: penalties -> grammar mask -> min-token ban -> (greedy | temperature,
top-k, top-p, min-p, sample). Logprobs reported to users come from the model's raw
distribution (log-softmax of the unprocessed logits), like SGLang and the OpenAI API.
Rows with a seed sample from their own generator so a seeded request is reproducible
whatever batch it lands in. Grammar masks go through `constrained.masks` (one
vectorized fill over the constrained rows only).
"""

from __future__ import annotations

import torch

from sgl.runtime.constrained.masks import allocate_masks, apply_masks, fill_masks
from sgl.runtime.executor.plan import RowResult, SampleSpec, TopLogprobs
from sgl.runtime.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, rows: list[SampleSpec]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1:
            continue
        row = logits[i]
        output_ids = r.penalty_output_ids or []
        if output_ids and (p.frequency_penalty != 0 or p.presence_penalty != 0):
            ids = torch.tensor(output_ids, dtype=torch.int64)
            counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)[: row.shape[0]]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(r.penalty_prompt_ids or []) | set(output_ids)), dtype=torch.int64)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def top_logprobs(logprobs: torch.Tensor, k: int) -> TopLogprobs:
    vals, ids = torch.topk(logprobs, k)
    return [(float(v), int(t)) for v, t in zip(vals.tolist(), ids.tolist())]


@torch.inference_mode()  # logits may be the model's own (inference) tensor: edited in place
def sample(logits: torch.Tensor, rows: list[SampleSpec], generators: list[torch.Generator | None],
           masks: torch.Tensor | None = None) -> list[RowResult]:
    """logits: float32 [len(rows), V] (modified in place). `masks`: a reusable bool buffer
    of at least [len(rows), V] for the grammar rows (allocated here when not given)."""
    n, vocab = logits.shape
    need_lp = [i for i, r in enumerate(rows) if r.want_logprob]
    raw_lp = torch.log_softmax(logits[need_lp], dim=-1) if need_lp else None

    apply_penalties(logits, rows)
    grammars = [r.grammar for r in rows]
    if any(g is not None for g in grammars):
        view = (masks if masks is not None else allocate_masks(n, vocab))[:n, :vocab]
        apply_masks(logits, view, fill_masks(grammars, view))
    apply_banned(logits, rows)

    out = torch.argmax(logits, dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled:
        probs = sampling_probs(logits[torch.tensor(sampled)], [rows[i].params for i in sampled])
        for j, i in enumerate(sampled):
            token = draw(probs[j], generators[i])
            if token is not None:  # else the row keeps its argmax
                out[i] = token

    res = [RowResult(token_id=t) for t in out.tolist()]
    if raw_lp is not None:
        for j, i in enumerate(need_lp):
            res[i].logprob = float(raw_lp[j, res[i].token_id])
            if rows[i].top_logprobs_num > 0:
                res[i].top_logprobs = top_logprobs(raw_lp[j], rows[i].top_logprobs_num)
    return res



def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """One token from a row of probabilities, or None where multinomial refuses the row: a
    temperature so small (1e-39) or a penalty so strong that logits / t overflowed leaves
    NaN or no mass. The caller then takes the argmax (the limit it tends to) instead of
    failing the whole batch."""
    try:
        return int(torch.multinomial(probs, 1, generator=generator)[0])
    except RuntimeError:
        return None

def apply_banned(logits: torch.Tensor, rows: list[SampleSpec]) -> None:
    """Forbid each row's `banned` ids (eos / stop ids before min_new_tokens), unless the
    grammar left nothing else."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        if r.banned:
            banned = [t for t in r.banned if t < vocab]
            saved = logits[i, banned].clone()
            logits[i, banned] = float("-inf")
            if bool(torch.isneginf(logits[i]).all()):  # the grammar allows only these: keep them
                logits[i, banned] = saved


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature, top-k / top-p / min-p, softmax."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    sub = logits / temps
    _filter_top_k_p_min_p(sub, params)
    return torch.softmax(sub, dim=-1)


def _filter_top_k_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Set filtered-out entries to -inf, vectorized over rows (one sort)."""
    if all(p.top_k == -1 and p.top_p >= 1.0 and p.min_p <= 0 for p in params):
        return
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    drop = ranks >= top_k
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    cum_before = torch.cumsum(probs, dim=-1) - probs
    drop |= cum_before > top_p  # keep the smallest prefix whose mass reaches top_p
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    drop |= probs < min_p * probs[:, :1]
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, sorted_idx, sorted_logits)


def prompt_logprobs(
    logits: torch.Tensor, next_ids: list[int], top_k: int
) -> tuple[list[float], list[TopLogprobs | None]]:
    """Logprob of next_ids[i] under logits row i (raw distribution), plus top-k lists."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(next_ids, dtype=torch.int64)
    picked = lp.gather(1, idx.unsqueeze(1)).squeeze(1).tolist()
    tops: list[TopLogprobs | None] = [None] * len(next_ids)
    if top_k > 0:
        vals, ids = torch.topk(lp, top_k, dim=-1)
        tops = [list(zip(v, t)) for v, t in zip(vals.tolist(), ids.tolist())]
    return picked, tops
