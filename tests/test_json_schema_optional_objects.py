"""Objects whose properties are all optional: every in-order subset of the declared
members is accepted in canonical form, anything out of order or duplicated is not,
and the regex stays small (no copy of each member per earlier optional member)."""

from __future__ import annotations

import itertools
import json
import re

from sgl.runtime.constrained.json_schema import canonical_json, schema_to_regex


def _schema(k: int, extra: bool = False, nested: bool = False) -> dict:
    props = {f"p{i}": {"type": "integer"} for i in range(k)}
    if nested:
        props[f"p{k - 1}"] = _schema(k, extra)
    return {"type": "object", "properties": props, "additionalProperties": extra}


def _instance(names: tuple[str, ...]) -> dict:
    return {n: i for i, n in enumerate(names)}


def test_every_ordered_subset_accepted_for_six_optional() -> None:
    schema = _schema(6)
    rx = re.compile(schema_to_regex(schema))
    names = list(schema["properties"])
    seen = 0
    for r in range(7):
        for sub in itertools.combinations(names, r):
            assert rx.fullmatch(canonical_json(_instance(sub), schema)), sub
            seen += 1
    assert seen == 64


def test_out_of_order_duplicated_and_bad_commas_rejected() -> None:
    rx = re.compile(schema_to_regex(_schema(6)))
    assert not rx.fullmatch('{"p1":1,"p0":0}')
    assert not rx.fullmatch('{"p0":0,"p5":1,"p2":2}')
    assert not rx.fullmatch('{"p2":1,"p2":1}')
    assert not rx.fullmatch('{"p0":0,"p0":0,"p1":1}')
    assert not rx.fullmatch('{,"p0":0}')
    assert not rx.fullmatch('{"p0":0,}')
    assert not rx.fullmatch('{"p0":0"p1":1}')
    assert not rx.fullmatch('{"zz":0}')


def test_extra_keys_come_last_and_are_optional() -> None:
    schema = _schema(4, extra=True)
    rx = re.compile(schema_to_regex(schema))
    names = list(schema["properties"])
    for r in range(5):
        for sub in itertools.combinations(names, r):
            inst = _instance(sub)
            assert rx.fullmatch(json.dumps(inst, separators=(",", ":")))
            inst.update({"x": True, "y": None})
            assert rx.fullmatch(json.dumps(inst, separators=(",", ":"))), sub
    assert not rx.fullmatch('{"x":1,"p0":0}')
    assert not rx.fullmatch('{"p0":0,"p0":0}')
    assert rx.fullmatch("{}") and rx.fullmatch('{"x":1}')


def test_required_member_in_the_middle() -> None:
    schema = _schema(5)
    schema["required"] = ["p2"]
    rx = re.compile(schema_to_regex(schema))
    names = list(schema["properties"])
    for r in range(6):
        for sub in itertools.combinations(names, r):
            ok = rx.fullmatch(canonical_json(_instance(sub), schema)) is not None
            assert ok == ("p2" in sub), sub


def test_regex_size_grows_at_most_quadratically() -> None:
    for extra in (False, True):
        small = len(schema_to_regex(_schema(6, extra)))
        big = len(schema_to_regex(_schema(12, extra)))
        assert big <= 4 * small, (extra, small, big)
    # nesting must not multiply copies by the member count at each level
    flat = len(schema_to_regex(_schema(12, True)))
    nested = len(schema_to_regex(_schema(12, True, nested=True)))
    assert nested <= 4 * flat, (flat, nested)


def test_each_member_copied_a_logarithmic_number_of_times() -> None:
    k = 12
    rx = schema_to_regex({"type": "object", "properties": {
        f"m{i}": {"const": f"v{i}"} for i in range(k)}})
    for i in range(k):
        assert rx.count(f'v{i}\\x22') <= 5, (i, rx.count(f'v{i}\\x22'))
