"""Vocabulary adapter: token bytes agree with the real tokenizer; spelling decoders."""

from __future__ import annotations

import pytest

from sgl.runtime.constrained.vocab import (BYTE_LEVEL, SENTENCEPIECE, TokenizerInfo,
                                           byte_level_to_bytes, cached_gguf_tokenizer_info,
                                           greedy_encode, sentencepiece_to_bytes)
from tests.grammar_helpers import GGUF, GGUF_DIR



@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_gguf_info_matches_hf_tokenizer_info(hf_tok):
    a = cached_gguf_tokenizer_info(GGUF)
    b = TokenizerInfo.from_hf_tokenizer(hf_tok)
    assert a.kind == b.kind == BYTE_LEVEL
    assert a.vocab_size == b.vocab_size == 49152
    assert a.eos_token_ids == b.eos_token_ids == (2,)
    assert a.hash == b.hash and a == b
    assert all(a.token_bytes[i] is None for i in hf_tok.all_special_ids)


def test_every_token_round_trips(hf_tok):
    info = TokenizerInfo.from_hf_tokenizer(hf_tok)
    mismatches = []
    for i, b in enumerate(info.token_bytes):
        if b is None:
            continue
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue  # partial UTF-8 sequence: checked through whole texts below
        if hf_tok.decode([i]) != text:
            mismatches.append(i)
    assert not mismatches, mismatches[:10]
    for text in ["Hello, world!", "  leading spaces\nand\ttabs", "café naïve 日本語 😀", '{"a": [1, 2]}']:
        ids = hf_tok.encode(text, add_special_tokens=False)
        assert info.decode(ids) == text.encode("utf-8")
        assert info.decode(greedy_encode(info, text)) == text.encode("utf-8")


def test_spelling_decoders():
    assert byte_level_to_bytes("\u0120hello") == b" hello"
    assert byte_level_to_bytes("\u010a") == b"\n"
    assert byte_level_to_bytes("\u00c3\u00a9") == "é".encode()
    assert sentencepiece_to_bytes("\u2581the") == b" the"
    assert sentencepiece_to_bytes("<0x0A>") == b"\n"
    assert sentencepiece_to_bytes("<0xE6>") == b"\xe6"
    info = TokenizerInfo.from_tokens(["<s>", "</s>", "\u2581hi", "<0xFF>", "x"], kind=SENTENCEPIECE,
                                     special_ids=[0, 1], eos_token_ids=[1])
    assert info.token_bytes == (None, None, b" hi", b"\xff", b"x")
    other = TokenizerInfo.from_tokens(["<s>", "</s>", "\u2581hi", "<0xFF>", "y"], kind=SENTENCEPIECE,
                                      special_ids=[0, 1], eos_token_ids=[1])
    assert info.hash != other.hash


def test_sentencepiece_vocab_works_with_regex_grammar():
    from sgl.runtime.constrained.matcher import GrammarMatcher

    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581yes", "\u2581no", "ye"]
    info = TokenizerInfo.from_tokens(toks, kind=SENTENCEPIECE, special_ids=[0, 1, 2], eos_token_ids=[2])
    m = GrammarMatcher("choices", [" yes", " no"], info)
    allowed = set(m.allowed_token_ids())
    assert len(toks) - 3 in allowed and len(toks) - 2 in allowed  # ▁yes, ▁no
    assert 3 + 0x20 in allowed and 2 not in allowed  # byte 0x20 yes, EOS not yet
    assert m.accept_token(len(toks) - 3) and m.can_end() and 2 in m.allowed_token_ids()
