"""Interpreter behaviour on a deterministic fake backend: text, variables, roles, forks, errors, streaming, batches."""

from __future__ import annotations

import asyncio
import sys

import pytest

import sgl
from sgl.lang.backends.fake import FakeBackend


def echo_last_line(prompt: str, sp: dict) -> str:
    """Answers 'A<n>' where n is the prompt length, so outputs depend on the prompt."""
    if sp.get("regex"):
        return "24\n"  # what a gen_int under its pattern ends with: one trailing newline
    return f"A{len(prompt)}. tail"


@pytest.fixture
def be():
    return FakeBackend(echo_last_line)


def test_import_sgl_does_not_import_torch():
    import subprocess

    code = "import sys, sgl; sgl.gen; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_text_and_variables(be):
    @sgl.function
    def prog(s, q):
        s += "Q: " + q + "\n"
        s += "A: " + sgl.gen("a", max_tokens=16, stop=".")
        s += "\nN: " + sgl.gen_int("n")

    st = prog.run("hi", backend=be)
    assert st["a"] == "A9"
    assert st["n"] == "24"  # the value alone; the trailing newline leaves the prompt too
    assert st.text() == "Q: hi\nA: A9\nN: 24"
    # SGLang's integer pattern with the whitespace the model may want around it; it ends
    # itself after one trailing space or newline, so no " " / "\n" stops are sent. The
    # prompt ends in "N: ", so no leading space is allowed on top of it.
    assert be.calls[1]["sampling_params"]["regex"] == r"[-+]?[0-9]+[ \n]?"
    assert "stop" not in be.calls[1]["sampling_params"]


def test_a_variable_reused_in_a_loop_reads_its_last_value():
    import time

    def slow(prompt: str, sp: dict) -> str:
        time.sleep(0.05)  # the program thread runs ahead of the generations
        return f"v{prompt.count('Step:')}"

    @sgl.function
    def prog(s):
        for _ in range(3):
            s += "Step: " + sgl.gen("step", max_tokens=4) + "\n"
        return s["step"]

    st = prog.run(backend=FakeBackend(slow))
    assert st.ret_value == "v3" and st["step"] == "v3"
    assert st.get_meta_info("step") is not None


def test_typed_gen_allows_a_leading_space_only_after_a_non_space(be):
    @sgl.function
    def prog(s):
        s += "N:" + sgl.gen_int("a") + "\nM:\n" + sgl.gen_int("b") + "\nR:" + sgl.gen("c", regex="[0-9]+")
        s += "\nS: " + sgl.gen("d", regex="[0-9]+")

    prog.run(backend=be)
    sent = [c["sampling_params"]["regex"] for c in be.calls]
    assert sent == [r"[ \n]?[-+]?[0-9]+[ \n]?", r"[-+]?[0-9]+[ \n]?", "[ ]?(?:[0-9]+)[ \n]?", "(?:[0-9]+)[ \n]?"]


def test_run_defaults_and_gen_overrides(be):
    @sgl.function
    def prog(s):
        s += sgl.gen("a", max_tokens=3, temperature=0.5)
        s += sgl.gen("b")

    prog.run(backend=be, temperature=0, max_new_tokens=7, top_k=5)
    a, b = (c["sampling_params"] for c in be.calls)
    assert (a["max_new_tokens"], a["temperature"], a["top_k"]) == (3, 0.5, 5)
    assert (b["max_new_tokens"], b["temperature"]) == (7, 0)


def test_roles_messages_and_chat_stop(be):
    @sgl.function
    def chat(s):
        s += sgl.system("sys")
        with s.user():
            s += "hello"
        s += sgl.assistant(sgl.gen("r", max_tokens=20))
        s += sgl.user("bye")

    st = chat.run(backend=be)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == st["r"]
    assert st.text().startswith("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n")
    assert "<|im_end|>" in be.calls[0]["sampling_params"]["stop"]


def test_default_system_prompt_inserted():
    from sgl.lang.chat_template import chat_template_from_jinja

    from tests.test_lang_chat_template import SMOLLM

    be = FakeBackend(chat_template=chat_template_from_jinja(SMOLLM))

    @sgl.function
    def chat(s):
        s += sgl.user("hi")

    st = chat.run(backend=be)
    assert [m["role"] for m in st.messages()] == ["system", "user"]
    assert "SmolLM" in st.text()


