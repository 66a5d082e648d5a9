"""String schemas: const-free strings with minLength/maxLength, `pattern` and `format`.

Length is counted in decoded characters (`CANON_COUNTED_CHAR` matches exactly one,
spelled canonically, which keeps bounds up to `MAX_STRING_COUNT` cheap in the DFA). A
pattern or format is combined with length bounds only when the bounds are implied by
the pattern's own width, or the pattern is a single repeated class whose repeat count
can absorb them; intersecting two arbitrary regexes is out of reach for a regex
emitter.
"""

from __future__ import annotations

from typing import Any

from ._regex import CANON_COUNTED_CHAR, STRING, Frag, NEVER, repeat
from .charsets import encode_set
from .context import MAX_STRING_COUNT, Context
from .formats import FORMATS, KNOWN_UNENFORCED
from .patterns import PatternUnsupported, single_class_repeat, translate


def _bounds(schema: dict, ctx: Context) -> tuple[int, int | None]:
    lo = int(schema.get("minLength", 0) or 0)
    hi = schema.get("maxLength")
    hi = None if hi is None else int(hi)
    if lo > MAX_STRING_COUNT:
        ctx.unsupported("minLength", f"{lo} exceeds the counting limit {MAX_STRING_COUNT}")
        lo = 0
    if hi is not None and hi > MAX_STRING_COUNT:
        ctx.unsupported("maxLength", f"{hi} exceeds the counting limit {MAX_STRING_COUNT}")
        hi = None
    return lo, hi


def string_regex(schema: dict[str, Any], ctx: Context) -> Frag:
    lo, hi = _bounds(schema, ctx)
    pattern = schema.get("pattern")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in KNOWN_UNENFORCED:
        ctx.unsupported("format", f"format {fmt!r} is not enforced")
        fmt = None
    if isinstance(fmt, str) and fmt not in FORMATS:
        fmt = None  # unknown formats are annotations
    if pattern is not None and fmt is not None:
        ctx.unsupported("format", "format together with pattern")
        fmt = None
    if pattern is None and fmt is not None:
        pattern = "^" + FORMATS[fmt] + "$"
    if pattern is None:
        if lo == 0 and hi is None:
            return STRING
        return '"' + (repeat(CANON_COUNTED_CHAR, lo, hi) or "") + '"'
    if not isinstance(pattern, str):
        ctx.unsupported("pattern", "not a string")
        return STRING
    return _pattern_regex(pattern, lo, hi, ctx)


def _pattern_regex(pattern: str, lo: int, hi: int | None, ctx: Context) -> Frag:
    try:
        body, (wlo, whi) = translate(pattern)
    except PatternUnsupported as e:
        ctx.unsupported("pattern", f"{pattern!r}: {e}")
        return '"' + (repeat(CANON_COUNTED_CHAR, lo, hi) or "") + '"'
    if body is None:
        return NEVER
    if lo <= wlo and (hi is None or (whi is not None and whi <= hi)):
        return '"' + body + '"'
    rep = single_class_repeat(pattern)
    if rep is not None:
        ranges, plo, phi = rep
        nlo = max(lo, plo)
        nhi = phi if hi is None else (hi if phi is None else min(hi, phi))
        if nhi is not None and nhi > MAX_STRING_COUNT:
            nhi = None
            ctx.unsupported("maxLength", "combined bound exceeds the counting limit")
        return seq_quoted(repeat(encode_set(ranges), nlo, nhi))
    ctx.unsupported("pattern", "pattern combined with minLength/maxLength")
    return '"' + body + '"'


def seq_quoted(body: Frag) -> Frag:
    return None if body is None else '"' + body + '"'
