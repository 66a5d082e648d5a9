"""ForwardBatch: the plain description of one model step, shared by the model, the
attention backends and the kernels.

A step runs a ragged batch: request i contributes `extend_lens[i]` new tokens (the prompt
tail for a prefill/extend, 1 for a decode), all concatenated in `input_ids` with no
padding. For request i, the KV pool slots of its whole sequence are
`req_to_token[req_pool_indices[i], :seq_lens[i]]`:

    0                prefix_lens[i]                 seq_lens[i]
    |-- cached (KV already in the pool) --|-- new tokens (extend_lens[i]) --|

The new tokens' K/V are written at `out_cache_loc` (already copied into the table by
the scheduler, so the table row covers the full sequence before attention runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of all requests, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, KV slot for each new token
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int64, prefix + new tokens
    extend_lens: torch.Tensor  # [B] int64, new tokens per request
    prefix_lens: torch.Tensor  # [B] int64, seq_lens - extend_lens
    extend_start_loc: torch.Tensor  # [B] int64, offset of request i in the T axis
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32/int64, shared table
    # Rows of the T axis whose logits are needed (last new token of each request, plus
    # prompt positions when prompt logprobs are requested). Ordered as the sampler wants.
    logits_indices: torch.Tensor  # [N] int64
    # Host copies: the torch backend and the scheduler read these without a device sync.
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        """True when every request adds exactly one token onto a non-empty prefix."""
        return all(e == 1 for e in self.extend_lens_cpu) and all(p > 0 for p in self.prefix_lens_cpu)

    @staticmethod
    def build(
        input_ids: list[int],
        out_cache_loc: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        req_to_token: torch.Tensor,
        logits_indices: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Build from plain lists. Positions run from each request's prefix length."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        positions: list[int] = []
        starts: list[int] = []
        for p, e in zip(prefix_lens, extend_lens):
            starts.append(len(positions))
            positions.extend(range(p, p + e))
        if logits_indices is None:  # last new token of each request
            logits_indices = [s + e - 1 for s, e in zip(starts, extend_lens)]

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return ForwardBatch(
            input_ids=t(input_ids),
            positions=t(positions),
            out_cache_loc=t(out_cache_loc),
            req_pool_indices=t(req_pool_indices),
            seq_lens=t(seq_lens),
            extend_lens=t(extend_lens),
            prefix_lens=t(prefix_lens),
            extend_start_loc=t(starts),
            req_to_token=req_to_token,
            logits_indices=t(logits_indices),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
            prefix_lens_cpu=list(prefix_lens),
        )
