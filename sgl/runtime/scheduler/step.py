"""One model step: turn a plan [(req, num_new_tokens)] whose slots are already
allocated into a ForwardBatch, run it, and say which logits row serves what.

Per request the new tokens are fill_ids[c0 : c0 + n] (c0 = tokens already computed before
this step). Logits rows are requested for
  - prompt-logprob positions p in [max(c0, first_logprob_row), min(c0 + n, prompt_len - 1)),
  - the sampling position c0 + n - 1, when the step reaches the end of fill_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.scheduler.req import Req


class ModelRunner(Protocol):
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [len(batch.logits_indices), vocab]."""


@dataclass
class RowMap:
    # per request: (first logits row, first position) of its prompt-logprob rows, count
    lp_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # per request: logits row to sample from, or -1
    sample_rows: list[int] = field(default_factory=list)


def build_batch(plan: list[tuple[Req, int]], req_to_token: torch.Tensor, device: str | torch.device = "cpu"
                ) -> tuple[ForwardBatch, RowMap]:
    input_ids: list[int] = []
    out_loc: list[int] = []
    rows: list[int] = []
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    logits_idx: list[int] = []
    rm = RowMap()
    for req, n in plan:
        c0 = req.num_computed - n  # slots for this step were appended already
        start = len(input_ids)
        fill = req.fill_ids
        input_ids.extend(fill[c0 : c0 + n])
        out_loc.extend(req.slots[c0 : c0 + n])
        assert req.req_pool_idx is not None
        rows.append(req.req_pool_idx)
        prefix_lens.append(c0)
        extend_lens.append(n)
        if req.wants_input_logprobs:
            lo = max(c0, req.first_logprob_row())
            hi = min(c0 + n, len(req.input_ids) - 1)
            cnt = max(0, hi - lo)
            rm.lp_rows.append((len(logits_idx), lo, cnt))
            logits_idx.extend(range(start + lo - c0, start + hi - c0))
        else:
            rm.lp_rows.append((len(logits_idx), 0, 0))
        if c0 + n == len(fill):
            rm.sample_rows.append(len(logits_idx))
            logits_idx.append(start + n - 1)
        else:
            rm.sample_rows.append(-1)
    fb = ForwardBatch.build(input_ids, out_loc, rows, prefix_lens, extend_lens, req_to_token,
                            logits_indices=logits_idx, device=device)
    return fb, rm
