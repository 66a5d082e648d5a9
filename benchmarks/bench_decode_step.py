"""One C decode step (kernels/cpu/decode.c) of the embedded SmolLM2-135M, timed per build
variant, weight format and batch size: the figures behind the AVX2 path's and the GGUF
blocks' speed-ups.

`--quantization none,gguf` times each variant on the dequantized bf16 matrices (none,
270 MB read per step) and on the file's Q4_1 / Q8_0 blocks (gguf, 96 MB; quant.c), side
by side in one run; the table names the kernels that ran.

Each variant is the same sources compiled with another `-march` (binding.kernels(march)),
bound in this process side by side: `x86-64-v2` is the plain-C build (no AVX2, no
AVX512), `native` the one the engine uses on this host (AVX2+FMA on Zen 2/3, AVX512-BF16
where present). Rows are B requests of `--context` cached tokens each, decoded together in one
step. The pool holds random values (timing only): a pool of untouched zero pages maps every
page to one physical page, which the step reads faster than real K/V. Variants and batch sizes are
interleaved over `--reps` rounds and the median per-step time of each is printed, so a
busy neighbour on a shared host moves all figures alike.

`--pages small,huge` times the KV pool and the GGUF weight blocks on 4 KB pages (a copy of
the blocks in ordinary memory) against the engine's 2 MB pages (memory/huge_pages.py),
each variant with its own pool; `--pool-slots` sizes the pools so that `--slots
scattered` spreads a request's tokens over a serving-sized pool.

Run: .venv/bin/python benchmarks/bench_decode_step.py [--marches x86-64-v2,native] [--rows 1,2,4,8]
     [--quantization none,gguf] [--context 1500 --slots scattered --pool-slots 65536 --pages small,huge]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table  # noqa: E402

from sgl.runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from sgl.runtime.kernels.cpu import binding  # noqa: E402
from sgl.runtime.kernels.cpu.decode import CpuDecoder  # noqa: E402
from sgl.runtime.memory import huge_pages  # noqa: E402
from sgl.runtime.memory.kv_pool import KVPool  # noqa: E402
from sgl.runtime.models.gguf_blocks import BlockWeight, GGUFBlocks  # noqa: E402
from sgl.runtime.models.loader import load_model  # noqa: E402

_ISA = {0: "plain C", 1: "AVX512-BF16", 2: "AVX2+FMA"}
_QISA = {0: "plain C", 2: "AVX2 maddubs", 3: "AVX2 VNNI dpbusd"}


def _batch(rows: int, context: int, r2t: torch.Tensor, scattered: bool, pool_slots: int) -> ForwardBatch:
    """`rows` requests with `context - 1` cached slots each, adding their next token; their
    slots in order, or drawn at random from the whole pool as a pool looks after a while of
    serving."""
    order = torch.randperm(pool_slots - 1, generator=torch.Generator().manual_seed(0)) if scattered else \
        torch.arange(rows * context)
    for r in range(rows):
        r2t[r, :context] = 1 + order[r * context:(r + 1) * context]
    locs = [int(r2t[r, context - 1]) for r in range(rows)]
    return ForwardBatch.build([100 + r for r in range(rows)], locs, list(range(rows)), [context - 1] * rows,
                              [1] * rows, r2t)


def _small_page_copy(blocks: GGUFBlocks) -> GGUFBlocks:
    """`blocks` with each matrix copied to ordinary memory: the loader's huge pages undone."""
    def copy(w: BlockWeight | None) -> BlockWeight | None:
        return None if w is None else BlockWeight(w.wtype, w.data.clone())
    return dataclasses.replace(blocks, layers=[{k: copy(w) for k, w in layer.items()} for layer in blocks.layers],
                               embed=copy(blocks.embed), head=copy(blocks.head))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--marches", default="x86-64-v2,native")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--slots", choices=("contiguous", "scattered"), default="contiguous",
                    help="KV slots of a request: in order, or shuffled over the pool")
    ap.add_argument("--threads", type=int, default=2, choices=(1, 2))
    ap.add_argument("--steps", type=int, default=10, help="steps per timing")
    ap.add_argument("--reps", type=int, default=5, help="timings per (variant, rows); the median is kept")
    ap.add_argument("--quantization", default="none,gguf", help="weights: none (bf16), gguf (the file's blocks)")
    ap.add_argument("--pool-slots", type=int, default=0,
                    help="KV pool size in tokens (default: just the rows' tokens); scattered slots spread over it")
    ap.add_argument("--pages", default="huge",
                    help="KV pool and weight-block memory: huge (2 MB pages where the OS gives them, the "
                         "engine's default), small (4 KB), or both side by side")
    args = ap.parse_args()
    quants = args.quantization.split(",")
    if not set(quants) <= {"none", "gguf"}:
        sys.exit(f"--quantization: none and/or gguf, got {args.quantization!r}")
    pages = args.pages.split(",")
    if not set(pages) <= {"huge", "small"}:
        sys.exit(f"--pages: huge and/or small, got {args.pages!r}")
    rows_list = [int(r) for r in args.rows.split(",")]
    loaded = load_model(dtype="bfloat16", quantization="gguf" if "gguf" in quants else "none")
    model, c = loaded.model, loaded.config
    pool_slots = max(args.pool_slots, max(rows_list) * args.context + 8)
    pools = {}
    for pg in pages:
        pools[pg] = KVPool(pool_slots, c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16,
                           huge_pages=pg == "huge")
        for t in pools[pg].k_buffers + pools[pg].v_buffers:
            t.normal_(0, 1)
    r2t = torch.zeros(max(rows_list), args.context + 8, dtype=torch.int64)
    decoders = {}
    marches = []  # variant names: march, and /quantization when more than one is timed
    for m in args.marches.split(","):
        lib = binding.kernels(m)
        if lib is None:
            sys.exit(f"cannot build the kernel library for -march={m}")
        for q in quants:
            for pg in pages:
                name = "/".join([m] + [q] * (len(quants) > 1) + [pg] * (len(pages) > 1))
                loaded_blocks = model.gguf_blocks
                if pg == "small" and loaded_blocks is not None:  # the step reads a copy on 4 KB pages
                    model.gguf_blocks = _small_page_copy(loaded_blocks)
                dec = CpuDecoder(model, lib, args.threads, native_blocks=q == "gguf")
                model.gguf_blocks = loaded_blocks
                kernel = _ISA.get(lib.decode_simd(), "?") if q == "none" else \
                    f"{'+'.join(sorted(dec.weight_types()))} {_QISA.get(lib.quant_simd(), '?')}"
                decoders[name] = (dec, kernel, pools[pg])
                marches.append(name)
    batches = {b: _batch(b, args.context, r2t, args.slots == "scattered", pool_slots) for b in rows_list}
    times: dict[tuple[str, int], list[float]] = {(m, b): [] for m in marches for b in rows_list}
    for m in marches:  # warm up: binds the pool, sizes the workspaces, faults the weights in
        for b in rows_list:
            decoders[m][0].forward(batches[b], decoders[m][2])
    for _ in range(args.reps):
        for b in rows_list:
            for m in marches:
                dec, _, pool = decoders[m]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    dec.forward(batches[b], pool)
                times[(m, b)].append((time.perf_counter() - t0) / args.steps * 1e3)
    print(f"cpu: {cpu_model()}; threads {args.threads}; context {args.context}, {args.slots} slots, "
          f"pool of {pool_slots} tokens; median of {args.reps} x {args.steps} steps")
    for pg, pool in pools.items():
        print(f"  pool '{pg}': {huge_pages.huge_bytes(pool.k_buffers[0]) >> 20} MB on huge pages "
              f"(THP mode {huge_pages.thp_mode()})")
    for name, (_, kernel, _) in decoders.items():
        print(f"  {name}: {kernel}")
    table = []
    for b in rows_list:
        row: dict[str, object] = {"rows": b}
        for m in marches:
            ms = statistics.median(times[(m, b)])
            row[f"{m} ms"] = ms
            row[f"{m} tok/s"] = b * 1e3 / ms
        if len(pages) == 2 and len(marches) == 2:  # 4 KB pages' time / huge pages' time
            small, huge = (next(m for m in marches if m.endswith(f"/{pg}")) for pg in ("small", "huge"))
            row["huge-page speed-up"] = (statistics.median(times[(small, b)])
                                         / statistics.median(times[(huge, b)]))
        elif len(marches) == 2:
            row["speed-up"] = statistics.median(times[(marches[0], b)]) / statistics.median(times[(marches[1], b)])
        elif len(quants) == 2:  # per build: bf16 time / blocks time
            for m in args.marches.split(","):
                row[f"{m} gguf speed-up"] = (statistics.median(times[(f"{m}/none", b)])
                                             / statistics.median(times[(f"{m}/gguf", b)]))
        table.append(row)
    print_table("C decode step per build variant", table)


if __name__ == "__main__":
    main()
