"""Build one rank's half of the engine in its worker process: the model shard, the KV
pool holding this rank's KV heads, the attention backend and model runner; on rank 0 also
the scheduler (radix tree, allocator, request table, grammar compiler) over them.

The pool size is decided once for all ranks (the smallest any rank can afford), because
rank 0's allocator hands out slot numbers that every rank's pool must hold.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sgl.runtime.config import EngineConfig
from sgl.runtime.distributed.parallel import TPInfo
from sgl.runtime.memory.kv_pool import KVPool
from sgl.runtime.models.config import ModelConfig

log = logging.getLogger("sgl.worker")

KV_TOKENS_CAP = 131072


@dataclass
class RankModel:
    """What every rank builds (plain handles; rank 0 adds a scheduler on top)."""

    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Any
    pool: KVPool
    runner: Any  # executor/model_runner.ModelRunner
    device: str
    context_length: int
    max_total_tokens: int
    tp: TPInfo
    host_pool: Any = None  # memory/host_pool.HostKVPool with --enable-hierarchical-cache


def resolve_device(cfg: EngineConfig) -> str:
    return cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def pool_tokens(cfg: EngineConfig, mc: ModelConfig, local_kv_heads: int, dtype: torch.dtype, tp: TPInfo) -> int:
    """KV slots every rank's pool gets: max_total_tokens, else mem_fraction of this machine's
    memory for this rank's heads (capped), the minimum over ranks."""
    if cfg.max_total_tokens:
        return cfg.max_total_tokens
    per_token = KVPool.bytes_per_token(mc.num_layers, local_kv_heads, mc.head_dim, dtype)
    total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local_ranks = max(1, cfg.tp_size // cfg.nnodes)  # they share this machine's memory
    n = min(KV_TOKENS_CAP, int(total_mem * cfg.mem_fraction / local_ranks / per_token))
    if tp.size > 1:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        n = int(t[0])
    return n


def build_rank(cfg: EngineConfig, hf_dir: str, tp: TPInfo) -> RankModel:
    from sgl.runtime.attention.registry import create_attention_backend
    from sgl.runtime.executor.model_runner import ModelRunner
    from sgl.runtime.models.loader import load_model

    from sgl.runtime.tuning.calibrate import choose_paths

    device = resolve_device(cfg)
    loaded = load_model(hf_dir, dtype=cfg.dtype, device=device, cache_dir=cfg.cache_dir,
                        prepack=not cfg.disable_packed_linears, tp=tp, quantization=cfg.quantization)
    mc = loaded.config
    model = loaded.model
    # Flags, else this host's cached measurements, else measured now (fp32 linears applied here).
    paths = choose_paths(cfg, model, device, tp.size)
    dtype = next(model.parameters()).dtype
    kv_heads = getattr(model, "num_local_kv_heads", mc.num_kv_heads)
    num_tokens = pool_tokens(cfg, mc, kv_heads, dtype, tp)
    pool = KVPool(num_tokens + 1, mc.num_layers, kv_heads, mc.head_dim, dtype, device)
    attn = create_attention_backend(paths.attention_backend, pool, device)
    runner = ModelRunner(model, attn, not cfg.disable_cpu_decode_kernel, paths.decode_threads,
                         paths.decode_max_rows, paths)
    return RankModel(model=model, config=mc, tokenizer=loaded.tokenizer, pool=pool, runner=runner, device=device,
                     context_length=cfg.context_length or mc.max_position_embeddings,
                     max_total_tokens=num_tokens, tp=tp, host_pool=host_tier(cfg, pool, num_tokens, device))


def host_tier(cfg: EngineConfig, pool: KVPool, num_tokens: int, device: str) -> Any:
    """This rank's host KV tier (same page count on every rank), or None when it is off."""
    if not cfg.enable_hierarchical_cache:
        return None
    from sgl.runtime.memory.host_pool import HostKVPool

    args = (cfg.page_size, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
    if cfg.hicache_size > 0:
        pages = HostKVPool.pages_for(cfg.hicache_size * 1e9, *args)
    else:
        pages = int(cfg.hicache_ratio * num_tokens) // cfg.page_size
    if pages < 1:
        raise ValueError(f"the host KV tier would hold no page (--hicache-size {cfg.hicache_size} GB, "
                         f"--hicache-ratio {cfg.hicache_ratio}, --page-size {cfg.page_size})")
    log.info("host KV tier: %d pages of %d tokens", pages, cfg.page_size)
    return HostKVPool(pages, *args, pin_memory=device.startswith("cuda"))


def hicache(cfg: EngineConfig, rm: RankModel) -> Any:
    """Rank 0's hierarchical-cache controller (with its storage tier), or None."""
    if rm.host_pool is None:
        return None
    from sgl.runtime.scheduler.hicache import HiCache

    storage = None
    if cfg.hicache_storage_backend is not None:
        from sgl.runtime.memory.storage import PageStore, make_backend, namespace_for
        from sgl.runtime.memory.storage.heap import keep_page_buffers_in_heap
        from sgl.runtime.scheduler.storage_tier import StorageTier

        keep_page_buffers_in_heap()  # page-sized reads and frames without fresh mappings each time

        extra = dict(cfg.hicache_storage_extra())
        timeout = float(extra.pop("prefetch_timeout", 1.0))
        ns = namespace_for(kv_identity(cfg, rm), str(rm.pool.dtype), cfg.page_size, rm.tp.size, rm.tp.rank)
        backend = make_backend(cfg.hicache_storage_backend, extra, ns)
        storage = StorageTier(PageStore(backend), ns, rm.host_pool.page_nbytes, rm.host_pool.view,
                              cfg.hicache_storage_prefetch_policy, timeout)
    return HiCache(cfg.page_size, rm.host_pool.num_pages, cfg.hicache_write_policy, storage=storage)


def kv_identity(cfg: EngineConfig, rm: RankModel) -> str:
    """What stored KV values depend on besides dtype, page size and TP layout (already in the
    namespace): the weights' content, not just their path (a file replaced in place, or two
    folders under one relative path, must not match), the architecture, and --quantization
    (GGUF blocks change the model's numerics, as a quantized variant would). Kernel choices
    (the calibrated linear path) stay out, as a GPU's type does in other caches: workers on
    different hosts, or whose calibrations differ by noise, still share. The display path
    goes last, after a "/", so its file name is the namespace's slug (namespace_for)."""
    from sgl.runtime.models.loader import weights_fingerprint

    quant = "gguf" if getattr(rm.model, "gguf_blocks", None) is not None else "none"
    shown = cfg.model_path or "embedded-smollm2-135m-instruct"
    return f"{weights_fingerprint(cfg.model_path)}|quant={quant}|{rm.config!r}|/{shown}"


def request_table(cfg: EngineConfig, rm: RankModel) -> Any:
    """The request -> token table, the same shape on every rank."""
    from sgl.runtime.memory.allocator import ReqToTokenPool
    from sgl.runtime.scheduler.scheduler import Scheduler

    return ReqToTokenPool(cfg.max_running_requests + Scheduler.REQ_TABLE_SLACK, rm.context_length, rm.device)


def speculator(cfg: EngineConfig, rm: RankModel, table: Any) -> Any:
    """Rank 0's speculative decoding (scheduler/speculate.py), or None when it is off."""
    if cfg.speculative_algorithm is None:
        return None
    from sgl.runtime.scheduler.scheduler import Scheduler
    from sgl.runtime.scheduler.speculate import Speculator
    from sgl.runtime.speculative.proposer import SpecOptions, algorithm_name

    decoder = getattr(rm.runner, "cpu_decoder", None)
    c_step = decoder is not None
    row_cost = None
    # With tensor parallelism a lone forward here would wait on the other ranks: no gating.
    if cfg.speculative_draft_policy == "adaptive" and rm.tp.size == 1:
        from sgl.runtime.speculative.calibrate import measure_row_cost

        rows = decoder.max_rows if c_step else cfg.speculative_num_draft_tokens + 1
        row_cost = measure_row_cost(rm.runner, table.table, rows)
        log.info("speculative decoding: a draft row costs %.3f of a one-row decode step here", row_cost)
    opts = SpecOptions(
        algorithm=algorithm_name(cfg.speculative_algorithm),
        num_draft_tokens=cfg.speculative_num_draft_tokens,
        ngram_min_window=cfg.speculative_ngram_min_match_window_size,
        ngram_max_window=cfg.speculative_ngram_max_match_window_size,
        # Keep verification steps on the C decode step where it runs (it takes max_rows rows).
        max_step_rows=decoder.max_rows if c_step else None,
        row_cost=row_cost,
    )
    paths = getattr(rm.runner, "paths", None)  # the draft runs on the target's measured paths
    if opts.algorithm == "ngram":
        from sgl.runtime.speculative.ngram import NgramProposer

        proposer: Any = NgramProposer(opts.ngram_min_window, opts.ngram_max_window)
    else:
        from sgl.runtime.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer.load(
            cfg.speculative_draft_model_path, dtype=cfg.dtype, device=rm.device, max_tokens=rm.max_total_tokens,
            target_vocab_size=rm.config.vocab_size, cache_dir=cfg.cache_dir, context_length=rm.context_length,
            max_requests=cfg.max_running_requests + Scheduler.REQ_TABLE_SLACK,
            attention_backend=paths.attention_backend if paths else cfg.attention_backend,
            prepack=not cfg.disable_packed_linears, use_cpu_decode_kernel=not cfg.disable_cpu_decode_kernel,
            cpu_decode_threads=paths.decode_threads if paths else cfg.cpu_decode_threads)
    log.info("speculative decoding: %s, up to %d drafts per request per step", opts.algorithm, opts.num_draft_tokens)
    return Speculator(opts, proposer)


def build_scheduler(cfg: EngineConfig, rm: RankModel, peers: Any = None) -> Any:
    """Rank 0's scheduler over `rm`; `peers` (distributed/peers.py) when tp > 1."""
    from sgl.radix import RadixTree
    from sgl.runtime.executor.step import StepExecutor
    from sgl.runtime.memory.allocator import SlotAllocator
    from sgl.runtime.scheduler.kv_cache import KVCache
    from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

    table = request_table(cfg, rm)
    if peers is not None:
        table.record_writes()  # the other ranks replay them (StepPlan.table_writes)
    kv = KVCache(RadixTree(disable=cfg.disable_radix_cache), SlotAllocator(rm.max_total_tokens + 1), table,
                 hicache(cfg, rm))
    eos = set(rm.config.eos_token_ids)
    sched = Scheduler(
        SchedulerConfig(
            schedule_policy=cfg.schedule_policy,
            max_prefill_tokens=cfg.max_prefill_tokens,
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_running_requests=cfg.max_running_requests,
            enable_jump_forward=not cfg.disable_jump_forward,
            jump_forward_healing=not cfg.disable_jump_forward_healing,
            enable_mixed_chunk=cfg.enable_mixed_chunk,
            random_seed=cfg.random_seed,
            grammar_compile_timeout=cfg.grammar_compile_timeout,
            detokenize_outputs=False,
        ),
        rm.runner, kv, rm.tokenizer, eos, grammar_compiler=LazyGrammarCompiler(rm.tokenizer, eos, cfg),
        device=rm.device, executor=StepExecutor(rm.runner, table.table, rm.device, peers, rm.host_pool, rm.pool),
        speculator=speculator(cfg, rm, table),
    )
    if kv.hicache is not None and kv.hicache.storage is not None:
        kv.hicache.storage.on_prefetch_done = sched.wake  # a request waiting on storage is admitted at once
    from sgl.runtime.disaggregation import build_role

    role = build_role(cfg, rm.pool, sched.wake)
    if role is not None:
        sched.attach_pd(role)
    return sched


def build_kv_events(cfg: EngineConfig, scheduler: Any, device: str) -> Any:
    """Rank 0's KV event stream (kv_events/stream.py) over the scheduler's radix tree, or
    None when `--kv-events-config` leaves events off (then the tree gets no observer)."""
    from sgl.runtime.kv_events.config import parse_kv_events_config

    settings = parse_kv_events_config(cfg.kv_events_config)
    if settings is None:
        return None
    from sgl.runtime.kv_events.stream import KVEventStream

    return KVEventStream(settings, scheduler.kv.tree, cfg.page_size, cfg.data_parallel_rank,
                         medium="CPU" if device == "cpu" else "GPU")


class LazyGrammarCompiler:
    """Builds the grammar compiler on first use, so workers that never see a constraint
    never import the grammar stack."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], cfg: EngineConfig) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(eos_ids)
        self._timeout = cfg.grammar_compile_timeout
        self._compiler: Any = None

    def _get(self) -> Any:
        if self._compiler is None:
            from sgl.runtime.constrained.registry import GrammarCompiler
            from sgl.runtime.constrained.vocab import TokenizerInfo

            tok = TokenizerInfo.from_hf_tokenizer(self._tokenizer, eos_token_ids=self._eos)
            self._compiler = GrammarCompiler(tok, timeout_s=self._timeout)
        return self._compiler

    @property
    def tok(self) -> Any:
        """The vocabulary as bytes (constrained/vocab.py); token healing needs it too."""
        return self._get().tok

    def submit(self, kind: str, spec: str) -> Any:
        return self._get().submit(kind, spec)
