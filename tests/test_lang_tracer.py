"""Tracing programs without a model: recorded nodes, constant prefixes, f-string errors."""

from __future__ import annotations

import pytest

import sgl
from sgl.lang.ir import SglArgument, SglConstantText, SglGen, SglSelect
from sgl.lang.tracer import extract_prefix_by_tracing


def test_fstring_of_argument_raises_type_error():
    @sgl.function
    def prog(s, question):
        s += f"Q: {question}\n"

    with pytest.raises(TypeError, match="f-string"):
        prog.trace()


def test_trace_records_nodes_in_order():
    @sgl.function
    def prog(s, question):
        s += "Q: " + question + "\n"
        s += "A: " + sgl.gen("answer", max_tokens=8)
        s += sgl.select("ok", ["yes", "no"])

    tracer = prog.trace()
    kinds = [type(n) for n in tracer.nodes]
    assert kinds == [SglConstantText, SglArgument, SglConstantText, SglConstantText, SglGen, SglSelect]
    assert tracer.text() == "Q: {question}\nA: {answer}{ok}"
    assert set(tracer.variables) == {"answer", "ok"}


def test_trace_with_given_argument_values():
    @sgl.function
    def prog(s, a):
        s += "x" + a

    tracer = prog.trace(a="known")
    assert tracer.text() == "xknown"


def test_prefix_stops_at_first_dependency():
    @sgl.function
    def prog(s, q):
        s += "Shared instructions. "
        s += "More. "
        s += q
        s += "never part of the prefix"

    assert extract_prefix_by_tracing(prog, None) == "Shared instructions. More. "


def test_prefix_of_chat_program_includes_role_text():
    from sgl.lang.backends.fake import FakeBackend

    @sgl.function
    def prog(s, q):
        s += sgl.system("Be terse.")
        s += sgl.user(q)

    prefix = extract_prefix_by_tracing(prog, FakeBackend())
    assert prefix == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n"


def test_prefix_tracing_survives_python_logic_on_arguments():
    @sgl.function
    def prog(s, items):
        s += "List: "
        for it in items:  # an argument placeholder cannot be iterated
            s += it

    assert extract_prefix_by_tracing(prog, None) == "List: "


def test_prefix_stops_at_fork():
    @sgl.function
    def prog(s):
        s += "root "
        f = s.fork(2)
        f += "b"
        f.join()

    assert extract_prefix_by_tracing(prog, None) == "root "
    tracer = prog.trace()
    assert len(tracer.child_states) == 2


def test_a_trace_in_one_thread_does_not_capture_another_threads_programs():
    import threading

    from sgl.lang.backends.fake import FakeBackend
    from sgl.lang.state import ProgramState
    from sgl.lang.tracer import TracerProgramState

    be = FakeBackend()
    tracing, release = threading.Event(), threading.Event()

    @sgl.function
    def batched(s, q):
        s += "A long constant few-shot prefix that run_batch warms up by tracing first. " * 2
        if isinstance(s, TracerProgramState):  # hold the warm-up trace open in its thread
            tracing.set()
            release.wait(10)
        s += q + sgl.gen("a", max_tokens=2)

    @sgl.function
    def inner(s):
        s += "inner " + sgl.gen("b", max_tokens=2)

    @sgl.function
    def outer(s):
        s += "outer "
        s["nested"] = inner()

    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(states=batched.run_batch([{"q": "x"}, {"q": "y"}],
                                                                                 backend=be)))
    worker.start()
    try:
        assert tracing.wait(10)
        # The other thread is inside a TracingScope right now; this call must still run.
        state = inner(backend=be)
        assert isinstance(state, ProgramState) and state["b"] == "ok"
    finally:
        release.set()
        worker.join(10)
    assert [st["a"] for st in out["states"]] == ["ok", "ok"]
    # Within one thread a program called while tracing is still traced into the trace.
    assert isinstance(outer.trace(backend=be).variables["nested"], TracerProgramState)
