"""Cascade attention for batches that share a cached prefix (few-shot prompts, forks,
n>1, select): the shared prefix's K/V is gathered once per layer and every query of the
step is scored against it in one dense matmul per KV head, instead of a padded gather
that copies the shared K/V once per request.

    keys of request i:  [ shared prefix: slots identical for all i | own tokens ]
                          0 ............ shared_len ................ seq_lens[i]

Queries are packed into groups of "pieces" (a request's queries, or a slice of them when
they are many) padded to the group's longest piece. For a group, the scores against the
shared prefix and against each piece's own keys are written side by side into one buffer
`[KV, n, e, G, shared + own]`, so a single softmax normalizes both parts together: no
log-sum-exp merge of two partial softmaxes, and far fewer passes over the scores.
Scores are the bf16 matmul's output (as in HF's eager attention); the softmax computes in
float32 and rounds the probabilities to the K/V dtype for the value matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this many shared tokens the plain path is as fast.
MIN_SHARED = 64
# Query tokens x keys one group may score at once (x heads x 2 bytes of bf16 scores):
# bounds the per-layer buffer (~5 MB at 9 heads); larger groups measured no faster.
MAX_GROUP_CELLS = 1 << 18
# A group pads its pieces to the longest one; start a new group rather than waste more.
MAX_PAD_WASTE = 1.25


def common_prefix_len(rows: torch.Tensor, limit: int) -> int:
    """Longest column prefix on which every row of `rows` [B, L] equals row 0, capped at `limit`."""
    if rows.shape[0] < 2 or limit <= 0:
        return 0
    cols = rows[:, :limit]
    same = (cols == cols[0:1]).all(dim=0)
    if bool(same.all()):
        return int(cols.shape[1])
    return int(torch.argmin(same.to(torch.int8)).item())


def gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] for a pool buffer [N, KV, D]; index_select is 4-7x faster than
    advanced indexing on the CPU."""
    return buf.index_select(0, slots.reshape(-1)).view(*slots.shape, *buf.shape[1:])


@dataclass
class CascadeGroup:
    """n pieces padded to e queries and l own keys each.

    Piece k = (request i, first query j0, m queries): T rows start_i + j0 ... + m - 1,
    own keys rows[i, shared : shared + own_k] with own_k = n_cached_i + j0 + m, and
    query j of the piece sees own key c iff c <= n_cached_i + j0 + j.
    """

    n: int
    e: int
    l: int
    q_index: torch.Tensor  # [n * e] T row of each padded query (padding repeats a real row)
    own_rows: torch.Tensor  # [KV * n * l] rows of the pool viewed [slots * KV, D], KV-major (padding: slot 0)
    hidden: torch.Tensor  # [1, n, e, 1, l] True where an own key is NOT visible
    out_index: torch.Tensor  # [m_total] padded positions of the real queries ...
    t_index: torch.Tensor  # [m_total] ... and the T rows they fill
    identity: bool  # padded positions == T rows (one group, one query per request, in order)


@dataclass
class CascadePlan:
    shared: torch.Tensor  # [S] slots of the shared prefix
    shared_rows: torch.Tensor  # [KV * S] their rows in the pool viewed [slots * KV, D], KV-major
    groups: list[CascadeGroup]
    # One group (the usual case): shared and own rows in one index, so K (and V) of a
    # layer is one gather, already in the [KV, S, D] / [KV * n, l, D] layouts the matmuls want.
    fused_rows: torch.Tensor | None = None


