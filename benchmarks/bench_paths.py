"""Prefill and decode steps on today's fixed CPU paths vs the calibrated ones (runtime/tuning),
side by side in one process on the embedded model: a 1,500-token prefill and decode steps of
1, 8 and 16 rows at 256 tokens of context. Prints a table and the JSON (with lscpu's model
name and flags, so figures from different hosts are never mixed up).

    python benchmarks/bench_paths.py [--cache-dir DIR] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sgl.runtime.attention.registry import create_attention_backend  # noqa: E402
from sgl.runtime.config import EngineConfig  # noqa: E402
from sgl.runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from sgl.runtime.executor.model_runner import ModelRunner  # noqa: E402
from sgl.runtime.models.loader import load_model  # noqa: E402
from sgl.runtime.tuning import measure  # noqa: E402
from sgl.runtime.tuning.calibrate import choose_paths  # noqa: E402


def lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    lines = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k: lines.get(k, "").strip() for k in ("Model name", "Flags")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=1500)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    setups = {}
    for name, flags in (("today", {"cpu_linear": "bf16", "cpu_decode_max_rows": "8", "cpu_decode_threads": 2}),
                        ("auto", {})):
        cfg = EngineConfig.from_kwargs(cache_dir=args.cache_dir, **flags)
        model = load_model(None, dtype="auto", device="cpu").model
        paths = choose_paths(cfg, model, "cpu")
        setups[name] = (model, paths)
    n = args.prefill_tokens
    rows = {}
    for name, (model, paths) in setups.items():
        bench = measure.Bench(model, 256, 16)
        attn = create_attention_backend(paths.attention_backend, bench.pool, "cpu")
        runner = ModelRunner(model, attn, True, paths.decode_threads, paths.decode_max_rows, paths)
        big = measure.Bench(model, 0, 1, n)
        battn = create_attention_backend(paths.attention_backend, big.pool, "cpu")
        ids = [(37 * i + 11) % model.config.vocab_size for i in range(n)]
        prefill = ForwardBatch.build(ids, big.table[0].tolist(), [0], [0], [n], big.table)
        out = {"paths": paths.info()}
        with torch.inference_mode():
            out["prefill_ms"] = measure.median_ms(lambda: model.forward(prefill, battn), args.reps)
            for b in (1, 8, 16):
                batch = bench.decode(b)
                out[f"decode{b}_ms"] = measure.median_ms(lambda: runner.forward(batch), args.reps)
                out[f"decode{b}_path"] = "C" if runner.cpu_decoder and runner.cpu_decoder.supports(
                    batch, bench.pool) else "torch"
        rows[name] = out
    print(f"{'paths':6} {'prefill ' + str(n) + ' tok (s)':>20} {'decode 1 (ms)':>14} {'decode 8 (ms)':>14} "
          f"{'decode 16 (ms)':>15}  choice")
    for name, r in rows.items():
        p = r["paths"]
        print(f"{name:6} {r['prefill_ms'] / 1000:20.2f} {r['decode1_ms']:14.1f} {r['decode8_ms']:14.1f} "
              f"{r['decode16_ms']:15.1f}  linear={p['linear']} attn={p['attention_backend']} "
              f"rows<={p['decode_max_rows']} threads={p['decode_threads']} (16 rows: {r['decode16_path']})")
    print(json.dumps({"lscpu": lscpu(), "load_avg": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
