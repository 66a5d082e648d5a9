"""Public DSL functions (`sgl.gen`, `sgl.select`, roles, backends), named as in SGLang.

These only build expression nodes or set process-wide config; nothing here talks to a
model. Backends given by the user may be an `sgl.Engine`, which is wrapped on use.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from sgl.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sgl.lang.function import SglFunction
from sgl.lang.global_config import global_config
from sgl.lang.ir import SglExpr, SglExprList, SglGen, SglRoleBegin, SglRoleEnd, SglSelect, gen_params, role_exprs
from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS
from sgl.runtime.sampling_params import regex_problem


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """Decorate `def prog(s, ...)` as a program; usable bare or as `@function(num_api_spec_tokens=...)`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)


def set_default_backend(backend: Any) -> None:
    from sgl.lang.backends import as_backend

    global_config.default_backend = as_backend(backend)


def flush_cache(backend: Any = None, empty_cache: bool = True) -> bool:
    from sgl.lang.backends import as_backend

    backend = backend or global_config.default_backend
    if backend is None:
        return False
    return as_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict | None:
    from sgl.lang.backends import as_backend

    backend = backend or global_config.default_backend
    if backend is None:
        return None
    return as_backend(backend).get_server_info()


def _check_regex(pattern: str | None) -> None:
    problem = None if pattern is None else regex_problem(pattern)
    if problem is not None:
        raise ValueError(f"regex {pattern[:80]!r} is not a valid regular expression: {problem}")


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, *,
        dtype: type | str | None = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, **options: Any) -> SglExpr:
    """Generate text into variable `name`.

    `options` are sampling parameters by their `SamplingParams` names (temperature, top_p,
    stop, seed, repetition_penalty, regex, json_schema, ebnf, lark, ...; `grammar=` is the
    Lark grammar too) and the logprob options (return_logprob, top_logprobs_num, ...).
    `choices=` makes it a `select`; `dtype=` (int, float, str, bool) a typed gen.
    """
    if choices:
        temperature = options.get("temperature")
        return SglSelect(name, choices, 0.0 if temperature is None else temperature,
                         choices_method or token_length_normalized)
    params = gen_params({"max_tokens": max_tokens, "min_tokens": min_tokens, **options}, "gen", dtype)
    sp = params.sampling
    _check_regex(sp.get("regex"))
    if isinstance(sp.get("json_schema"), dict):
        sp["json_schema"] = json.dumps(sp["json_schema"])
    constraints = [k for k in CONSTRAINT_KINDS if k in sp]
    if len(constraints) > 1:
        raise ValueError(f"gen() takes at most one constraint of {list(CONSTRAINT_KINDS)}, got {constraints}")
    return SglGen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **options: Any) -> SglExpr:
    """A gen constrained to an integer; `options` as for `gen`."""
    return gen(name, max_tokens, dtype=int, **options)


def gen_string(name: str | None = None, max_tokens: int | None = None, **options: Any) -> SglExpr:
    """A gen constrained to a double-quoted string of word characters and spaces; `options` as for `gen`."""
    return gen(name, max_tokens, dtype=str, **options)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> SglExpr:
    """Append the most likely of `choices` (scored by `choices_method`) and store it in `name`."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select() needs choices: a non-empty list of strings")
    if temperature > 1e-5:  # as SGLang: the choice is the best-scored one, never sampled
        raise ValueError(f"select() picks the most likely choice; temperature={temperature} is not supported")
    return SglSelect(name, choices, temperature, choices_method)


def system(expr: Any = None) -> SglExprList:
    return role_exprs("system", expr)


def user(expr: Any = None) -> SglExprList:
    return role_exprs("user", expr)


def assistant(expr: Any = None) -> SglExprList:
    return role_exprs("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")
