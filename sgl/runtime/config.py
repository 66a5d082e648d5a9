"""Configuration: frozen dataclasses whose fields (each with help text) generate the CLI
flags and the `SGL_*` environment variables, so an option is declared once.

Two groups share a base. `EngineConfig` is what one `Engine` is built from (SGLang's
names: `--model-path`, `--max-total-tokens`, ...). `Settings` are process-wide switches
read by modules far from any Engine (the grammar compiler, the C kernel loaders) through
`settings()`. The fields of `SharedOptions` (the cache folder) belong to both: an
Engine's explicit value wins for that engine, the environment's elsewhere.
Precedence: explicit argument > CLI flag > environment variable > default.

    field `max_total_tokens` -> flag `--max-total-tokens` -> variable SGL_MAX_TOTAL_TOKENS

No other module reads `os.environ` for behaviour; `cache_dir()` is the one place the
cache folder is resolved.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgl.runtime.kv_events.config import parse_kv_events_config
from sgl.runtime.speculative.proposer import algorithm_name

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
QUANTIZATION_CHOICES = ("gguf", "none")


def _f(default: Any, help: str, choices: tuple[Any, ...] | None = None, env: str | None = None) -> Any:
    # `env` names a variable owned by another tool (TRITON_INTERPRET) instead of SGL_<FIELD>.
    return field(default=default, metadata={"help": help, "choices": choices, "env": env})


@dataclass(frozen=True)
class SharedOptions:
    """Options that are both Engine arguments and process-wide settings."""

    cache_dir: str | None = _f(None, "where converted weights, compiled grammars and built C kernels are cached "
                                     "(default ~/.cache/sgl)")

    def check_choices(self) -> None:
        """TypeError for a field of the wrong type, ValueError for one outside its declared
        choices (explicit arguments skip parsing, so `Engine(page_size="16")` lands here)."""
        types = _types(type(self))
        for f in dataclasses.fields(self):
            allowed, value = f.metadata.get("choices"), getattr(self, f.name)
            want = types[f.name]
            # bool is an int subclass and an int is a fine float; a bool is no number here.
            fits = (value is None or (isinstance(value, want) and not (want is not bool and isinstance(value, bool)))
                    or (want is float and isinstance(value, int) and not isinstance(value, bool)))
            if not fits:
                raise TypeError(f"{f.name} must be {_PY_EXPECTED.get(want, want.__name__)}; "
                                f"got {value!r} ({type(value).__name__})")
            if allowed and value is not None and value not in allowed:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclass(frozen=True)
class EngineConfig(SharedOptions):
    """What one Engine is built from (SGLang's option names)."""

    model_path: str | None = _f(None, "GGUF file or Hugging Face folder; default: the embedded SmolLM2-135M-Instruct")
    dtype: str = _f("auto", "weights/activations dtype: auto (bfloat16 on CPU), bfloat16, float32",
                    ("auto", "bfloat16", "float32"))
    device: str = _f("auto", "cpu, cuda or auto")
    quantization: str | None = _f(None, "weights of the C decode step: gguf (a GGUF file's quantized blocks, "
                                        "multiplied natively) or none (dequantized to --dtype, the reference "
                                        "path); default: gguf for a GGUF model, else none", QUANTIZATION_CHOICES)
    max_total_tokens: int | None = _f(None, "KV pool size in tokens (default: from mem_fraction of RAM, capped at 131072)")
    mem_fraction: float = _f(0.08, "fraction of total memory for the KV pool when max_total_tokens is unset")
    max_running_requests: int = _f(256, "most requests decoding at once")
    context_length: int | None = _f(None, "longest prompt + output (default: the model's)")
    chunked_prefill_size: int = _f(2048, "most prompt tokens computed in one step; longer prompts are chunked")
    max_prefill_tokens: int = _f(8192, "most tokens (prompts) admitted into one prefill batch")
    schedule_policy: str = _f("lpm", "waiting-queue order: lpm (longest cached prefix), fcfs, dfs-weight",
                              SCHEDULE_POLICIES)
    disable_radix_cache: bool = _f(False, "do not share KV between requests (for comparison)")
    attention_backend: str | None = _f(None, "cpu, torch or triton (default: triton on CUDA; on the CPU the faster of "
                                             "cpu (its C kernel, where it applies) and torch, measured at first start "
                                             "on this host and cached)")
    disable_jump_forward: bool = _f(False, "sample forced grammar strings token by token (for comparison)")
    disable_jump_forward_healing: bool = _f(False, "jump forward over the whole forced string, even where its last "
                                                   "token is one the model could extend (for comparison)")
    enable_mixed_chunk: bool = _f(False, "run running requests' decode steps inside prefill batches "
                                         "(no pause while long prompts are prefilled)")
    random_seed: int = _f(0, "seed for requests without their own seed")
    grammar_compile_timeout: float = _f(30.0, "seconds before a grammar compile aborts its request")
    num_threads: int | None = _f(None, "torch CPU threads (default: all cores)")
    disable_cpu_decode_kernel: bool = _f(False, "run small bf16 CPU decode batches through torch ops instead of "
                                                "the C decode kernel (for comparison)")
    cpu_decode_threads: int | None = _f(None, "threads of the C decode kernel, 1 or 2 (default: measured at first "
                                              "start and cached; use 1 on a machine other busy processes share)",
                                        (1, 2))
    cpu_decode_max_rows: str = _f("auto", "most rows (tokens) a step may have to run on the C decode kernel: auto "
                                          "(measured at first start against the torch path, and cached) or a "
                                          "number up to what the kernel build takes (8 with AVX512-BF16)")
    cpu_linear: str = _f("auto", "how bf16 CPU steps outside the C decode kernel run their matmuls: bf16 GEMMs on "
                                 "the bf16 weights, fp32 GEMMs on fp32 copies (rounded back to bf16; for CPUs "
                                 "without bf16 matmul hardware), gguf (int8 activations times the GGUF file's "
                                 "Q4_0/Q4_1/Q8_0/Q4_K blocks in AVX512-VNNI dot products; needs --quantization "
                                 "gguf), or auto (measured at first start, cached)",
                         ("auto", "bf16", "fp32", "gguf"))
    disable_packed_linears: bool = _f(False, "keep small-batch CPU matmuls on the plain weight layout instead of "
                                             "oneDNN's prepacked one (used only where verified bit-identical)")
    tp_size: int = _f(1, "tensor-parallel ranks (processes) the model is split over")
    nnodes: int = _f(1, "machines the tensor-parallel ranks span (node 0 serves HTTP; tp_size/nnodes ranks each)")
    node_rank: int = _f(0, "this machine's index among nnodes")
    dist_init_addr: str | None = _f(None, "HOST:PORT where the ranks meet (torch.distributed rendezvous; "
                                          "required when nnodes > 1, default a free loopback port)")
    dist_timeout: float = _f(300.0, "seconds a rank waits for the others to join, and for a collective")
    page_size: int = _f(16, "tokens per KV page: the block size of KV events and of the host and storage tiers")
    enable_hierarchical_cache: bool = _f(False, "keep KV evicted from the device pool in a host tier (and a storage "
                                                "tier) and load it back instead of recomputing")
    hicache_ratio: float = _f(2.0, "host tier size as a multiple of the device KV pool (when hicache_size is 0)")
    hicache_size: float = _f(0, "host tier size in GB (0: use hicache_ratio)")
    hicache_write_policy: str = _f("write_through", "when KV is copied to the host tier: write_through (when "
                                   "cached), write_through_selective (after 2 device hits), write_back (at eviction)",
                                   ("write_through", "write_through_selective", "write_back"))
    hicache_storage_backend: str | None = _f(None, "storage tier (L3) under the host tier: file or redis "
                                                   "(default: none)", ("file", "redis"))
    hicache_storage_backend_extra_config: str | None = _f(
        None, 'storage tier options as a JSON object: {"path": DIR} (file), {"url": "redis://HOST:PORT"} (redis), '
              '"max_bytes", and "prefetch_timeout" (seconds, for the timeout prefetch policy; default 1.0)')
    hicache_storage_prefetch_policy: str = _f("best_effort", "how long a request waits for its storage prefetch: "
                                              "best_effort (not at all), wait_complete, timeout",
                                              ("best_effort", "wait_complete", "timeout"))
    kv_events_config: str | None = _f(None, "publish KV cache events (vLLM's ZMQ/msgpack format) as this JSON "
                                            "object: publisher (zmq|null), endpoint (tcp://*:5557), replay_endpoint, "
                                            "topic (kv-events), enable_kv_cache_events, buffer_steps, hwm, "
                                            "max_queue_size")
    data_parallel_rank: int | None = _f(None, "this worker's index in a replica set: sent in every KV event batch, "
                                              "and added to the KV event ports (vLLM's rule)")
    disaggregation_mode: str = _f("null", "prefill/decode disaggregation: null (colocated), prefill (compute prompts, "
                                          "send their KV to decode workers) or decode (receive KV, decode)",
                                  DISAGGREGATION_MODES)
    disaggregation_bootstrap_port: int = _f(8998, "prefill: the port of its bootstrap/transfer socket; decode: the "
                                                  "prefill port used when a request's bootstrap_port is null")
    disaggregation_transfer_backend: str = _f("tcp", "how KV moves between prefill and decode workers (ZMQ over TCP)",
                                              ("tcp",))
    disaggregation_timeout: float = _f(300.0, "seconds a decode worker waits for a request's KV, and a prefill worker "
                                              "holds a room nobody pulls, before failing the request")
    disaggregation_worker_id: str | None = _f(None, "this worker's name to its PD peers, HOST:PORT (default: the "
                                                    "server's --host:--port, a decode's wildcard or loopback host "
                                                    "replaced by the hostname); a prefill binds its bootstrap "
                                                    "socket on HOST")

    speculative_algorithm: str | None = _f(None, "speculative decoding: ngram (prompt lookup) or draft (a smaller "
                                                 "model, --speculative-draft-model-path); SGLang's NGRAM and "
                                                 "STANDALONE are accepted (default: off)")
    speculative_num_draft_tokens: int = _f(4, "most draft tokens verified per request per decode step")
    speculative_draft_model_path: str | None = _f(None, "the draft model (GGUF file or Hugging Face folder) of "
                                                        "--speculative-algorithm draft; same vocabulary as the model")
    speculative_draft_policy: str = _f("adaptive", "adaptive: verify only the drafts worth it, from each request's "
                                                   "acceptance so far and a draft row's cost measured at start; "
                                                   "always: every proposed draft", ("adaptive", "always"))
    speculative_ngram_min_match_window_size: int = _f(1, "ngram: fewest trailing tokens that must match earlier "
                                                         "context to propose what followed")
    speculative_ngram_max_match_window_size: int = _f(12, "ngram: most trailing tokens compared when matching")

    def resolved(self) -> "EngineConfig":
        """Validate and return a new config (explicit values are kept)."""
        self.check_choices()
        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("max_total_tokens must be >= 16")
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a positive multiple of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr HOST:PORT (the address of node 0, reachable by all)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise ValueError("dist_timeout must be > 0 seconds")
        self.decode_max_rows()  # ValueError naming --cpu-decode-max-rows
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.data_parallel_rank is not None and self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")
        if self.quantization == "gguf" and self.model_path is not None and not self.model_path.endswith(".gguf"):
            raise ValueError(f"quantization gguf needs a GGUF model file; {self.model_path!r} is not a .gguf file "
                             "(use --quantization none)")
        parse_kv_events_config(self.kv_events_config)  # ValueError naming --kv-events-config
        self._check_hicache()
        self._check_disaggregation()
        self._check_speculative()
        return self

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is None:
            return
        algo = algorithm_name(self.speculative_algorithm)  # ValueError naming the flag
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(f"--speculative-ngram-min-match-window-size ({lo}) must be >= 1 and <= "
                             f"--speculative-ngram-max-match-window-size ({hi})")
        if algo == "draft":
            if not self.speculative_draft_model_path:
                raise ValueError("--speculative-algorithm draft needs --speculative-draft-model-path (a smaller "
                                 "model with the same vocabulary)")
            if self.tp_size > 1:
                raise ValueError("--speculative-algorithm draft does not support --tp-size > 1 yet (use ngram)")

    def _check_disaggregation(self) -> None:
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"--disaggregation-bootstrap-port must be a port number, got "
                             f"{self.disaggregation_bootstrap_port}")
        if self.disaggregation_timeout <= 0:
            raise ValueError(f"--disaggregation-timeout must be > 0 seconds, got {self.disaggregation_timeout}")
        if self.disaggregation_mode == "null":
            return
        mode = f"--disaggregation-mode {self.disaggregation_mode}"
        if self.tp_size > 1:
            raise ValueError(f"{mode} does not support --tp-size > 1 yet (the KV pool is sent from one rank)")
        if self.enable_hierarchical_cache:
            raise ValueError(f"{mode} cannot be combined with --enable-hierarchical-cache yet")
        if self.disable_radix_cache:
            raise ValueError(f"{mode} needs the radix cache (the prefill holds, the decode reuses KV there): "
                             "drop --disable-radix-cache")

    def _check_hicache(self) -> None:
        if self.hicache_ratio <= 0:
            raise ValueError(f"--hicache-ratio must be > 0, got {self.hicache_ratio}")
        if self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be >= 0 GB, got {self.hicache_size}")
        extra = self.hicache_storage_extra()  # ValueError naming the flag
        if not self.enable_hierarchical_cache:
            return
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache")
        if self.hicache_storage_backend is not None and self.tp_size > 1:
            raise ValueError("--hicache-storage-backend is not supported with --tp-size > 1 yet")
        timeout = extra.get("prefetch_timeout", 1.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"--hicache-storage-backend-extra-config: prefetch_timeout must be a positive number "
                             f"of seconds, got {timeout!r}")

    def decode_max_rows(self) -> int | None:
        """--cpu-decode-max-rows as a number, or None for auto (measured)."""
        text = str(self.cpu_decode_max_rows).strip().lower()
        if text == "auto":
            return None
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"--cpu-decode-max-rows must be auto or a positive number, got {self.cpu_decode_max_rows!r}")
        return int(text)

    def hicache_storage_extra(self) -> dict[str, Any]:
        """The parsed JSON object of --hicache-storage-backend-extra-config ({} when unset)."""
        if not self.hicache_storage_backend_extra_config:
            return {}
        try:
            value = json.loads(self.hicache_storage_backend_extra_config)
        except ValueError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
        return value

    @staticmethod
    def from_kwargs(**kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        settings()  # a bad process-wide variable fails here, at startup, not in the first step
        values = env_values(EngineConfig)
        values.update(torchrun_values())
        values.update(kwargs)
        return EngineConfig(**values).resolved()


@dataclass(frozen=True)
class Settings(SharedOptions):
    """Process-wide switches, read through `settings()` where no Engine is at hand."""

    disable_cpu_ops: bool = _f(False, "run the bf16 CPU elementwise ops (RMSNorm, RoPE, SiLU*up, residual adds) "
                                      "through torch instead of the fused C ops (for comparison)")
    disable_cpu_attention: bool = _f(False, "never use the C attention kernel: the cpu attention backend falls "
                                            "back to torch (for comparison)")
    cc: str | None = _f(None, "C compiler that builds the CPU kernels (default: cc, else gcc, on PATH)", env="CC")
    grammar_backend: str = _f("ours", "grammar engine for every constraint kind (SGLang's flag): ours (regex / JSON "
                                      "Schema on byte DFAs and pushdown machines, any CFG), llguidance, outlines "
                                      "(outlines-core: regex / json_schema / choices only) or xgrammar (the xgrammar "
                                      "package, if installed; SGLang's default engine, not ours)",
                              ("ours", "llguidance", "outlines", "xgrammar"))
    regex_backend: str = _f("native", "regex / JSON Schema / CFG backend: native (C engine: DFA states built as "
                                      "texts reach them, masks by a byte-trie walk; lazy where no C compiler), "
                                      "lazy (byte DFAs and masks in numpy) or outlines (a full outlines-core "
                                      "index at compile)", ("native", "lazy", "outlines"))
    lazy_dfa: str = _f("native", "byte-DFA builder of the lazy backend: native (C, falling back to rust for syntax "
                                 "it does not read), rust (regex-automata via outlines-core) or interegular "
                                 "(pure Python, slower)", ("native", "rust", "interegular"))
    constrained_json_whitespace_pattern: str | None = _f(
        None, "regex for the whitespace a JSON Schema constraint allows between JSON tokens and before the value "
              "(SGLang's flag; ours and outlines: default one optional space, [ ]?, which measured best for "
              "accuracy; llguidance: default its flexible whitespace; xgrammar: ignored)")
    constrained_json_disable_any_whitespace: bool = _f(
        False, "compact JSON: no whitespace between JSON tokens or before the value (SGLang's flag; every backend)")
    pushdown_lazy: bool = _f(True, "build a pushdown grammar's sub-machines on first use instead of all at compile")
    grammar_cache_entries: int = _f(256, "compiled grammars kept in memory (least recently used dropped first)")
    grammar_disk_cache: bool = _f(True, "keep compiled regex DFAs / indexes on disk under <cache dir>/grammars")
    enable_debug_calls: bool = _f(False, "serve POST /debug/worker_call (KV invariant checks, fault injection) for "
                                         "tests; never in production")
    triton_interpret: bool = _f(False, "run Triton kernels in Triton's CPU interpreter (Triton's own variable; "
                                       "lets the triton attention backend run without a GPU)", env="TRITON_INTERPRET")


# ---- text <-> values, typed by the annotations -------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_EXPECTED = {bool: "a boolean (1/true/yes/on or 0/false/no/off)", int: "an integer", float: "a number",
             str: "a string"}
