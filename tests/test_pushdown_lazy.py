"""Lazily built sub-machines (pushdown_build.build_tables(lazy=True)).

Machines off every call cycle are built on first use; the lazy tables must give the
same masks, steps and jump-forward as tables built and pruned all at once, and a
schema whose recursion has no base case must still be refused at compile time.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl.runtime.constrained import dfa_build
from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.json_schema import schema_to_machines
from sgl.runtime.constrained.pushdown import CompiledPushdown
from sgl.runtime.constrained.pushdown_build import build_tables
from sgl.runtime.constrained.vocab import greedy_encode


# 12 sub-objects of 24 optional members each: too large for one regex, so members
# and objects become machines.
def sub(j: int) -> dict:
    return {"type": "object", "additionalProperties": False,
            "properties": {f"f{j}_{i:02d}": {"type": ["string", "integer"]} for i in range(24)}}


BIG = {"type": "object", "additionalProperties": False,
       "properties": {f"part{j}": sub(j) for j in range(12)} | {"tree": {"$ref": "#/$defs/t"}},
       "$defs": {"t": {"type": "object", "additionalProperties": False,
                       "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}}
TEXT = '{"part3":{"f3_01":"x","f3_20":7},"part7":{"f7_00":1},"tree":{"kids":[{}]}}'


def tables(schema, lazy):
    spec = schema_to_machines(schema)
    return build_tables(spec.root, spec.subs, dfa_build.build_byte_dfa, lazy=lazy)


@pytest.mark.timeout(120)
def test_lazy_equals_eager(tok):
    lazy, eager = tables(BIG, True), tables(BIG, False)
    n = len(lazy)
    assert n > 8 and len(eager.built()) == n
    assert len(lazy.built()) < n  # only the root and the recursive machine so far
    a, b = CompiledPushdown(lazy, tok), CompiledPushdown(eager, tok)
    ga, gb = a.new_matcher(), b.new_matcher()
    for t in greedy_encode(tok, TEXT):
        assert np.array_equal(a.token_mask(ga.config), b.token_mask(gb.config))
        assert ga.jump_forward_string() == gb.jump_forward_string()
        ga.accept_token(t)
        gb.accept_token(t)
    assert ga.can_end() and gb.can_end()
    for i in range(n):  # every machine, once built, is the eagerly pruned one
        la, eb = lazy[i], eager[i]
        assert np.array_equal(la.trans, eb.trans) and np.array_equal(la.accept, eb.accept)
        assert la.calls == eb.calls


def test_recursion_without_base_case_is_refused():
    # Every node requires a child node: no finite instance. The recursive machine is
    # built at once, found empty, and the whole schema is refused.
    schema = {"$ref": "#/$defs/n", "$defs": {"n": {
        "type": "object", "additionalProperties": False,
        "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}}
    with pytest.raises(GrammarError, match="no instance"):
        tables(schema, True)
