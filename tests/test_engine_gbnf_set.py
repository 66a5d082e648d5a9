"""The GBNF test set generated from by the real embedded model (CPU), temperature 1.0.

Every grammar of tests/data/gbnf/ gets its prompt, SAMPLES seeds each, all in one engine
batch. Every output that finished by itself (EOS or the grammar's end) must parse under
the independent judge (Lark Earley on a character-level translation, tests/gbnf_set.py);
outputs cut by max_new_tokens are only counted, and enough of the batch must finish for
the check to mean something.

The default run takes a cross-section (`QUICK`: JSON, left recursion direct, indirect
and hidden, ambiguity, a C-like and a tool-call grammar); the rest of the set runs
under `-m slow` (about four minutes on a shared 2-core machine).
"""

from __future__ import annotations

import pytest

from sgl.runtime.engine import Engine
from tests.gbnf_set import CASES, NAMES, grammar, judge_accepts

SAMPLES = 2
MAX_NEW_TOKENS = 32
QUICK = ["json", "expr_leftrec", "indirect_leftrec", "nullable_leftrec", "ambiguous_expr",
         "sql_select", "tool_call", "date_time"]
REST = [n for n in NAMES if n not in QUICK]

pytestmark = pytest.mark.model


def generate(engine: Engine, names_wanted: list[str]) -> dict[str, list[dict]]:
    prompts, params, names = [], [], []
    for name in names_wanted:
        prompt = engine.apply_chat_template([{"role": "user", "content": CASES[name]["prompt"]}])
        for seed in range(SAMPLES):
            prompts.append(prompt)
            params.append({"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS, "seed": seed,
                           "ebnf": grammar(name)})
            names.append(name)
    grouped: dict[str, list[dict]] = {}
    for name, out in zip(names, engine.generate(prompts, params)):
        grouped.setdefault(name, []).append(out)
    return grouped


@pytest.fixture(scope="module")
def quick(engine: Engine) -> dict[str, list[dict]]:
    return generate(engine, QUICK)


@pytest.fixture(scope="module")
def rest(engine: Engine) -> dict[str, list[dict]]:
    return generate(engine, REST)


def finished(out: dict) -> bool:
    return out["meta_info"]["finish_reason"]["type"] == "stop"


def check(outputs: dict[str, list[dict]], name: str) -> None:
    outs = outputs[name]
    assert len(outs) == SAMPLES
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out
        if finished(out):
            assert judge_accepts(name, out["text"]), out["text"]


def enough_finish(outputs: dict[str, list[dict]]) -> None:
    done = sum(finished(o) for outs in outputs.values() for o in outs)
    assert done >= len(outputs) // 2, {n: [o["meta_info"]["finish_reason"] for o in v] for n, v in outputs.items()}


@pytest.mark.parametrize("name", QUICK)
def test_finished_outputs_parse(quick: dict[str, list[dict]], name: str) -> None:
    check(quick, name)


def test_enough_outputs_finish(quick: dict[str, list[dict]]) -> None:
    enough_finish(quick)


@pytest.mark.slow
@pytest.mark.parametrize("name", REST)
def test_finished_outputs_parse_rest(rest: dict[str, list[dict]], name: str) -> None:
    check(rest, name)


@pytest.mark.slow
def test_enough_outputs_finish_rest(rest: dict[str, list[dict]]) -> None:
    enough_finish(rest)
