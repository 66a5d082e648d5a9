"""Detokenization cost per token on the scheduler's hot path (issue #11, point 6).

One stream of 4,000 tokens (prose with some emoji, the embedded model's tokenizer) with a
stop string set that never matches, fed token by token through the scheduler's
`OutputProcessor.append_token` (detokenize + stop-string check). We time each call and
compare the mean over the last 500 tokens with the first 500: decoding all output ids
again grows linearly with the output, incremental decoding stays flat.
Mode "stream" also times `make_output` per token (a stream output carries the whole
cumulative text, so it copies O(n) characters per token by design, but decodes O(1)).

Side by side in one run: `--before DIR` measures the same stream with the `sgl` of
another checkout (e.g. `git worktree add /tmp/before 2fba443`) in a subprocess.

Run: .venv/bin/python benchmarks/bench_detok.py [--before /tmp/before] [--tokens 4000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STOP = "<<never printed>>"
TEXT = ("The scheduler appends one token per request per step, and streaming clients want the text "
        "so far after each of them. Déjà vu: naïve façades cost O(n²) 😀👍🏽 — 日本語のテキストも少し。 ")


def measure(tree: Path, num_tokens: int, window: int) -> dict[str, dict[str, Any]]:
    """Per-token seconds for one stream per mode, with `sgl` imported from `tree`."""
    sys.path.insert(0, str(tree))
    from sgl.runtime.models.loader import embedded_gguf_path, ensure_hf_from_gguf
    from sgl.runtime.models.tokenizer import load_tokenizer
    try:
        from sgl.runtime.sampling_params import SamplingParams
    except ImportError:  # a tree from before the sampling schema moved (the "before" run)
        from sgl.runtime.request import SamplingParams  # type: ignore[no-redef]
    from sgl.runtime.scheduler.output import OutputProcessor
    from sgl.runtime.scheduler.req import Req

    tok = load_tokenizer(ensure_hf_from_gguf(embedded_gguf_path()))
    ids = (tok.encode(TEXT, add_special_tokens=False) * num_tokens)[:num_tokens]
    full = tok.decode(ids)
    out = OutputProcessor(tok, {tok.eos_token_id}, enable_jump_forward=False)
    params = SamplingParams.from_dict({"max_new_tokens": num_tokens, "stop": [STOP], "ignore_eos": True})
    runs: dict[str, dict[str, Any]] = {}
    for mode in ("stop", "stream"):
        req = Req(rid=mode, input_ids=[1], params=params, stream=mode == "stream")
        per_token: list[float] = []
        for t in ids:
            t0 = time.perf_counter()
            out.append_token(req, t, None, None)
            if req.stream and not req.finished:
                out.make_output(req)
            per_token.append(time.perf_counter() - t0)
        assert req.finish_reason == {"type": "length", "length": num_tokens}, req.finish_reason
        assert out.make_output(req).text == full, "the detokenized text differs from a full decode"
        first = sum(per_token[:window]) / window
        last = sum(per_token[-window:]) / window
        runs[mode] = {"sgl": str(Path(sys.modules["sgl"].__file__).parent), "chars": len(full),
                      "first_us_per_token": first * 1e6, "last_us_per_token": last * 1e6,
                      "last_over_first": last / first, "total_s": sum(per_token)}
    return runs


def cpu_model() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")), "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--window", type=int, default=500, help="tokens averaged at the start and at the end")
    ap.add_argument("--before", type=Path, help="another checkout to measure the same way (subprocess)")
    ap.add_argument("--measure-only", type=Path, help=argparse.SUPPRESS)  # subprocess mode: print JSON
    args = ap.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.measure_only, args.tokens, args.window)))
        return

    print(f"CPU: {cpu_model()}")
    runs: dict[str, dict[str, Any]] = {}
    if args.before:
        proc = subprocess.run([sys.executable, __file__, "--measure-only", str(args.before.resolve()),
                               "--tokens", str(args.tokens), "--window", str(args.window)],
                              capture_output=True, text=True, check=True)
        runs["before"] = json.loads(proc.stdout.strip().splitlines()[-1])
    runs["after"] = measure(ROOT, args.tokens, args.window)

    sys.path.insert(0, str(HERE))
    from common import print_table, write_json

    rows = [{"code": code, "mode": mode, f"first {args.window} (us/tok)": r["first_us_per_token"],
             f"last {args.window} (us/tok)": r["last_us_per_token"], "last/first": r["last_over_first"],
             "total (s)": r["total_s"]}
            for mode in ("stop", "stream") for code, run in runs.items() for r in [run[mode]]]
    print_table(f"scheduler text processing per token, one {args.tokens}-token stream with a stop string", rows)
    if "before" in runs:
        for mode in ("stop", "stream"):
            b, a = runs["before"][mode]["total_s"], runs["after"][mode]["total_s"]
            print(f"{mode}: total before {b:.3f} s, after {a:.3f} s ({b / a:.1f}x less)")
    write_json("bench_detok.json", {"cpu_model": cpu_model(), "tokens": args.tokens, "window": args.window,
                                    "stop": STOP, "runs": runs})


if __name__ == "__main__":
    main()
