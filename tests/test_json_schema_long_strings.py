"""Long minLength/maxLength bounds (up to MAX_STRING_COUNT) are enforced exactly, with
the canonically spelled counted character; past the limit strict mode refuses."""

from __future__ import annotations

import json
import re

import pytest

from sgl.runtime.constrained.json_schema import UnsupportedSchemaError, schema_to_regex
from sgl.runtime.constrained.json_schema.context import MAX_STRING_COUNT


def _ok(rx: str, value: object) -> bool:
    return re.fullmatch(rx, json.dumps(value, ensure_ascii=False)) is not None


def test_max_length_255_counts_decoded_characters() -> None:
    rx = schema_to_regex({"type": "string", "minLength": 3, "maxLength": 255})
    for n in (3, 100, 255):
        assert _ok(rx, "é" * n) and _ok(rx, "\n" * n) and _ok(rx, "\x01" * n)
        assert _ok(rx, "😀" * n) and _ok(rx, '"' * n)
    for n in (0, 2, 256, 300):
        assert not _ok(rx, "a" * n) and not _ok(rx, "\x01" * n)


def test_counted_char_is_one_decoded_character() -> None:
    rx = schema_to_regex({"type": "string", "maxLength": 1})
    assert re.fullmatch(rx, r'"\u001f"') and re.fullmatch(rx, r'"\n"')
    assert not re.fullmatch(rx, r'"\u00"') and not re.fullmatch(rx, r'"ab"')


def test_past_the_string_limit_is_refused() -> None:
    schema_to_regex({"type": "string", "maxLength": MAX_STRING_COUNT})
    with pytest.raises(UnsupportedSchemaError):
        schema_to_regex({"type": "string", "maxLength": MAX_STRING_COUNT + 1})
