"""`$ref` resolution, `allOf` merging, and distributing sibling keywords into
`anyOf`/`oneOf` branches, so the per-type builders only ever see one flat schema.

Merging is an intersection: the merged schema accepts only instances every part
accepts (tightest bounds, intersected types and enums, properties merged recursively
through a nested allOf). Where two parts cannot be intersected exactly (two different
patterns, say) we report the keyword as unsupported rather than guess.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from .context import Context
from .patterns import name_matches

_MIN_KEYS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_MAX_KEYS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_ALL_TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def resolve_ref(ref: str, ctx: Context) -> Any:
    """The subschema a local `$ref` names; unsupported (None) for remote refs."""
    base = ctx.root.get("$id") or ctx.root.get("id") if isinstance(ctx.root, dict) else None
    if isinstance(base, str) and ref.startswith(base.split("#")[0]) and base:
        ref = ref[len(base.split("#")[0]):]
    if not ref.startswith("#"):
        ctx.unsupported("$ref", f"non-local reference {ref!r}")
        return None
    node: Any = ctx.root
    for part in [p for p in ref[1:].split("/") if p != ""]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            ctx.unsupported("$ref", f"unresolvable reference {ref!r}")
            return None
    return node


def normalize_bounds(schema: dict) -> dict:
    """Draft-4 boolean exclusiveMinimum/Maximum become the numeric form."""
    s = dict(schema)
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(s.get(flag), bool):
            if s[flag] and bound in s:
                s[flag] = s.pop(bound)
            else:
                del s[flag]
    return s


def types_of(schema: dict) -> list[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    return [t] if isinstance(t, str) else list(t)


def _merge_types(a: list[str] | None, b: list[str] | None) -> list[str] | None:
    if a is None:
        return b
    if b is None:
        return a
    out = [t for t in a if t in b]
    if "integer" in a and "number" in b and "integer" not in out:
        out.append("integer")
    if "number" in a and "integer" in b and "integer" not in out:
        out.append("integer")
    return out


def merge(a: Any, b: Any, ctx: Context) -> Any:
    """Intersection of two resolved schemas (dicts or booleans)."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    a, b = normalize_bounds(a), normalize_bounds(b)
    out: dict[str, Any] = dict(a)
    for key, bv in b.items():
        if key not in out:
            out[key] = bv
            continue
        av = out[key]
        if key == "type":
            out[key] = _merge_types(types_of(a), types_of(b))
        elif key == "properties":
            continue  # below: each name also meets the other part's additionalProperties
        elif key == "patternProperties":
            props = dict(av)
            for name, ps in bv.items():
                props[name] = {"allOf": [props[name], ps]} if name in props else ps
            out[key] = props
        elif key == "required":
            out[key] = list(dict.fromkeys(list(av) + list(bv)))
        elif key in ("enum", "const"):
            continue  # handled below
        elif key in _MIN_KEYS:
            out[key] = max(av, bv)
        elif key in _MAX_KEYS:
            out[key] = min(av, bv)
        elif key in ("items", "additionalProperties", "additionalItems", "propertyNames"):
            if isinstance(av, dict) and isinstance(bv, dict) or av is False or bv is False \
                    or av is True or bv is True:
                out[key] = merge(av, bv, ctx) if not (av is False or bv is False) else False
            elif canon(av) != canon(bv):
                ctx.unsupported(key, "cannot intersect tuple-form items")
        elif key in ("anyOf", "oneOf"):
            out["allOf"] = list(out.get("allOf", [])) + [{key: bv}]
        elif key == "allOf":
            out[key] = list(av) + list(bv)
        elif canon(av) != canon(bv) and key in _VALIDATION:
            ctx.unsupported(key, "cannot intersect two different values")
    _merge_members(a, b, out, ctx)
    enums = [s for s in (a, b) if "enum" in s or "const" in s]
    if enums:
        sets = [list(s["enum"]) if "enum" in s else [s["const"]] for s in enums]
        keep = [v for v in sets[0] if all(canon(v) in {canon(w) for w in s} for s in sets[1:])]
        out.pop("const", None)
        out["enum"] = keep
    return out


def _governing(name: str, side: dict, ctx: Context) -> Any:
    """The subschema one part applies to member `name`: its property, else the patterns
    that match the name, else its additionalProperties."""
    props = side.get("properties") or {}
    if name in props:
        return props[name]
    matched = []
    for pat, sub in (side.get("patternProperties") or {}).items():
        try:
            if name_matches(pat, name):
                matched.append(sub)
        except re.error as e:
            ctx.unsupported("patternProperties", f"{pat!r}: {e}")
    if matched:
        return matched[0] if len(matched) == 1 else {"allOf": matched}
    return side.get("additionalProperties", True)


def _merge_members(a: dict, b: dict, out: dict, ctx: Context) -> None:
    """Members of an intersection of two object schemas. A name one part declares must
    also satisfy what the other part applies to it: `{"properties": {"x": ...}}` and
    `{"additionalProperties": false}` together allow no x (additionalProperties looks
    only at its own schema's properties, not at allOf siblings')."""
    names = list(dict.fromkeys([*(a.get("properties") or {}), *(b.get("properties") or {})]))
    if names:
        props: dict[str, Any] = {}
        for name in names:
            parts = [p for p in (_governing(name, a, ctx), _governing(name, b, ctx)) if p is not True and p != {}]
            props[name] = (False if any(p is False for p in parts) else
                           parts[0] if len(parts) == 1 else {"allOf": parts} if parts else True)
        out["properties"] = props
    for x, y in ((a, b), (b, a)):  # x's patterns on names y does not declare meet y's extras
        extra = y.get("additionalProperties", True)
        if not x.get("patternProperties") or extra is True or extra == {}:
            continue
        if y.get("patternProperties"):
            ctx.unsupported("patternProperties", "in two merged parts, one with additionalProperties")
            return
        out["patternProperties"] = {pat: {"allOf": [sub, extra]} for pat, sub in x["patternProperties"].items()}


_ANNOTATIONS = {
    "title", "description", "examples", "example", "default", "$schema", "$id", "id",
    "$comment", "deprecated", "readOnly", "writeOnly", "definitions", "$defs",
    "contentEncoding", "contentMediaType", "contentSchema", "$anchor", "$vocabulary",
    "markdownDescription",
}

# Validation keywords whose two differing values we cannot intersect here; any other
# key (annotations, vendor extensions such as x-*) keeps the first value.
_VALIDATION = {
    "pattern", "format", "multipleOf", "uniqueItems", "contains", "not", "if", "then",
    "else", "dependencies", "dependentRequired", "dependentSchemas", "prefixItems",
    "unevaluatedProperties", "unevaluatedItems", "nullable",
}
