"""Tracing: run a program's Python with placeholder arguments and record its expressions.

Nothing reaches a model. `trace_program` returns the recording (`fn.trace()`);
`extract_prefix_by_tracing` returns the constant text a program writes before its
first argument, gen, select or fork, which `run_batch` prefills once. Placeholders
refuse to be formatted, so an f-string of an argument raises TypeError while tracing.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any, Callable, Protocol

from sgl.lang.chat_template import DEFAULT_TEMPLATE
from sgl.lang.ir import (SglArgument, SglConstantText, SglExpr, SglExprList, SglFork, SglGen, SglGetForkItem,
                         SglRoleBegin, SglRoleEnd, SglSelect, SglVariable, SglVarScopeEnd)
from sgl.lang.roles import RoleWriter


class StopTracing(Exception):
    pass


class Program(Protocol):
    """What tracing and running need of a program (`SglFunction` is one)."""

    __name__: str
    func: Callable[..., Any]
    arg_names: list[str]
    bind_arguments: dict[str, Any]


class TracingScope:
    """Marks the tracer state of the trace running in this thread (or task): a program called
    inside a traced body is traced into it instead of run. A context variable, so a trace in one
    thread never captures programs that another thread runs meanwhile (run_batch's warm-up traces)."""

    def __init__(self, tracer_state: "TracerProgramState"):
        self.tracer_state = tracer_state
        self._token: Token | None = None

    def __enter__(self) -> "TracingScope":
        self._token = _current_scope.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _current_scope.reset(self._token)

    @staticmethod
    def current() -> "TracingScope | None":
        return _current_scope.get()


_current_scope: ContextVar[TracingScope | None] = ContextVar("sgl_tracing_scope", default=None)


class TracerProgramState(RoleWriter):
    """Records what a program appends, in order, as flat expression nodes."""

    def __init__(self, backend: Any, arguments: dict[str, Any], only_trace_prefix: bool):
        self.backend = backend
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.nodes: list[SglExpr] = []
        self.variables: dict[str, Any] = {}
        self.messages_: list[dict] = []
        self.cur_role: str | None = None
        self.child_states: list[TracerProgramState] = []
        self.ret_value: Any = None
        self.chat_template = backend.get_chat_template() if backend is not None else DEFAULT_TEMPLATE

    def __iadd__(self, other: Any) -> "TracerProgramState":
        self._record(other)
        return self

    def _record(self, x: Any) -> None:
        if isinstance(x, str):
            self.nodes.append(SglConstantText(x))
        elif isinstance(x, SglExprList):
            for e in x.expr_list:
                self._record(e)
        elif isinstance(x, SglRoleBegin):
            if not self.messages_ and x.role != "system" and self.chat_template.default_system_prompt:
                self._record(SglRoleBegin("system"))
                self._record(self.chat_template.default_system_prompt)
                self._record(SglRoleEnd("system"))
            self.cur_role = x.role
            self.nodes.append(SglConstantText(self.chat_template.get_prefix_and_suffix(x.role)[0]))
        elif isinstance(x, SglRoleEnd):
            self.nodes.append(SglConstantText(self.chat_template.get_prefix_and_suffix(x.role)[1]))
            self.messages_.append({"role": x.role, "content": ""})
            self.cur_role = None
        elif isinstance(x, SglVarScopeEnd):
            self.nodes.append(x)
            self.variables[x.name] = SglVariable(x.name, None)
        elif isinstance(x, (SglGen, SglSelect)):
            name = x.name if x.name is not None else f"{type(x).__name__.lower()}_{len(self.variables)}"
            self.variables[name] = SglVariable(name, x)
            self.nodes.append(x)
        elif isinstance(x, SglExpr):
            self.nodes.append(x)
        else:
            self.nodes.append(SglConstantText(str(x)))

    def _write(self, expr: SglExpr) -> None:
        self._record(expr)

    def fork(self, size: int = 1, position_ids_offset: Any = None):
        if self.only_trace_prefix:
            raise StopTracing()
        self.nodes.append(SglFork(size))
        children = []
        for i in range(size):
            c = TracerProgramState(self.backend, self.arguments, False)
            c.nodes.append(SglGetForkItem(i))
            c.variables = dict(self.variables)
            c.messages_ = list(self.messages_)
            c.cur_role = self.cur_role
            children.append(c)
        self.child_states.extend(children)
        return _TraceGroup(children, self)

    def __getitem__(self, name: str) -> Any:
        if name in self.arguments and self.arguments[name] is not None:
            return self.arguments[name]
        if self.only_trace_prefix:
            raise StopTracing()
        if name not in self.variables:
            raise KeyError(f"no variable {name!r} while tracing")
        return self.variables[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_var(self, name: str) -> Any:
        return self[name]

    def flatten_nodes(self) -> list[SglExpr]:
        return list(self.nodes)

    def text(self) -> str:
        """The constant text recorded so far, with placeholders shown as {name}."""
        out = []
        for n in self.nodes:
            if isinstance(n, SglConstantText):
                out.append(n.value)
            elif isinstance(n, (SglArgument, SglGen, SglSelect, SglVariable)):
                out.append("{" + str(n.name) + "}")
        return "".join(out)

    def join(self) -> None:
        pass


class _TraceGroup:
    def __init__(self, states: list[TracerProgramState], src: TracerProgramState):
        self.states = states
        self.src = src

    def __getitem__(self, i: int) -> TracerProgramState:
        return self.states[i]

    def __setitem__(self, i: int, v: Any) -> None:
        pass

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Any) -> "_TraceGroup":
        for i, s in enumerate(self.states):
            s += other(i) if callable(other) and not isinstance(other, SglExpr) else (
                other[i] if isinstance(other, (list, tuple)) else other)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        for c in self.states:
            for k, v in c.variables.items():
                if k not in self.src.variables:
                    self.src.variables[k] = [v]


def _placeholders(program: Program, given: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {n: SglArgument(n) for n in program.arg_names if n not in given}
    args.update(given)
    args.update(program.bind_arguments)
    return args


def trace_program(program: Program, arguments: dict[str, Any], backend: Any) -> TracerProgramState:
    from sgl.lang.backends import as_backend

    backend = as_backend(backend) if backend is not None else None
    args = _placeholders(program, dict(arguments))
    tracer = TracerProgramState(backend, args, only_trace_prefix=False)
    with TracingScope(tracer):
        tracer.ret_value = program.func(tracer, **args)
    return tracer


def extract_prefix_by_tracing(program: Program, backend: Any) -> str:
    """Constant text the program writes before anything that depends on arguments or the model."""
    args = _placeholders(program, {})
    tracer = TracerProgramState(backend, args, only_trace_prefix=True)
    try:
        with TracingScope(tracer):
            tracer.ret_value = program.func(tracer, **args)
    except (StopTracing, TypeError, AttributeError, KeyError, ValueError, IndexError):
        pass  # the program needed a real value here; the prefix ends at this point anyway
    prefix = []
    for node in tracer.nodes:
        if not isinstance(node, SglConstantText):
            break
        prefix.append(node.value)
    return "".join(prefix)
