"""C kernels for the CPU path, compiled on first use with the system C compiler.

`load()` builds every `.c` file here (decode step, attention, fused ops, team.c) into one
library with `-O3 -march=native` in `<cache dir>/kernels/` (config.cache_dir()),
keyed by a hash of the sources, the compiler and the CPU's flags, and returns the ctypes
library, or None (with one warning) where no compiler is present or the build fails;
callers then keep the torch path. The build takes a few seconds; later processes reuse
the cached library. Its C interface is one header, sgl_kernels.h, bound once in
binding.py; callers use `binding.kernels()`, not the bare library returned here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sgl.runtime.config import cache_dir, settings

log = logging.getLogger(__name__)

# Every C file here goes into one library (kernels share team.c's helper thread).
_SOURCES = sorted(p for p in Path(__file__).parent.iterdir() if p.suffix in (".c", ".h"))
_libs: dict[str, ctypes.CDLL | None] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""




def _build(cc: str, out: Path, march: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name then rename, so concurrent processes never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        srcs = [str(p) for p in _SOURCES if p.suffix == ".c"]
        subprocess.run([cc, "-O3", f"-march={march}", "-fPIC", "-shared", "-pthread", "-o", tmp, *srcs, "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(march: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel library (undeclared: see binding.py), or None if it cannot be
    built here. `march` other
    than native builds a portable variant (tests use it for the non-AVX512 code path)."""
    if march not in _libs:
        _libs[march] = _load(march)
    return _libs[march]


def build_key(march: str = "native") -> str | None:
    """The identity of this host's kernel build (sources, compiler, -march, CPU flags), or
    None without a compiler; runtime/tuning keys its measurements by it too."""
    cc = settings().cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = b"".join(p.read_bytes() for p in _SOURCES)
    return hashlib.sha256(src + cc.encode() + march.encode() + _cpu_flags().encode()).hexdigest()[:16]


def _load(march: str) -> ctypes.CDLL | None:
    cc = settings().cc or shutil.which("cc") or shutil.which("gcc")
    key = build_key(march)
    if cc is None or key is None:
        log.warning("no C compiler found: the CPU decode kernel is off (torch path instead)")
        return None
    out = cache_dir() / "kernels" / f"decode-{key}.so"
    try:
        if not out.exists():
            _build(cc, out, march)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("building the CPU decode kernel failed (torch path instead): %s", detail[-500:])
        return None
    return lib
