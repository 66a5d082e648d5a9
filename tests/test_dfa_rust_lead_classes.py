"""dfa_rust probes UTF-8 lead bytes by class when the regex cannot tell class members
apart; the DFA it builds must be identical to probing every lead byte."""

from __future__ import annotations

import numpy as np
import pytest

from sgl.runtime.constrained import dfa_rust as D
from sgl.runtime.constrained.json_schema import schema_to_regex


def _both(regex: str):
    fast = D._rust_dfa(regex, "t")
    saved = D._LEAD_CLASSES
    D._LEAD_CLASSES = D._ALL_LEADS
    try:
        full = D._rust_dfa(regex, "t")
    finally:
        D._LEAD_CLASSES = saved
    return fast, full


@pytest.mark.parametrize("regex,uniform", [
    (r'"(?:[^"\\\x00-\x1f]|\\u[0-9a-f]{4})*"', True),
    (r"[^a]{2}x.", True),
    (r"[\x60-\ud7ff\ue000-\U0010ffff]+z", True),
    (r"[\u00e9a]+", False),        # names one 2-byte character: C2..DF must split
    (r"[a-\u4e00]+", False),       # range ending inside E1..EC
    (r"(?i)k+", False),            # case folding reaches U+212A KELVIN SIGN
    (r"\w+", False),
    (r"\\u\\x\\p", True),         # escaped backslashes, not escapes
])
def test_lead_classes_build_the_same_dfa(regex: str, uniform: bool) -> None:
    assert D.ascii_uniform(regex) is uniform
    fast, full = _both(regex)
    assert np.array_equal(fast.trans, full.trans)
    assert np.array_equal(fast.accept, full.accept)


def test_ascii_schema_regex_is_uniform() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
              "additionalProperties": {"type": "integer"}}
    regex = schema_to_regex(schema)
    assert D.ascii_uniform(regex)
    fast, full = _both(regex)
    assert np.array_equal(fast.trans, full.trans)


def test_schema_regex_naming_non_ascii_builds_the_same_dfa() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                               "é": {"enum": ["x", "ü"]}},
              "required": ["a"], "additionalProperties": {"type": "integer"}}
    regex = schema_to_regex(schema)
    fast, full = _both(regex)
    assert np.array_equal(fast.trans, full.trans)
    # a 2-byte key char and a 3-byte one both reach the additional-member branch
    dfa = fast
    for text in ['{"a":"xyz","ü":1}', '{"a":"","中":2}', '{"a":"ab","é":"ü"}']:
        s = 0
        for b in text.encode():
            s = int(dfa.trans[s, b])
            assert s >= 0, text
        assert dfa.accept[s], text
