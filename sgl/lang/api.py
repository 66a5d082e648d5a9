"""Public DSL functions (`sgl.gen`, `sgl.select`, roles, backends), named as in SGLang.

These only build expression nodes or set process-wide config; nothing here talks to a
model. Backends given by the user may be an `sgl.Engine`, which is wrapped on use.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from sgl.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sgl.lang.global_config import global_config
from sgl.lang.ir import (GenParams, SglExpr, SglExprList, SglFunction, SglGen, SglRoleBegin, SglRoleEnd,
                         SglSelect)


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
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"regex {pattern!r} is not a valid regular expression: {e}") from None


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    ebnf: str | None = None,
    grammar: str | None = None,
) -> SglExpr:
    """Generate text into variable `name`. `grammar=` takes a Lark grammar, `ebnf=` a GBNF/EBNF one."""
    if choices:
        return SglSelect(name, choices, 0.0 if temperature is None else temperature,
                         choices_method or token_length_normalized)
    _check_regex(regex)
    if isinstance(json_schema, dict):
        import json

        json_schema = json.dumps(json_schema)
    constraints = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf),
                                  ("grammar", grammar)) if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"gen() takes at most one of regex/json_schema/ebnf/grammar, got {constraints}")
    return SglGen(name, GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema,
        ebnf=ebnf, lark=grammar))


def _typed_gen(dtype: type, name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
               min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs) -> SglExpr:
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs, dtype=dtype)


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
            stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
            stop_regex: str | list[str] | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
            frequency_penalty: float | None = None, presence_penalty: float | None = None,
            ignore_eos: bool | None = None, return_logprob: bool | None = None,
            logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
            return_text_in_logprobs: bool | None = None) -> SglExpr:
    """A gen constrained to an integer."""
    return _typed_gen(int, name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
                      min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
                      logprob_start_len, top_logprobs_num, return_text_in_logprobs)


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
               stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
               stop_regex: str | list[str] | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               ignore_eos: bool | None = None, return_logprob: bool | None = None,
               logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
               return_text_in_logprobs: bool | None = None) -> SglExpr:
    """A gen constrained to a double-quoted string of word characters and spaces."""
    return _typed_gen(str, name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
                      min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
                      logprob_start_len, top_logprobs_num, return_text_in_logprobs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> SglExpr:
    """Append the most likely of `choices` (scored by `choices_method`) and store it in `name`."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select() needs choices: a non-empty list of strings")
    return SglSelect(name, choices, temperature, choices_method)


def _role(name: str, expr: Any = None) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(name), SglRoleEnd(name)])
    body = expr if isinstance(expr, SglExpr) else _text(expr)
    return SglExprList([SglRoleBegin(name), body, SglRoleEnd(name)])


def _text(x: Any) -> SglExpr:
    from sgl.lang.ir import SglConstantText

    return SglConstantText(x if isinstance(x, str) else str(x))


def system(expr: Any = None) -> SglExprList:
    return _role("system", expr)


def user(expr: Any = None) -> SglExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> SglExprList:
    return _role("assistant", expr)


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
