"""String schemas: const-free strings with minLength/maxLength, `pattern` and `format`.

Length is counted in decoded characters (`CANON_COUNTED_CHAR` matches exactly one,
spelled canonically, which keeps bounds up to `MAX_STRING_COUNT` cheap in the DFA).

Machine mode (ctx.machines set) is exact where single-regex mode gives up:
- a pattern or format with length bounds the pattern does not imply, and a format
  together with a pattern, become an intersection machine (machines.Machines.intersect:
  the product of the parts' DFAs). Every part spells characters the canonical way
  (charsets.encode_set for pattern text, CANON_COUNTED_CHAR for the count; an
  unanchored side's ANY_CHAR is wider, but only in spellings the other parts refuse),
  so the product accepts exactly the canonical spellings of the valid instances;
- bounds past the backend's inline count (ctx.limits.string_count) are counted in
  blocks: a block machine matches exactly ctx.limits.block characters, the next level
  exactly that many blocks, and so on, so a bound of 65535 costs a few hundred DFA
  states (see `_count_in_blocks`). Whole-DFA backends use blocks of 32 (each block DFA
  small: ~500 states for canonical characters, ~130 for a block of calls); the native
  engine builds states lazily and uses blocks of 1024, so few tokens cross a block end.
In machine mode every string built here opens with a call of a one-quote machine
(`_open_quote`) instead of a literal quote. The Rust DFA builder determinizes the
unanchored start too, whose restarts at each `"` of a `\\"` escape track every
subset of counts: `"(?:CHAR){0,16}"` alone takes seconds and each extra count doubles
it. A call marker never occurs in text, so no restart survives and the build is
linear again; block machines open with a call of a one-character machine likewise.
Single-regex mode combines a pattern with bounds only when the bounds are implied by
the pattern's own width, or the pattern is a single repeated class whose repeat count
can absorb them; anything else there is unsupported (a regex emitter cannot intersect).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._regex import CANON_COUNTED_CHAR, STRING, Frag, NEVER, alt, group, repeat
from .charsets import encode_set
from .context import MAX_STRING_COUNT, Context
from .formats import FORMATS, KNOWN_UNENFORCED
from .patterns import PatternUnsupported, single_class_repeat, translate

if TYPE_CHECKING:
    from .machines import Machines

def _lengths(schema: dict) -> tuple[int, int | None]:
    lo = int(schema.get("minLength", 0) or 0)
    hi = schema.get("maxLength")
    return lo, (None if hi is None else int(hi))


def _limit_bounds(lo: int, hi: int | None, ctx: Context) -> tuple[int, int | None]:
    """Single-regex mode: bounds past MAX_STRING_COUNT cannot be counted inline."""
    if lo > MAX_STRING_COUNT:
        ctx.unsupported("minLength", f"{lo} exceeds the counting limit {MAX_STRING_COUNT}")
        lo = 0
    if hi is not None and hi > MAX_STRING_COUNT:
        ctx.unsupported("maxLength", f"{hi} exceeds the counting limit {MAX_STRING_COUNT}")
        hi = None
    return lo, hi


def _format_pattern(schema: dict, ctx: Context) -> str | None:
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in KNOWN_UNENFORCED:
        ctx.unsupported("format", f"format {fmt!r} is not enforced")
        return None
    if not isinstance(fmt, str) or fmt not in FORMATS:
        return None  # unknown formats are annotations
    return "^" + FORMATS[fmt] + "$"


def string_regex(schema: dict[str, Any], ctx: Context) -> Frag:
    lo, hi = _lengths(schema)
    if ctx.machines is None:
        lo, hi = _limit_bounds(lo, hi, ctx)
    pattern = schema.get("pattern")
    if pattern is not None and not isinstance(pattern, str):
        ctx.unsupported("pattern", "not a string")
        pattern = None
    fmt = _format_pattern(schema, ctx)
    if pattern is not None and fmt is not None and ctx.machines is None:
        ctx.unsupported("format", "format together with pattern")
        fmt = None
    sources = [p for p in (pattern, fmt) if p is not None]
    bodies: list[tuple[str, str, int, int | None]] = []  # (source, body, min, max width)
    for src in sources:
        try:
            body, (wlo, whi) = translate(src)
        except PatternUnsupported as e:
            ctx.unsupported("pattern", f"{src!r}: {e}")
            continue
        if body is None:
            return NEVER
        bodies.append((src, body, wlo, whi))
    if not bodies:
        return _quoted_count(CANON_COUNTED_CHAR, lo, hi, ctx)
    if hi is not None and hi < lo:
        return NEVER
    # The intersection's width lies within every part's, so one part can imply a bound.
    implied = (lo <= max(b[2] for b in bodies)
               and (hi is None or any(b[3] is not None and b[3] <= hi for b in bodies)))
    if implied and len(bodies) == 1:
        return '"' + bodies[0][1] + '"'
    quote = _open_quote(ctx)
    parts = [quote + body + '"' for _, body, _, _ in bodies]
    if implied:
        assert ctx.machines is not None  # several parts: format with pattern
        return ctx.machines.intersect(parts)
    if len(bodies) == 1:
        rep = single_class_repeat(bodies[0][0])
        if rep is not None:
            return _class_repeat(rep, lo, hi, ctx)
    if ctx.machines is not None and max(lo, hi or 0) <= MAX_STRING_COUNT:  # products are built whole
        counted = quote + (repeat(CANON_COUNTED_CHAR, lo, hi) or "") + '"'
        return ctx.machines.intersect(parts + [counted])
    if ctx.machines is not None:
        ctx.unsupported("maxLength" if (hi or 0) > MAX_STRING_COUNT else "minLength",
                        f"pattern or format with a length bound above {MAX_STRING_COUNT}")
        return ctx.machines.intersect(parts)  # relaxed: the bounds are dropped
    ctx.unsupported("pattern", "pattern combined with minLength/maxLength")
    return parts[0]


def _open_quote(ctx: Context) -> str:
    """The opening quote of a string regex built here: in machine mode a call of a
    machine matching `"` (see the module docstring), else the quote itself."""
    return '"' if ctx.machines is None else ctx.machines.call('"')


def _class_repeat(rep: tuple[list[tuple[int, int]], int, int | None], lo: int,
                  hi: int | None, ctx: Context) -> Frag:
    """^[set]{plo,phi}$ with bounds lo..hi: one repeat of the class, both bounds met."""
    ranges, plo, phi = rep
    nlo = max(lo, plo)
    nhi = phi if hi is None else (hi if phi is None else min(hi, phi))
    if ctx.machines is None and nhi is not None and nhi > MAX_STRING_COUNT:
        nhi = None
        ctx.unsupported("maxLength", "combined bound exceeds the counting limit")
    char = encode_set(ranges)
    if char is None:
        return '""' if nlo == 0 and (nhi is None or nhi >= 0) else NEVER
    return _quoted_count(char, nlo, nhi, ctx)


def _quoted_count(char: str, lo: int, hi: int | None, ctx: Context) -> Frag:
    """'"' + `char` repeated lo..hi times + '"' (plain STRING when unbounded)."""
    if lo == 0 and hi is None and char == CANON_COUNTED_CHAR:
        return STRING
    if hi is not None and hi < lo:
        return NEVER
    if max(lo, hi or 0) <= ctx.limits.string_count or ctx.machines is None:
        body = repeat(char, lo, hi) or ""
        call = ctx.limits.call_count
        if ctx.machines is not None and call is not None and max(lo, hi or 0) > call:
            return _open_quote(ctx) + ctx.machines.call(body + '"')  # with the quote: never empty
        return '"' + body + '"'
    return _open_quote(ctx) + _count_in_blocks(char, lo, hi, ctx.machines, ctx.limits.block) + '"'


def _count_in_blocks(char: str, lo: int, hi: int | None, machines: "Machines", block: int) -> str:
    """`char` repeated lo..hi times (lo <= hi), counted with block machines.

    unit(0) is one `char`; unit(L) calls a machine matching exactly block units of
    level L-1, i.e. block**L characters. A count of exactly n spells n's base-block
    digits as unit repeats, top level first. "Up to n" more is, with n = q * size + r
    at the top level L: fewer than q units of L followed by anything below a unit
    (up to size - 1), or exactly q units followed by up to r. Every alternative is a
    disjoint range of counts, so the language is exact; the pushdown runs the few
    parses a prefix allows (in a top unit, or in a lower one) side by side.
    """
    top = 0
    while block ** (top + 1) <= max(lo, hi or 0):
        top += 1
    units = [group(char)]
    for level in range(top):
        # The first unit of a level-1 block is a call (see the module docstring).
        first = machines.call(units[0]) if level == 0 else units[-1]
        units.append(machines.call(first + units[-1] * (block - 1)))

    def exactly(n: int) -> str:
        out = []
        for level in range(top, -1, -1):
            d, n = divmod(n, block ** level)
            out.append(repeat(units[level], d, d) or "")
        return "".join(out)

    def up_to(n: int) -> str:
        if n == 0:
            return ""
        level = 0
        while level < top and block ** (level + 1) <= n:
            level += 1
        if level == 0:
            return repeat(units[0], 0, n) or ""
        size = block ** level
        q, r = divmod(n, size)
        below = up_to(size - 1)
        if r == size - 1:  # both alternatives end alike: one repeat covers them
            return (repeat(units[level], 0, q) or "") + below
        fewer = (repeat(units[level], 0, q - 1) or "") + below
        full = (repeat(units[level], q, q) or "") + up_to(r)
        out = alt([fewer, full])
        assert out is not None
        return out

    tail = (repeat(units[0], 0, None) or "") if hi is None else up_to(hi - lo)
    return exactly(lo) + tail
