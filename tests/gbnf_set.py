"""The GBNF test set (tests/data/gbnf/): grammar files, their hand-written cases, and the
independent judge used on generated text.

The judge is Lark's Earley parser on a character-level translation of the grammar
(`gbnf_to_lark(..., char_level=True)`): it shares only the GBNF reader with the matcher
under test, none of the rewriting, machines, DFAs or masks.
"""

from __future__ import annotations

import functools
import json
import pathlib

import lark

from sgl.runtime.constrained.gbnf import gbnf_to_lark

DATA = pathlib.Path(__file__).parent / "data" / "gbnf"
CASES: dict[str, dict] = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))
NAMES = sorted(CASES)


def grammar(name: str) -> str:
    return (DATA / f"{name}.gbnf").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def judge(name: str) -> lark.Lark:
    return lark.Lark(gbnf_to_lark(grammar(name), char_level=True), parser="earley",
                     lexer="dynamic_complete")


def judge_accepts(name: str, text: str) -> bool:
    try:
        judge(name).parse(text)
        return True
    except lark.exceptions.LarkError:
        return False
