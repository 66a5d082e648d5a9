"""Object schemas: declared properties in declared order (required ones always,
optional ones maybe), then any additional members the schema allows.

Commas go only between members. Once a required member is known to be written the
list is linear; an all-optional list is spelled so that each member regex appears
twice (four times past 32 members) and the first member written picks the branch.
Additional members come last; their keys must differ from every declared name, which
`keys.key_not_in` spells as a trie complement over decoded characters.
"""

from __future__ import annotations

from typing import Any, Callable

import jsonschema

from ._regex import STRING, Frag, NEVER, alt, group
from .charsets import encode_literal
from .combinators import merge
from .context import Context
from .keys import disjoint_bodies, key_not_in
from .machines import SPLIT_CHARS, Machines, shrink
from .patterns import PatternUnsupported, name_matches, translate

Convert = Callable[[Any, Context], Frag]


def object_regex(schema: dict[str, Any], ctx: Context, convert: Convert) -> Frag:
    ws = ctx.ws
    props: dict[str, Any] = dict(schema.get("properties") or {})
    required = [r for r in schema.get("required") or [] if isinstance(r, str)]
    for name in required:
        props.setdefault(name, True)
    for kw in ("dependencies", "dependentRequired", "dependentSchemas",
               "unevaluatedProperties"):
        if kw in schema:
            ctx.unsupported(kw)
    keys: list[tuple[str, bool]] = []
    values: list[Frag] = []
    for name, sub in props.items():
        ctx.path += ["properties", name]
        value = convert(sub, ctx)
        ctx.path[-2:] = []
        is_req = name in required
        if value is None:
            if is_req:
                return NEVER
            continue
        keys.append(('"' + encode_literal(name) + '"', is_req))
        values.append(value)
    extra = _extra_member(schema, list(props), ctx, convert)
    _check_counts(schema, required, len(keys), extra is not None, ctx)
    # minProperties 1 without a required member: the member list may not be empty.
    nonempty = not required and schema.get("minProperties") == 1
    comma = ws + "," + ws

    m = ctx.machines
    if m is not None and extra is not None and len(extra) > SPLIT_CHARS // 2:
        extra = m.call(extra)  # one member (never empty), copied up to log k times

    def build(vals: list[Frag]) -> Frag:
        members = [(k + ws + ":" + ws + str(v), req) for (k, req), v in zip(keys, vals)]
        return r"\{" + ws + _members_body(members, extra, comma, m, nonempty) + ws + r"\}"

    # Machine mode: member values copied past the size budget become calls.
    return shrink(values, build, ctx.machines)


def _members_body(members: list[tuple[str, bool]], extra: Frag, comma: str,
                  machines: Machines | None = None, nonempty: bool = False) -> str:
    """The member list between the braces, commas only between members.

    With a required member the list is linear: the optional members before the first
    required one each carry a trailing comma, the rest a leading one. Without one the
    list may be empty, so no member knows its comma side: `_nonempty` spells the
    nonempty in-order subsequences with each member copied twice (see there).
    """
    first_req = next((i for i, (_, req) in enumerate(members) if req), None)
    if first_req is not None:
        out = "".join(group(m + comma) + "?" for m, _ in members[:first_req])
        out += members[first_req][0]
        for m, req in members[first_req + 1:]:
            out += comma + m if req else group(comma + m) + "?"
        if extra is not None:
            out += group(comma + extra) + "*"
        return out
    items = [m for m, _ in members]
    if extra is not None:
        items.append(extra + group(comma + extra) + "*")
    if not items:
        return ""
    return group(_nonempty(items, comma, machines)) + ("" if nonempty else "?")


# Items per level of `_nonempty`: each level nests one group per item (Rust's regex
# parser refuses nesting past 250) and copies every member twice more.
_CHUNK = 32


def _nonempty(items: list[str], comma: str, machines: Machines | None = None) -> str:
    """Nonempty in-order subsequences of `items`, comma-joined.

    NE(x1..xj) = NE(x1..xj-1) (,xj)? | xj: the first member written picks the branch
    (member keys differ), so the DFA stays deterministic with each member spelled
    twice; the halving encoding this replaces kept several alternatives alive in
    parallel and cost the Rust DFA builder ~25x more time per state. Past `_CHUNK`
    items the same recursion runs over chunks' NEs (4 copies for up to 1024 members).
    In machine mode a large prefix NE is a call (never empty, as calls require)."""
    if len(items) > _CHUNK:
        chunks = [_nonempty(items[i:i + _CHUNK], comma, machines)
                  for i in range(0, len(items), _CHUNK)]
        return _nonempty(chunks, comma, machines)
    out = items[0]
    for x in items[1:]:
        if machines is not None and len(out) > SPLIT_CHARS:
            out = machines.call(out)
        out = group(out + group(comma + x) + "?|" + x)
    return out


def _extra_member(schema: dict, declared: list[str], ctx: Context, convert: Convert) -> Frag:
    additional = schema.get("additionalProperties", True)
    patterns = schema.get("patternProperties") or {}
    if additional is False and not patterns:
        return None
    if "propertyNames" in schema:
        ctx.unsupported("propertyNames", "with additional properties allowed")
    if additional is False:
        bodies = []
        for pat in patterns:
            try:
                body, _ = translate(pat)
            except PatternUnsupported as e:
                ctx.unsupported("patternProperties", f"{pat!r}: {e}")
                return None
            if any(name_matches(pat, n) for n in declared):
                ctx.unsupported("patternProperties", f"{pat!r} also matches a declared name")
                return None
            bodies.append(body)
        if len(bodies) > 1 and all(b is not None for b in bodies) and disjoint_bodies(bodies):
            # Each key meets one pattern only, so its value meets that pattern's schema
            # alone (the merge below would demand every pattern's schema of every key).
            return _per_pattern_members(bodies, list(patterns.values()), ctx, convert)
        body = alt(bodies)
        if body is None:
            return None
        key = '"' + body + '"'
    else:
        key = key_not_in(declared) if declared else STRING
    value_schema: Any = True if additional is False else additional
    for sub in patterns.values():
        value_schema = merge(value_schema, sub, ctx)
    ctx.path.append("additionalProperties")
    value = convert(value_schema, ctx)
    ctx.path.pop()
    if value is None:
        return None
    return key + ctx.ws + ":" + ctx.ws + value


def _per_pattern_members(bodies: list[str], subs: list[Any], ctx: Context,
                         convert: Convert) -> Frag:
    members = []
    for pat_body, sub in zip(bodies, subs):
        ctx.path.append("patternProperties")
        value = convert(sub, ctx)
        ctx.path.pop()
        if value is not None:
            members.append('"' + pat_body + '"' + ctx.ws + ":" + ctx.ws + value)
    return alt(members)


def _check_counts(schema: dict, required: list[str], n_members: int, extras: bool,
                  ctx: Context) -> None:
    lo = schema.get("minProperties")
    if lo == 1 and not required and (n_members or extras):
        lo = None  # object_regex makes the member list nonempty
    if lo is not None and lo > len(required):
        ctx.unsupported("minProperties", f"{lo} > number of required properties")
    hi = schema.get("maxProperties")
    if hi is not None and (extras or n_members > hi):
        ctx.unsupported("maxProperties")
    names = schema.get("propertyNames")
    if isinstance(names, dict) and not extras:
        validator = jsonschema.Draft202012Validator(names)
        if not all(validator.is_valid(n) for n in (schema.get("properties") or {})):
            ctx.unsupported("propertyNames", "a declared property name violates it")
