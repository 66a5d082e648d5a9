"""Whether other processes used the CPUs while this one timed its path candidates.

A calibration timed next to a busy neighbour picks what wins under contention, and the
cache then keeps that pick for every later start on the host: measured on an AMD EPYC
Zen 4 while a test suite ran beside it, the C decode step chose 1 thread (51 vs 60 ms for
2 on the timing workload) where the quiet host gives 2 (44 vs 70 ms), and kept it until
the cache file was deleted by hand (`bench_decode_step.py --context 1500`, 1 / 2 / 4 rows:
14.5 / 24.3 / 47.0 ms on 1 thread, 12.2 / 17.1 / 28.6 on 2). So the calibration
samples the host's CPU time around its timings; where other processes took more than
`BUSY_SHARE` of the machine, the picks serve this start but are not cached, and the next
start measures again.

Linux only (/proc/stat); elsewhere `sample` answers None and every calibration counts as
quiet, as before.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_SHARE = 0.15  # of all CPUs' time during the timings, used by other processes
_PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds at one instant: the CPUs this process may run on busy (every process on
    them, and time the hypervisor stole), this process (all threads), the wall clock, and
    how many CPUs were counted."""

    host_busy_s: float
    own_s: float
    wall_s: float
    cpus: int = 0  # 0: unknown (others_share then takes os.cpu_count())


def _busy_ticks(fields: list[str]) -> int:
    ticks = [int(x) for x in fields]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    return sum(ticks[:8]) - ticks[3] - ticks[4]


def _affinity() -> set[int] | None:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def sample(proc_stat: Path = _PROC_STAT, cpus: set[int] | None = None) -> CpuTimes | None:
    """The busy time of the CPUs this process may run on (`cpus`, default its affinity: a
    neighbour on other cores is no neighbour, and one on ours must not be diluted by them)
    and this process's CPU time now, or None where /proc/stat is unreadable."""
    try:
        lines = proc_stat.read_text().split("\n")
    except OSError:
        return None
    first = lines[0].split()
    if not first or first[0] != "cpu" or len(first) < 6:
        return None
    try:
        busy, counted = _busy_ticks(first[1:]), 0
        mine = cpus if cpus is not None else _affinity()
        per_cpu = [ln.split() for ln in lines[1:] if ln.startswith("cpu") and ln[3:4].isdigit()]
        if mine is not None and per_cpu:
            chosen = [f for f in per_cpu if int(f[0][3:]) in mine and len(f) >= 6]
            if chosen:
                busy, counted = sum(_busy_ticks(f[1:]) for f in chosen), len(chosen)
    except ValueError:
        return None
    own = os.times()
    return CpuTimes(busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic(), counted)


def others_share(before: CpuTimes | None, after: CpuTimes | None, num_cpus: int | None = None) -> float:
    """Fraction of all CPUs' time between the samples that went to other processes (or was
    stolen); 0.0 when either sample is missing or no time passed."""
    if before is None or after is None:
        return 0.0
    capacity = (after.wall_s - before.wall_s) * (num_cpus or after.cpus or os.cpu_count() or 1)
    if capacity <= 0:
        return 0.0
    others = (after.host_busy_s - before.host_busy_s) - (after.own_s - before.own_s)
    return min(1.0, max(0.0, others / capacity))
