"""Peer-engine worker for bench_peers.py: runs inside a peer's own venv, not ours.

`python peer_worker.py {llamacpp|vllm} JOB.json` loads one peer engine, runs the three
measurements bench_peers.py asks for on the token ids in JOB.json (so every system sees
the exact same prompts), and prints one line `RESULT <json>` on stdout. It imports
nothing from sgl and nothing outside the standard library besides the peer itself,
because the peer venvs do not have our package.

JOB.json: {"model": path, "threads": int, "decode_prompt": [ids], "decode_tokens": int,
           "prefill_prompts": [[ids]...], "shared_prompts": [[ids]...], "new_tokens": int,
           "long_prompt": [ids], "long_decode_tokens": int,
           "stream_prompts": [[ids]...], "stream_tokens": int}
RESULT:   {"version", "decode_tok_s", "prefill_tok_s", "shared_seconds", "shared_outputs",
           "cached_tokens" (or null when the peer does not report it), "long_decode_tok_s",
           "streams_tok_s", "kernels", "notes"}

Decode at long context is timed like short decode, (t(N+1) - t(1)) / N, but with the long
prompt's KV kept from a warm-up (each peer's own prefix reuse), so no timing pays its prefill.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable


def _best(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_llamacpp(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    n = job["threads"]
    n_ctx = max(2048, len(job["long_prompt"]) + job["long_decode_tokens"] + 8,
                max(map(len, job["stream_prompts"])) + job["stream_tokens"] + 8)
    llm = Llama(model_path=job["model"], n_ctx=n_ctx, n_batch=1024, n_ubatch=1024, n_threads=n,
                n_threads_batch=n, verbose=False)

    def gen(ids: list[int], k: int) -> list[int]:
        # Llama.generate keeps the previous prompt's KV and only evaluates the part of the
        # new prompt after the longest common prefix: llama.cpp's single-sequence prefix reuse.
        out = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(tok)
            if len(out) == k:
                break
        return out

    def fresh(ids: list[int], k: int) -> list[int]:
        llm.reset()  # forget the previous sequence: no prefix reuse inside a timing
        return gen(ids, k)

    dp, dk = job["decode_prompt"], job["decode_tokens"]
    fresh(dp, 2)  # warm-up
    t_long = _best(lambda: fresh(dp, dk + 1), 2)
    t_short = _best(lambda: fresh(dp, 1), 2)
    decode = dk / max(t_long - t_short, 1e-9)

    prompts = job["prefill_prompts"]
    it = iter(prompts)
    t_pre = _best(lambda: (llm.reset(), llm.eval(next(it))), len(prompts))
    prefill = len(prompts[0]) / t_pre

    llm.reset()
    shared = job["shared_prompts"]
    t0 = time.perf_counter()
    outs = [gen(p, job["new_tokens"]) for p in shared]
    secs = time.perf_counter() - t0

    lp, lk = job["long_prompt"], job["long_decode_tokens"]
    fresh(lp, 2)  # the long prompt's KV stays; later calls re-evaluate only its last token
    long_decode = lk / max(_best(lambda: gen(lp, lk + 1), 2) - _best(lambda: gen(lp, 1), 2), 1e-9)

    t0 = time.perf_counter()
    for p in job["stream_prompts"]:  # the high-level API runs one sequence at a time
        fresh(p, job["stream_tokens"])
    streams = len(job["stream_prompts"]) * job["stream_tokens"] / (time.perf_counter() - t0)
    return {"version": llama_cpp.__version__, "decode_tok_s": decode, "prefill_tok_s": prefill,
            "shared_seconds": secs, "shared_outputs": outs, "cached_tokens": None,
            "long_decode_tok_s": long_decode, "streams_tok_s": streams,
            "kernels": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "notes": "one request at a time; llama.cpp reuses the previous prompt's common prefix"}


def run_vllm(job: dict) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    max_len = max(2048, len(job["long_prompt"]) + job["long_decode_tokens"] + 8,
                  max(map(len, job["stream_prompts"])) + job["stream_tokens"] + 8)
    llm = LLM(model=job["model"], dtype="bfloat16", enable_prefix_caching=True, max_model_len=max_len,
              max_num_seqs=64, seed=0)

    def gen(prompts: list[list[int]], k: int) -> list[Any]:
        sp = SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    def reset() -> None:
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()

    dp, dk = job["decode_prompt"], job["decode_tokens"]
    gen([dp], 2)
    reset()
    t_long = _best(lambda: (reset(), gen([dp], dk + 1)), 2)
    t_short = _best(lambda: (reset(), gen([dp], 1)), 2)
    decode = dk / max(t_long - t_short, 1e-9)

    prompts = job["prefill_prompts"]
    it = iter(prompts)
    t_pre = _best(lambda: (reset(), gen([next(it)], 1)), len(prompts))
    prefill = len(prompts[0]) / t_pre

    reset()
    t0 = time.perf_counter()
    res = gen(job["shared_prompts"], job["new_tokens"])
    secs = time.perf_counter() - t0
    cached = [getattr(r, "num_cached_tokens", None) for r in res]

    lp, lk = job["long_prompt"], job["long_decode_tokens"]
    gen([lp], 2)  # prefix caching keeps the long prompt's full blocks
    long_decode = lk / max(_best(lambda: gen([lp], lk + 1), 2) - _best(lambda: gen([lp], 1), 2), 1e-9)

    t0 = time.perf_counter()
    gen(job["stream_prompts"], job["stream_tokens"])
    streams = len(job["stream_prompts"]) * job["stream_tokens"] / (time.perf_counter() - t0)
    return {"version": vllm.__version__, "decode_tok_s": decode, "prefill_tok_s": prefill,
            "shared_seconds": secs, "shared_outputs": [list(r.outputs[0].token_ids) for r in res],
            "cached_tokens": None if None in cached else sum(cached),
            "long_decode_tok_s": long_decode, "streams_tok_s": streams, "kernels": "vLLM CPU backend, bf16",
            "notes": "all requests submitted at once; automatic prefix caching on"}


def main() -> None:
    peer, job_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    runner = {"llamacpp": run_llamacpp, "vllm": run_vllm}[peer]
    result = runner(job)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
