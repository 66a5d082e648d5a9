"""Engine: SGLang's offline engine API; the model runs in worker processes.

`Engine(...)` resolves the model (a GGUF is converted once), loads its tokenizer and chat
template here, in the API process, and starts one worker process per tensor-parallel rank
of this machine (worker/client.py): the scheduler and the model live there. `generate` /
`async_generate` tokenize, submit plain requests, and collect `{"text", "output_ids",
"meta_info"}` results; the text is detokenized here (streams yield cumulative text).
Closing a stream early aborts its request, which frees its KV. If a worker dies (killed,
out of memory, a crash it reports), every caller waiting on it gets
`SchedulerCrashedError` naming the cause, and so does every later call. `shutdown()`
(or leaving the `with` block) stops every process the engine started.

Why processes and not a thread of this one: measured in benchmarks/bench_process_split.py
(see the README); the worker runs its loop without this process's GIL, tokenization,
detokenization and HTTP in its way.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import queue
import time
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import AsyncIterator, Iterator
from typing import Any

from sgl.runtime.config import EngineConfig
from sgl.runtime.engine_io import ReqSpec, is_sample_of, normalize, to_result
from sgl.runtime.ipc.messages import Request
from sgl.runtime.scheduler.req import ReqOutput

log = logging.getLogger("sgl.engine")

# How often a waiting caller checks that the workers are still alive.
LIVENESS_POLL_S = 0.5
# A storage clear waits on the backend (a directory walk, a Redis SCAN): bounded, never a hang.
STORAGE_CLEAR_LIMIT_S = 600.0


class SchedulerCrashedError(RuntimeError):
    """The engine's worker (its scheduler or model) died; the message names the cause. The
    engine is unusable afterwards: create a new one (the server reports 5xx and /health fails)."""


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from sgl.runtime.models.loader import read_model_config, resolve_model_dir
        from sgl.runtime.models.tokenizer import load_tokenizer
        from sgl.runtime.worker.client import WorkerClient
        from sgl.runtime.worker.launch import with_dist_addr

        if not faulthandler.is_enabled():  # a fatal signal leaves the stacks in the log
            faulthandler.enable(all_threads=True)
        self._stopped = False
        self.workers: Any = None
        cfg = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        if cfg.node_rank != 0:
            raise ValueError("an Engine runs on node 0; start the other nodes with "
                             "python -m sgl.launch_server --node-rank N (they serve no requests)")
        self.config = cfg = with_dist_addr(cfg)
        hf_dir, self.model_path = resolve_model_dir(cfg.model_path, cfg.cache_dir)
        self.hf_dir = hf_dir
        self.model_config = mc = read_model_config(hf_dir)
        self.tokenizer = load_tokenizer(hf_dir)
        self.chat_template = self.tokenizer.chat_template
        self.context_length = cfg.context_length or mc.max_position_embeddings
        self.eos_token_ids = set(mc.eos_token_ids)
        self.vocab_size = mc.vocab_size
        self.workers = WorkerClient(cfg, str(hf_dir), self.tokenizer)
        ready = self.workers.ready
        self.max_total_tokens = ready.max_total_tokens
        self.dtype = ready.dtype
        self.device = ready.device
        self._ready = ready

    # -- liveness -----------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise SchedulerCrashedError if the workers have died."""
        reason = self.workers.crash_reason if self.workers is not None else "the engine did not start"
        if reason is not None:
            raise SchedulerCrashedError(f"the engine's worker died ({reason}); create a new Engine")

    def _get(self, q: "queue.Queue[ReqOutput]") -> ReqOutput:
        while True:
            try:
                out = q.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                self.check_alive()
                continue
            if _is_abort(out):  # a death finishes every request with an abort first
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

    def _call(self, name: str, *args: Any, limit_s: float | None = None) -> Any:
        """Run a named control call in the worker and return its value; raise if it dies, or
        TimeoutError past `limit_s` (the call may still finish)."""
        fut = self.workers.call(name, *args)
        deadline = None if limit_s is None else time.monotonic() + limit_s
        while True:
            try:
                return fut.result(timeout=LIVENESS_POLL_S)
            except FutureTimeout:
                self.check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the worker's {name} did not finish in {limit_s:g} s") from None
            except Exception:
                self.check_alive()  # a death is reported as such, not as the call's failure
                raise

    # -- generation -------------------------------------------------------------------
    def _specs(self, prompt: Any, input_ids: Any, sampling_params: Any, return_logprob: Any,
               logprob_start_len: Any, top_logprobs_num: Any, return_text_in_logprobs: bool,
               rid: Any, bootstrap: tuple[Any, Any, Any] = (None, None, None)) -> tuple[list[ReqSpec], bool]:
        if self._stopped:
            raise RuntimeError("this engine was shut down; create a new Engine")
        self.check_alive()
        specs, is_batch = normalize(self.tokenizer, prompt, input_ids, sampling_params, return_logprob,
                                    logprob_start_len, top_logprobs_num, return_text_in_logprobs, rid,
                                    self.vocab_size, self.context_length, bootstrap,
                                    self.config.disaggregation_bootstrap_port)
        for s in specs:  # a request larger than the whole KV pool could never be scheduled
            need = len(s.input_ids) + s.params.max_new_tokens
            if need > self.max_total_tokens:
                raise ValueError(
                    f"prompt ({len(s.input_ids)} tokens) + max_new_tokens ({s.params.max_new_tokens}) needs "
                    f"{need} KV slots but the pool holds {self.max_total_tokens}; raise max_total_tokens "
                    "or shorten the request")
        return specs, is_batch

    def _submit(self, specs: list[ReqSpec], on_output: list[Any], stream: bool) -> None:
        """Send one call's requests together (they are admitted in the same step)."""
        self.workers.submit([Request(
            rid=s.rid, input_ids=s.input_ids, params=s.params, return_logprob=s.return_logprob,
            logprob_start_len=s.logprob_start_len, top_logprobs_num=s.top_logprobs_num, stream=stream,
            bootstrap=s.bootstrap) for s in specs], on_output)

    def generate(
        self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None, top_logprobs_num: int | list[int] | None = None,
        stream: bool = False, rid: str | list[str] | None = None, return_text_in_logprobs: bool = False,
        bootstrap_host: Any = None, bootstrap_port: Any = None, bootstrap_room: Any = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's Engine.generate. On a PD worker (--disaggregation-mode) the bootstrap_*
        arguments name each request's room (disaggregation/rooms.py); without them a
        request runs here in full, as on a colocated worker."""
        specs, is_batch = self._specs(prompt, input_ids, sampling_params, return_logprob,
                                      logprob_start_len, top_logprobs_num, return_text_in_logprobs, rid,
                                      (bootstrap_host, bootstrap_port, bootstrap_room))
        if stream:
            if len(specs) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream_sync(specs[0])
        q: queue.Queue[ReqOutput] = queue.Queue()
        self._submit(specs, [q.put] * len(specs), stream=False)
        done: dict[str, ReqOutput] = {}
        while len(done) < len(specs):
            out = self._get(q)
            done[out.rid] = out
        results = [to_result(self.tokenizer, s, done[s.rid]) for s in specs]
        return results if is_batch else results[0]

    def _stream_sync(self, spec: ReqSpec) -> Iterator[dict]:
        q: queue.Queue[ReqOutput] = queue.Queue()
        self._submit([spec], [q.put], stream=True)
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
        bootstrap_host: Any = None, bootstrap_port: Any = None, bootstrap_room: Any = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        specs, is_batch = self._specs(prompt, input_ids, sampling_params, return_logprob,
                                      logprob_start_len, top_logprobs_num, return_text_in_logprobs, rid,
                                      (bootstrap_host, bootstrap_port, bootstrap_room))
        if stream:
            if len(specs) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream_async(specs[0])
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future] = [loop.create_future() for _ in specs]
        self._submit(specs, [lambda out, fut=fut: loop.call_soon_threadsafe(_set_once, fut, out) for fut in futs],
                     stream=False)
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
        self._submit([spec], [lambda out: loop.call_soon_threadsafe(q.put_nowait, out)], stream=True)
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
        """Abort request `rid`, and the samples of an n > 1 request given that rid."""
        for r in [rid] + [r for r in self.workers.active_rids() if is_sample_of(r, rid)]:
            self.workers.abort(r)

    def flush_cache(self) -> bool:
        return bool(self._call("flush_cache"))

    def clear_hicache_storage_backend(self) -> bool:
        """Drop the storage tier's pages of this model (flush_cache leaves them); False without one."""
        return bool(self._call("clear_hicache_storage", limit_s=STORAGE_CLEAR_LIMIT_S))

    def get_server_info(self) -> dict[str, Any]:
        info = self._call("snapshot")
        r = self._ready
        info.update({
            "model_path": self.model_path, "dtype": self.dtype, "context_length": self.context_length,
            "device": self.device, "schedule_policy": self.config.schedule_policy,
            "disable_radix_cache": self.config.disable_radix_cache,
            "disaggregation_bootstrap_port": self.config.disaggregation_bootstrap_port,
            "tp_size": r.tp_size, "nnodes": r.nnodes,
            "kv_pool_tokens_per_rank": r.kv_pool_tokens_per_rank, "kv_pool_bytes_per_rank": r.kv_pool_bytes_per_rank,
            "weight_bytes_per_rank": r.weight_bytes_per_rank, "worker_pids": r.pids,
        })
        return info

    def check_invariants(self) -> None:
        """Prove (in the worker) that no KV slot is leaked or double-owned."""
        self._call("check_invariants")

    def worker_call(self, name: str, *args: Any) -> Any:
        """A named control call of the worker (worker/serve.py CALLS: invariants, fault
        injection for tests); its value."""
        return self._call(name, *args)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, tools=tools)

    def shutdown(self) -> None:
        """Abort what is in flight (callers get an abort result) and stop every worker process."""
        if self._stopped:
            return
        self._stopped = True
        if self.workers is not None:
            self.workers.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:  # forgotten without shutdown(): do not leave the worker processes running
            if not self._stopped and self.workers is not None:
                self.workers.close()
        except Exception:
            pass


def _is_abort(out: ReqOutput) -> bool:
    fr = out.meta_info.get("finish_reason")
    return out.finished and isinstance(fr, dict) and fr.get("type") == "abort"


def _set_once(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
