"""Decide the CPU paths of one worker: explicit flags first, then this host's cached
measurements, then new measurements (tuning/measure.py) of whatever is still open.

    flag given ──► that value (nothing timed)
    else cached for this CPU + flags, kernel build, torch, model shapes, threads ──► reuse
    else time the candidates on the model's real shapes ──► cache (merged) ──► use
                                        (not cached where other processes were busy meanwhile)

Only a bf16 model on the CPU without tensor parallelism is measured; anything else gets
the flags or today's defaults. The order matters: the linear path is applied to the
model (fp32 copies of the projections) before the C decode step's row limit is timed
against the model's torch forward, which runs on that path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from sgl.runtime.config import EngineConfig, cache_dir
from sgl.runtime.tuning import cache as tcache
from sgl.runtime.tuning import host_load, measure
from sgl.runtime.tuning.choice import PathChoice

log = logging.getLogger("sgl.tuning")

ROW_CANDIDATES = (8, 16, 32)  # C decode step row limits tried (within the build's limit)
# Another candidate must beat the default (the first) by this share: a 3-repeat median
# moves by a few percent between starts, and picks that flip on noise make one host's
# runs incomparable for no gain.
MARGIN = 0.05
FP32_CHECKS = "fp32_linear_checks"  # cache item: weight shape -> rows the fp32 path pads to (0: unusable)


def choose_paths(cfg: EngineConfig, model: Any, device: str, tp_size: int = 1, timers: Any = measure,
                 cpuinfo: str | None = None,
                 load: Callable[[], host_load.CpuTimes | None] = host_load.sample) -> PathChoice:
    """The paths for `model` on this host (see the module docstring). `timers` is the
    measuring module (tests wrap it to count calls); `cpuinfo` replaces /proc/cpuinfo;
    `load` samples the host's CPU time around the timings (tuning/host_load.py)."""
    from sgl.runtime.attention.registry import resolve_backend_name
    from sgl.runtime.kernels.cpu import binding, build_key
    from sgl.runtime.kernels.cpu.decode import MAX_ROWS, default_threads, row_limit

    kernels = binding.kernels() if device == "cpu" else None
    c_step = kernels is not None and not cfg.disable_cpu_decode_kernel and model.dtype == torch.bfloat16
    limit = row_limit(kernels) if kernels is not None else MAX_ROWS
    rows_flag = cfg.decode_max_rows()
    if rows_flag is not None and c_step and rows_flag > limit:
        raise ValueError(f"--cpu-decode-max-rows {rows_flag}: this build of the C decode kernel takes at most "
                         f"{limit} rows on this CPU")
    attn_flag = None if cfg.attention_backend in (None, "auto") else cfg.attention_backend
    linear_flag = None if cfg.cpu_linear == "auto" else cfg.cpu_linear
    picks: dict[str, Any] = {"attention_backend": attn_flag, "linear": linear_flag,
                             "decode_threads": cfg.cpu_decode_threads, "decode_max_rows": rows_flag}
    sources = {k: "flag" for k, v in picks.items() if v is not None}
    short = model.config.max_position_embeddings < measure.CONTEXT + measure.PREFILL_ROWS
    if model.dtype != torch.bfloat16 or device != "cpu" or tp_size > 1 or short:
        # Nothing to measure: a float32 model has one linear path and no C step; tensor-
        # parallel ranks must agree, and a GPU has its own kernels; the timings' positions
        # would run past a tiny model's RoPE table.
        bf16 = model.dtype == torch.bfloat16
        fallback = {"attention_backend": resolve_backend_name(None, device),
                    "linear": "bf16" if bf16 else str(model.dtype).replace("torch.", ""),
                    "decode_threads": default_threads(), "decode_max_rows": MAX_ROWS}
        if not bf16 and picks["linear"] is not None:
            log.warning("--cpu-linear %s applies to bf16 models only: this one is %s", picks["linear"],
                        fallback["linear"])
            picks["linear"] = None
        for k, v in fallback.items():
            if picks[k] is None:
                picks[k], sources[k] = v, "default"
        picks["linear"] = _apply_linear_value(model, picks["linear"])
        return PathChoice(**picks, sources=sources)

    parts = tcache.key_parts(tcache.cpu_identity(cpuinfo), build_key(), torch.__version__,
                             tcache.shape_signature(model.config, "bfloat16"), torch.get_num_threads())
    path = tcache.cache_path(Path(cache_dir(cfg.cache_dir)), parts)
    # One start at a time measures on a host (replicas starting together would time each
    # other, find the host busy and cache nothing); the next reads what it cached.
    with tcache.exclusive(path):
        cached = tcache.read_items(path, parts)
        session = _Session(cached)
        before = load()

        if picks["attention_backend"] is None:
            names = ["torch"] + (["cpu"] if _c_attention_applies(model) else [])
            session.decide("attention_backend", "attention_backend", names,
                           lambda: timers.attention_backends(model, names), picks, sources)
        if picks["linear"] is None:
            tiles = _layer0_tiles(model, kernels)
            # A model with tiled GGUF blocks has a third candidate: its own cache item.
            session.decide("linear" if tiles is None else "linear[bf16,fp32,gguf]", "linear",
                           ["bf16"] + (["fp32"] if fp32_fits(model) else []) + ([] if tiles is None else ["gguf"]),
                           lambda: timers.linear_paths(model.layers[0], tiles=tiles), picks, sources)
        picks["linear"] = _apply_linear_value(model, picks["linear"], session)
        if picks["decode_threads"] is None:
            if not c_step:
                picks["decode_threads"], sources["decode_threads"] = default_threads(), "default"
            elif torch.get_num_threads() < 2:
                picks["decode_threads"], sources["decode_threads"] = 1, "only"
            else:
                default = default_threads()  # the first candidate: the one the margin keeps
                session.decide("decode_threads", "decode_threads",
                               [str(default)] + [t for t in ("1", "2") if t != str(default)],
                               lambda: timers.decode_threads(model, kernels), picks, sources, int)
        if picks["decode_max_rows"] is None:
            rows = [n for n in ROW_CANDIDATES if n <= limit]
            if not c_step or len(rows) < 2:
                picks["decode_max_rows"], sources["decode_max_rows"] = MAX_ROWS, "default" if not c_step else "only"
            else:
                # The answer depends on the torch path it is compared with: part of its cache name.
                name = (f"decode_max_rows[attention={picks['attention_backend']},linear={picks['linear']},"
                        f"threads={picks['decode_threads']}]")
                session.decide_rows(name, rows, lambda: timers.decode_rows(
                    model, kernels, picks["decode_threads"], picks["attention_backend"], rows[1:]), picks, sources)
        if session.measured:
            share = host_load.others_share(before, load())
            if share > host_load.BUSY_SHARE:
                log.warning("CPU paths: other processes used %.0f%% of the CPUs while they were timed; using the "
                            "picks for this start only (not cached: the next start measures again)", 100 * share)
                sources.update({k: "busy" for k, v in sources.items() if v == "measured"})
            else:
                tcache.write_items(path, parts, session.items)
    choice = PathChoice(**picks, sources=sources, timings_ms=session.timings)
    log.info("CPU paths: %s; timings (ms): %s", choice.describe(), session.timings or "none (cache or flags)")
    return choice