def kv_major_rows(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Rows of a pool buffer viewed [num_slots * KV, D] for `slots`, ordered [KV, *slots.shape]."""
    heads = torch.arange(kv_heads, device=slots.device).view(-1, *([1] * slots.dim()))
    return (slots.unsqueeze(0) * kv_heads + heads).reshape(-1)


def plan_cascade(rows: torch.Tensor, shared: int, prefix_lens: list[int], extend_lens: list[int],
                 kv_heads: int) -> CascadePlan:
    """rows [B, >= max seq_len] request->token slots; every request starts with the same
    `shared` slots and has prefix_lens[i] >= shared."""
    pieces: list[tuple[int, int, int, int]] = []  # (request, start in T, j0, m)
    start = 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        # Slice long extends so one piece's scores stay within the group budget.
        step = max(1, MAX_GROUP_CELLS // (p + e))
        for j0 in range(0, e, step):
            pieces.append((i, start, j0, min(step, e - j0)))
        start += e
    num_tokens = start
    if len({m for *_, m in pieces}) > 1:
        pieces.sort(key=lambda x: -x[3])  # similar sizes side by side: less padding
    groups: list[CascadeGroup] = []
    cur: list[tuple[int, int, int, int]] = []
    real = e_max = l_max = 0  # the current group's real cells, longest piece, most keys
    for pc in pieces:
        i, _, j0, m = pc
        keys = prefix_lens[i] + j0 + m
        if cur:
            padded = (len(cur) + 1) * max(e_max, m) * max(l_max, keys)
            if padded > MAX_PAD_WASTE * (real + m * keys) + 4096 or padded > MAX_GROUP_CELLS:
                groups.append(_group(rows, shared, prefix_lens, cur, num_tokens, len(pieces), kv_heads))
                cur, real, e_max, l_max = [], 0, 0, 0
        cur.append(pc)
        real += m * keys
        e_max, l_max = max(e_max, m), max(l_max, keys)
    groups.append(_group(rows, shared, prefix_lens, cur, num_tokens, len(pieces), kv_heads))
    shared_slots = rows[0, :shared]
    shared_rows = kv_major_rows(shared_slots, kv_heads)
    fused = torch.cat((shared_rows, groups[0].own_rows)) if len(groups) == 1 else None
    return CascadePlan(shared_slots, shared_rows, groups, fused)


def _group(rows: torch.Tensor, shared: int, prefix_lens: list[int], pieces: list[tuple[int, int, int, int]],
           num_tokens: int, num_pieces: int, kv_heads: int) -> CascadeGroup:
    dev = rows.device
    n = len(pieces)
    e = max(m for *_, m in pieces)
    first = [p[2] + prefix_lens[p[0]] - shared for p in pieces]  # own keys before the piece's first query
    own_lens = [f + m for f, (*_, m) in zip(first, pieces)]
    l = max(own_lens)
    req = torch.tensor([p[0] for p in pieces], device=dev)
    own = rows[req, shared : shared + l]
    c = torch.arange(l, device=dev)
    own_len_t = torch.tensor(own_lens, device=dev)[:, None]
    own = torch.where(c[None, :] < own_len_t, own, torch.zeros((), dtype=own.dtype, device=dev))
    j = torch.arange(e, device=dev)
    lim = torch.tensor(first, device=dev)[:, None, None] + j[None, :, None]  # [n, e, 1]
    visible = (c[None, None, :] <= lim) & (c[None, None, :] < own_len_t[:, :, None])
    m_t = torch.tensor([p[3] for p in pieces], device=dev)[:, None]
    row0 = torch.tensor([p[1] + p[2] for p in pieces], device=dev)[:, None]
    real = j[None, :] < m_t  # [n, e]
    q_index = (row0 + torch.where(real, j[None, :], torch.zeros_like(j)[None, :])).reshape(-1)
    out_index = torch.nonzero(real.reshape(-1)).reshape(-1)
    t_index = q_index[out_index]
    identity = num_pieces == n == num_tokens and e == 1 and bool((t_index == torch.arange(n, device=dev)).all())
    return CascadeGroup(n, e, l, q_index, kv_major_rows(own.long(), kv_heads), (~visible)[None, :, :, None, :],
                        out_index, t_index, identity)


def cascade_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: CascadePlan,
                      scale: float) -> torch.Tensor:
    """q [T, H, D] (the pool's dtype) -> [T, H, D]: each query over the shared prefix and
    its own visible keys, one softmax."""
    kv, d = k_buf.shape[1], k_buf.shape[2]
    s = plan.shared.shape[0]
    # Scaling q instead of the scores saves a pass over them; with head_dim a power of 4
    # (64, 256) the scale is a power of two and this is exact.
    qs = q * scale
    k_rows, v_rows = k_buf.view(-1, d), v_buf.view(-1, d)
    if plan.fused_rows is not None:
        k_all, v_all = k_rows.index_select(0, plan.fused_rows), v_rows.index_select(0, plan.fused_rows)
        kp, vp = k_all[: kv * s].view(kv, s, d), v_all[: kv * s].view(kv, s, d)
        grp = plan.groups[0]
        o = _attend_group(qs, kp, vp, k_all[kv * s :], v_all[kv * s :], grp, kv)
        if grp.identity:
            return o
        return torch.empty_like(q).index_copy_(0, grp.t_index, o.index_select(0, grp.out_index))
    kp = k_rows.index_select(0, plan.shared_rows).view(kv, s, d)
    vp = v_rows.index_select(0, plan.shared_rows).view(kv, s, d)
    out = torch.empty_like(q)
    for grp in plan.groups:
        ko, vo = k_rows.index_select(0, grp.own_rows), v_rows.index_select(0, grp.own_rows)
        o = _attend_group(qs, kp, vp, ko, vo, grp, kv)
        out.index_copy_(0, grp.t_index, o.index_select(0, grp.out_index))
    return out


def _attend_group(qs: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor,
                  grp: CascadeGroup, kv: int) -> torch.Tensor:
    """[n * e, H, D] outputs of the group's padded queries; kp/vp [KV, S, D] shared keys,
    ko/vo [KV * n * l, D] own keys. Everything runs KV-head-major: rows (n, e, g) of one
    KV head are one matmul against the shared keys, and the (KV, piece) pairs are the
    batch of the small matmuls against the own keys."""
    h, d = qs.shape[1], qs.shape[2]
    g, s = h // kv, kp.shape[1]
    n, e, l = grp.n, grp.e, grp.l
    m = e * g  # query rows of one piece under one KV head
    qg = qs if grp.identity else qs.index_select(0, grp.q_index)
    q_k = qg.view(n, e, kv, g, d).permute(2, 0, 1, 3, 4).reshape(kv, n * m, d)
    scores = torch.empty((kv, n, m, s + l), dtype=qs.dtype, device=qs.device)
    scores[..., :s] = torch.bmm(q_k, kp.transpose(1, 2)).view(kv, n, m, s)
    ko = ko.view(kv * n, l, d)
    scores[..., s:] = torch.bmm(q_k.reshape(kv * n, m, d), ko.transpose(1, 2)).view(kv, n, m, l)
    scores.view(kv, n, e, g, s + l)[..., s:].masked_fill_(grp.hidden, float("-inf"))
    # On bf16 the CPU softmax computes in float32 internally and rounds the probabilities
    # once: the same numbers as an explicit float32 softmax, in one pass instead of three.
    p = torch.softmax(scores, dim=-1)
    o = torch.bmm(p[..., :s].reshape(kv, n * m, s), vp)  # [KV, n*m, D]
    o.view(kv * n, m, d).add_(torch.bmm(p[..., s:].reshape(kv * n, m, l), vo.view(kv * n, l, d)))
    return o.view(kv, n, e, g, d).permute(1, 2, 0, 3, 4).reshape(n * e, h, d)
