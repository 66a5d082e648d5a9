"""Peer benchmark (issues 6 and 16): sgl vs transformers vs llama.cpp vs vLLM-CPU, one run.

(a) single-stream decode tok/s on a short prompt, and prefill tok/s at 1,024 tokens;
(b) 64 requests sharing a ~600-token few-shot prefix (bench_engine's workload), 16 new
    greedy tokens each, with how many requests produced exactly sgl's tokens;
(c) single-stream decode at ~4,000 tokens of context, and 8 streams x 1,500 new tokens
    (aggregate tok/s): where agents live;
(d) the issue's targets: sgl over the best peer per workload.
Every row prints this host's physical bound next to it (peer_bounds.py: weight + KV bytes
over measured bandwidth, FLOPs over the best measured matmul rate) and which kernels ran.

Every system gets the same token ids (tokenized once by our tokenizer). transformers runs
in this process on `eng.hf_dir` (bf16); llama.cpp (llama-cpp-python on the same GGUF,
Q4_1) and vLLM-CPU (bf16 on `eng.hf_dir`, prefix caching on) run in their own venvs under
benchmarks/.peers/ through benchmarks/peer_worker.py; install them with
benchmarks/setup_peers.sh. A peer without a venv is a "not installed" row; a peer that
crashes is a "failed: ..." row. Decode tok/s everywhere is (t(N+1 tokens) - t(1 token)) / N,
so it excludes prefill and start-up. Every system gets --threads compute threads (default:
all CPUs); the load average is recorded, because on a shared machine other processes' load
distorts every number.

Run: .venv/bin/python benchmarks/bench_peers.py [--peers sgl,transformers,llamacpp,vllm]
Writes benchmarks/results/bench_peers.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_engine import FEWSHOT, shared_prefix_prompts  # noqa: E402
from common import cpu_model, print_table, write_json  # noqa: E402
from peer_bounds import ModelShape, decode_bound_tok_s, measure_host, prefill_bound_tok_s, prefill_flops  # noqa: E402
from peers_inproc import run_sgl, run_transformers  # noqa: E402

from sgl.runtime.engine import Engine  # noqa: E402

PEERS_DIR = HERE / ".peers"
PEER_VENVS = {"llamacpp": ("llamacpp-venv", "llama_cpp"), "vllm": ("vllm-venv", "vllm")}
ALL = ("sgl", "sgl-1t", "transformers", "llamacpp", "vllm")
LABEL = {"sgl": "sgl", "sgl-1t": "sgl --cpu-decode-threads 1", "transformers": "transformers",
         "llamacpp": "llama.cpp (Q4_1 GGUF)", "vllm": "vLLM-CPU"}
# (workload key, title, higher is better, peers compared, target ratio of sgl over them)
TARGETS = [
    ("decode_tok_s", "decode, 1 stream", True, ("llamacpp",), 1.2),
    ("prefill_tok_s", "prefill", True, ("vllm",), 1.2),
    ("shared_seconds", "shared prefix vs vLLM", False, ("vllm",), 3.0),
    ("shared_seconds", "shared prefix vs llama.cpp", False, ("llamacpp",), 20.0),
    ("long_decode_tok_s", "decode at long context", True, ("llamacpp", "vllm"), 1.2),
    ("streams_tok_s", "streams x long outputs", True, ("llamacpp", "vllm"), 1.2),
]


def build_job(eng: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The token ids every system runs on."""
    tok = eng.tokenizer

    def fewshot_ids(n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += tok.encode(FEWSHOT + "\n")
        return ids[:n]

    base = fewshot_ids(args.prefill_tokens)
    # A different first token per repetition, so no prefix cache can serve a timed prefill.
    prefill = [[tok.encode(f" {r}")[0]] + base[1:] for r in range(args.prefill_reps)]
    return {
        "threads": args.threads,
        "decode_prompt": tok.encode("Story 0: once upon a time there was a"),
        "decode_tokens": args.decode_tokens,
        "prefill_prompts": prefill,
        "shared_prompts": [tok.encode(p) for p in shared_prefix_prompts(args.requests)],
        "new_tokens": args.new_tokens,
        "long_prompt": fewshot_ids(args.long_context),
        "long_decode_tokens": args.decode_tokens,
        "stream_prompts": [tok.encode(f"Story {i}: once upon a time, in a town by the sea,") for i in range(args.streams)],
        "stream_tokens": args.stream_tokens,
    }


def run_peer(name: str, model: str, job: dict, timeout: float) -> dict[str, Any]:
    """Run peer_worker.py in the peer's venv; a status string instead of numbers on failure."""
    venv, module = PEER_VENVS[name]
    python = PEERS_DIR / venv / "bin" / "python"
    if not python.exists() or not list((PEERS_DIR / venv).glob(f"lib/python*/site-packages/{module}")):
        return {"status": "not installed"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({**job, "model": model}, f)
    threads = job["threads"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(threads), VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="1")
    try:
        proc = subprocess.run([str(python), str(HERE / "peer_worker.py"), name, f.name], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"status": f"failed: timed out after {timeout:.0f}s"}
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    err = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    last = err[-1] if err else f"exit code {proc.returncode}"
    (PEERS_DIR / f"{name}-run.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return {"status": f"failed: {last[:200]} (full log: benchmarks/.peers/{name}-run.log)"}


def target_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    ours = results.get("sgl", {})
    for key, title, higher, peers, target in TARGETS:
        have = [(p, results[p][key]) for p in peers if results.get(p, {}).get(key) is not None]
        if ours.get(key) is None or not have:
            rows.append({"workload": title, "sgl": ours.get(key, ""), "best peer": "not measured", "ratio": "",
                         "target": f">= {target}x", "met": "n/a"})
            continue
        name, best = max(have, key=lambda pv: pv[1]) if higher else min(have, key=lambda pv: pv[1])
        ratio = ours[key] / best if higher else best / ours[key]
        rows.append({"workload": title, "sgl": ours[key], "best peer": f"{LABEL[name]}: {best:.3g}",
                     "ratio": ratio, "target": f">= {target}x", "met": "yes" if ratio >= target else "NO"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(ALL), help="comma-separated subset of " + ",".join(ALL))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--long-context", type=int, default=4000, help="prompt tokens of the long-context decode")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=1500)
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers generate batch size")
    ap.add_argument("--hf-requests", type=int, default=0,
                    help="time transformers on only this many shared-prefix requests and scale (0: all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="compute threads for every system (torch, llama.cpp n_threads, vLLM's OMP binding)")
    ap.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds per subprocess peer")
    args = ap.parse_args()
    chosen = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(chosen) - set(ALL)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}")

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    host = measure_host()
    eng = Engine(max_total_tokens=65536, num_threads=args.threads)
    c = eng.model_config
    bf16_bytes = sum(eng.get_server_info()["weight_bytes_per_rank"])
    shape = ModelShape(params=bf16_bytes // 2, embed_params=c.vocab_size * c.hidden_size, layers=c.num_layers,
                       heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    job = build_job(eng, args)
    gguf = Path(eng.model_path)
    gguf_bytes = gguf.stat().st_size if gguf.suffix == ".gguf" else bf16_bytes
    native = eng.get_server_info().get("quantization") == "gguf"
    # Bytes one decode step reads per system: the GGUF blocks where they run natively.
    weight_bytes = {"sgl": gguf_bytes if native else bf16_bytes, "sgl-1t": gguf_bytes if native else bf16_bytes,
                    "transformers": bf16_bytes, "vllm": bf16_bytes, "llamacpp": gguf_bytes}

    results: dict[str, dict[str, Any]] = {}
    if "sgl" in chosen:
        results["sgl"] = run_sgl(eng, job)
    hf_dir = eng.hf_dir
    eng.shutdown()
    if "sgl-1t" in chosen:  # the decode kernel on one thread
        with Engine(max_total_tokens=65536, num_threads=args.threads, cpu_decode_threads=1) as eng1:
            results["sgl-1t"] = run_sgl(eng1, job)
    del eng
    gc.collect()
    if "transformers" in chosen:
        hf_n = args.hf_requests or args.requests
        hf_job = {**job, "shared_prompts": job["shared_prompts"][:hf_n]}
        r = run_transformers(hf_dir, hf_job, args.hf_batch)
        if hf_n < args.requests:
            r["shared_seconds"] *= args.requests / hf_n
            r["notes"] += f"; timed on {hf_n} requests and scaled to {args.requests}"
        results["transformers"] = r
    for name in ("llamacpp", "vllm"):
        if name in chosen:
            results[name] = run_peer(name, str(gguf) if name == "llamacpp" else str(hf_dir), job, args.peer_timeout)

    t = args.prefill_tokens
    short_ctx = len(job["decode_prompt"]) + args.decode_tokens / 2
    long_ctx = args.long_context + args.decode_tokens / 2
    stream_ctx = sum(map(len, job["stream_prompts"])) / args.streams + args.stream_tokens / 2
    pre_bound = prefill_bound_tok_s(host, shape, t)
    ref = results.get("sgl", {}).get("shared_outputs")
    rows_a, rows_b, rows_c, rows_k = [], [], [], []
    for name in chosen:
        r = results[name]
        if "status" in r:
            for rows in (rows_a, rows_b, rows_c):
                rows.append({"system": LABEL[name], "status": r["status"]})
            continue
        wb = weight_bytes[name]
        dec_bound = decode_bound_tok_s(host, shape, wb, 1, short_ctx)
        rows_a.append({"system": LABEL[name], "status": "ok", "weights_MB": wb / 1e6,
                       "decode_tok/s": r["decode_tok_s"], "decode_bound": dec_bound,
                       "decode_%bound": 100 * r["decode_tok_s"] / dec_bound,
                       "prefill_tok/s": r["prefill_tok_s"], "prefill_bound": pre_bound,
                       "prefill_%bound": 100 * r["prefill_tok_s"] / pre_bound})
        sgl_secs = results.get("sgl", {}).get("shared_seconds")
        same = None if ref is None else sum(a == b for a, b in zip(ref, r["shared_outputs"]))
        n_out = len(r["shared_outputs"])
        rows_b.append({"system": LABEL[name], "status": "ok", "seconds": r["shared_seconds"],
                       "req/s": args.requests / r["shared_seconds"],
                       "out_tok/s": args.requests * args.new_tokens / r["shared_seconds"],
                       "time_vs_sgl": r["shared_seconds"] / sgl_secs if sgl_secs else "",
                       "cached_tokens": "n/a" if r["cached_tokens"] is None else r["cached_tokens"],
                       "same_tokens_as_sgl": "" if same is None else f"{same}/{n_out}",
                       "notes": r["notes"]})
        long_bound = decode_bound_tok_s(host, shape, wb, 1, long_ctx)
        st_bound = decode_bound_tok_s(host, shape, wb, args.streams, stream_ctx)
        ld, st = r.get("long_decode_tok_s"), r.get("streams_tok_s")
        rows_c.append({"system": LABEL[name], "status": "ok",
                       "long_decode_tok/s": "n/a" if ld is None else ld, "long_bound": long_bound,
                       "long_%bound": "" if ld is None else 100 * ld / long_bound,
                       "streams_tok/s": "n/a" if st is None else st, "streams_bound": st_bound,
                       "streams_%bound": "" if st is None else 100 * st / st_bound})
        rows_k.append({"system": LABEL[name], "version": r.get("version", ""), "kernels": r.get("kernels", "")})
    n_prefix = len(os.path.commonprefix(job["shared_prompts"]))
    load_after = os.getloadavg()
    print(f"host: {cpu_model()}; {os.cpu_count()} CPUs, {args.threads} threads per system, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (other processes share the CPUs); "
          f"copy bandwidth {host.bandwidth_gbs:.1f} GB/s, matmul bf16 {host.bf16_tflops:.3f} / fp32 "
          f"{host.fp32_tflops:.3f} / int8 over GGUF blocks {host.int8_tflops:.3f} TFLOP/s; "
          f"{shape.params / 1e6:.1f}M params, "
          f"KV {shape.kv_bytes_per_token() / 1e3:.1f} kB/token")
    print_table(f"(a) single stream: decode ({args.decode_tokens} tokens) vs bandwidth bound, "
                f"prefill ({t} tokens) vs compute bound", rows_a)
    print_table(f"(b) {args.requests} requests, shared {n_prefix}-token prefix, {args.new_tokens} new tokens "
                "(time_vs_sgl > 1: slower than sgl)", rows_b)
    print_table(f"(c) decode at {args.long_context} tokens of context; {args.streams} streams x "
                f"{args.stream_tokens} new tokens (aggregate)", rows_c)
    rows_t = target_rows(results)
    print_table("(d) targets: sgl over the best peer measured", rows_t)
    print_table("kernels that ran", rows_k)
    for r in results.values():
        r.pop("shared_outputs", None)
    write_json("bench_peers.json", {
        "threads": args.threads, "loadavg_before": load_before, "loadavg_after": load_after,
        "bandwidth_gbs": host.bandwidth_gbs, "bf16_tflops": host.bf16_tflops, "fp32_tflops": host.fp32_tflops,
        "int8_tflops": host.int8_tflops,
        "params": shape.params, "prefill_flops": prefill_flops(shape, t),
        "job": {k: v for k, v in vars(args).items()}, "single_stream": rows_a, "shared_prefix": rows_b,
        "long": rows_c, "targets": rows_t, "kernels": rows_k, "raw": results})


if __name__ == "__main__":
    main()
