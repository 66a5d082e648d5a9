"""Lazy Triton JIT: compile-or-interpret is decided at the first launch, not at import.

`triton.jit` picks between the real compiler and the CPU interpreter when the decorator
runs, i.e. when a kernel module is imported. Test suites set `TRITON_INTERPRET=1` at some
point during collection, and whichever module imported the kernels first would otherwise
freeze the choice for the whole process. `lazy_jit` keeps the plain Python function and
wraps it on first launch (again if the mode flips), so import order never matters.

The interpreter also has a gap we work around: its `tl.dot` multiplies bf16 operands
as their raw uint16 bit patterns (numpy has no bf16). Kernels take an `UPCAST`
constexpr and cast dot operands to fp32 when `interpreting()` is true.
"""

from __future__ import annotations

from typing import Any, Callable

import triton
from triton import knobs


def interpreting() -> bool:
    """True when Triton kernels will run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


class LazyKernel:
    """A Triton kernel wrapped with `triton.jit` at first launch: `kernel[grid](...)`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self._jitted: Any = None
        self._mode: bool | None = None

    def __getitem__(self, grid: Any) -> Any:
        mode = interpreting()
        if self._jitted is None or self._mode != mode:
            self._jitted = triton.jit(self.fn)
            self._mode = mode
        return self._jitted[grid]


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))
