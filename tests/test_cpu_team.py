"""The C kernels' two-thread team (kernels/cpu/team.c) under stress.

tests/c/team_stress.c runs many jobs of alternating small and large chunk counts and
checks that each chunk runs exactly once with its own job's arguments and that nothing
runs after team_run returns (issue #19: a descheduled helper could claim a chunk of the
next job from a stale ticket). The build used here widens the two windows where that
race opened (SGL_TEAM_RACE_WINDOW); the old protocol failed it within 100,000 jobs. A
ThreadSanitizer build must report no data race.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "sgl" / "runtime" / "kernels" / "cpu"
DRIVER = ROOT / "tests" / "c" / "team_stress.c"
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def _build(tmp_path: Path, name: str, *flags: str) -> Path | None:
    exe = tmp_path / name
    r = subprocess.run([CC, *flags, "-pthread", f"-I{KERNELS}", "-o", str(exe), str(DRIVER), str(KERNELS / "team.c")],
                       capture_output=True, text=True, timeout=120)
    return exe if r.returncode == 0 else None


def _run(exe: Path, jobs: int, seed: int) -> str:
    r = subprocess.run([str(exe), str(jobs), str(seed)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_every_chunk_once_and_none_after_return_with_widened_race_windows(tmp_path):
    exe = _build(tmp_path, "team_race", "-O2", "-DSGL_TEAM_RACE_WINDOW")
    assert exe is not None
    for seed in (1, 2):
        assert "violations 0" in _run(exe, 20000, seed)


def test_plain_build_under_load_of_many_jobs(tmp_path):
    exe = _build(tmp_path, "team_plain", "-O2")
    assert exe is not None
    assert "violations 0" in _run(exe, 50000, 3)


def test_thread_sanitizer_reports_no_race(tmp_path):
    exe = _build(tmp_path, "team_tsan", "-O1", "-g", "-fsanitize=thread")
    if exe is None:
        pytest.skip("this compiler has no ThreadSanitizer runtime")
    out = _run(exe, 5000, 4)
    assert "violations 0" in out
    assert "ThreadSanitizer" not in out, out[-3000:]
