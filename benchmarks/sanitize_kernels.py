"""Run the C kernels' tests with AddressSanitizer + UndefinedBehaviorSanitizer (issue #19).

Builds kernels/cpu into one library with `-fsanitize=address,undefined`, makes the
loader hand that library to every caller (decode step, attention, fused ops), and runs
the kernel tests in this process. Python itself is not instrumented, so the sanitizer
runtime must be preloaded; the script re-executes itself that way:

    .venv/bin/python benchmarks/sanitize_kernels.py [pytest args, default: the kernel tests]

A finding aborts the run with the sanitizer's report on stderr. Only the code paths this
host's CPU runs are checked (without AVX512-BF16: the portable loops). The team's
thread-safety is checked separately, under ThreadSanitizer, by tests/test_cpu_team.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "sgl" / "runtime" / "kernels" / "cpu"
DEFAULT_TESTS = ["tests/test_cpu_decode_kernel.py", "tests/test_cpu_attention.py", "tests/test_cpu_ops.py",
                 "-m", "not model"]
FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-march=native", "-fPIC", "-shared", "-pthread"]


def build(cc: str, out: Path) -> None:
    srcs = [str(p) for p in sorted(KERNELS.glob("*.c"))]
    subprocess.run([cc, *FLAGS, "-o", str(out), *srcs, "-lm"], check=True)


def main() -> int:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("no C compiler", file=sys.stderr)
        return 2
    if "SGL_ASAN_LIB" not in os.environ:  # first pass: build, then re-run preloaded
        lib = Path(tempfile.mkdtemp(prefix="sgl-asan-")) / "kernels-asan.so"
        build(cc, lib)
        runtime = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
        env = dict(os.environ, SGL_ASAN_LIB=str(lib), LD_PRELOAD=runtime,
                   ASAN_OPTIONS="detect_leaks=0:abort_on_error=1", UBSAN_OPTIONS="print_stacktrace=1")
        return subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, cwd=ROOT).returncode
    import ctypes

    import pytest

    sys.path.insert(0, str(ROOT))  # this checkout's sgl and tests, not another installed copy

    from sgl.runtime.kernels import cpu as cpu_kernels
    from sgl.runtime.models import llama

    # A C++ exception thrown inside torch aborts under the preloaded ASan runtime, and
    # oneDNN's weight packing throws on CPUs without bf16 GEMMs; packing is not our C code.
    llama.pack_weight = lambda *args, **kwargs: None
    sanitized = ctypes.CDLL(os.environ["SGL_ASAN_LIB"])
    cpu_kernels._libs["native"] = sanitized  # load() now returns the sanitized build, which binding.py declares
    print(f"kernels built with {' '.join(FLAGS[:5])}: {os.environ['SGL_ASAN_LIB']}")
    return int(pytest.main(["-q", "-p", "no:cacheprovider", *(sys.argv[1:] or DEFAULT_TESTS)]))


if __name__ == "__main__":
    sys.exit(main())
