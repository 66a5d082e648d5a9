"""Small helpers shared by the Triton kernels: interpreter detection and block sizes.

Triton fixes compile-vs-interpret per function when `@triton.jit` runs, and its own
library functions (`tl.max`, `tl.sum`, `tl.cdiv`, ...) are decorated when `triton` is
first imported. So TRITON_INTERPRET=1 must be set before the first `import triton` in
the process; `interpreting(kernel)` reports the mode a kernel was actually built in.

The interpreter also has a gap we work around: its `tl.dot` multiplies bf16 operands
as their raw uint16 bit patterns (numpy has no bf16). Kernels take an `UPCAST`
constexpr and cast dot operands to fp32 when they run interpreted. (It also truncates
fp32 -> bf16 instead of rounding to nearest, so bf16 results may differ by one ulp.)
"""

from __future__ import annotations

from typing import Any

import triton


def interpreting(kernel: Any) -> bool:
    """True when `kernel` (a `@triton.jit` object) runs in Triton's CPU interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))
