"""EngineBackend: the DSL on an in-process `sgl.Engine` (no HTTP, no serialization).

Calls go straight to `Engine.generate`, which accepts the same arguments as our
protocol; this file only derives the chat template from the tokenizer's. Many program
threads call `generate` at once; the engine's scheduler batches them.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Iterator

from sgl.lang.backends.base import Backend
from sgl.lang.chat_template import ChatTemplate, chat_template_or_default


class EngineBackend(Backend):
    supports_token_healing = True
    def __init__(self, engine: Any):
        self.engine = engine

    @cached_property
    def chat_template(self) -> ChatTemplate:
        tok = getattr(self.engine, "tokenizer", None)
        eos = getattr(tok, "eos_token", None) or ""
        return chat_template_or_default(getattr(self.engine, "chat_template", None), name="engine", eos_token=eos)

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(self, prompt=None, sampling_params=None, *, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=False):
        return self.engine.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                    top_logprobs_num=top_logprobs_num,
                                    return_text_in_logprobs=return_text_in_logprobs)

    def generate_stream(self, prompt: str, sampling_params: dict, **opts: Any) -> Iterator[dict]:
        yield from self.engine.generate(prompt=prompt, sampling_params=sampling_params, stream=True, **opts)

    def flush_cache(self) -> bool:
        out = self.engine.flush_cache()
        return True if out is None else bool(out)

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
