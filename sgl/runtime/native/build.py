"""Build a small C library from sources with the system compiler, once per host, cached.

`build_library(name, sources, march)` compiles the `.c` files of `sources` (headers count
for the key) with `-O3 -march=<march>` into `<cache dir>/kernels/<name>-<key>.so`, keyed
by a hash of the sources, the compiler, `march` and the CPU's flags, and returns the
loaded ctypes library, or None (with one warning naming `name`) where no compiler is
present or the build fails, so callers keep their Python/torch path. The build goes to a
temporary name then is renamed, so concurrent processes never load a half-written file.
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
from typing import Sequence

from sgl.runtime.config import cache_dir, settings

log = logging.getLogger(__name__)


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line ("" where unreadable): part of every build key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compile(cc: str, out: Path, march: str, srcs: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, "-O3", f"-march={march}", "-fPIC", "-shared", "-pthread", "-o", tmp, *srcs, "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compiler() -> str | None:
    """The C compiler every build uses (the `cc` setting, else cc or gcc on PATH), or None."""
    return settings().cc or shutil.which("cc") or shutil.which("gcc")


def library_key(sources: Sequence[Path], march: str = "native") -> str | None:
    """The build's identity: a hash of the sources, the compiler, `march` and the CPU's
    flags; None without a compiler."""
    cc = compiler()
    if cc is None:
        return None
    blob = b"".join(p.read_bytes() for p in sorted(sources))
    return hashlib.sha256(blob + cc.encode() + march.encode() + cpu_flags().encode()).hexdigest()[:16]


def build_library(name: str, sources: Sequence[Path], march: str = "native") -> ctypes.CDLL | None:
    cc, key = compiler(), library_key(sources, march)
    if cc is None or key is None:
        log.warning("no C compiler found: %s is off (Python/torch path instead)", name)
        return None
    srcs = sorted(sources)
    out = cache_dir() / "kernels" / f"{name}-{key}.so"
    try:
        if not out.exists():
            _compile(cc, out, march, [str(p) for p in srcs if p.suffix == ".c"])
        return ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("building %s failed (Python/torch path instead): %s", name, detail[-500:])
        return None