def test_gen_outside_assistant_has_no_chat_stop(be):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")

    prog.run(backend=be)
    assert "<|im_end|>" not in (be.calls[0]["sampling_params"].get("stop") or [])


def test_var_scope_and_setitem(be):
    @sgl.function
    def prog(s):
        with s.var_scope("block"):
            s += "name: " + sgl.gen("name", max_tokens=3)
        s["extra"] = 5

    st = prog.run(backend=be)
    assert st["block"] == "name: " + st["name"]
    assert st["extra"] == 5


def test_reading_a_variable_mid_program(be):
    @sgl.function
    def prog(s):
        s += "first " + sgl.gen("a", stop=".")
        s += " then " + s["a"].lower()

    st = prog.run(backend=be)
    assert st.text() == "first A6 then a6"


def test_fork_join_lambda_and_shared_prefix_cache(be):
    @sgl.function
    def prog(s):
        s += "x" * 300
        forks = s.fork(4)
        forks += lambda i: f" branch {i}:" + sgl.gen("b", max_tokens=4)
        forks[0] += " extra"
        forks.join()
        s += " done"

    st = prog.run(backend=be)
    assert st["b"] == [f"A{300 + len(f' branch {i}:')}"[:4] for i in range(4)]
    assert st.text() == "x" * 300 + " done"
    # The parent's prefix is prefilled once before the branches run.
    warm = [c for c in be.calls if c["sampling_params"].get("max_new_tokens") == 0]
    assert len(warm) == 1 and warm[0]["prompt"] == "x" * 300


def test_fork_items_see_parent_text(be):
    @sgl.function
    def prog(s):
        s += "base"
        f = s.fork(2)
        for i in range(2):
            f[i] += "-" + str(i)
        f.join()
        return [f[i].text() for i in range(2)]

    st = prog.run(backend=be)
    assert st.ret_value == ["base-0", "base-1"]


def test_n_greater_than_one_gives_a_list():
    be = FakeBackend(lambda p, sp: ["one", "two", "three"])

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", n=3)

    st = prog.run(backend=be)
    assert st["a"] == ["one", "two", "three"]
    assert st.text() == "xone"


def test_backend_error_raised_with_context_and_reported():
    be = FakeBackend(fail_on="BOOM")

    @sgl.function
    def prog(s):
        s += "fine " + sgl.gen("a")
        s += " BOOM " + sgl.gen("b")
        s += " never"

    with pytest.raises(sgl.ProgramError) as info:
        prog.run(backend=be)
    msg = str(info.value)
    assert "prog" in msg and "Gen('b')" in msg and "fake failure" in msg
    assert isinstance(info.value.__cause__, sgl.BackendError)
    state = info.value.state
    assert state.error() is info.value
    assert state["a"] == "ok"
    with pytest.raises(sgl.ProgramError):
        state["b"]


def test_program_exception_propagates_unchanged(be):
    @sgl.function
    def prog(s):
        s += "x"
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        prog.run(backend=be)


def test_no_backend_is_a_clear_error():
    sgl.global_config.default_backend = None

    @sgl.function
    def prog(s):
        s += "x"

    with pytest.raises(ValueError, match="set_default_backend"):
        prog.run()


def test_streaming_pieces_concatenate_to_final_text():
    be = FakeBackend(lambda p, sp: "abcdefghijklmnop", stream_chunk=3)

    @sgl.function
    def prog(s):
        s += "Q. "
        s += sgl.gen("a", max_tokens=50)
        s += " end"

    st = prog.run(backend=be, stream=True)
    pieces = list(st.text_iter())
    assert "".join(pieces) == st.text() == "Q. abcdefghijklmnop end"
    st2 = prog.run(backend=be, stream=True)
    assert "".join(st2.text_iter("a")) == "abcdefghijklmnop"

    async def collect():
        st3 = prog.run(backend=be, stream=True)
        out = []
        async for piece, meta in st3.text_async_iter("a", return_meta_data=True):
            out.append(piece)
            assert "prompt_tokens" in meta
        return "".join(out)

    assert asyncio.run(collect()) == "abcdefghijklmnop"


def test_streaming_error_surfaces_from_iterator():
    be = FakeBackend(fail_on="Q")

    @sgl.function
    def prog(s):
        s += "Q" + sgl.gen("a")

    st = prog.run(backend=be, stream=True)
    with pytest.raises(sgl.ProgramError):
        list(st.text_iter())
    assert st.error() is not None


