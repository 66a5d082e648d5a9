"""Exact string constraints in machine mode: pattern or format with length bounds and
format with pattern (intersection machines), and length bounds past MAX_STRING_COUNT
(block machines). Each schema is compiled with the registry and driven over tokenized
instances: accepted iff jsonschema (with format checking) says valid, exactly at each
bound accepted, one past it rejected; masks are checked against brute force where a
string crosses block boundaries."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.json_schema import UnsupportedSchemaError, schema_to_regex
from sgl.runtime.constrained.vocab import greedy_encode
from tests.grammar_helpers import compiled

pytestmark = pytest.mark.usefixtures("no_grammar_disk_cache")

_FMT = jsonschema.FormatChecker()


def accepts(c, tok, value, mask_steps: int = 8) -> bool:
    """Drive the matcher over the canonical text of `value`; the first and last
    `mask_steps` tokens must also be in the mask."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    ids = greedy_encode(tok, text)
    g = c.new_matcher()
    row = torch.zeros(tok.vocab_size, dtype=torch.bool)
    for i, t in enumerate(ids):
        if i < mask_steps or i >= len(ids) - mask_steps:
            row.zero_()
            g.fill_mask(row)
            if not row[t]:
                return False
        try:
            g.accept_token(t)
        except GrammarError:
            return False
    return g.can_end()


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema, format_checker=_FMT).is_valid(value)


def check(schema, tok, values, stricter: tuple = ()) -> None:
    """Accepted iff valid, except `stricter` values: valid for jsonschema's loose
    format checks, refused by our (documented, stricter) format patterns."""
    c = compiled(schema, tok)
    for v in values:
        want = valid(schema, v) and v not in stricter
        assert accepts(c, tok, v) == want, (schema, v, want)


# ---------------------------------------------------------------- intersections

def test_pattern_with_length_bounds(tok) -> None:
    schema = {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "minLength": 3, "maxLength": 10}
    check(schema, tok, ["abc", "ab", "a-b", "abcdefghij", "abcdefghijk", "abcd-efghi",
                        "abcd-efghij", "abc-", "-abc", "ABC", "a-b-c-d-e"])
    # Exactly at both bounds, and one past each.
    c = compiled(schema, tok)
    assert accepts(c, tok, "a" * 10) and not accepts(c, tok, "a" * 11)
    assert accepts(c, tok, "a" * 3) and not accepts(c, tok, "a" * 2)


def test_pattern_with_length_counts_decoded_characters(tok) -> None:
    # Escaped and multi-byte characters count once, the way jsonschema counts them.
    schema = {"type": "string", "pattern": "^a.*z$", "minLength": 3, "maxLength": 6}
    check(schema, tok, ["abz", "az", 'a""""z', 'a"""""z', "a\nz", "a\n\n\n\nz", "a\n\n\n\n\nz",
                        "a\x01\x1fz", "aééééz", "aéééééz", "a😀😀😀😀z", "a😀😀😀😀😀z", "a\\\\z",
                        "a/z", "abcz!", "a\u2028z"])


def test_pattern_with_length_inside_an_object(tok) -> None:
    schema = {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$", "maxLength": 6},
        "ok": {"type": "boolean"}}, "required": ["id", "ok"], "additionalProperties": False}
    check(schema, tok, [{"id": "AB1234", "ok": True}, {"id": "AB12345", "ok": True},
                        {"id": "AB1", "ok": False}, {"id": "A1", "ok": True}])


def test_format_with_max_length(tok) -> None:
    schema = {"type": "string", "format": "email", "maxLength": 48}
    c = compiled(schema, tok)
    at = "a" * 43 + "@b.co"
    assert len(at) == 48 and valid(schema, at) and accepts(c, tok, at)
    assert not accepts(c, tok, "a" + at)
    check(schema, tok, ["ann@mail.com", "ann.lee@mail.example.org", "ann", "ann@mail",
                        "x" * 40 + "@mail.com"], stricter=("ann@mail",))


def test_format_with_min_length(tok) -> None:
    schema = {"type": "string", "format": "uri", "minLength": 20}
    check(schema, tok, ["https://example.com/x", "https://ex.com/", "https://example.com/abc",
                        "not a uri at all, but long"], stricter=("not a uri at all, but long",))