_PY_EXPECTED = {bool: "True or False", int: "an int", float: "a number (int or float)", str: "a str"}


@functools.cache
def _types(cls: type) -> dict[str, type]:
    """Field name -> its type with Optional unwrapped (`int | None` -> int)."""
    out = {}
    for name, t in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(t) if a is not type(None)]
        out[name] = args[0] if args else t
    return out


def env_name(f: dataclasses.Field) -> str:
    return f.metadata.get("env") or "SGL_" + f.name.upper()


def parse_value(cls: type, f: dataclasses.Field, raw: str, source: str) -> Any:
    """`raw` (from the variable or flag `source`) as the field's type; ValueError naming `source`."""
    t = _types(cls)[f.name]
    text = raw.strip()
    try:
        if t is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            value: Any = text.lower() in _TRUE
        elif t in (int, float):
            value = t(text)
        elif t is str:
            value = text.lower() if f.metadata.get("choices") else raw
        else:
            raise TypeError(f"config field {f.name}: no parser for type {t!r}")
    except ValueError:
        raise ValueError(f"{source}={raw!r}: expected {_EXPECTED[t]}") from None
    allowed = f.metadata.get("choices")
    if allowed and value not in allowed:
        raise ValueError(f"{source}={raw!r}: expected one of {', '.join(map(str, allowed))}")
    return value


