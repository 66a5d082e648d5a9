"""schema_to_regex: each supported keyword checked with re.fullmatch against instances
labelled by jsonschema (with format checking), plus strict/relaxed error handling."""

from __future__ import annotations

import re
import warnings

import jsonschema
import pytest

from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.json_schema import (
    UnsupportedSchemaError,
    canonical_json,
    schema_to_regex,
)

_FMT = jsonschema.Draft202012Validator.FORMAT_CHECKER


def check(schema: dict, instances: list) -> None:
    rx = schema_to_regex(schema)
    validator = jsonschema.Draft202012Validator(schema, format_checker=_FMT)
    n_valid = 0
    for inst in instances:
        valid = validator.is_valid(inst)
        n_valid += valid
        got = re.fullmatch(rx, canonical_json(inst, schema)) is not None
        assert got == valid, (schema, inst, valid, got)
    assert 0 < n_valid < len(instances), "feature test needs valid and invalid instances"


def test_integer_ranges_inclusive_exclusive_negative():
    for lo, hi in [(-120, -7), (-15, 230), (0, 9), (10, 1000)]:
        check({"type": "integer", "minimum": lo, "maximum": hi},
              list(range(lo - 30, hi + 30, 3)) + [lo, hi, lo - 1, hi + 1, 1.5])
    check({"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 12},
          [-6, -5, -4, 0, 11, 12, 13])


def test_number_ranges():
    check({"type": "number", "minimum": -2.5, "exclusiveMaximum": 10.25},
          [-2.6, -2.5, -2.49, 0, 0.0, 3, 10.2, 10.25, 10.250001, 11, -3, "x"])
    check({"type": "number", "exclusiveMinimum": 0, "maximum": 1},
          [0, 0.0, 0.001, 0.5, 1, 1.0, 1.01, -0.5])


def test_allof_merge():
    check({"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}},
                      "required": ["a"]},
                     {"properties": {"a": {"maximum": 5}, "b": {"type": "string"}},
                      "required": ["b"]}]},
          [{"a": 3, "b": "x"}, {"a": 6, "b": "x"}, {"a": 3}, {"b": "x"}, {"a": -1, "b": "y"}])