class _Session:
    """The cached items and what this start measures, merged for the cache file."""

    def __init__(self, cached: dict[str, dict[str, Any]]) -> None:
        self.items = dict(cached)
        self.timings: dict[str, dict[str, float]] = {}
        self.measured = False

    def _lookup(self, name: str, item: str, sources: dict[str, str]) -> Any:
        hit = self.items.get(name)
        if hit is None:
            return None
        sources[item] = "cache"
        self.timings[item] = dict(hit.get("timings_ms") or {})
        return hit["value"]

    def _store(self, name: str, item: str, value: Any, timings: dict[str, float], sources: dict[str, str]) -> None:
        self.items[name] = {"value": value, "timings_ms": timings}
        self.timings[item] = timings
        sources[item] = "measured"
        self.measured = True

    def decide(self, name: str, item: str, candidates: list[str], run: Any, picks: dict[str, Any],
               sources: dict[str, str], cast: Any = str) -> None:
        """The fastest candidate (one candidate: no timing)."""
        if len(candidates) == 1:
            picks[item], sources[item] = cast(candidates[0]), "only"
            return
        value = self._lookup(name, item, sources)
        if value is None or str(value) not in candidates:
            timings = self._run(item, run)
            if timings is None:  # the timing failed: the first candidate, today's default
                picks[item], sources[item] = cast(candidates[0]), "default"
                return
            value = fastest(candidates, timings)
            self._store(name, item, value, timings, sources)
        picks[item] = cast(value)

    @staticmethod
    def _run(item: str, run: Any) -> dict[str, float] | None:
        """The timings, or None where measuring failed (out of memory, a kernel refusing a
        shape): a start must not fail because a measurement did."""
        try:
            return {k: round(float(v), 3) for k, v in run().items()}
        except Exception:  # noqa: BLE001 - any failure means: keep the default
            log.warning("CPU paths: timing %s failed; using the default", item, exc_info=True)
            return None

    def decide_rows(self, name: str, rows: list[int], run: Any, picks: dict[str, Any],
                    sources: dict[str, str]) -> None:
        """The largest row count up to which the C step beat the torch forward at every
        measured count; the smallest candidate (today's default, where the C step is known
        to win) is not timed."""
        item = "decode_max_rows"
        value = self._lookup(name, item, sources)
        if not isinstance(value, int) or value not in rows:  # a cached count this build no longer takes
            timings = self._run(item, run)
            if timings is None:
                picks[item], sources[item] = rows[0], "default"
                return
            value = rows[0]
            for n in rows[1:]:
                c, t = timings.get(f"c@{n}"), timings.get(f"torch@{n}")
                if c is None or t is None or t < c:
                    break
                value = n
            self._store(name, item, value, timings, sources)
        picks[item] = value


