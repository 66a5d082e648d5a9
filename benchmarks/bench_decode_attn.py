"""The C decode step's attention alone (kernels/cpu/decode_attn.c): two variants side by side,
runs interleaved over `--rounds` so a host's drift moves both alike, medians reported.

  --ab source   the kernel at git revision `--base` (default HEAD) vs the working tree,
                both with the pool on `--pages`; the table also says whether the two
                produced the same output bits (a hash of the attention output)
  --ab pages    the working tree's kernel with the pool on 4 KB vs 2 MB pages

The harness (benchmarks/c/decode_attn_bench.c) runs SmolLM2-135M's shapes (30 layers, 9
query heads over 3 K/V heads of 64) for each case "rows x context", with slots in order,
scattered or in shuffled pages over a pool of `--pool-slots`, on 1 or 2 threads, built with the system C
compiler at -O3 -march=native like the engine's kernels. `--slots pages` shuffles whole
16-slot pages, the layout the engine's default page size gives.

Run: .venv/bin/python benchmarks/bench_decode_attn.py [--ab source --base HEAD~1 | --ab pages]
     [--cases 1x1500,2x1500,1x4000] [--pool-slots 65536] [--rounds 5]
Writes benchmarks/results/bench_decode_attn.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table, write_json  # noqa: E402

from sgl.runtime.memory import huge_pages  # noqa: E402
from sgl.runtime.native.build import compiler  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KERNELS = "sgl/runtime/kernels/cpu"
SOURCES = ("decode_attn.c", "decode_attn.h", "simd.h", "team.c", "team.h")
HARNESS = REPO / "benchmarks" / "c" / "decode_attn_bench.c"
SLOTS = ("contiguous", "scattered", "pages")  # the harness's SCATTERED argument: 0, 1, 2


def kernel_dir(rev: str | None, into: Path) -> Path:
    """The kernel sources at git revision `rev` (None: the working tree) copied into `into`."""
    into.mkdir(parents=True)
    for name in SOURCES:
        path = f"{KERNELS}/{name}"
        if rev is None:
            shutil.copy(REPO / path, into / name)
            continue
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, check=True).stdout
        (into / name).write_bytes(text)
    return into


def build(src: Path, out: Path) -> Path:
    """The harness against the kernel sources in `src`, with the engine's compiler and -O3."""
    cc = compiler()
    if cc is None:
        sys.exit("no C compiler (cc or gcc on PATH, or the cc setting)")
    subprocess.run([cc, "-O3", "-march=native", "-pthread", f"-I{src}", "-o", str(out), str(HARNESS),
                    str(src / "decode_attn.c"), str(src / "team.c"), "-lm"], check=True)
    return out


def run(binary: Path, rows: int, context: int, slots: int, threads: int, pool: int, huge: bool,
        reps: int) -> tuple[float, str]:
    """(median ms per step of the 30 layers' attention, output hash); `slots` indexes SLOTS."""
    args = [rows, context, slots, threads, pool, int(huge), reps]
    out = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), out[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", choices=("source", "pages"), default="source")
    ap.add_argument("--base", default="HEAD", help="--ab source: the git revision to compare the working tree with")
    ap.add_argument("--pages", choices=("small", "huge"), default="huge", help="--ab source: the pool's pages")
    ap.add_argument("--cases", default="1x1500,2x1500,4x1500,1x4000", help="rows x context of each case")
    ap.add_argument("--slots", default="contiguous,scattered",
                    help="contiguous, scattered (single slots at random), pages (16-slot pages at random)")
    ap.add_argument("--threads", default="2", help="thread counts, e.g. 1,2")
    ap.add_argument("--pool-slots", type=int, default=65536, help="pool size: scattered slots spread over it")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median of each case is kept")
    ap.add_argument("--reps", type=int, default=7, help="timings per run (5 steps each); the run's median")
    args = ap.parse_args()
    if not set(args.slots.split(",")) <= set(SLOTS):
        sys.exit(f"--slots: some of {', '.join(SLOTS)}, got {args.slots!r}")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        if args.ab == "source":
            names = (f"{args.base}", "working tree")
            bins = (build(kernel_dir(args.base, t / "a"), t / "a.bin"), build(kernel_dir(None, t / "b"), t / "b.bin"))
            huge = (args.pages == "huge",) * 2
        else:
            names = ("4 KB pages", "2 MB pages")
            binary = build(kernel_dir(None, t / "b"), t / "b.bin")
            bins, huge = (binary, binary), (False, True)
        cases = [(int(r), int(c), SLOTS.index(s), int(th)) for rc in args.cases.split(",")
                 for r, c in [rc.split("x")] for s in args.slots.split(",") for th in args.threads.split(",")]
        ms: dict[tuple, list[list[float]]] = {case: [[], []] for case in cases}
        hashes: dict[tuple, list[set[str]]] = {case: [set(), set()] for case in cases}
        for rnd in range(args.rounds):
            for case in cases:
                for v in ((0, 1) if rnd % 2 == 0 else (1, 0)):  # each variant first in half the rounds
                    m, h = run(bins[v], *case, args.pool_slots, huge[v], args.reps)
                    ms[case][v].append(m)
                    hashes[case][v].add(h)
    table, out = [], []
    for (rows, ctx, slots, threads), (a, b) in ms.items():
        ma, mb = statistics.median(a), statistics.median(b)
        row = {"rows": rows, "context": ctx, "slots": SLOTS[slots], "threads": threads,
               f"{names[0]} ms": ma, f"{names[1]} ms": mb, "speed-up": ma / mb}
        if args.ab == "source":
            row["same bits"] = hashes[(rows, ctx, slots, threads)][0] == hashes[(rows, ctx, slots, threads)][1]
        table.append(row)
        out.append({**row, "runs": {names[0]: a, names[1]: b}})
    print(f"cpu: {cpu_model()}; THP mode {huge_pages.thp_mode()}; pool of {args.pool_slots} slots; "
          f"median of {args.rounds} interleaved rounds")
    print_table(f"decode attention, {names[0]} vs {names[1]} (ms per step, 30 layers)", table)
    write_json("bench_decode_attn.json", {"args": vars(args), "variants": list(names), "rows": out})


if __name__ == "__main__":
    main()
