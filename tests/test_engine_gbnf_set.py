"""The GBNF test set generated from by the real embedded model (CPU), temperature 1.0.

Every grammar of tests/data/gbnf/ gets its prompt, SAMPLES seeds each, all in one engine
batch. Every output that finished by itself (EOS or the grammar's end) must parse under
the independent judge (Lark Earley on a character-level translation, tests/gbnf_set.py);
outputs cut by max_new_tokens are only counted, and enough of the batch must finish for
the check to mean something.
"""

from __future__ import annotations

import pytest

from sgl.runtime.engine import Engine
from tests.gbnf_set import CASES, NAMES, grammar, judge_accepts

SAMPLES = 2
MAX_NEW_TOKENS = 40

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def outputs(engine: Engine) -> dict[str, list[dict]]:
    prompts, params, names = [], [], []
    for name in NAMES:
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


def finished(out: dict) -> bool:
    return out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("name", NAMES)
def test_finished_outputs_parse(outputs: dict[str, list[dict]], name: str) -> None:
    outs = outputs[name]
    assert len(outs) == SAMPLES
    for out in outs:
        assert "error" not in out["meta_info"]["finish_reason"].get("message", "").lower(), out
        if finished(out):
            assert judge_accepts(name, out["text"]), out["text"]


def test_enough_outputs_finish(outputs: dict[str, list[dict]]) -> None:
    done = sum(finished(o) for outs in outputs.values() for o in outs)
    assert done >= len(NAMES) // 2, {n: [o["meta_info"]["finish_reason"] for o in v] for n, v in outputs.items()}
