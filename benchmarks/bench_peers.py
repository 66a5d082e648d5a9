"""Peer benchmark (issue 6 point 4): sgl vs transformers vs llama.cpp vs vLLM-CPU, one run.

(a) single-stream decode tok/s against the memory-bandwidth bound (weight bytes / measured
    copy bandwidth), and prefill tok/s at 1,024 tokens against the compute bound
    (matmul + causal-attention FLOPs per token / measured bf16 FLOP/s);
(b) 64 requests sharing a ~600-token few-shot prefix (bench_engine's workload), 16 new
    greedy tokens each, with how many requests produced exactly sgl's tokens.

Every system gets the same token ids (tokenized once by our tokenizer). transformers runs
in this process on `eng.hf_dir` (bf16); llama.cpp (llama-cpp-python on the same GGUF,
Q4_1) and vLLM-CPU (bf16 on `eng.hf_dir`, prefix caching on) run in their own venvs under
benchmarks/.peers/ through benchmarks/peer_worker.py; install them with
benchmarks/setup_peers.sh. A peer without a venv is a "not installed" row; a peer that
crashes is a "failed: ..." row. Decode tok/s everywhere is (t(N+1 tokens) - t(1 token)) / N
on a short prompt, so it excludes prefill and start-up. Every system gets --threads compute
threads (default: all CPUs); the load average is recorded, because on a shared machine
other processes' load distorts every number.

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
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_engine import FEWSHOT, shared_prefix_prompts  # noqa: E402
from common import measure_bandwidth_gbs, measure_bf16_tflops, print_table, timed, write_json  # noqa: E402

from sgl.runtime.engine import Engine  # noqa: E402

PEERS_DIR = HERE / ".peers"
PEER_VENVS = {"llamacpp": ("llamacpp-venv", "llama_cpp"), "vllm": ("vllm-venv", "vllm")}
ALL = ("sgl", "sgl-1t", "transformers", "llamacpp", "vllm")


def build_job(eng: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The token ids every system runs on."""
    tok = eng.tokenizer
    base: list[int] = []
    while len(base) < args.prefill_tokens:
        base += tok.encode(FEWSHOT + "\n")
    base = base[: args.prefill_tokens]
    # A different first token per repetition, so no prefix cache can serve a timed prefill.
    prefill = [[tok.encode(f" {r}")[0]] + base[1:] for r in range(args.prefill_reps)]
    return {
        "threads": args.threads,
        "decode_prompt": tok.encode("Story 0: once upon a time there was a"),
        "decode_tokens": args.decode_tokens,
        "prefill_prompts": prefill,
        "shared_prompts": [tok.encode(p) for p in shared_prefix_prompts(args.requests)],
        "new_tokens": args.new_tokens,
    }


def _best(fn: Any, reps: int) -> float:
    return min(timed(fn)[0] for _ in range(reps))


def run_sgl(eng: Engine, job: dict) -> dict[str, Any]:
    def gen(ids: Any, k: int) -> Any:
        eng.flush_cache()  # every timing starts from an empty radix tree
        return eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": k, "ignore_eos": True})

    dp, dk = job["decode_prompt"], job["decode_tokens"]
    gen(dp, 2)
    decode = dk / (_best(lambda: gen(dp, dk + 1), 2) - _best(lambda: gen(dp, 1), 2))
    prompts = iter(job["prefill_prompts"])
    prefill = len(job["prefill_prompts"][0]) / _best(lambda: gen(next(prompts), 1), len(job["prefill_prompts"]))
    eng.flush_cache()
    sp = {"temperature": 0, "max_new_tokens": job["new_tokens"], "ignore_eos": True}
    secs, outs = timed(lambda: eng.generate(input_ids=job["shared_prompts"], sampling_params=sp))
    return {"version": "this repo", "decode_tok_s": decode, "prefill_tok_s": prefill, "shared_seconds": secs,
            "shared_outputs": [o["output_ids"] for o in outs],
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "notes": "all requests at once; radix cache"}