def test_allof_members_meet_the_other_parts_additional_properties():
    # additionalProperties sees only its own schema's properties: a member an allOf part
    # declares is "additional" to a sibling part that forbids or constrains extras
    check({"type": "object", "properties": {"x": {"minimum": 0}}, "additionalProperties": False,
           "allOf": [{"properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}]},
          [{"x": 1}, {}, {"x": 1, "y": "a"}, {"y": "a"}, {"x": -1}, {"x": "s"}])
    check({"type": "object", "additionalProperties": {"type": "integer"},
           "allOf": [{"properties": {"y": {"minimum": 2}}}]},
          [{"y": 3}, {"y": 1}, {"y": "s"}, {}, {"z": 5}, {"z": "s"}])
    check({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False,
           "allOf": [{"patternProperties": {"^p": {"type": "integer"}}}]},
          [{"a": 1}, {"a": 1, "p1": 2}, {"p1": 2}, {"a": "s"}])


def test_ref_recursion_bounded():
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
    check(schema, [{"v": 1}, {"v": 1, "next": {"v": 2}}, {"v": "x"}, {"next": {"v": 1}}])
    rx = schema_to_regex(schema)
    deep = {"v": 1, "next": {"v": 2, "next": {"v": 3, "next": {"v": 4}}}}
    assert re.fullmatch(rx, canonical_json(deep, schema)) is None  # cut at depth bound


def test_enum_const_any_type():
    check({"enum": [{"a": [1, None]}, [1, 2], None, "x", 3]},
          [{"a": [1, None]}, [1, 2], None, "x", 3, [2, 1], {"a": []}, "y", 4])
    check({"const": {"k": True}}, [{"k": True}, {"k": False}, True])


def test_pattern_and_lengths():
    check({"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}, ["AB-123", "ab-123", "AB-12", "AB-1234"])
    check({"type": "string", "pattern": "ab+c"}, ["xxabbbcyy", "ac", "abc"])
    check({"type": "string", "minLength": 2, "maxLength": 4},
          ["", "a", "ab", "abcd", "abcde", "é\n\"x", "\\\\\\\\\\"])
    check({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ["abc", "abcd", "a1"])


@pytest.mark.parametrize("fmt,good,bad", [
    ("date", ["2024-02-29", "1999-12-31"], ["2023-02-29", "2024-13-01", "24-01-01"]),
    ("time", ["12:30:00Z", "23:59:60+01:00"], ["25:00:00Z", "12:30"]),
    ("date-time", ["2024-01-01T10:00:00Z", "2024-01-01T10:00:00.5+02:00"],
     ["2024-01-01 10:00", "2024-01-32T10:00:00Z"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    ("email", ["a.b@example.com"], ["no-at-sign"]),
    ("ipv4", ["192.168.0.1"], ["256.1.1.1", "1.2.3"]),
    ("ipv6", ["::1", "2001:db8::ff00:42:8329"], ["1:2:3:4:5:6:7:8:9", "12345::"]),
    ("hostname", ["example.com"], ["-bad-.com"]),
])
def test_formats(fmt, good, bad):
    rx = schema_to_regex({"type": "string", "format": fmt})
    for s in good:
        assert re.fullmatch(rx, canonical_json(s)), (fmt, s)
    for s in bad:
        assert not re.fullmatch(rx, canonical_json(s)), (fmt, s)


def test_uri_format():
    rx = schema_to_regex({"type": "string", "format": "uri"})
    assert re.fullmatch(rx, '"https://example.com/a?b=c#d"')
    assert not re.fullmatch(rx, '"not a uri"')
    # RFC 3986: an empty authority (file:///), a query right after the authority, an
    # absolute path without one; "http://" alone is left out.
    for good in ("file:///C:/Users/a", "http://a.com?q=1", "urn:/x", "mailto:a@b.c"):
        assert re.fullmatch(rx, f'"{good}"'), good
    for bad in ("http://", "1a:b", "x y:z"):
        assert not re.fullmatch(rx, f'"{bad}"'), bad


def test_items_and_counts():
    check({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
          [[], [1], [1, 2, 3], [1, 2, 3, 4], ["a"]])
    check({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
           "items": False}, [[], ["a"], ["a", 1], ["a", 1, 2], [1]])


def test_additional_properties_and_required():
    check({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
           "required": ["b"], "additionalProperties": False},
          [{"b": "x"}, {"a": 1, "b": "x"}, {"a": 1}, {"b": "x", "c": 1}, {}])
    check({"type": "object", "properties": {"a": {"type": "integer"}},
           "additionalProperties": {"type": "string"}},
          [{}, {"a": 1}, {"a": 1, "z": "s"}, {"z": 2}, {"a": "s"}])


def test_untyped_schema_admits_every_type_and_constrains_its_own():
    # No "type": a keyword applies only to values of its type, as validators read it.
    check({"properties": {"a": {"type": "integer"}}, "required": ["a"]},
          [{"a": 1}, {"a": "x"}, {}, "s", 3, None, [1], True])
    check({"type": "array", "items": {"minLength": 2}}, [["ab"], ["a"], [1, None], [{"k": 1}]])
    check({"minimum": 3}, [3, 2, "x", 1.5, [0]])
    check({"items": {"type": "string"}}, [["a"], [1], {"k": 1}, "s"])


def test_disjoint_pattern_properties_each_key_meets_its_own_schema():
    check({"type": "object", "additionalProperties": False,
           "patternProperties": {"^c_": {"type": "array"}, "^u_": {"type": "object"}}},
          [{}, {"c_1": [1]}, {"u_1": {}}, {"c_1": [], "u_2": {"x": 1}}, {"c_1": {}},
           {"u_1": []}, {"z": 1}])
    check({"type": "object", "additionalProperties": False,
           "patternProperties": {"^/": {"type": "string"}, "^[^/]": {"type": "integer"}}},
          [{"/a": "x"}, {"b": 1}, {"/a": 1}, {"b": "x"}, {"": 1}])


def test_anyof_oneof_nullable():
    check({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]},
          [1, "ab", "abc", None])
    check({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, [1, True, "x"])
    check({"type": ["string", "null"]}, ["a", None, 1])
    # `nullable` is OpenAPI's spelling of type [T, "null"] (jsonschema ignores it).
    rx = schema_to_regex({"type": "string", "nullable": True})
    assert re.fullmatch(rx, "null") and re.fullmatch(rx, '"a"') and not re.fullmatch(rx, "1")


def test_whitespace_option():
    rx = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}}},
                         whitespace=r"[ \n]?")
    assert re.fullmatch(rx, '{ "a": 1 }')
    assert re.fullmatch(rx, '{"a":1}')


def test_strict_raises_with_keyword_and_pointer():
    schema = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedSchemaError) as ei:
        schema_to_regex(schema)
    assert isinstance(ei.value, GrammarError)
    assert "uniqueItems" in str(ei.value) and "/properties/x" in str(ei.value)
    with pytest.raises(UnsupportedSchemaError, match="oneOf"):
        schema_to_regex({"oneOf": [{"type": "integer"}, {"type": "number"}]})


def test_relaxed_warns_never_silent():
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.warns(UserWarning, match="uniqueItems"):
        rx = schema_to_regex(schema, strict=False)
    assert re.fullmatch(rx, "[1,2]")


def test_annotations_ignored_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema_to_regex({"type": "integer", "title": "t", "description": "d", "examples": [1],
                         "$schema": "x", "default": 1, "deprecated": True, "$comment": "c"})


def test_pathologically_nested_schema_is_a_clear_error_not_a_crash():
    schema: dict = {"type": "string"}
    for _ in range(3000):  # deeper than Python's recursion limit
        schema = {"allOf": [schema]}
    with pytest.raises(UnsupportedSchemaError, match="nests too deeply"):
        schema_to_regex(schema)