def env_values(cls: type) -> dict[str, Any]:
    """The fields of `cls` set in the environment (unset or empty variables are skipped)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = os.environ.get(env_name(f))
        if raw:
            out[f.name] = parse_value(cls, f, raw, env_name(f))
    return out


def to_env(values: dict[str, Any]) -> dict[str, str]:
    """{field: value} -> {variable: text}, the inverse of `env_values` (None values dropped)."""
    by_name = {f.name: f for cls in (EngineConfig, Settings) for f in dataclasses.fields(cls)}
    out = {}
    for name, v in values.items():
        if v is not None:
            out[env_name(by_name[name])] = ("1" if v else "0") if isinstance(v, bool) else str(v)
    return out


def export(values: dict[str, Any]) -> None:
    """Set `values` ({field: value}) as their variables in this process, so that
    `settings()` here and any child process read them (the CLI's process-wide flags)."""
    os.environ.update(to_env(values))


def torchrun_values() -> dict[str, Any]:
    """torchrun's environment as engine options: each torchrun process is one node of
    one rank (RANK -> node_rank, WORLD_SIZE -> nnodes and tp_size, MASTER_ADDR:MASTER_PORT ->
    dist_init_addr); empty when not launched by torchrun."""
    env = os.environ
    if not all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return {}
    world = int(env["WORLD_SIZE"])
    return {"node_rank": int(env["RANK"]), "nnodes": world, "tp_size": world,
            "dist_init_addr": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"}


# Third-party variables that change which GEMM kernels torch / oneDNN / MKL run (read here,
# the one module that reads the environment; the calibration cache keys on them).
KERNEL_ENV_VARS = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                   "MKL_CBWR")


def kernel_environment() -> dict[str, str]:
    """The KERNEL_ENV_VARS set in this process."""
    return {k: os.environ[k] for k in KERNEL_ENV_VARS if k in os.environ}


# ---- process-wide settings -------------------------------------------------------------------

_SETTINGS_VARS = tuple(env_name(f) for f in dataclasses.fields(Settings))


def settings() -> Settings:
    """The process-wide settings, from the environment.

    Parsed once per distinct set of values (a tuple of lookups, a few microseconds), so it
    follows a variable that the CLI or a test sets later; a hot loop should still read it
    once per step rather than once per op. ValueError names a bad variable.
    """
    return _settings_for(tuple(os.environ.get(v) for v in _SETTINGS_VARS))


@functools.lru_cache(maxsize=8)  # a memo of a pure function of the variables, not a data cache
def _settings_for(raw: tuple[str | None, ...]) -> Settings:
    values = {f.name: parse_value(Settings, f, r, env_name(f))
              for f, r in zip(dataclasses.fields(Settings), raw) if r}
    s = Settings(**values)
    s.check_choices()
    return s


def cache_dir(explicit: str | Path | None = None) -> Path:
    """The cache folder: `explicit` (an Engine's cache_dir), else SGL_CACHE_DIR, else ~/.cache/sgl.
    Users add their own subfolder (models/, grammars/, kernels/)."""
    root = explicit or settings().cache_dir
    return Path(root) if root else Path.home() / ".cache" / "sgl"


# ---- CLI ---------------------------------------------------------------------------------------

def _own_fields_first(cls: type) -> list[dataclasses.Field]:
    own = cls.__dict__.get("__annotations__", {})
    fs = dataclasses.fields(cls)
    return [f for f in fs if f.name in own] + [f for f in fs if f.name not in own]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field of EngineConfig and Settings, in two help groups."""
    seen: set[str] = set()
    for cls, title in ((EngineConfig, "engine options"),
                       (Settings, "process-wide settings (C kernels, grammar compiler)")):
        group = parser.add_argument_group(title)
        for f in _own_fields_first(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            _add_flag(group, cls, f)


def _add_flag(group: Any, cls: type, f: dataclasses.Field) -> None:
    flag = "--" + f.name.replace("_", "-")
    help = f"{f.metadata['help']} [env {env_name(f)}]"
    if _types(cls)[f.name] is bool:
        # A switch that is on by default needs its --no- form to be turned off from the CLI.
        action = argparse.BooleanOptionalAction if f.default else "store_true"
        group.add_argument(flag, dest=f.name, action=action, default=None, help=help)
        return

    def parse(s: str) -> Any:
        try:
            return parse_value(cls, f, s, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    allowed = f.metadata.get("choices")
    metavar = "{" + ",".join(map(str, allowed)) + "}" if allowed else f.name.upper()
    group.add_argument(flag, dest=f.name, type=parse, default=None, metavar=metavar, help=help)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` set on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}