def run_transformers(hf_dir: Path, job: dict, batch: int) -> dict[str, Any]:
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def gen(rows: list[list[int]], k: int) -> torch.Tensor:
        # Left-pad so every row's last prompt token sits at the same position.
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                             pad_token_id=pad)
        return out[:, width:]

    with torch.inference_mode():
        dp, dk = job["decode_prompt"], job["decode_tokens"]
        gen([dp], 2)
        decode = dk / (_best(lambda: gen([dp], dk + 1), 2) - _best(lambda: gen([dp], 1), 2))
        prompts = iter(job["prefill_prompts"])
        # A bare forward (no generate loop), last position's logits only, like a serving prefill.
        t_pre = _best(lambda: model(torch.tensor([next(prompts)]), logits_to_keep=1), len(job["prefill_prompts"]))
        prefill = len(job["prefill_prompts"][0]) / t_pre
        shared = job["shared_prompts"]
        t0 = time.perf_counter()
        outs: list[list[int]] = []
        for i in range(0, len(shared), batch):
            outs += gen(shared[i : i + batch], job["new_tokens"]).tolist()
        secs = time.perf_counter() - t0
    del model
    gc.collect()
    return {"version": transformers.__version__, "decode_tok_s": decode, "prefill_tok_s": prefill,
            "shared_seconds": secs, "shared_outputs": outs, "cached_tokens": 0,
            "notes": f"HF generate, left-padded batches of {batch}, no prefix sharing"}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(ALL), help="comma-separated subset of " + ",".join(ALL))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers generate batch size")
    ap.add_argument("--hf-requests", type=int, default=0,
                    help="time transformers on only this many shared-prefix requests and scale (0: all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="compute threads for every system (torch, llama.cpp n_threads, vLLM's OMP binding)")
    ap.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds per subprocess peer")
    args = ap.parse_args()
    chosen = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(chosen) - set(ALL)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}")

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    bw, tflops = measure_bandwidth_gbs(), measure_bf16_tflops()
    eng = Engine(max_total_tokens=65536, num_threads=args.threads)
    c = eng.model_config
    bf16_bytes = sum(eng.get_server_info()["weight_bytes_per_rank"])
    params = bf16_bytes // 2
    embed = c.vocab_size * c.hidden_size
    job = build_job(eng, args)
    t = args.prefill_tokens
    # Per prefill: every non-embedding weight in a matmul per token (2 FLOPs per MAC) plus
    # causal attention (QK^T and PV over ~t/2 keys on average), all 30 layers.
    prefill_flops = 2 * (params - embed) * t + 2 * 2 * c.num_layers * c.num_heads * c.head_dim * t * t / 2
    prefill_bound = t / (prefill_flops / (tflops * 1e12))
    gguf = Path(eng.model_path)
    weight_bytes = {"sgl": bf16_bytes, "sgl-1t": bf16_bytes, "transformers": bf16_bytes, "vllm": bf16_bytes,
                    "llamacpp": gguf.stat().st_size if gguf.suffix == ".gguf" else bf16_bytes}

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

    ref = results.get("sgl", {}).get("shared_outputs")
    label = {"sgl": "sgl", "sgl-1t": "sgl --cpu-decode-threads 1", "transformers": "transformers",
             "llamacpp": "llama.cpp (Q4_1 GGUF)", "vllm": "vLLM-CPU"}
    rows_a, rows_b = [], []
    for name in chosen:
        r = results[name]
        if "status" in r:
            rows_a.append({"system": label[name], "status": r["status"]})
            rows_b.append({"system": label[name], "status": r["status"]})
            continue
        dec_bound = bw * 1e9 / weight_bytes[name]
        rows_a.append({"system": label[name], "status": "ok", "weights_MB": weight_bytes[name] / 1e6,
                       "decode_tok/s": r["decode_tok_s"], "decode_bound": dec_bound,
                       "decode_%bound": 100 * r["decode_tok_s"] / dec_bound,
                       "prefill_tok/s": r["prefill_tok_s"], "prefill_bound": prefill_bound,
                       "prefill_%bound": 100 * r["prefill_tok_s"] / prefill_bound})
        sgl_secs = results.get("sgl", {}).get("shared_seconds")
        same = None if ref is None else sum(a == b for a, b in zip(ref, r["shared_outputs"]))
        n_out = len(r["shared_outputs"])
        rows_b.append({"system": label[name], "status": "ok", "seconds": r["shared_seconds"],
                       "req/s": args.requests / r["shared_seconds"],
                       "out_tok/s": args.requests * args.new_tokens / r["shared_seconds"],
                       "time_vs_sgl": r["shared_seconds"] / sgl_secs if sgl_secs else "",
                       "cached_tokens": "n/a" if r["cached_tokens"] is None else r["cached_tokens"],
                       "same_tokens_as_sgl": "" if same is None else f"{same}/{n_out}",
                       "notes": r["notes"]})
    n_prefix = len(os.path.commonprefix(job["shared_prompts"]))
    load_after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, {args.threads} threads per system, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (other processes share the CPUs); copy bandwidth {bw:.1f} GB/s, bf16 matmul {tflops:.3f} TFLOP/s; "
          f"{params / 1e6:.1f}M params")
    print_table(f"(a) single stream: decode ({args.decode_tokens} tokens) vs bandwidth bound, "
                f"prefill ({t} tokens) vs bf16 compute bound", rows_a)
    print_table(f"(b) {args.requests} requests, shared {n_prefix}-token prefix, {args.new_tokens} new tokens "
                "(time_vs_sgl > 1: slower than sgl)", rows_b)
    for r in results.values():
        r.pop("shared_outputs", None)
    write_json("bench_peers.json", {
        "threads": args.threads, "loadavg_before": load_before, "loadavg_after": load_after,
        "bandwidth_gbs": bw, "bf16_tflops": tflops, "params": params, "prefill_flops": prefill_flops,
        "job": {k: v for k, v in vars(args).items()}, "single_stream": rows_a, "shared_prefix": rows_b,
        "raw": results})


if __name__ == "__main__":
    main()
