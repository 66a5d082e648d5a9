"""C kernels for the CPU path, compiled on first use with the system C compiler.

`load()` builds every `.c` file here (decode step, attention, fused ops, team.c) into one
library through native/build.py (`-O3 -march=native`, cached in `<cache dir>/kernels/`
by a hash of the sources, the compiler and the CPU's flags) and returns the ctypes
library, or None (with one warning) where no compiler is present or the build fails;
callers then keep the torch path. The build takes a few seconds; later processes reuse
the cached library. Its C interface is one header, sgl_kernels.h, bound once in
binding.py; callers use `binding.kernels()`, not the bare library returned here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from sgl.runtime.native.build import build_library, library_key

# Every C file here goes into one library (kernels share team.c's helper thread).
_SOURCES = sorted(p for p in Path(__file__).parent.iterdir() if p.suffix in (".c", ".h"))
_libs: dict[str, ctypes.CDLL | None] = {}


def load(march: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel library (undeclared: see binding.py), or None if it cannot be
    built here. `march` other than native builds a portable variant (tests use it for
    the non-AVX512 code path)."""
    if march not in _libs:
        _libs[march] = build_library("decode", _SOURCES, march)
    return _libs[march]


def build_key(march: str = "native") -> str | None:
    """The identity of this host's kernel build (sources, compiler, -march, CPU flags), or
    None without a compiler; runtime/tuning keys its measurements by it too."""
    return library_key(_SOURCES, march)
