"""SGLang-style programs end to end on the real embedded model (in-process sgl.Engine).

Each `check_*` takes a backend, so tests/test_lang_backends_http.py runs the very same
programs over HTTP. Everything runs at temperature 0 with small token budgets.
"""

from __future__ import annotations

import json
import re

import pytest

import sgl

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

IPV4 = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=8)


def check_few_shot_qa(backend):
    qs = ["What is the capital of Japan?", "What is the capital of the United Kingdom?",
          "What is the capital city of China?"]
    states = few_shot_qa.run_batch([{"question": q} for q in qs], backend=backend, temperature=0)
    answers = [st["answer"].strip().lower() for st in states]
    assert "tokyo" in answers[0] and "london" in answers[1] and "beijing" in answers[2], answers


@sgl.function
def multi_turn(s, q1, q2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(q1)
    s += sgl.assistant(sgl.gen("a1", max_tokens=24))
    s += sgl.user(q2)
    s += sgl.assistant(sgl.gen("a2", max_tokens=24))


def check_multi_turn_chat(backend):
    # "Which city": a clear first token on every CPU path (bf16, fp32 and the int8 gguf
    # products); "What is the capital of France?" is a near tie that the gguf path answers in French.
    st = multi_turn.run("Which city is the capital of France?", "And what is the capital of Japan?",
                        backend=backend, temperature=0)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == st["a1"].strip() and "paris" in st["a1"].lower()
    assert "tokyo" in st["a2"].lower()
    assert "<|im_end|>" not in st["a1"]


@sgl.function
def select_prog(s):
    s += "Q: Is the sun hot or cold?\nA: The sun is very"
    s += sgl.select("temp", [" cold", " hot", " blue"])


def check_select(backend):
    st = select_prog.run(backend=backend)
    assert st["temp"] == " hot"
    assert st.text().endswith("The sun is very hot")
    for method in (sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        @sgl.function
        def prog(s):
            s += "The capital of France is "
            s += sgl.select("c", ["Paris", "London", "Berlin"], choices_method=method)

        assert prog.run(backend=backend)["c"] == "Paris"


@sgl.function
def gen_int_prog(s):
    s += "Q: How many legs does a dog have?\nA: 4\nQ: How many minutes are in an hour?\nA: 60\n"
    s += "Q: How many hours are in a day?\nA: " + sgl.gen_int("hours") + "\n"
    s += "Q: How many days are in a year?\nA: " + sgl.gen_int("days") + "\n"


def check_gen_int(backend):
    st = gen_int_prog.run(backend=backend, temperature=0)
    assert int(st["hours"]) == 24
    assert int(st["days"]) == 365


@sgl.function
def json_prog(s):
    s += "Write a JSON description of Paris, the capital of France.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string() + ",\n"
        s += '  "population": ' + sgl.gen(regex=r"[0-9]{1,9}", max_tokens=10) + ",\n"
        s += '  "area_km2": ' + sgl.gen(regex=r"[0-9]{1,6}(\.[0-9])?", max_tokens=10) + ",\n"
        s += '  "country": ' + sgl.gen_string() + "\n"
        s += "}"


def check_json_regex(backend):
    st = json_prog.run(backend=backend, temperature=0, max_new_tokens=24)
    obj = json.loads(st["json_output"])
    assert set(obj) == {"name", "population", "area_km2", "country"}
    assert isinstance(obj["population"], int)


@sgl.function
def expert_answer(s, question):
    s += "Question: " + question + "\n"
    s += "Which expert should answer it? The best expert is a" + sgl.select(
        "expert", [" physicist", " chef", " historian"]) + ".\n"
    s += "As a" + s["expert"] + ", I answer: " + sgl.gen("answer", max_tokens=16, stop="\n")


def check_expert_answer(backend):
    st = expert_answer.run("How do I bake sourdough bread?", backend=backend, temperature=0)
    assert st["expert"] == " chef"
    assert "As a chef, I answer:" in st.text()
    assert st["answer"]


@sgl.function
def tool_use(s, question):
    s += "Use the calculator: write calc(<expression>).\n"
    s += "Question: What is 12 times 3?\nTool: calc(12 * 3)\n"
    s += "Question: What is 7 plus 8?\nTool: calc(7 + 8)\n"
    s += "Question: " + question + "\nTool: calc(" + sgl.gen("expr", stop=")", max_tokens=12) + ")\n"


def check_tool_use(backend):
    st = tool_use.run("What is 25 times 4?", backend=backend, temperature=0)
    expr = st["expr"]
    assert re.fullmatch(r"[0-9+\-*/ ().]+", expr), expr
    assert eval(expr) == 100  # noqa: S307 - digits and operators only, checked above


@sgl.function
def fork_prog(s):
    s += "Here are two tips for staying healthy: 1. Balanced diet. 2. Regular exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a short paragraph:\n" + sgl.gen("detail", max_tokens=16, stop="\n\n")
    forks.join()
    s += "Tip 1:" + forks[0]["detail"] + "\nTip 2:" + forks[1]["detail"] + "\n"


def check_fork_join(backend):
    st = fork_prog.run(backend=backend, temperature=0)
    assert isinstance(st["detail"], list) and len(st["detail"]) == 2
    assert all(d.strip() for d in st["detail"])
    assert st.text().endswith("Tip 2:" + st["detail"][1] + "\n")


def check_streaming(backend):
    state = few_shot_qa.run("What is the capital of Japan?", backend=backend, temperature=0, stream=True)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text()
    state2 = few_shot_qa.run("What is the capital of Japan?", backend=backend, temperature=0, stream=True)
    assert "".join(state2.text_iter("answer")) == state2["answer"]
    assert "tokyo" in state2["answer"].lower()


@sgl.function
def regex_ip(s):
    s += "Q: What is the IP address of Google's public DNS server?\nA: "
    s += sgl.gen("ip", regex=IPV4, max_tokens=20)


def check_regex_ipv4(backend):
    st = regex_ip.run(backend=backend, temperature=0)
    assert re.fullmatch(IPV4, st["ip"]), st["ip"]


@sgl.function
def dtype_prog(s):
    s += "Q: What is 2 + 2?\nA: " + sgl.gen("i", dtype=int, max_tokens=4) + "\n"
    s += "Q: What is pi to two decimals?\nA: " + sgl.gen("f", dtype=float, max_tokens=6) + "\n"
    s += "Q: Is water wet? True or False?\nA: " + sgl.gen("b", dtype=bool, max_tokens=3) + "\n"
    s += "Q: Name a color in quotes.\nA: " + sgl.gen("s", dtype=str, max_tokens=8) + "\n"


def check_dtype_gens(backend):
    st = dtype_prog.run(backend=backend, temperature=0)
    int(st["i"])
    float(st["f"])
    assert st["b"] in ("True", "False")
    assert re.fullmatch(r"\"[\w\d\s]*\"", st["s"]), st["s"]


@sgl.function
def min_tokens_prog(s):
    s += "Q: What is 1 + 1?\nA:" + sgl.gen("a", min_tokens=12, max_tokens=16)


def check_min_tokens(backend):
    st = min_tokens_prog.run(backend=backend, temperature=0)
    assert st.get_meta_info("a")["completion_tokens"] >= 12


@sgl.function
def long_fork(s, n):
    s += "Read these notes. " + " ".join(f"Note {i}: the value is {i * 7}." for i in range(60)) + "\n"
    forks = s.fork(n)
    forks += lambda i: f"Question {i}: say one word.\nAnswer:" + sgl.gen("w", max_tokens=3)
    forks.join()
    return [f.get_meta_info("w") for f in forks]


def check_fork_shares_prefix(backend):
    sgl.flush_cache(backend)
    before = sgl.get_server_info(backend)
    st = long_fork.run(8, backend=backend, temperature=0)
    after = sgl.get_server_info(backend)
    metas = st.ret_value
    shared = min(m["prompt_tokens"] for m in metas) - 12  # the prefix, less each fork's short question
    assert shared > 700 and len(st["w"]) == 8
    computed = (after["prompt_tokens_total"] - after["cached_tokens_total"]) - (
        before["prompt_tokens_total"] - before["cached_tokens_total"])
    # The prefix is computed once (by the fork's warm-up); each fork computes only its own question.
    assert computed < shared + 8 * 30, (computed, shared)
    assert all(m["cached_tokens"] >= shared for m in metas), [m["cached_tokens"] for m in metas]


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


@pytest.fixture(scope="module")
def engine():
    e = sgl.Engine()
    yield e
    e.shutdown()


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_program_on_engine(engine, name):
    CHECKS[name](engine)
