"""Typed gens at the prompt boundary, on the real embedded model through the DSL.

After a prompt that ends in ":", ": " or "\\n", `gen_int`, a regex gen and `select` must
return the value the unconstrained model gives for the same prompt (greedy), on a fixed
set of few-shot questions: the constraint may restrict the answer's form, never change
the answer. The variable keeps SGLang's form (the digits, the option) while the prompt
text keeps the space the model chose.
"""

from __future__ import annotations

import re

import pytest

import sgl

QUESTIONS = ["How many legs does a spider have?", "How many days are in a week?",
             "How many months are in a year?", "How many sides does a triangle have?"]
ENDS = {"colon": ":", "colon_space": ": ", "newline": ":\n"}


def few_shot(end: str) -> str:
    # The examples answer in the prompt's own shape, so the free model answers at all.
    sep = "\n" if end.endswith("\n") else " "
    return (f"Answer each question with a number.\n\nQuestion: How many wheels does a car have?\nAnswer:{sep}4\n\n"
            f"Question: What is 3 plus 4?\nAnswer:{sep}7\n\n")


@sgl.function
def free_answer(s, head, q, end):
    s += head + "Question: " + q + "\nAnswer" + end
    s += sgl.gen("a", max_tokens=6)


@sgl.function
def int_answer(s, head, q, end):
    s += head + "Question: " + q + "\nAnswer" + end
    s += sgl.gen_int("a", max_tokens=6)
    s += "\n"


@sgl.function
def regex_answer(s, head, q, end):
    s += head + "Question: " + q + "\nAnswer" + end
    s += sgl.gen("a", regex=r"[0-9]+", max_tokens=6)


def first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group(0)) if m else None


@pytest.mark.parametrize("shape", list(ENDS))
def test_typed_gens_return_the_free_models_value(engine, shape):
    end = ENDS[shape]
    head = few_shot(end)
    args = [{"head": head, "q": q, "end": end} for q in QUESTIONS]
    free = [first_int(st["a"]) for st in free_answer.run_batch(args, backend=engine, temperature=0)]
    assert all(v is not None for v in free), free
    ints = int_answer.run_batch(args, backend=engine, temperature=0)
    regexes = regex_answer.run_batch(args, backend=engine, temperature=0)
    for f, st, rs in zip(free, ints, regexes):
        assert re.fullmatch(r"[-+]?[0-9]+", st["a"]), st["a"]  # the value alone, as SGLang stores it
        assert int(st["a"]) == f
        assert re.fullmatch(r"[0-9]+", rs["a"]) and int(rs["a"]) == f
        assert st.text().endswith(st["a"] + "\n")


@sgl.function
def pick(s, q, options, end):
    s += ("Answer each question with one of the options.\n\n"
          "Question: What is the capital of Peru? Options: Lima, Quito, Bogota.\nAnswer: Lima\n\n")
    s += f"Question: {q} Options: {', '.join(options)}.\nAnswer{end}"
    s += sgl.select("c", options)


@sgl.function
def pick_free(s, q, options, end):
    s += ("Answer each question with one of the options.\n\n"
          "Question: What is the capital of Peru? Options: Lima, Quito, Bogota.\nAnswer: Lima\n\n")
    s += f"Question: {q} Options: {', '.join(options)}.\nAnswer{end}"
    s += sgl.gen("c", max_tokens=4)


def test_select_after_a_colon_picks_what_the_free_model_writes(engine):
    cases = [("What is the capital of France?", ["London", "Paris", "Berlin"]),
             ("What is the capital of Japan?", ["Seoul", "Beijing", "Tokyo"])]
    for q, options in cases:
        free = pick_free.run(q, options, ":", backend=engine, temperature=0)["c"]
        st = pick.run(q, options, ":", backend=engine, temperature=0)
        assert free.strip().startswith(st["c"]), (free, st["c"])
        assert st["c"] in options  # the variable is the option itself
        assert st.text().endswith("Answer: " + st["c"])  # the prompt keeps the space the model wanted
