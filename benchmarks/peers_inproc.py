"""bench_peers' in-process systems: sgl (our Engine) and transformers, on the job's token ids.

Each runner returns the same result dict peer_worker.py prints for the subprocess peers
(decode_tok_s, prefill_tok_s, shared_seconds, shared_outputs, cached_tokens,
long_decode_tok_s, streams_tok_s, kernels, notes); a workload a system does not run is
None.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch
from common import timed

from sgl.runtime.engine import Engine
from sgl.runtime.kernels.cpu import binding

_SIMD = {0: "plain C", 1: "AVX512-BF16", 2: "AVX2+FMA"}


def _best(fn: Any, reps: int) -> float:
    return min(timed(fn)[0] for _ in range(reps))


def sgl_kernels(eng: Engine) -> str:
    """Which paths ran: the engine's own report plus the C decode step's vector level."""
    info = eng.get_server_info()
    k = binding.kernels()
    parts = [f"dtype {info.get('dtype')}", f"C decode step {_SIMD.get(k.decode_simd(), '?') if k else 'unavailable'}",
             f"{info.get('cpu_decode_steps', 0)} C decode steps"]
    if "quantization" in info:
        parts.append(f"quantization {info['quantization']}")
    paths = info.get("cpu_paths") or {}
    parts += [f"{item} {paths[item]} ({paths.get('sources', {}).get(item, '?')})"
              for item in ("attention_backend", "linear", "decode_threads", "decode_max_rows") if item in paths]
    return "; ".join(parts)


def run_sgl(eng: Engine, job: dict) -> dict[str, Any]:
    def gen(ids: Any, k: int, flush: bool = True) -> Any:
        if flush:
            eng.flush_cache()  # timing starts from an empty radix tree
        return eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": k, "ignore_eos": True})

    dp, dk = job["decode_prompt"], job["decode_tokens"]
    gen(dp, 2)
    decode = dk / (_best(lambda: gen(dp, dk + 1), 2) - _best(lambda: gen(dp, 1), 2))
    prompts = iter(job["prefill_prompts"])
    prefill = len(job["prefill_prompts"][0]) / _best(lambda: gen(next(prompts), 1), len(job["prefill_prompts"]))
    eng.flush_cache()
    sp = {"temperature": 0, "max_new_tokens": job["new_tokens"], "ignore_eos": True}
    secs, outs = timed(lambda: eng.generate(input_ids=job["shared_prompts"], sampling_params=sp))

    lp, lk = job["long_prompt"], job["long_decode_tokens"]
    gen(lp, 2)  # the radix tree keeps the long prompt: later timings pay one token of extend
    long_decode = lk / (_best(lambda: gen(lp, lk + 1, False), 2) - _best(lambda: gen(lp, 1, False), 2))

    eng.flush_cache()
    st = job["stream_tokens"]
    t_streams, _ = timed(lambda: eng.generate(
        input_ids=job["stream_prompts"], sampling_params={"temperature": 0, "max_new_tokens": st, "ignore_eos": True}))
    return {"version": "this repo", "decode_tok_s": decode, "prefill_tok_s": prefill, "shared_seconds": secs,
            "shared_outputs": [o["output_ids"] for o in outs],
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "long_decode_tok_s": long_decode, "streams_tok_s": len(job["stream_prompts"]) * st / t_streams,
            "kernels": sgl_kernels(eng), "notes": "all requests at once; radix cache"}


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
            "long_decode_tok_s": None, "streams_tok_s": None, "kernels": "torch eager, bf16",
            "notes": f"HF generate, left-padded batches of {batch}, no prefix sharing; long workloads not run"}
