"""JSON Schema -> regex, for grammar-constrained decoding through outlines-core.

`schema_to_regex` emits a regex whose matches are exactly (never more than) the
*canonical compact* serializations of instances the schema accepts: object members in
the schema's declared property order (then any additional members), no whitespace
unless `whitespace` is given, strings spelled the way `json.dumps(...,
ensure_ascii=False)` spells them where a constraint looks inside them. Anything the
regex matches validates; valid instances are matched when serialized that way.
Keywords we cannot enforce raise `UnsupportedSchemaError` (strict) or are dropped with
a warning (relaxed); annotations (title, description, examples, ...) are ignored.

`schema_to_machines` is the same conversion in machine mode (machines.py): recursive
$refs, free-form values and large subschemas become sub-machines called from the
regex, for the pushdown backend; with no sub-machine its root is `schema_to_regex`'s
regex.
"""

from __future__ import annotations

import json
from typing import Any

from ._regex import ReservedCodePoint
from .context import MAX_COUNT, MAX_REF_DEPTH, MAX_REGEX_CHARS, Context, UnsupportedSchemaError
from .converter import convert
from .machines import Intersect, MachineSpec, Machines, sub_texts


def schema_to_regex(schema: dict[str, Any] | bool | str, *, whitespace: str | None = None,
                    strict: bool = True) -> str:
    """Regex (Python `re` / Rust `regex` common dialect) for instances of `schema`.

    `whitespace` is a regex for what may appear between JSON tokens (default: nothing).
    `strict=False` drops unenforceable keywords with a `warnings.warn` instead of
    raising `UnsupportedSchemaError`.
    """
    schema, ws = _parse(schema, whitespace)
    return _run(schema, Context(root=schema, ws=ws, strict=strict))


def schema_to_machines(schema: dict[str, Any] | bool | str, *, whitespace: str | None = None,
                       strict: bool = True) -> MachineSpec:
    """Machine-mode conversion: the root regex and the sub-machine regexes it calls
    (`MachineSpec`). Same options and errors as `schema_to_regex`."""
    schema, ws = _parse(schema, whitespace)
    machines = Machines(ws)
    ctx = Context(root=schema, ws=ws, strict=strict, machines=machines)
    try:
        root = _run(schema, ctx)
    except OverflowError as e:
        raise UnsupportedSchemaError("schema", "/", str(e)) from None
    for sub in machines.regexes:
        if any(len(t) > MAX_REGEX_CHARS for t in sub_texts(sub)):
            raise UnsupportedSchemaError("schema", "/", f"regex exceeds {MAX_REGEX_CHARS} characters")
    return machines.spec(root)


def _parse(schema: Any, whitespace: str | None) -> tuple[Any, str]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise UnsupportedSchemaError("schema", "/", f"not valid JSON: {e}") from None
    return schema, "" if not whitespace else "(?:" + whitespace + ")"


def _run(schema: Any, ctx: Context) -> str:
    try:
        out = convert(schema, ctx)
    except RecursionError:  # deeply nested allOf/anyOf merges: a clear error, not a crash
        raise UnsupportedSchemaError("schema", "/", "the schema nests too deeply to convert") from None
    except (ReservedCodePoint, AssertionError):  # a literal spelling a reserved code point
        raise UnsupportedSchemaError("enum", ctx.pointer,
                                     "code points U+10F000..U+10FFFF are reserved") from None
    if out is None:
        raise UnsupportedSchemaError("schema", "/", "the schema accepts no instance")
    return out


def canonical_json(instance: Any, schema: Any = None) -> str:
    """The compact serialization the regex expects (keys in the schema's declared
    property order where the schema declares properties; best effort through $ref)."""
    if schema is not None:
        instance = _order(instance, schema, schema, 0)
    return json.dumps(instance, separators=(",", ":"), ensure_ascii=False)


def _order(value: Any, schema: Any, root: Any, depth: int) -> Any:
    if depth > 40 or not isinstance(schema, dict):
        return value
    if "$ref" in schema and isinstance(schema["$ref"], str) and schema["$ref"].startswith("#"):
        ctx = Context(root=root, strict=False)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from .combinators import resolve_ref

            target = resolve_ref(schema["$ref"], ctx)
        if target is not None:
            return _order(value, target, root, depth + 1)
    subs = [schema] + [s for kw in ("allOf", "anyOf", "oneOf") for s in schema.get(kw, [])
                       if isinstance(s, dict)]
    if isinstance(value, dict):
        props: dict[str, Any] = {}
        for s in subs:
            s = _deref(s, root)
            for name, ps in (s.get("properties") or {}).items():
                props.setdefault(name, ps)
            for name in s.get("required") or []:
                if isinstance(name, str):
                    props.setdefault(name, True)
        out = {k: _order(value[k], props[k], root, depth + 1) for k in props if k in value}
        for k, v in value.items():
            if k not in out:
                add = next((s.get("additionalProperties") for s in subs
                            if isinstance(s.get("additionalProperties"), dict)), None)
                out[k] = _order(v, add, root, depth + 1)
        return out
    if isinstance(value, list):
        for s in subs:
            s = _deref(s, root)
            items, prefix = s.get("items"), s.get("prefixItems")
            if isinstance(items, list):
                prefix, items = items, s.get("additionalItems")
            if items is not None or prefix:
                prefix = prefix or []
                return [_order(v, prefix[i] if i < len(prefix) else items, root, depth + 1)
                        for i, v in enumerate(value)]
    return value


def _deref(s: Any, root: Any) -> Any:
    for _ in range(8):
        if isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
            node: Any = root
            for part in [p for p in s["$ref"][1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                return {}
            s = node
        else:
            break
    return s if isinstance(s, dict) else {}


__all__ = ["schema_to_regex", "schema_to_machines", "MachineSpec", "Intersect", "canonical_json",
           "UnsupportedSchemaError", "MAX_COUNT", "MAX_REF_DEPTH"]
