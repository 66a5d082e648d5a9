"""Tensor parallelism: which slice of a model each rank holds, and the collectives that
join the slices back together.

A model split over `tp.size` ranks keeps the residual stream whole on every rank and
splits the work between (Megatron's column-then-row pattern):

    x (whole, every rank) ─► QKV, gate_up: column-parallel (this rank's heads / intermediate rows)
                          ─► attention over the local heads, SiLU*up over the local rows
                          ─► O, down: row-parallel (the local input columns) ─► partial sums
                          ─► all_reduce ─► x (whole again)

The embedding table and the LM head are split by vocab rows: a rank's lookup is zero for
ids outside its rows, so the all_reduce of the lookups is exact; the logits shards are
gathered on rank 0. The partition rules live here and nowhere else: the model allocates
its shard with them and the loader slices checkpoints with the same ranges. At size 1
nothing here calls torch.distributed, so a single process runs exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TPInfo:
    """This process's place in a tensor-parallel group: `rank` within the group (rank 0
    receives the logits), `size` ranks, `group` the process group (None: the default one)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1} (size {self.size})")


# ---- partition rules ----------------------------------------------------------------------------

def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of piece `index` when 0..n-1 is cut into `parts` contiguous pieces whose
    sizes differ by at most one (the first n % parts pieces are the longer ones)."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def shard_range(n: int, tp: TPInfo, what: str = "rows") -> tuple[int, int]:
    """This rank's contiguous, balanced share [lo, hi) of `n` vocab or intermediate rows
    (uneven allowed: 49,153 rows over 2 ranks are 24,577 + 24,576)."""
    if n < tp.size:
        raise ValueError(f"cannot split {n} {what} over {tp.size} tensor-parallel ranks: use at most {n} ranks")
    return split_range(n, tp.size, tp.rank)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds, as ranges of the whole model's heads: query
    heads [q_lo, q_hi) and KV heads [kv_lo, kv_hi); every local query head's KV head is local."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    @property
    def num_heads(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def num_kv_heads(self) -> int:
        return self.kv_hi - self.kv_lo


def head_shard(num_heads: int, num_kv_heads: int, tp: TPInfo) -> HeadShard:
    """This rank's heads. With at least as many KV heads as ranks, each rank takes a
    balanced contiguous range of KV heads and the query heads of their groups (9 q / 3 kv
    at tp 2: q 0-5 + kv 0-1, then q 6-8 + kv 2). With fewer, the ranks split evenly over
    the KV heads: each holds one KV head (replicated on its ranks) and a balanced share of
    its group's query heads (4 q / 2 kv at tp 4: q i with kv i // 2)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv_lo, kv_hi = split_range(num_kv_heads, tp.size, tp.rank)
        return HeadShard(kv_lo * group, kv_hi * group, kv_lo, kv_hi)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor-parallel size {tp.size} does not fit {num_kv_heads} KV heads: with fewer KV heads than ranks "
            f"the size must be a multiple of {num_kv_heads} (or use at most {num_kv_heads} ranks)")
    ranks_per_kv = tp.size // num_kv_heads
    if ranks_per_kv > group:
        raise ValueError(f"tensor-parallel size {tp.size} exceeds the {num_heads} query heads: every rank needs "
                         f"at least one (use at most {num_heads} ranks)")
    kv = tp.rank // ranks_per_kv
    lo, hi = split_range(group, ranks_per_kv, tp.rank % ranks_per_kv)
    return HeadShard(kv * group + lo, kv * group + hi, kv, kv + 1)


# ---- collectives --------------------------------------------------------------------------------

def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum `x` over the ranks in place and return it; nothing at size 1.

    bf16 is reduced as bf16 (gloo sums bf16 natively on torch 2.13, checked with two
    processes; NCCL does too), so the sum of two ranks rounds once, like the fp32 sum
    cast back would: no fp32 round trip. Every rank receives the same bits, so the
    replicated residual stream never drifts apart between ranks."""
    if tp.size > 1:
        if not x.is_contiguous():  # collectives need dense memory; outputs of linears already are
            x = x.contiguous()
        dist.all_reduce(x, group=tp.group)
    return x


def embedding(ids: torch.Tensor, weight: torch.Tensor, lo: int, tp: TPInfo) -> torch.Tensor:
    """Rows `ids` of a vocab-parallel table whose local rows are global rows [lo, lo +
    len(weight)). Ids outside them look up zeros, so the all_reduce is exact."""
    if tp.size == 1:
        return F.embedding(ids, weight)
    local = ids - lo
    outside = (local < 0) | (local >= weight.shape[0])
    x = F.embedding(local.masked_fill(outside, 0), weight)
    x.masked_fill_(outside.unsqueeze(-1), 0)
    return all_reduce(x, tp)


def gather_logits(local: torch.Tensor, vocab: int, tp: TPInfo) -> torch.Tensor | None:
    """Float32 logits [N, vocab] on rank 0 from every rank's [N, its vocab shard]; None on
    other ranks. Shards travel in their own dtype (half the bytes for bf16; the cast to
    float32 after is exact) and are padded to the widest shard, as gather needs equal sizes."""
    if tp.size == 1:
        return local.float()
    n = local.shape[0]
    if n == 0:  # every rank runs the same batch, so all skip the collective together
        return local.new_empty(0, vocab, dtype=torch.float32) if tp.rank == 0 else None
    widths = [hi - lo for lo, hi in (split_range(vocab, tp.size, r) for r in range(tp.size))]
    pad = widths[0] - local.shape[1]  # rank 0's shard is the widest
    padded = (F.pad(local, (0, pad)) if pad else local).contiguous()
    parts = [torch.empty_like(padded) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(padded, parts, group=tp.group, group_dst=0)
    if parts is None:
        return None
    return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1).float()
