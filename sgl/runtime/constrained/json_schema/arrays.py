"""Array schemas: `items` (schema or draft-4 tuple list), `prefixItems`,
`additionalItems`, minItems/maxItems.

A tuple prefix is spelled as nested optional groups (position k exists only if k-1
does), followed by repetitions of the tail item schema; counts above the counting
limit are reported as unenforceable.
"""

from __future__ import annotations

from typing import Any, Callable

from ._regex import Frag, NEVER, alt, group, repeat
from .context import MAX_COUNT, Context
from .machines import MIN_EXTRACT_CHARS, shrink

Convert = Callable[[Any, Context], Frag]


def array_regex(schema: dict[str, Any], ctx: Context, convert: Convert) -> Frag:
    ws = ctx.ws
    comma = ws + "," + ws
    lo = int(schema.get("minItems", 0) or 0)
    hi = schema.get("maxItems")
    for kw in ("contains", "unevaluatedItems", "minContains", "maxContains"):
        if kw in schema:
            ctx.unsupported(kw)
    if schema.get("uniqueItems") is True and not (hi is not None and hi <= 1):
        ctx.unsupported("uniqueItems")
    items = schema.get("items", True)
    prefix = schema.get("prefixItems")
    tail: Any
    if isinstance(items, list):
        prefix, tail = items, schema.get("additionalItems", True)
    else:
        tail = items
    prefix = list(prefix or [])
    limit = ctx.limits.item_count
    if lo > limit:
        ctx.unsupported("minItems", f"{lo} exceeds the counting limit {limit}")
        lo = 0
    if hi is not None and hi > limit:
        ctx.unsupported("maxItems", f"{hi} exceeds the counting limit {limit}")
        hi = None
    pre: list[Frag] = []
    for i, sub in enumerate(prefix):
        ctx.path += ["prefixItems", str(i)]
        pre.append(convert(sub, ctx))
        ctx.path[-2:] = []
    ctx.path.append("items")
    tail_re = convert(tail, ctx) if tail is not False else NEVER
    ctx.path.pop()
    if (ctx.machines is not None and max(lo, hi or 0) > MAX_COUNT and tail_re is not None
            and len(tail_re) > MIN_EXTRACT_CHARS):
        tail_re = ctx.machines.call(tail_re)  # a long count repeats one call, not the item
    # Machine mode: tuple items repeated past the size budget become calls.
    return shrink(pre + [tail_re], lambda parts: _build(parts[:-1], parts[-1], lo, hi, ws),
                  ctx.machines)


def _build(pre: list[Frag], tail_re: Frag, lo: int, hi: Any, ws: str) -> Frag:
    comma = ws + "," + ws
    # Alternatives by how many elements are present: within the prefix, or past it.
    alts: list[Frag] = []
    k = len(pre)
    for n in range(0, k + 1):
        if n < lo or (hi is not None and n > hi):
            continue
        if n < k or (n == k):
            if any(p is None for p in pre[:n]):
                continue
            if n == k:
                break
            alts.append(comma.join(pre[:n]) if n else "")  # type: ignore[arg-type]
    if all(p is not None for p in pre):
        more_lo = max(lo - k, 0)
        more_hi = None if hi is None else hi - k
        if more_hi is None or more_hi >= 0:
            if k == 0:
                if tail_re is None:
                    alts.append("" if lo == 0 else NEVER)
                elif more_hi == 0:
                    alts.append("" if lo == 0 else NEVER)
                else:
                    first = tail_re
                    rest = repeat(comma + tail_re, max(more_lo - 1, 0),
                                  None if more_hi is None else more_hi - 1)
                    body = None if rest is None else first + rest
                    alts.append(body if more_lo >= 1 else (group(body) + "?" if body else ""))
            else:
                head = comma.join(pre)  # type: ignore[arg-type]
                more = repeat(None if tail_re is None else comma + tail_re, more_lo, more_hi)
                alts.append(None if more is None else head + more)
    body = alt(alts)
    if body is None:
        return NEVER
    return r"\[" + ws + body + ws + r"\]"