def fastest(candidates: list[str], timings: dict[str, float]) -> str:
    """The fastest candidate, where it beats the first (the default) by more than MARGIN."""
    best = min(candidates, key=lambda k: timings.get(k, float("inf")))
    return best if timings.get(best, float("inf")) < (1 - MARGIN) * timings.get(candidates[0], float("inf")) \
        else candidates[0]


def _c_attention_applies(model: Any) -> bool:
    from sgl.runtime.attention import cpu_backend
    from sgl.runtime.memory.kv_pool import KVPool

    c = model.config
    probe = KVPool(2, 1, getattr(model, "num_local_kv_heads", c.num_kv_heads), c.head_dim, model.dtype, "cpu")
    return cpu_backend.kernel_supported(probe)


def _tile_threads() -> int:
    return 2 if torch.get_num_threads() >= 2 else 1


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def fp32_fits(model: Any) -> bool:
    """Whether the fp32 linear path's float32 copy of the weights (4 bytes a parameter, the
    bf16 ones staying for the C decode step) takes at most half the memory available now:
    faster is no use if the start is killed for memory (a 7B model adds 28 GB)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True  # unknown: the measurement decides, as before
    return 4 * _params(model) <= avail // 2


def _layer0_tiles(model: Any, kernels: Any) -> list | None:
    """Layer 0's four projections in tile form (kernels/cpu/qgemm.c), to time the gguf
    linear path; None where the build has no AVX512-VNNI or a projection no tiled blocks."""
    blocks = getattr(model, "gguf_blocks", None)
    if kernels is None or kernels.qgemm_simd() != 1 or blocks is None or not hasattr(model, "use_tile_linears"):
        return None
    forms = model.layers[0].tile_forms(blocks.layers[0], _tile_threads())
    return list(forms.values()) if len(forms) == 4 else None


def _apply_linear_value(model: Any, linear: str, session: _Session | None = None) -> str:
    """Switch the model's projections to fp32 GEMMs when `linear` is fp32, or to int8
    products over the GGUF blocks when it is gguf; the path in effect. The per-shape
    bit-stability checks (seconds for a big LM head) are kept in the session's cache file
    as item FP32_CHECKS."""
    if linear == "gguf":
        switched, total = model.use_tile_linears(_tile_threads()) if hasattr(model, "use_tile_linears") else (0, 0)
        if not switched:
            log.warning("--cpu-linear gguf needs a GGUF model loaded with --quantization gguf on the CPU (one rank) "
                        "with Q4_0/Q4_1/Q8_0/Q4_K matrices: staying on bf16 GEMMs")
            return "bf16"
        if switched < total:
            log.info("gguf linear path: %d of %d projections have tiled GGUF blocks; the others stay bf16",
                     switched, total)
        from sgl.runtime.kernels.cpu import binding

        k = binding.kernels()
        if k is None or k.qgemm_simd() != 1:  # only a flag gets here: measurement skips it
            log.warning("--cpu-linear gguf: this build has no AVX512-VNNI, so the int8 products run in plain C "
                        "(correct but slow); --cpu-linear auto measures the faster path")
        return "gguf"
    if linear != "fp32":
        return linear
    if not hasattr(model, "use_fp32_linears") or model.embed_tokens.device.type != "cpu":
        log.warning("--cpu-linear fp32 applies to bf16 models on the CPU only: ignored")
        return "bf16"
    if not fp32_fits(model):  # only a flag gets here: measurement leaves fp32 out
        log.warning("--cpu-linear fp32: the float32 copy of the weights (%.1f GB) is more than half of the "
                    "memory available now; the start may run out of memory", 4 * _params(model) / 1e9)
    hit = session.items.get(FP32_CHECKS) if session is not None else None
    verified = _checks_from_json(hit["value"]) if hit is not None else {}
    known = len(verified)
    switched, total = model.use_fp32_linears(verified)
    if session is not None and len(verified) > known:
        session.items[FP32_CHECKS] = {"value": _checks_to_json(verified)}
        session.measured = True
    if switched < total:
        log.warning("fp32 linear path: %d of %d weights verified bit-stable across row counts here; the others "
                    "stay on bf16 GEMMs", switched, total)
    return "fp32" if switched else "bf16"



def _checks_to_json(verified: dict[tuple, int]) -> dict[str, int]:
    return {json.dumps(list(k)): v for k, v in verified.items()}


def _checks_from_json(value: Any) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    try:
        for k, v in dict(value).items():
            kind, shape, bias = json.loads(k)
            out[(kind, tuple(shape), bool(bias))] = int(v)
    except (TypeError, ValueError):
        return {}  # an unusable entry: check again
    return out