def test_format_with_pattern(tok) -> None:
    schema = {"type": "string", "format": "date", "pattern": "^2024-"}
    check(schema, tok, ["2024-02-29", "2024-12-31", "2023-02-28", "2024-02-30", "2024-1-01"])
    # With a length bound as well (three parts); date width is 10, so 9 is empty.
    schema = {"type": "string", "format": "ipv4", "pattern": "^10\\.", "maxLength": 8}
    check(schema, tok, ["10.0.0.1", "10.0.0.10", "11.0.0.1", "10.1.1.1"])


def test_empty_intersection_accepts_nothing(tok) -> None:
    schema = {"type": "object", "properties": {
        "d": {"type": "string", "format": "date", "pattern": "^x"}}}
    c = compiled(schema, tok)
    assert accepts(c, tok, {}) and not accepts(c, tok, {"d": "x"})
    assert not accepts(c, tok, {"d": "2024-01-01"})


# ---------------------------------------------------------------- long bounds

def test_max_length_32767(tok, regex_backend) -> None:
    schema = {"type": "string", "maxLength": 32767}
    c = compiled(schema, tok)
    assert c.num_machines > 1  # block machines count past MAX_STRING_COUNT
    mixed = ('ab"é\n😀\\x/\x01 ' * 3300)[:32767]
    for n in (0, 1, 31, 32, 33, 1023, 1024, 1025):
        assert accepts(c, tok, "q" * n)
    assert accepts(c, tok, "a" * 32767)
    assert not accepts(c, tok, "a" * 32768)
    assert accepts(c, tok, mixed)
    assert not accepts(c, tok, mixed + "a")


def test_min_length_2000(tok) -> None:
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 2000},
        "t": {"type": "string", "minLength": 2000, "maxLength": 2100}},
        "required": ["s", "t"]}
    c = compiled(schema, tok)
    ok = "é" * 2000
    assert accepts(c, tok, {"s": ok, "t": ok})
    assert accepts(c, tok, {"s": "x" * 5000, "t": "\n" * 2100})
    assert not accepts(c, tok, {"s": ok[:-1], "t": ok})
    assert not accepts(c, tok, {"s": ok, "t": "\n" * 2101})
    assert not accepts(c, tok, {"s": ok, "t": ok[:-1]})


def test_class_pattern_with_long_bound(tok) -> None:
    schema = {"type": "string", "pattern": "^[a-f0-9]+$", "maxLength": 5000}
    c = compiled(schema, tok)
    assert accepts(c, tok, "ab12" * 1250)
    assert not accepts(c, tok, "ab12" * 1250 + "a")
    assert not accepts(c, tok, "")
    assert not accepts(c, tok, "abg")


def brute_mask(c, config, tok) -> set[int]:
    eos = set(tok.eos_token_ids)
    return {i for i, b in enumerate(tok.token_bytes)
            if b and i not in eos and c.step_bytes(config, b) is not None}


def _num_stacks(cfg) -> int:
    """Stacks of a configuration: a set of stack tuples (numpy backend) or flat int32
    words whose first is the count (native)."""
    return int(np.frombuffer(cfg, dtype=np.int32)[0]) if isinstance(cfg, bytes) else len(cfg)


def test_block_masks_match_brute_force(tok, regex_backend) -> None:
    # Around a block boundary, right at the bound and one before it, the mask is
    # exactly the tokens whose bytes can be stepped; parses stay few.
    c = compiled({"type": "string", "maxLength": 1100}, tok)
    for n in (31, 1099, 1100):
        cfg = c.step_bytes(c.initial, ('"' + "x" * n).encode())
        assert cfg is not None and _num_stacks(cfg) <= 8
        got = set(torch.nonzero(torch.from_numpy(c.token_mask(cfg))).flatten().tolist())
        assert got == brute_mask(c, cfg, tok), n
        assert c.can_end(c.step_bytes(cfg, b'"'))


# ---------------------------------------------------------------- single-regex mode

@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 1025},
    {"type": "string", "minLength": 2000},
    {"type": "string", "pattern": "^a.*z$", "maxLength": 6},
    {"type": "string", "format": "date", "pattern": "^2024"},
])
def test_single_regex_mode_still_refuses(schema) -> None:
    with pytest.raises(UnsupportedSchemaError):
        schema_to_regex(schema)


def test_pattern_with_length_past_limit_is_refused(tok) -> None:
    # An intersection with a count past MAX_STRING_COUNT is not built (too large).
    with pytest.raises(GrammarError):
        compiled({"type": "string", "pattern": "^a.*z$", "maxLength": 2000}, tok)
