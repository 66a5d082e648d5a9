"""EngineBackend: the DSL on an in-process `sgl.Engine` (no HTTP, no serialization).

Calls go straight to `Engine.generate`, which accepts the same arguments as our
protocol, so this file only adapts what the engine does not do itself: token texts in
logprob entries (`return_text_in_logprobs`) and the chat template from the tokenizer.
Many program threads call `generate` at once; the engine batches them.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Iterator

from sgl.lang.backends.base import Backend
from sgl.lang.chat_template import ChatTemplate, chat_template_or_default

_LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")


class EngineBackend(Backend):
    def __init__(self, engine: Any):
        self.engine = engine

    @cached_property
    def chat_template(self) -> ChatTemplate:
        tok = getattr(self.engine, "tokenizer", None)
        eos = getattr(tok, "eos_token", None) or ""
        return chat_template_or_default(getattr(self.engine, "chat_template", None), name="engine", eos_token=eos)

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def _with_texts(self, res: Any) -> Any:
        if isinstance(res, list):
            return [self._with_texts(r) for r in res]
        meta = res.get("meta_info") or {}
        tok = self.engine.tokenizer
        for key in _LOGPROB_LISTS:
            entries = meta.get(key)
            if entries:
                meta[key] = [(e[0], e[1], tok.decode([e[1]])) for e in entries]
        return res

    def generate(self, prompt=None, sampling_params=None, *, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=False):
        res = self.engine.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                   return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                   top_logprobs_num=top_logprobs_num)
        return self._with_texts(res) if return_text_in_logprobs and return_logprob else res

    def generate_stream(self, prompt: str, sampling_params: dict, **opts: Any) -> Iterator[dict]:
        want_text = opts.pop("return_text_in_logprobs", False)
        for res in self.engine.generate(prompt=prompt, sampling_params=sampling_params, stream=True, **opts):
            yield self._with_texts(res) if want_text and opts.get("return_logprob") else res

    def flush_cache(self) -> bool:
        out = self.engine.flush_cache()
        return True if out is None else bool(out)

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
