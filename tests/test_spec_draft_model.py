"""The draft-model proposer (sgl/runtime/speculative/draft_model.py): deterministic greedy
drafts within budget, exact KV reconciliation after partial acceptance, rewrites and
retraction, pool exhaustion without failure, vocabulary check, and, with the embedded model
as its own draft, drafts equal to the engine's greedy continuation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sgl.runtime.models.llama import random_hf_weights, tiny_config
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.req import Req
from sgl.runtime.speculative.draft_model import DraftModelProposer

VOCAB = 49152  # the embedded SmolLM2's, so the tiny draft could draft for it


def write_tiny_draft(path: Path, vocab_size: int = VOCAB, seed: int = 3) -> Path:
    c = tiny_config(vocab_size=vocab_size, max_position_embeddings=256)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(random_hf_weights(c, seed=seed), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return write_tiny_draft(tmp_path_factory.mktemp("draft") / "tiny")


def make(draft_dir: Path, max_tokens: int = 4096, **kw) -> DraftModelProposer:
    return DraftModelProposer.load(str(draft_dir), "float32", "cpu", max_tokens, VOCAB, **kw)


def req(uid: int, ids: list[int]) -> Req:
    r = Req(rid=f"r{uid}", input_ids=list(ids[:4]), params=SamplingParams(), uid=uid)
    r.output_ids = list(ids[4:])
    return r


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def check(p: DraftModelProposer) -> None:
    p.allocator.check_invariants(p.owned_slots())


def test_drafts_are_deterministic_and_respect_budgets(draft_dir):
    p = make(draft_dir)
    reqs = [req(i, prompt(i, 10 + 7 * i)) for i in range(4)]
    budgets = [0, 1, 3, 6]
    first = p.propose(reqs, budgets)
    assert [len(d) for d in first] == budgets
    assert all(0 <= t < VOCAB for d in first for t in d)
    check(p)
    assert p.propose(reqs, budgets) == first  # the same call again (its own drafts' KV reused or trimmed)
    check(p)
    # Each alone, on a fresh proposer: batching changes nothing.
    for r, b, d in zip(reqs, budgets, first):
        assert make(draft_dir).propose([r], [b]) == [d]
    # Budget 6 keeps the KV of fill + 5 drafts (the last draft has none yet).
    assert p.held_tokens(3) == reqs[3].fill_ids + first[3][:5]
    for r in reqs:
        p.release(r.uid)
    check(p)
    assert p.allocator.num_free == p.allocator.capacity and p.table.num_free == p.table.max_reqs


def test_partial_acceptance_rewrite_and_retraction_reconcile_exactly(draft_dir):
    p = make(draft_dir)
    base = [prompt(10, 12), prompt(11, 20), prompt(12, 9)]
    reqs = [req(i, ids) for i, ids in enumerate(base)]
    drafts = p.propose(reqs, [5, 5, 5])
    # Request 0 accepted 2 drafts then the target corrected; request 1 accepted all 5 plus a
    # bonus token; request 2 was retracted and came back shorter (its last 3 tokens gone).
    other = (drafts[0][2] + 1) % VOCAB
    new = [base[0] + drafts[0][:2] + [other], base[1] + drafts[1] + [7], base[2][:-3]]
    reqs = [req(i, ids) for i, ids in enumerate(new)]
    got = p.propose(reqs, [4, 4, 4])
    check(p)
    fresh = make(draft_dir).propose(reqs, [4, 4, 4])
    assert got == fresh
    assert p.held_tokens(0) == new[0] + got[0][:3]  # the rejected drafts' KV is gone
    # Jump-forward rewrote request 1's last two tokens and appended three more.
    new1 = new[1][:-2] + [11, 12, 13, 14, 15]
    r1 = req(1, new1)
    assert p.propose([r1], [3]) == make(draft_dir).propose([r1], [3])
    check(p)


def test_common_prefix():
    from sgl.runtime.speculative.draft_model import _common_prefix

    a = list(range(50))
    assert _common_prefix(a, a, 49) == 49 and _common_prefix(a, a[:10], 99) == 10
    for k in (0, 1, 17, 48):
        assert _common_prefix(a, a[:k] + [-1] + a[k + 1 :], 99) == k
    assert _common_prefix([], a, 5) == 0


def test_context_length_limits_drafts(draft_dir):
    p = make(draft_dir)  # the tiny draft's context: 256 tokens
    long = req(1, prompt(1, 254))
    drafts = p.propose([long], [6])[0]
    assert len(drafts) == 3 and p.held_tokens(1) == long.fill_ids + drafts[:2]  # 256 tokens of KV
    assert p.propose([req(2, prompt(2, 300))], [4]) == [[]]
    assert p.held_tokens(2) == []
    check(p)


def test_pool_exhaustion_gives_no_drafts_never_fails(draft_dir):
    p = make(draft_dir, max_tokens=60, max_requests=8)
    reqs = [req(i, prompt(20 + i, 25)) for i in range(3)]  # each needs 25 + 3 slots
    out = p.propose(reqs, [4, 4, 4])
    assert [len(d) for d in out].count(4) == 2 and out.count([]) == 1
    check(p)
    # A request not seen before takes the slots of the least recently used one.
    late = req(9, prompt(29, 25))
    assert len(p.propose([late], [4])[0]) == 4
    check(p)
    assert p.num_dropped >= 2
    # One that could never fit gets nothing and evicts no one.
    held = p.owned_slots()
    assert p.propose([req(10, prompt(30, 70))], [2]) == [[]]
    assert p.owned_slots() == held
    for uid in (0, 1, 2, 9, 10):
        p.release(uid)
    p.allocator.check_invariants([])
    assert p.allocator.num_free == 60 and p.table.num_free == 8


def test_table_rows_run_out_gracefully(draft_dir):
    p = make(draft_dir, max_requests=2)
    out = p.propose([req(i, prompt(40 + i, 8)) for i in range(3)], [2, 2, 2])
    assert [len(d) for d in out] == [2, 2, 0]
    assert len(p.propose([req(5, prompt(45, 8))], [2])[0]) == 2  # evicts the least recently used
    check(p)


def test_vocabulary_mismatch_is_refused(tmp_path):
    d = write_tiny_draft(tmp_path / "small", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens but the target has 49152"):
        DraftModelProposer.load(str(d), "float32", "cpu", 1024, VOCAB)


def drafts_follow_greedy(dtype: str, ids: list[list[int]], ref: list[list[int]]) -> None:
    """The embedded model drafting for itself proposes exactly its greedy continuation `ref`
    (8 tokens per prompt), before and after a step whose drafts were all accepted."""
    assert all(len(r) == 8 for r in ref)
    p = DraftModelProposer.load(None, dtype, "cpu", 256, VOCAB)
    reqs = [req(i, x) for i, x in enumerate(ids)]
    assert p.propose(reqs, [4] * len(ids)) == [r[:4] for r in ref]
    # The target accepted all 4 and added its bonus token: the next drafts continue from there.
    reqs = [req(i, x + r[:5]) for i, (x, r) in enumerate(zip(ids, ref))]
    assert p.propose(reqs, [3] * len(ids)) == [r[5:8] for r in ref]
    check(p)


PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY8 = {"temperature": 0, "max_new_tokens": 8}


@pytest.mark.model
def test_embedded_model_as_its_own_draft_matches_greedy_decoding_float32():
    from sgl.runtime.engine import Engine

    with Engine(dtype="float32", max_total_tokens=1024) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        ref = [o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=[GREEDY8] * len(ids))]
    drafts_follow_greedy("float32", ids, ref)


@pytest.mark.model
def test_embedded_model_as_its_own_draft_matches_greedy_decoding_bf16(engine):
    """bf16 on the CPU: the draft's decode steps take the C decode step, as the target's do."""
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    ref = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=[GREEDY8] * len(ids))]
    drafts_follow_greedy("bfloat16", ids, ref)
