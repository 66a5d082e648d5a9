"""Incremental detokenization against full decoding, with the embedded model's real
tokenizer: random ids, emoji-heavy and broken UTF-8 outputs, rewritten tails
(jump-forward), and a bounded amount of decoding per token. Then the scheduler's
streamed text and stop-string trimming under retraction, against full decoding."""

from __future__ import annotations

import random
from typing import Any

import pytest

from sgl.radix import RadixTree
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.detokenize import REPLACEMENT, DecodeState
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.req import Req, ReqOutput
from sgl.runtime.scheduler.output import hold_back_stop_prefix
from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.fakes import FakeExecutor, expected_output

EMOJI_TEXT = "héllo 😀👍🏽 日本語 ok 🇫🇷 naïve façade — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧑‍🚀 done. "


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    from sgl.runtime.models.loader import embedded_gguf_path, ensure_hf_from_gguf
    from sgl.runtime.models.tokenizer import load_tokenizer

    return load_tokenizer(ensure_hf_from_gguf(embedded_gguf_path()))


def emoji_ids(tok: Any, rng: random.Random, n: int) -> list[int]:
    """Tokens of emoji-heavy text, with lone byte tokens mixed in (never-completed UTF-8)."""
    pool = tok.encode(EMOJI_TEXT, add_special_tokens=False)
    lone = [i for i in range(17, 300) if tok.decode([i]) == REPLACEMENT]
    assert lone, "expected byte-level tokens that decode to U+FFFD alone"
    return [rng.choice(lone) if rng.random() < 0.1 else rng.choice(pool) for _ in range(n)]


def decode_incremental(tok: Any, st: DecodeState, ids: list[int], skip: bool) -> str:
    st.update(tok, ids, skip)
    return st.text()


def check_every_prefix(tok: Any, ids: list[int], skip: bool) -> None:
    """The whole text every 7th step (joining the chunks); in between, only text_from."""
    rng = random.Random(len(ids))
    st = DecodeState()
    for k in range(len(ids) + 1):
        full = tok.decode(ids[:k], skip_special_tokens=skip)
        st.update(tok, ids[:k], skip)
        assert len(st) == len(full), k
        start = rng.randrange(len(full) + 1)
        assert st.text_from(start) == full[start:], (k, start)
        if k % 7 == 0:
            assert st.text() == full, k


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_random_ids_match_full_decode(hf_tok: Any, seed: int, skip: bool) -> None:
    rng = random.Random(seed)
    check_every_prefix(hf_tok, [rng.randrange(len(hf_tok)) for _ in range(300)], skip)


@pytest.mark.parametrize("seed", range(3))
def test_emoji_and_broken_utf8_match_full_decode(hf_tok: Any, seed: int) -> None:
    rng = random.Random(seed)
    check_every_prefix(hf_tok, emoji_ids(hf_tok, rng, 400), skip=True)
    check_every_prefix(hf_tok, hf_tok.encode(EMOJI_TEXT * 3, add_special_tokens=False), skip=True)


def test_rewritten_tail_and_bulk_appends_match_full_decode(hf_tok: Any) -> None:
    """Jump-forward replaces the last id by a retokenized run, several ids at once."""
    rng = random.Random(7)
    st = DecodeState()
    ids: list[int] = []
    for _ in range(300):
        r = rng.random()
        if r < 0.15 and ids:
            forced = rng.choice(['": ', "😀", ' "name": "', "}"])
            ids[-1:] = hf_tok.encode(hf_tok.decode([ids[-1]]) + forced, add_special_tokens=False)
        elif r < 0.2:
            ids.extend(emoji_ids(hf_tok, rng, rng.randrange(2, 6)))
        else:
            ids.extend(emoji_ids(hf_tok, rng, 1))
        st.update(hf_tok, ids, True)  # undoing a commit with the chunks joined, or not
        got = st.text() if rng.random() < 0.5 else st.text_from(0)
        assert got == hf_tok.decode(ids, skip_special_tokens=True)
    ids[:] = ids[:50]  # anything else rewritten: starts again, still exact
    assert decode_incremental(hf_tok, st, ids, True) == hf_tok.decode(ids, skip_special_tokens=True)


class CountingTokenizer:
    def __init__(self, tok: Any) -> None:
        self.tok, self.ids_decoded = tok, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.ids_decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decoding_work_per_token_is_bounded(hf_tok: Any) -> None:
    counting = CountingTokenizer(hf_tok)
    ids = hf_tok.encode(EMOJI_TEXT * 60, add_special_tokens=False)
    st = DecodeState()
    per_token = []
    for k in range(1, len(ids) + 1):
        before = counting.ids_decoded
        st.update(counting, ids[:k], True)
        per_token.append(counting.ids_decoded - before)
    assert len(ids) > 1500
    # a window spans the last commit and the pending partial character: a handful of ids
    assert max(per_token) <= 24 and max(per_token[-200:]) == max(per_token[:200])


def test_streamed_text_and_stop_strings_under_retraction(hf_tok: Any) -> None:
    """Fake-model ids (bytes and specials of the real vocabulary) streamed through the
    scheduler with a tiny pool: every streamed text is decode(ids) less a trailing
    partial character (and a tail that may begin the stop string); the final text is cut
    before the first stop string."""
    kv = KVCache(RadixTree(), SlotAllocator(160), ReqToTokenPool(16 + Scheduler.REQ_TABLE_SLACK, 1024))
    cfg = SchedulerConfig(max_running_requests=16, check_invariants_when_idle=True)
    s = Scheduler(cfg, None, kv, hf_tok, {0}, executor=FakeExecutor(kv.req_to_token.table))
    rng = random.Random(4)
    streamed: dict[str, list[ReqOutput]] = {}
    prompts = {f"s{i}": [rng.randrange(17, 60) for _ in range(30)] for i in range(10)}
    stops: dict[str, str] = {}
    for i, (rid, prompt) in enumerate(prompts.items()):
        text = hf_tok.decode(expected_output(prompt, 40), skip_special_tokens=True)
        stops[rid] = text[25:27] if i % 2 else ""  # half of them stop on a string seen late
        p = SamplingParams.from_dict({"max_new_tokens": 40, "temperature": 0, "stop": stops[rid] or None})
        s.submit(Req(rid=rid, input_ids=prompt, params=p, stream=True,
                     on_output=lambda o: streamed.setdefault(o.rid, []).append(o)))
    for _ in range(10000):
        s.step()
        if not s.has_work() and s.inbox.empty():
            break
    assert s.stats["num_retractions_total"] > 0
    for rid, outs in streamed.items():
        for o in outs[:-1]:  # less, with a stop string, a tail that may begin it (held back)
            shown = hf_tok.decode(o.output_ids, skip_special_tokens=True).rstrip(REPLACEMENT)
            if stops[rid]:
                shown = hold_back_stop_prefix(shown, [stops[rid]])
            assert not o.finished and o.text == shown
        last = outs[-1]
        full = hf_tok.decode(last.output_ids, skip_special_tokens=True)
        assert last.finished and last.output_ids == expected_output(prompts[rid], len(last.output_ids))
        if stops[rid]:
            assert last.meta_info["finish_reason"] == {"type": "stop", "matched": stops[rid]}
            assert last.text == full[: full.find(stops[rid])]
            assert stops[rid] not in hf_tok.decode(last.output_ids[:-1], skip_special_tokens=True)  # stopped at the first token that showed it
        else:
            assert last.text == full and len(last.output_ids) == 40
