"""The scheduler and model of one rank in this process, on a thread: for profilers that
wrap `scheduler.step` / `runner.forward` (profile_engine.py). Not the serving path: the
Engine runs these in a worker process. Outputs carry ids only (text is the API
process's job), which is all a profiler needs.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from sgl.runtime.config import EngineConfig
from sgl.runtime.distributed.parallel import TPInfo
from sgl.runtime.engine_io import normalize
from sgl.runtime.models.loader import resolve_model_dir
from sgl.runtime.scheduler.req import Req, ReqOutput
from sgl.runtime.worker.build import build_rank, build_scheduler
from sgl.runtime.worker.process import threads_per_rank


class InProcessEngine:
    def __init__(self, **kwargs: Any) -> None:
        cfg = EngineConfig.from_kwargs(**kwargs)
        self.threads = threads_per_rank(cfg)
        torch.set_num_threads(self.threads)
        hf_dir, _ = resolve_model_dir(cfg.model_path, cfg.cache_dir)
        rm = build_rank(cfg, str(hf_dir), TPInfo())
        self.tokenizer = rm.tokenizer
        self.vocab_size, self.context_length = rm.config.vocab_size, rm.context_length
        self.scheduler = build_scheduler(cfg, rm)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # a new thread starts with OpenMP's default team
        self.scheduler.run_forever(self._stop)

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None) -> Any:
        specs, is_batch = normalize(self.tokenizer, prompt, input_ids, sampling_params, False, None, None,
                                    False, None, self.vocab_size, self.context_length)
        q: queue.Queue[ReqOutput] = queue.Queue()
        for s in specs:
            self.scheduler.submit(Req(rid=s.rid, input_ids=s.input_ids, params=s.params, on_output=q.put))
        done = {o.rid: o for o in (q.get() for _ in specs)}
        outs = [{"output_ids": done[s.rid].output_ids, "meta_info": done[s.rid].meta_info} for s in specs]
        return outs if is_batch else outs[0]

    def flush_cache(self) -> bool:
        return bool(self.scheduler.call(self.scheduler.kv.flush).result())

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.scheduler.close()  # as the worker does after its loop: the storage tier's threads and store
