"""Small helpers shared by the Triton kernels: interpreter detection and block sizes.

Triton fixes compile-vs-interpret per function when `@triton.jit` runs, and its own
library functions (`tl.max`, `tl.sum`, `tl.cdiv`, ...) are decorated when `triton` is
first imported. So TRITON_INTERPRET=1 must be set before the first `import triton` in
the process; `interpreting(kernel)` reports the mode a kernel was actually built in.

The interpreter stores bf16 as raw uint16 (numpy has no bf16), and its arithmetic and
`tl.dot` then work on the bit patterns: bf16 values must be cast to fp32 before any
math. Elementwise kernels always do that; the attention kernels take an `UPCAST`
constexpr that casts dot operands to fp32 only when interpreted (GPUs keep bf16 dots).
It also truncates fp32 -> bf16 instead of rounding to nearest, so bf16 results may
differ from a GPU's by one ulp.
"""

from __future__ import annotations

from typing import Any

import triton


def interpreting(kernel: Any) -> bool:
    """True when `kernel` (a `@triton.jit` object) runs in Triton's CPU interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))
