"""The recursive walk: one (sub)schema in, one regex fragment out.

Order of work for a schema: booleans; `$ref` (merged with its siblings; on recursion
depth-bounded, the cut-off branch matching nothing, or in machine mode a call of the
$ref's own machine); `allOf` merged into one schema;
`anyOf`/`oneOf` distributed over their siblings and emitted as an alternation
(`oneOf` only when its branches provably exclude each other); `enum`/`const` as
literal alternatives; then one builder per JSON type.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from ._regex import (BOOLEAN, NULL, NUMBER, STRING, Frag, NEVER, alt, call_marker, group,
                     json_literal)
from .arrays import array_regex
from .combinators import _ANNOTATIONS, canon, merge, normalize_bounds, resolve_ref, types_of
from .context import ANY_VALUE_DEPTH, MAX_REF_DEPTH, MAX_REGEX_CHARS, Context, UnsupportedSchemaError
from .machines import SPLIT_CHARS, shrink
from .numbers import int_range, number_range
from .objects import object_regex
from .strings import string_regex

_OBJECT_KW = {"properties", "required", "additionalProperties", "patternProperties",
              "minProperties", "maxProperties", "propertyNames", "dependencies",
              "dependentRequired", "dependentSchemas", "unevaluatedProperties"}
_ARRAY_KW = {"items", "prefixItems", "additionalItems", "minItems", "maxItems",
             "uniqueItems", "contains", "unevaluatedItems"}
_STRING_KW = {"minLength", "maxLength", "pattern", "format"}
_NUMBER_KW = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_UNSUPPORTED_ANY = ("not", "if", "then", "else")
_JSON_TYPES = ("object", "array", "string", "number", "boolean", "null")  # integer is in number


def convert(schema: Any, ctx: Context) -> Frag:
    out = _convert(schema, ctx)
    if ctx.machines is not None and out is not None and len(out) > SPLIT_CHARS and ctx.path:
        # Machine mode: a large value becomes a call (the root itself never does).
        return ctx.machines.call(out)
    if out is not None and len(out) > MAX_REGEX_CHARS:
        # Regex text this large means a DFA outlines-core cannot index in time.
        raise UnsupportedSchemaError("schema", ctx.pointer,
                                     f"regex exceeds {MAX_REGEX_CHARS} characters")
    return out


def _convert(schema: Any, ctx: Context) -> Frag:
    if schema is True:
        return any_value(ctx, ANY_VALUE_DEPTH)
    if schema is False:
        return NEVER
    if not isinstance(schema, dict):
        ctx.unsupported("schema", f"not an object: {schema!r}")
        return any_value(ctx, ANY_VALUE_DEPTH)
    if "$ref" in schema:
        return _ref(schema, ctx)
    if "allOf" in schema:
        merged: Any = {k: v for k, v in schema.items() if k != "allOf"}
        for i, part in enumerate(schema["allOf"]):
            ctx.path += ["allOf", str(i)]
            merged = merge(merged, _inline_refs(part, ctx), ctx)
            ctx.path[-2:] = []
        return convert(merged, ctx)
    for kw in ("anyOf", "oneOf"):
        if kw in schema:
            return _alternatives(schema, kw, ctx)
    for kw in _UNSUPPORTED_ANY:
        if kw in schema:
            ctx.unsupported(kw)
    if schema.get("nullable") is True:
        rest = {k: v for k, v in schema.items() if k != "nullable"}
        return alt([NULL, convert(rest, ctx)])
    if "const" in schema or "enum" in schema:
        return _enum(schema, ctx)
    return _typed(normalize_bounds(schema), ctx)


def _inline_refs(schema: Any, ctx: Context) -> Any:
    """Resolve a top-level $ref (for merging); recursion depth still applies."""
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and seen < 8:
        target = resolve_ref(schema["$ref"], ctx)
        if target is None:
            return {k: v for k, v in schema.items() if k != "$ref"}
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = merge(target, rest, ctx) if rest else target
        seen += 1
    return schema


def _ref(schema: dict, ctx: Context) -> Frag:
    if ctx.machines is not None:
        return _ref_machine(schema, ctx)
    ref = schema["$ref"]
    if ctx.ref_stack.count(ref) >= MAX_REF_DEPTH:
        return NEVER  # recursion bound: the deeper branch matches nothing
    target = resolve_ref(ref, ctx)
    rest = {k: v for k, v in schema.items() if k != "$ref"}
    if target is None:
        return convert(rest, ctx)
    ctx.ref_stack.append(ref)
    try:
        return convert(merge(target, rest, ctx) if rest else target, ctx)
    finally:
        ctx.ref_stack.pop()


def _ref_machine(schema: dict, ctx: Context) -> Frag:
    """Machine mode: a $ref converts once (memoized); met again while open, it is
    recursive and becomes its own machine, called from inside itself."""
    m = ctx.machines
    assert m is not None
    ref = schema["$ref"]
    rest = {k: v for k, v in schema.items() if k != "$ref"}
    checked = {k: v for k, v in rest.items() if k not in _ANNOTATIONS}
    key = ref if not checked else ref + "\0" + canon(checked)
    if key in ctx.ref_stack:
        mid = m.ref_ids.get(key)
        if mid is None:
            mid = m.ref_ids[key] = m.reserve()
        return call_marker(mid)
    if key in m.ref_memo:
        return m.ref_memo[key]
    target = resolve_ref(ref, ctx)
    ctx.ref_stack.append(key)
    try:
        if target is None:
            out = convert(rest, ctx)
        else:
            out = convert(merge(target, rest, ctx) if rest else target, ctx)
    finally:
        ctx.ref_stack.pop()
    mid = m.ref_ids.get(key)
    if mid is not None:
        m.define(mid, out)
        out = call_marker(mid)
    m.ref_memo[key] = out
    return out


def _alternatives(schema: dict, kw: str, ctx: Context) -> Frag:
    siblings = {k: v for k, v in schema.items() if k != kw}
    branches = []
    for i, b in enumerate(schema[kw]):
        ctx.path += [kw, str(i)]
        branches.append(merge(siblings, _inline_refs(b, ctx), ctx) if siblings else b)
        ctx.path[-2:] = []
    if kw == "oneOf" and not _pairwise_disjoint(branches, ctx):
        ctx.unsupported("oneOf", "branches may overlap; exactly-one cannot be enforced")
    frags = []
    for i, b in enumerate(branches):
        ctx.path += [kw, str(i)]
        frags.append(convert(b, ctx))
        ctx.path[-2:] = []
    return shrink(frags, alt, ctx.machines)


def _enum(schema: dict, ctx: Context) -> Frag:
    values = [schema["const"]] if "const" in schema else list(schema["enum"] or [])
    if "const" in schema and "enum" in schema:
        allowed = {canon(v) for v in schema["enum"]}
        values = [v for v in values if canon(v) in allowed]
    types = types_of(schema)
    out = []
    for v in values:
        if types is not None and not any(_is_type(v, t) for t in types):
            continue
        out.append(json_literal(v))
    return alt(out)


def _is_type(v: Any, t: str) -> bool:
    if t == "null":
        return v is None
    if t == "boolean":
        return isinstance(v, bool)
    if t == "string":
        return isinstance(v, str)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or (
            isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "array":
        return isinstance(v, list)
    if t == "object":
        return isinstance(v, dict)
    return False


def _infer_types(schema: dict) -> list[str]:
    keys = set(schema)
    found = []
    if keys & _OBJECT_KW:
        found.append("object")
    if keys & _ARRAY_KW:
        found.append("array")
    if keys & _STRING_KW:
        found.append("string")
    if keys & _NUMBER_KW:
        found.append("number")
    return found


def _typed(schema: dict, ctx: Context) -> Frag:
    types = types_of(schema)
    if types is None:
        inferred = _infer_types(schema)
        if not inferred:
            return any_value(ctx, ANY_VALUE_DEPTH)
        # No "type": every JSON type is valid and a keyword constrains only values of its
        # own type ({"properties": ...} admits a string as it is), as validators read it.
        frags = [_one_type(t, schema, ctx) for t in inferred]
        return alt(frags + [_one_type(t, {}, ctx) for t in _JSON_TYPES if t not in inferred])
    frags = []
    for t in dict.fromkeys(types):
        if t == "integer" and "number" in types:
            continue
        frags.append(_one_type(t, schema, ctx))
    return alt(frags)


def _one_type(t: str, schema: dict, ctx: Context) -> Frag:
    if t == "object":
        return object_regex(schema, ctx, convert)
    if t == "array":
        return array_regex(schema, ctx, convert)
    if t == "string":
        return string_regex(schema, ctx)
    if t in ("number", "integer"):
        return _number(schema, t == "integer", ctx)
    if t == "boolean":
        return BOOLEAN
    if t == "null":
        return NULL
    ctx.unsupported("type", f"unknown type {t!r}")
    return NEVER


def _dec(v: Any) -> Decimal | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return Decimal(str(v))
    except (InvalidOperation, ValueError):
        return None


def _number(schema: dict, integer: bool, ctx: Context) -> Frag:
    lo, hi = _dec(schema.get("minimum")), _dec(schema.get("maximum"))
    xlo, xhi = _dec(schema.get("exclusiveMinimum")), _dec(schema.get("exclusiveMaximum"))
    lo_strict = hi_strict = False
    if xlo is not None and (lo is None or xlo >= lo):
        lo, lo_strict = xlo, True
    if xhi is not None and (hi is None or xhi <= hi):
        hi, hi_strict = xhi, True
    mult = _dec(schema.get("multipleOf"))
    if mult is not None:
        if mult == mult.to_integral_value() and mult == 1:
            integer = True
        elif not integer and mult < 1 and (1 / mult) == (1 / mult).to_integral_value() \
                and str(int(1 / mult)).strip("0") == "1" and lo is None and hi is None:
            places = len(str(int(1 / mult))) - 1
            return r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]{1,%d})?" % places
        else:
            ctx.unsupported("multipleOf", str(schema.get("multipleOf")))
    if integer:
        ilo = None if lo is None else int(lo.to_integral_value(rounding="ROUND_CEILING"))
        if lo is not None and lo_strict and ilo == lo:
            ilo += 1  # type: ignore[operator]
        ihi = None if hi is None else int(hi.to_integral_value(rounding="ROUND_FLOOR"))
        if hi is not None and hi_strict and ihi == hi:
            ihi -= 1  # type: ignore[operator]
        return int_range(ilo, ihi)
    return number_range(lo, lo_strict, hi, hi_strict)


def any_value(ctx: Context, depth: int) -> str:
    """Any JSON value, nested at most `depth` containers deep (any depth in machine
    mode: a call of the free-form machine)."""
    if ctx.machines is not None:
        return ctx.machines.any_value()
    scalars = [STRING, NUMBER, BOOLEAN, NULL]
    if depth <= 0:
        return group("|".join(scalars))
    inner = any_value(ctx, depth - 1)
    ws, comma = ctx.ws, ctx.ws + "," + ctx.ws
    arr = r"\[" + ws + group(inner + group(comma + inner) + "*") + "?" + ws + r"\]"
    member = STRING + ws + ":" + ws + inner
    obj = r"\{" + ws + group(member + group(comma + member) + "*") + "?" + ws + r"\}"
    return group("|".join(scalars + [arr, obj]))


def _pairwise_disjoint(branches: list, ctx: Context) -> bool:
    return all(_disjoint(a, b, ctx, 0) for i, a in enumerate(branches)
               for b in branches[i + 1:])


def _kinds(s: Any, ctx: Context) -> set[str] | None:
    if not isinstance(s, dict):
        return None
    s = _inline_refs(s, ctx)
    if not isinstance(s, dict) or any(k in s for k in ("anyOf", "oneOf", "allOf", "not")):
        return None
    if "const" in s or "enum" in s:
        vals = [s["const"]] if "const" in s else s["enum"]
        return {_kind_of(v) for v in vals}
    t = types_of(s)
    if not t:
        return None  # untyped: every kind (its keywords constrain some of them)
    out = set(t)
    if "number" in out:
        out.add("integer")
    return out


def _kind_of(v: Any) -> str:
    for t in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(v, t) and not (t == "number" and _is_type(v, "integer")):
            return t
    return "?"


def _disjoint(a: Any, b: Any, ctx: Context, depth: int) -> bool:
    if a is False or b is False:
        return True
    ka, kb = _kinds(a, ctx), _kinds(b, ctx)
    if ka is not None and kb is not None and not (ka & kb):
        return True
    if not (isinstance(a, dict) and isinstance(b, dict)) or depth > 3:
        return False
    a, b = _inline_refs(a, ctx), _inline_refs(b, ctx)
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    ea = [a["const"]] if "const" in a else a.get("enum")
    eb = [b["const"]] if "const" in b else b.get("enum")
    if ea is not None and eb is not None:
        return not ({canon(v) for v in ea} & {canon(v) for v in eb})
    if ka == {"object"} or kb == {"object"} or (ka and "object" in ka and kb and "object" in kb):
        for x, y in ((a, b), (b, a)):
            for name in x.get("required") or []:
                yprops = y.get("properties") or {}
                if y.get("additionalProperties") is False and name not in yprops \
                        and not y.get("patternProperties"):
                    return True
                if name in yprops and name in (y.get("required") or []):
                    xs = (x.get("properties") or {}).get(name, True)
                    if _disjoint(xs, yprops[name], ctx, depth + 1):
                        return True
    return False