def test_run_batch_results_in_order_and_prefix_precached(be):
    few_shot = "Example: " + "lorem ipsum " * 10

    @sgl.function
    def prog(s, q, k=1):
        s += few_shot
        s += "Q: " + q + sgl.gen("a", max_tokens=5)

    batch = [{"q": "x" * i} for i in range(6)]
    states = prog.run_batch(batch, num_threads=3, progress_bar=True, backend=be)
    assert [st.text() for st in states] == [few_shot + "Q: " + "x" * i + st["a"] for i, st in enumerate(states)]
    # The traced constant prefix is warmed once, before the programs run.
    assert be.calls[0]["prompt"] == few_shot + "Q: " and be.calls[0]["sampling_params"]["max_new_tokens"] == 0
    states2 = prog.run_batch([("a",), ("b", 2)], backend=be)
    assert len(states2) == 2


def test_run_batch_raises_after_all_finish():
    be = FakeBackend(fail_on="bad")

    @sgl.function
    def prog(s, q):
        s += q + sgl.gen("a")

    with pytest.raises(sgl.ProgramError) as info:
        prog.run_batch([{"q": "good"}, {"q": "bad"}, {"q": "fine"}], backend=be)
    states = info.value.states
    assert states[0]["a"] == "ok" and states[2]["a"] == "ok"
    assert states[1].error() is not None


def test_run_batch_generator_style_yields_states_in_order_then_raises_for_failures():
    be = FakeBackend(fail_on="bad")

    @sgl.function
    def prog(s, q):
        s += q + sgl.gen("a")

    it = prog.run_batch([{"q": "good"}, {"q": "bad"}, {"q": "fine"}], backend=be, generator_style=True)
    first = next(it)
    assert first["a"] == "ok"
    second, third = next(it), next(it)
    assert second.error() is not None and third["a"] == "ok"
    with pytest.raises(sgl.ProgramError, match="1 of 3"):
        next(it)


def test_sglang_call_options_run_use_thread_and_select_temperature(be):
    @sgl.function
    def prog(s):
        s += "Q" + sgl.gen("a", max_tokens=3)

    assert prog.run(backend=be, use_thread=False)["a"]
    with pytest.raises(ValueError, match="temperature"):
        sgl.select("x", ["a", "b"], temperature=0.8)


def test_bind_and_set_default_backend(be):
    sgl.set_default_backend(be)
    try:
        @sgl.function
        def prog(s, a, b):
            s += a + "+" + b

        assert prog.bind(b="2").run(a="1").text() == "1+2"
        with pytest.raises(TypeError):
            prog.bind(c=1)
    finally:
        sgl.global_config.default_backend = None


def test_regex_json_schema_ebnf_grammar_pass_through(be):
    @sgl.function
    def prog(s):
        s += sgl.gen("a", regex=r"\d+")
        s += sgl.gen("b", json_schema={"type": "object"})
        s += sgl.gen("c", ebnf='root ::= "x"')
        s += sgl.gen("d", grammar='start: "x"')
        s += sgl.gen("e", stop_regex=r"\d", min_tokens=2, ignore_eos=True)

    prog.run(backend=be)
    sps = [c["sampling_params"] for c in be.calls]
    assert sps[0]["regex"] == "[ ]?(?:\\d+)[ \n]?"  # the user's regex, optional whitespace around it
    assert sps[1]["json_schema"] == '{"type": "object"}'
    assert sps[2]["ebnf"] == 'root ::= "x"'
    assert sps[3]["lark"] == 'start: "x"'
    assert (sps[4]["stop_regex"], sps[4]["min_new_tokens"], sps[4]["ignore_eos"]) == ([r"\d"], 2, True)
    with pytest.raises(ValueError):
        sgl.gen("x", regex="(")
    for refused in ("a{4294967295}", "(" * 600 + ")" * 600):  # re refuses these with other exceptions
        with pytest.raises(ValueError, match="not a valid regular expression"):
            sgl.gen("x", regex=refused)
    with pytest.raises(ValueError):
        sgl.gen("x", regex="a", json_schema="{}")


def test_gen_with_choices_is_a_select(be):
    @sgl.function
    def prog(s):
        s += "pick: " + sgl.gen("c", choices=["a", "b"])

    st = prog.run(backend=be)
    assert st["c"] in ("a", "b")
