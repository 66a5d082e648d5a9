"""Engine configuration: one frozen dataclass, each field with help text.

The CLI flags (SGLang's names: `--model-path`, `--max-total-tokens`, ...) and the `SGL_*`
environment variables are generated from the fields, so a new option is added once.
Precedence: explicit argument > CLI flag > environment variable > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = _f(None, "GGUF file or Hugging Face folder; default: the embedded SmolLM2-135M-Instruct")
    dtype: str = _f("auto", "weights/activations dtype: auto (bfloat16 on CPU), bfloat16, float32",
                    ("auto", "bfloat16", "float32"))
    device: str = _f("auto", "cpu, cuda or auto")
    cache_dir: str | None = _f(None, "where converted weights and compiled grammars are cached (default ~/.cache/sgl)")
    max_total_tokens: int | None = _f(None, "KV pool size in tokens (default: from mem_fraction of RAM, capped at 131072)")
    mem_fraction: float = _f(0.08, "fraction of total memory for the KV pool when max_total_tokens is unset")
    max_running_requests: int = _f(256, "most requests decoding at once")
    context_length: int | None = _f(None, "longest prompt + output (default: the model's)")
    chunked_prefill_size: int = _f(2048, "most prompt tokens computed in one step; longer prompts are chunked")
    max_prefill_tokens: int = _f(8192, "most tokens (prompts) admitted into one prefill batch")
    schedule_policy: str = _f("lpm", "waiting-queue order: lpm (longest cached prefix), fcfs, dfs-weight",
                              SCHEDULE_POLICIES)
    disable_radix_cache: bool = _f(False, "do not share KV between requests (for comparison)")
    attention_backend: str | None = _f(None, "cpu, torch or triton (default: triton on CUDA, else cpu where its C kernel applies)")
    disable_jump_forward: bool = _f(False, "sample forced grammar strings token by token (for comparison)")
    enable_mixed_chunk: bool = _f(False, "run running requests' decode steps inside prefill batches "
                                         "(no pause while long prompts are prefilled)")
    random_seed: int = _f(0, "seed for requests without their own seed")
    grammar_compile_timeout: float = _f(30.0, "seconds before a grammar compile aborts its request")
    num_threads: int | None = _f(None, "torch CPU threads (default: all cores)")
    disable_cpu_decode_kernel: bool = _f(False, "run small bf16 CPU decode batches through torch ops instead of "
                                                "the C decode kernel (for comparison)")
    disable_packed_linears: bool = _f(False, "keep small-batch CPU matmuls on the plain weight layout instead of "
                                             "oneDNN's prepacked one (used only where verified bit-identical)")
    cpu_decode_threads: int | None = _f(None, "threads of the C decode kernel, 1 or 2 (default: 2 when torch has 2+; "
                                              "use 1 on a machine other busy processes share)")

    def resolved(self) -> "EngineConfig":
        """Validate and return a new config (explicit values are kept)."""
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.cpu_decode_threads not in (None, 1, 2):
            raise ValueError(f"cpu_decode_threads must be 1 or 2, got {self.cpu_decode_threads}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("max_total_tokens must be >= 16")
        return self

    @staticmethod
    def from_kwargs(**kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        env = env_overrides()
        env.update({k: v for k, v in kwargs.items()})
        return EngineConfig(**env).resolved()


_TRUE = ("1", "true", "yes", "on")


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean SGL_* switch read at use time: 1/true/yes/on are true, other values
    false, unset or empty is `default`."""
    raw = os.environ.get(name, "")
    return default if raw == "" else raw.lower() in _TRUE


def _parse(f: dataclasses.Field, raw: str) -> Any:
    t = str(f.type)
    if "bool" in t:
        return raw.lower() in _TRUE
    if "int" in t:
        return int(raw)
    if "float" in t:
        return float(raw)
    return raw


def env_overrides() -> dict[str, Any]:
    """SGL_<FIELD> variables, e.g. SGL_MAX_TOTAL_TOKENS=4096 (SGL_CACHE_DIR is read by the loader too)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        raw = os.environ.get("SGL_" + f.name.upper())
        if raw is not None and raw != "":
            out[f.name] = _parse(f, raw)
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        if "bool" in str(f.type):
            parser.add_argument(flag, action="store_true", default=None, help=meta["help"])
        else:
            parser.add_argument(flag, type=lambda s, f=f: _parse(f, s), default=None,
                                choices=meta.get("choices"), help=meta["help"])


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
             if getattr(args, f.name, None) is not None}
    return EngineConfig.from_kwargs(**given)
