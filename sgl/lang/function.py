"""`SglFunction`, the decorated program: `@sgl.function def f(s, ...)`.

It binds arguments and hands runs to runner.py and traces to tracer.py; the expression
nodes (ir.py) know nothing of it. Options given to `run` / `run_batch` are the run's
defaults for every gen: sampling parameters by their `SamplingParams` names, plus the
logprob options (see `ir.gen_params`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from sgl.lang.global_config import global_config
from sgl.lang.ir import gen_params, is_option


class SglFunction:
    """A program; call `.run`, `.run_batch`, `.bind`, `.trace`, `.cache`."""

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

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any):
        """Run once. A keyword naming a program parameter goes to the program (it wins over an
        option of the same name); any other is a sampling or logprob option, e.g.
        `temperature=0, max_new_tokens=64, seed=3`. SGLang's `use_thread` is accepted (a
        program always runs on its own thread here)."""
        from sgl.lang.runner import run_program

        if "use_thread" not in self.arg_names:
            kwargs.pop("use_thread", None)
        program_kwargs = {k: v for k, v in kwargs.items() if k in self.arg_names or not is_option(k)}
        options = {k: v for k, v in kwargs.items() if k not in program_kwargs}
        params = gen_params(options, "run")
        return run_program(self, backend or global_config.default_backend, args, program_kwargs, params, stream)

    def run_batch(self, batch_kwargs: list, *, backend: Any = None, num_threads: str | int = "auto",
                  progress_bar: bool = False, generator_style: bool = False, **options: Any):
        """Run once per item of `batch_kwargs` (dicts or tuples of arguments) on a thread pool;
        `options` are sampling and logprob options shared by every run. With
        `generator_style=True`, an iterator of the states in input order, each as soon as it
        is done."""
        from sgl.lang.runner import iter_program_batch, run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts (or argument tuples)")
        params = gen_params(options, "run_batch")
        if not batch_kwargs:
            return []
        batch = [self._as_kwargs(a) for a in batch_kwargs]
        run = iter_program_batch if generator_style else run_program_batch
        return run(self, backend or global_config.default_backend, batch, params, num_threads, progress_bar)

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
        # Traced into the caller's trace: run options (backend=, temperature=, ...) do not apply.
        program_kwargs = {k: v for k, v in kwargs.items() if k in self.arg_names}
        return self.trace(backend=scope.tracer_state.backend, **program_kwargs)

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"
