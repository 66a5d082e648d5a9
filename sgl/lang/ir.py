"""The DSL's expression nodes and `SglFunction`, the decorated program.

A program appends expressions to its state (`s += expr`): constant text, `gen`,
`select`, role markers, variable scopes. The nodes here are plain descriptions; the
interpreter (interpreter.py) executes them against a backend and the tracer (tracer.py)
records them without running a model. `GenParams` holds a gen's sampling overrides: a
field left `None` inherits the value given to `run(...)`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

from sgl.lang.global_config import global_config

if TYPE_CHECKING:
    from sgl.lang.choices import ChoicesSamplingMethod

# dtype= shortcuts, the same patterns as SGLang so outputs parse the same way.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


@dataclass
class GenParams:
    """Sampling options of one gen (None = inherit), in SGLang's `sampling_params` names."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    lark: str | None = None

    def merged_over(self, base: "GenParams") -> "GenParams":
        """A new GenParams: `base` with every non-None field of self on top."""
        out = GenParams(**{f.name: getattr(base, f.name) for f in fields(GenParams)})
        for f in fields(GenParams):
            v = getattr(self, f.name)
            if v is not None:
                setattr(out, f.name, v)
        return out


# Keys that are request options rather than sampling parameters.
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def default_run_params(**kw: Any) -> GenParams:
    """Defaults for a program run: SGLang's (max_new_tokens=128, temperature=1.0, ...)."""
    p = GenParams(max_new_tokens=128, stop=[], stop_token_ids=[], temperature=1.0, top_p=1.0, top_k=-1,
                  min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False)
    for k, v in kw.items():
        if v is not None:
            setattr(p, k, v)
    return p


class SglExpr:
    """Base node; `a + b` builds an expression list so `s += "Q: " + sgl.gen("a")` works."""

    def __add__(self, other: Any) -> "SglExprList":
        return _concat(self, _as_expr(other))

    def __radd__(self, other: Any) -> "SglExprList":
        return _concat(_as_expr(other), self)


def _as_expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"cannot add {type(x).__name__} to an sgl expression; use a str or an sgl expression")


def _concat(a: SglExpr, b: SglExpr) -> "SglExprList":
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList(left + right)


class SglExprList(SglExpr):
    def __init__(self, expr_list: list[SglExpr]):
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglGen(SglExpr):
    def __init__(self, name: str | None, params: GenParams):
        self.name = name
        self.sampling_params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(self, name: str | None, choices: list[str], temperature: float,
                 choices_method: "ChoicesSamplingMethod"):
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglVariable(SglExpr):
    """A variable's value used as text; during tracing it stands for a not-yet-known value."""

    def __init__(self, name: str, source: Any = None):
        self.name = name
        self.source = source

    def __repr__(self) -> str:
        return f"Variable({self.name!r})"


class SglArgument(SglExpr):
    """Stand-in for a program argument while tracing; formatting it cannot be traced."""

    def __init__(self, name: str, value: Any = None):
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"

    def __format__(self, spec: str) -> str:
        raise TypeError(
            f"cannot put argument {self.name!r} inside an f-string while tracing; "
            "append it as its own piece instead (s += 'Q: ' + arg)"
        )

    def __str__(self) -> str:
        return self.__format__("")


class SglFork(SglExpr):
    def __init__(self, size: int):
        self.size = size


class SglGetForkItem(SglExpr):
    def __init__(self, index: int):
        self.index = index


class SglFunction:
    """A program: `@sgl.function def f(s, ...)`; call `.run`, `.run_batch`, `.bind`, `.trace`."""

    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        spec = inspect.getfullargspec(func)
        if not spec.args or spec.args[0] != "s":
            raise TypeError(f"the first parameter of an sgl.function must be named 's' (got {spec.args[:1]})")
        self.arg_names = spec.args[1:]
        self.arg_defaults = spec.defaults or ()
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> "SglFunction":
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}() has no parameter(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, stop: str | list[str] | None = None,
            stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
            stream: bool = False, backend: Any = None, **kwargs: Any):
        from sgl.lang.runner import run_program

        params = default_run_params(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program(self, backend or global_config.default_backend, args, kwargs, params, stream)

    def run_batch(self, batch_kwargs: list, *, max_new_tokens: int = 128, stop: str | list[str] | None = None,
                  stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0,
                  top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool | None = None,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None, backend: Any = None,
                  num_threads: str | int = "auto", progress_bar: bool = False):
        from sgl.lang.runner import run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts (or argument tuples)")
        if not batch_kwargs:
            return []
        batch = [self._as_kwargs(a) for a in batch_kwargs]
        params = default_run_params(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program_batch(self, backend or global_config.default_backend, batch, params,
                                 num_threads, progress_bar)

    def _as_kwargs(self, args: Any) -> dict[str, Any]:
        if isinstance(args, dict):
            return args
        if isinstance(args, (list, tuple)):
            need = len(self.arg_names) - len(self.arg_defaults)
            if not need <= len(args) <= len(self.arg_names):
                raise TypeError(f"{self.__name__}() takes {need}..{len(self.arg_names)} arguments, got {len(args)}")
            return dict(zip(self.arg_names, args))
        raise TypeError(f"run_batch items must be dicts or tuples, got {type(args).__name__}")

    def trace(self, *, backend: Any = None, **kwargs: Any):
        from sgl.lang.tracer import trace_program

        return trace_program(self, kwargs, backend or global_config.default_backend)

    def cache(self, backend: Any = None) -> None:
        from sgl.lang.runner import cache_program

        cache_program(self, backend or global_config.default_backend)

    def __call__(self, *args: Any, **kwargs: Any):
        from sgl.lang.tracer import TracingScope

        scope = TracingScope.current()
        if scope is None:
            return self.run(*args, **kwargs)
        return self.trace(backend=scope.tracer_state.backend, **kwargs)

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"
