"""Pushdown backend for JSON Schema (machine mode): recursive $refs, free-form values at
any depth, and schemas too large for one regex.

Masks are checked against a brute-force reference (every vocabulary token's bytes
stepped through the configuration one by one), instances against jsonschema's labels,
and rollback / jump-forward across call and return boundaries.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from sgl.runtime.constrained.json_schema import canonical_json, schema_to_machines, schema_to_regex
from sgl.runtime.constrained.lazy_regex import CompiledLazyRegex
from sgl.runtime.constrained.native.compiled import CompiledNative
from sgl.runtime.constrained.pushdown import CompiledPushdown
from sgl.runtime.constrained.vocab import greedy_encode
from tests.grammar_helpers import accepts_text, compiled

pytestmark = pytest.mark.usefixtures("no_grammar_disk_cache")

DATA = Path(__file__).resolve().parent / "data"

TREE = {"$ref": "#/definitions/node", "definitions": {"node": {
    "type": "object", "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/definitions/node"}}},
    "required": ["v"], "additionalProperties": False}}}
FREE = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# One kid at most, kids required: after an inner node closes, `}]}` is forced across returns.
CHAIN = {"$ref": "#/definitions/n", "definitions": {"n": {
    "type": "object", "properties": {"kids": {"type": "array", "maxItems": 1,
                                              "items": {"$ref": "#/definitions/n"}}},
    "required": ["kids"], "additionalProperties": False}}}


def brute_mask(c, config, tok) -> set[int]:
    eos = set(tok.eos_token_ids)
    return {i for i, b in enumerate(tok.token_bytes)
            if b and i not in eos and c.step_bytes(config, b) is not None}


def accepts(c, text: str, tok) -> bool:
    return accepts_text(c, text)


@pytest.mark.parametrize("schema,text,every", [
    (TREE, '{"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4}]}]}', 4),
    (FREE, '{"ok":true,"a":{"b":[1,{"c":[["x",null]]}]},"z":"q"}', 3),
])
@pytest.mark.timeout(60)
def test_masks_equal_brute_force(tok, regex_backend, schema, text, every):
    c = compiled(schema, tok)
    assert isinstance(c, CompiledPushdown if regex_backend == "lazy" else CompiledNative)
    g = c.new_matcher()
    ids = greedy_encode(tok, text)
    for n, t in enumerate(ids):
        mask = c.token_mask(g.config)
        assert mask[t], (n, tok.token_bytes[t])
        if n % every == 0 or n == len(ids) - 1:
            assert set(np.nonzero(mask)[0].tolist()) == brute_mask(c, g.config, tok), n
        g.accept_token(t)
    assert g.can_end()
    row = np.zeros(tok.vocab_size, dtype=bool)
    import torch

    r = torch.zeros(tok.vocab_size, dtype=torch.bool)
    g.fill_mask(r)
    assert all(r[e] for e in tok.eos_token_ids) and not row.any()


def test_recursive_tree_instances(tok, regex_backend):
    c = compiled(TREE, tok)
    v = jsonschema.Draft7Validator(TREE)
    deep = {"v": 0}
    for i in range(1, 7):
        deep = {"v": i, "kids": [deep, {"v": -i}]}
    good = [{"v": 1}, {"v": 1, "kids": []}, deep]
    bad = [{"v": 1, "kids": [{"v": "x"}]}, {"v": 1, "kids": [{"kids": []}]},
           {"v": 1, "kids": [{"v": 2, "w": 3}]}, {"kids": []}]
    for inst in good + bad:
        assert accepts(c, canonical_json(inst, TREE), tok) == v.is_valid(inst), inst
    assert not accepts(c, '{"v":1,"kids":[{"v":2}', tok)  # unclosed: cannot end


def test_free_form_values_any_depth(tok, regex_backend):
    c = compiled(FREE, tok)
    deep = [1, {"a": [{"b": {"c": [None, True, "s", -1.5e3]}}]}]
    assert accepts(c, json.dumps({"ok": True, "x": deep}, separators=(",", ":")), tok)
    assert accepts(c, '{"ok":false,"x":[[[[[[]]]]]],"y":{}}', tok)
    for bad in ['{"ok":true,"x":[[[[[1,]]]]]}', '{"ok":true,"x":{"a":{"b":tru}}}',
                '{"ok":true,"x":[[[[[1]]]]}', '{"ok":1}', '{"ok":true,"ok2":[1 2]}']:
        assert not accepts(c, bad, tok), bad


def test_rollback_and_jump_forward_across_calls(tok, regex_backend):
    c = compiled(CHAIN, tok)
    g = c.new_matcher()
    assert g.jump_forward_string() == '{"kids":['  # crosses the root's call
    text = '{"kids":[{"kids":[]'
    ids = greedy_encode(tok, text)
    masks = []
    for t in ids:
        masks.append(c.token_mask(g.config).copy())
        g.accept_token(t)
    assert g.jump_forward_string() == "}]}"  # two returns
    depth = max(len(s) for s in g.stacks()) // 2
    g.rollback(len(ids))
    assert g.num_accepted() == 0 and g.config == c.initial
    for t, m in zip(ids, masks):
        assert (c.token_mask(g.config) == m).all()
        g.accept_token(t)
    assert max(len(s) for s in g.stacks()) // 2 == depth
    for t in greedy_encode(tok, "}]}"):
        g.accept_token(t)
    assert g.can_end() and g.is_terminated()
    g.accept_token(tok.eos_token_ids[0])
    assert g.is_terminated() and g.jump_forward_string() is None
    g.rollback(1)
    assert not g.is_terminated() or g.can_end()
    with pytest.raises(ValueError):
        g.accept_token(greedy_encode(tok, ",")[0])
    assert g.copy().num_accepted() == 0


def test_small_schema_keeps_single_regex(tok, regex_backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a"], "additionalProperties": False}
    spec = schema_to_machines(schema)
    assert not spec.subs and spec.root == schema_to_regex(schema)
    c = compiled(schema, tok)
    assert isinstance(c, CompiledLazyRegex if regex_backend == "lazy" else CompiledNative) and c.num_machines == 1


def test_machines_memoized_per_ref(tok):
    item = {"type": "object", "properties": {f"p{i}": {"type": "string", "enum": [f"v{i}{j}" for j in range(30)]}
                                            for i in range(20)}, "additionalProperties": False}
    schema = {"definitions": {"item": item}, "type": "object", "additionalProperties": False,
              "properties": {f"f{i}": {"$ref": "#/definitions/item"} for i in range(40)}}
    spec = schema_to_machines(schema)
    assert len(spec.root) < 20_000
    assert len([s for s in spec.subs if s is not None]) <= 6


@pytest.mark.timeout(60)
def test_large_maskbench_schema(tok, regex_backend):
    # Single-regex mode inlines every $ref of this Kubernetes schema past the size cap.
    d = json.loads((DATA / "maskbench_Kubernetes---kb_850_Normalized.json").read_text())
    with pytest.raises(ValueError, match="exceeds"):
        schema_to_regex(d["schema"])
    c = compiled(d["schema"], tok)
    assert c.num_machines > 2
    seen = {True: 0, False: 0}
    for t in d["tests"]:
        text = canonical_json(t["data"], d["schema"])
        g = c.new_matcher()
        ok = True
        for tid in greedy_encode(tok, text):
            if not c.token_mask(g.config)[tid]:
                ok = False
                break
            g.accept_token(tid)
        assert (ok and g.can_end()) == t["valid"], text[:200]
        seen[t["valid"]] += 1
    assert seen[True] and seen[False]


def test_reserved_code_points_refused():
    from sgl.runtime.constrained.json_schema import UnsupportedSchemaError

    with pytest.raises(UnsupportedSchemaError):
        schema_to_regex({"enum": ["a\U0010f001"]})
    rx = schema_to_regex({"type": "string"})
    import re

    assert re.fullmatch(rx, '"\U0010efff"') and not re.fullmatch(rx, '"\U0010f000"')
