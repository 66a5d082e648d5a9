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
