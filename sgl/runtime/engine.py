"""In-process Engine: SGLang's offline engine API over our scheduler.

`Engine(...)` loads the model, sizes the KV pool, and starts the scheduler thread.
`generate` / `async_generate` tokenize, submit plain requests, and collect
`{"text", "output_ids", "meta_info"}` results (streams yield cumulative text). Closing a
stream early aborts its request, which frees its KV. If the scheduler thread dies, every
caller waiting on it gets `SchedulerCrashedError` naming the cause (waits poll the
thread, so even a death that notifies nobody cannot hang a caller), and so does every
later call; `faulthandler` is on, so a fatal signal in native code leaves every
thread's stack on stderr.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import queue
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from sgl.runtime.config import EngineConfig
from sgl.runtime.engine_io import ReqSpec, normalize, to_result
from sgl.runtime.scheduler.req import Req, ReqOutput

log = logging.getLogger("sgl.engine")

KV_TOKENS_CAP = 131072
# How often a waiting caller checks that the scheduler thread is still alive.
LIVENESS_POLL_S = 0.5


class SchedulerCrashedError(RuntimeError):
    """The engine's scheduler thread died; the message names the cause. The engine is
    unusable afterwards: create a new one (the server reports 5xx and /health fails)."""


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = cfg = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        from sgl.radix import RadixTree
        from sgl.runtime.attention.registry import create_attention_backend
        from sgl.runtime.executor.model_runner import ModelRunner
        from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
        from sgl.runtime.memory.kv_pool import KVPool
        from sgl.runtime.models.loader import load_model
        from sgl.runtime.scheduler.kv_cache import KVCache
        from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

        if not faulthandler.is_enabled():  # a fatal signal in a kernel leaves the stacks in the log
            faulthandler.enable(all_threads=True)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # Set once per process, and once in the scheduler thread before its first step
        # (see _run_scheduler); nothing changes it between steps.
        self._num_threads = torch.get_num_threads()
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = device
        loaded = load_model(cfg.model_path, dtype=cfg.dtype, device=device, cache_dir=cfg.cache_dir,
                            prepack=not cfg.disable_packed_linears)
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.model_path = loaded.model_path
        self.hf_dir = loaded.hf_dir
        self.dtype = next(loaded.model.parameters()).dtype
        self.context_length = cfg.context_length or mc.max_position_embeddings
        self.eos_token_ids = set(mc.eos_token_ids)
        self.vocab_size = mc.vocab_size

        kv_dtype = self.dtype
        per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype)
        if cfg.max_total_tokens:
            num_tokens = cfg.max_total_tokens
        else:
            total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            num_tokens = min(KV_TOKENS_CAP, int(total_mem * cfg.mem_fraction / per_token))
        self.max_total_tokens = num_tokens
        pool = KVPool(num_tokens + 1, mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype, device)
        attn = create_attention_backend(cfg.attention_backend, pool, device)
        kv = KVCache(RadixTree(disable=cfg.disable_radix_cache), SlotAllocator(num_tokens + 1),
                     ReqToTokenPool(cfg.max_running_requests + Scheduler.REQ_TABLE_SLACK, self.context_length, device))
        self.scheduler = Scheduler(
            SchedulerConfig(
                schedule_policy=cfg.schedule_policy,
                max_prefill_tokens=cfg.max_prefill_tokens,
                chunked_prefill_size=cfg.chunked_prefill_size,
                max_running_requests=cfg.max_running_requests,
                enable_jump_forward=not cfg.disable_jump_forward,
                enable_mixed_chunk=cfg.enable_mixed_chunk,
                random_seed=cfg.random_seed,
                grammar_compile_timeout=cfg.grammar_compile_timeout,
            ),
            ModelRunner(loaded.model, attn, not cfg.disable_cpu_decode_kernel, cfg.cpu_decode_threads),
            kv, self.tokenizer, self.eos_token_ids,
            grammar_compiler=_LazyGrammarCompiler(self), device=device,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run_scheduler, name="sgl-scheduler", daemon=True)
        self._thread.start()

    def _run_scheduler(self) -> None:
        # A new thread starts with OpenMP's default team size, not the caller's: set it
        # here, once, before the first oneDNN primitive is built on this thread.
        torch.set_num_threads(self._num_threads)
        self.scheduler.run_forever(self._stop)

    # -- liveness -----------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise SchedulerCrashedError if the scheduler thread has died."""
        reason = self.scheduler.crash_reason
        if reason is None and not self._thread.is_alive() and not self._stop.is_set():
            reason = "the scheduler thread exited"
        if reason is not None:
            raise SchedulerCrashedError(f"the engine's scheduler crashed ({reason}); create a new Engine")

    def _get(self, q: "queue.Queue[ReqOutput]") -> ReqOutput:
        while True:
            try:
                out = q.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                self.check_alive()
                continue
            if _is_abort(out):  # a crash finishes every request with an abort first
                self.check_alive()
            return out

    async def _await(self, aw: Any) -> Any:
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
                if done:
                    return task.result()
                self.check_alive()
        finally:
            task.cancel()

    def _call(self, fn: Any, timeout: float | None = None) -> Any:
        """Run fn in the scheduler thread and return its result; raise if the thread dies."""
        fut = self.scheduler.call(fn)
        waited = 0.0
        while True:
            try:
                return fut.result(timeout=LIVENESS_POLL_S)
            except FutureTimeout:
                self.check_alive()
                waited += LIVENESS_POLL_S
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"the scheduler did not answer within {timeout:.0f}s") from None

    # -- generation -------------------------------------------------------------------
    def _specs(self, prompt: Any, input_ids: Any, sampling_params: Any, return_logprob: Any,
               logprob_start_len: Any, top_logprobs_num: Any, return_text_in_logprobs: bool,
               rid: Any) -> tuple[list[ReqSpec], bool]:
        if self._stop.is_set():
            raise RuntimeError("this engine was shut down; create a new Engine")
        self.check_alive()
        specs, is_batch = normalize(self.tokenizer, prompt, input_ids, sampling_params, return_logprob,
                                    logprob_start_len, top_logprobs_num, return_text_in_logprobs, rid,
                                    self.vocab_size, self.context_length)
        for s in specs:  # a request larger than the whole KV pool could never be scheduled
            need = len(s.input_ids) + s.params.max_new_tokens
            if need > self.max_total_tokens:
                raise ValueError(
                    f"prompt ({len(s.input_ids)} tokens) + max_new_tokens ({s.params.max_new_tokens}) needs "
                    f"{need} KV slots but the pool holds {self.max_total_tokens}; raise max_total_tokens "
                    "or shorten the request")
        return specs, is_batch

    def _submit(self, spec: ReqSpec, on_output: Any, stream: bool) -> None:
        self.scheduler.submit(Req(
            rid=spec.rid, input_ids=spec.input_ids, params=spec.params,
            return_logprob=spec.return_logprob, logprob_start_len=spec.logprob_start_len,
            top_logprobs_num=spec.top_logprobs_num, stream=stream, on_output=on_output))

    def generate(
        self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None, top_logprobs_num: int | list[int] | None = None,
        stream: bool = False, rid: str | list[str] | None = None, return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        specs, is_batch = self._specs(prompt, input_ids, sampling_params, return_logprob,
                                      logprob_start_len, top_logprobs_num, return_text_in_logprobs, rid)
        if stream:
            if len(specs) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream_sync(specs[0])
        q: queue.Queue[ReqOutput] = queue.Queue()
        for s in specs:
            self._submit(s, q.put, stream=False)
        done: dict[str, ReqOutput] = {}
        while len(done) < len(specs):
            out = self._get(q)
            done[out.rid] = out
        results = [to_result(self.tokenizer, s, done[s.rid]) for s in specs]
        return results if is_batch else results[0]

    def _stream_sync(self, spec: ReqSpec) -> Iterator[dict]:
        q: queue.Queue[ReqOutput] = queue.Queue()
        self._submit(spec, q.put, stream=True)
        finished = False
        try:
            while not finished:
                out = self._get(q)
                finished = out.finished
                yield to_result(self.tokenizer, spec, out)
        finally:
            if not finished:
                self.abort(spec.rid)

    async def async_generate(
        self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None, top_logprobs_num: int | list[int] | None = None,
        stream: bool = False, rid: str | list[str] | None = None, return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        specs, is_batch = self._specs(prompt, input_ids, sampling_params, return_logprob,
                                      logprob_start_len, top_logprobs_num, return_text_in_logprobs, rid)
        if stream:
            if len(specs) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream_async(specs[0])
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future] = []
        for s in specs:
            fut = loop.create_future()
            futs.append(fut)
            self._submit(s, lambda out, fut=fut: loop.call_soon_threadsafe(_set_once, fut, out), stream=False)
        try:
            outs = await self._await(asyncio.gather(*futs))
        except asyncio.CancelledError:  # the caller went away: free what its requests hold
            for s in specs:
                self.abort(s.rid)
            raise
        if any(_is_abort(o) for o in outs):
            self.check_alive()
        results = [to_result(self.tokenizer, s, o) for s, o in zip(specs, outs)]
        return results if is_batch else results[0]

    async def _stream_async(self, spec: ReqSpec) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[ReqOutput] = asyncio.Queue()
        self._submit(spec, lambda out: loop.call_soon_threadsafe(q.put_nowait, out), stream=True)
        finished = False
        try:
            while not finished:
                out = await self._await(q.get())
                if _is_abort(out):
                    self.check_alive()
                finished = out.finished
                yield to_result(self.tokenizer, spec, out)
        finally:
            if not finished:
                self.abort(spec.rid)

    # -- control ------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def flush_cache(self) -> bool:
        return bool(self._call(self.scheduler.kv.flush))

    def get_server_info(self) -> dict[str, Any]:
        info = self._call(self.scheduler.snapshot)
        info.update({
            "model_path": self.model_path, "dtype": str(self.dtype).replace("torch.", ""),
            "context_length": self.context_length, "device": self.device,
            "schedule_policy": self.config.schedule_policy,
            "disable_radix_cache": self.config.disable_radix_cache,
        })
        return info

    def check_invariants(self) -> None:
        """Prove (in the scheduler thread) that no KV slot is leaked or double-owned."""
        self._call(self.scheduler.check_invariants)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, tools=tools)

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        try:  # callers still waiting get an abort result instead of hanging
            self._call(lambda: self.scheduler.abort_all("the engine was shut down"), timeout=30)
        except SchedulerCrashedError:
            pass  # its callers were told when it died
        except Exception:  # a wedged loop must not block shutdown
            log.exception("could not abort in-flight requests at shutdown")
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception:
            pass


def _is_abort(out: ReqOutput) -> bool:
    fr = out.meta_info.get("finish_reason")
    return out.finished and isinstance(fr, dict) and fr.get("type") == "abort"


def _set_once(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


class _LazyGrammarCompiler:
    """Builds the grammar compiler on first use, so engines that never see a
    constraint never import the grammar stack."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._compiler: Any = None

    def submit(self, kind: str, spec: str) -> Any:
        if self._compiler is None:
            from sgl.runtime.constrained.registry import GrammarCompiler
            from sgl.runtime.constrained.vocab import TokenizerInfo

            e = self._engine
            tok = TokenizerInfo.from_hf_tokenizer(e.tokenizer, eos_token_ids=sorted(e.eos_token_ids))
            self._compiler = GrammarCompiler(tok, timeout_s=e.config.grammar_compile_timeout)
        return self._compiler.submit(kind, spec)
