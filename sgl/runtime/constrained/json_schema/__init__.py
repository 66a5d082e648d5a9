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
from .context import (LAZY_DFA, MAX_COUNT, MAX_REF_DEPTH, MAX_REGEX_CHARS, WHOLE_DFA, Context, Limits,
                      UnsupportedSchemaError)
from .converter import convert
from .machines import Intersect, MachineSpec, Machines, sub_texts
from .memo import clear_memos


def schema_to_regex(schema: dict[str, Any] | bool | str, *, whitespace: str | None = None,
                    strict: bool = True, leading: bool = False) -> str:
    """Regex (Python `re` / Rust `regex` common dialect) for instances of `schema`.

    `whitespace` is a regex for what may appear between JSON tokens (default: nothing);
    `leading=True` allows it before the value too (after a prompt ending in ":" a
    model's next token is " {"). `strict=False` drops unenforceable keywords with a
    `warnings.warn` instead of raising `UnsupportedSchemaError`.
    """
    schema, ws = _parse(schema, whitespace)
    return _lead(_run(schema, Context(root=schema, ws=ws, strict=strict)), ws if leading else "")


def schema_to_machines(schema: dict[str, Any] | bool | str, *, whitespace: str | None = None,
                       strict: bool = True, leading: bool = False, limits: Limits = WHOLE_DFA) -> MachineSpec:
    """Machine-mode conversion: the root regex and the sub-machine regexes it calls
    (`MachineSpec`). Same options and errors as `schema_to_regex`; `limits` says how
    much counting the backend affords (context.Limits: WHOLE_DFA, or LAZY_DFA for the
    native engine)."""
    schema, ws = _parse(schema, whitespace)
    machines = Machines(ws)
    ctx = Context(root=schema, ws=ws, strict=strict, machines=machines, limits=limits)
    try:
        root = _lead(_run(schema, ctx), ws if leading else "")
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


def _lead(root: str, ws: str) -> str:
    return root if not ws else ws + "(?:" + root + ")"


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
    property order where the schema declares properties; through $ref, into the
    anyOf/oneOf branch the value validates against, and patternProperties)."""
    if schema is not None:
        instance = _order(instance, schema, schema, 0, _branch_checker(schema))
    return json.dumps(instance, separators=(",", ":"), ensure_ascii=False)


def _branch_checker(root: Any) -> Any:
    """is_valid(value, subschema) with $refs resolved against `root`, or None without
    the jsonschema package (then branches' properties are merged, best effort)."""
    try:
        import jsonschema
    except ImportError:
        return None
    if not isinstance(root, dict):
        return None
    try:
        base = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)(root)
    except Exception:  # noqa: BLE001 - an odd root: fall back to merging
        return None

    def ok(value: Any, sub: Any) -> bool:
        try:
            return bool(base.evolve(schema=sub).is_valid(value))
        except Exception:  # noqa: BLE001 - unresolvable refs, bad patterns
            return False
    return ok


def _order(value: Any, schema: Any, root: Any, depth: int, valid: Any = None) -> Any:
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
            return _order(value, target, root, depth + 1, valid)
    subs = [schema] + [s for s in schema.get("allOf", []) if isinstance(s, dict)]
    for kw in ("anyOf", "oneOf"):
        branches = [s for s in schema.get(kw, []) if isinstance(s, dict)]
        # The branch the value belongs to decides its key order; merge all if unknown.
        chosen = [b for b in branches if valid is not None and valid(value, b)][:1]
        subs += chosen or branches
    if isinstance(value, dict):
        props: dict[str, Any] = {}
        patterns: list[tuple[str, Any]] = []
        for s in subs:
            s = _deref(s, root)
            for name, ps in (s.get("properties") or {}).items():
                props.setdefault(name, ps)
            for name in s.get("required") or []:
                if isinstance(name, str):
                    props.setdefault(name, True)
            patterns += [(p, ps) for p, ps in (s.get("patternProperties") or {}).items()]
        out = {k: _order(value[k], props[k], root, depth + 1, valid) for k in props if k in value}
        add = next((s.get("additionalProperties") for s in subs
                    if isinstance(s.get("additionalProperties"), dict)), None)
        for k, v in value.items():
            if k not in out:
                sub = next((ps for p, ps in patterns if _search(p, k)), add)
                out[k] = _order(v, sub, root, depth + 1, valid)
        return out
    if isinstance(value, list):
        for s in subs:
            s = _deref(s, root)
            items, prefix = s.get("items"), s.get("prefixItems")
            if isinstance(items, list):
                prefix, items = items, s.get("additionalItems")
            if items is not None or prefix:
                prefix = prefix or []
                return [_order(v, prefix[i] if i < len(prefix) else items, root, depth + 1, valid)
                        for i, v in enumerate(value)]
    return value


def _search(pattern: str, key: str) -> bool:
    import re

    try:
        return re.search(pattern, key) is not None
    except re.error:
        return False


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
           "UnsupportedSchemaError", "MAX_COUNT", "MAX_REF_DEPTH", "clear_memos"]
