"""OpenAI backend: the DSL on any OpenAI-compatible /v1 server (`sgl.OpenAI(model, ...)`).

Chat models get the program's turns as messages: programs are written with a ChatML
template, and the prompt text is cut back into messages at generation time, so a gen
must sit right at the start of an assistant turn. Completion models get the raw text.
What /v1 cannot express (select, regex, JSON schema, grammars, logprob-based choice
methods) raises BackendError naming the missing feature instead of silently degrading.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from sgl.lang.backends.base import Backend, BackendError
from sgl.lang.chat_template import CHATML_TEMPLATE, ChatTemplate
from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS
from sgl.runtime.sampling_params import SamplingParams

_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.S)
_UNSUPPORTED = (*CONSTRAINT_KINDS, "stop_regex", "min_new_tokens")
# Models that only serve /v1/completions (OpenAI's legacy ones); every other name is a chat
# model, as in SGLang ("Llama-3.1-8B-Instruct" is a chat model). `is_chat_model` overrides.
_COMPLETION_MODELS = ("gpt-3.5-turbo-instruct", "davinci", "babbage")
# Sampling fields /v1 names itself; every other non-default one travels as an extension
# (sgl, SGLang and vLLM servers apply them; OpenAI's own API refuses them with a 400).
_OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "n": "n",
                  "seed": "seed", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}
_DEFAULTS = SamplingParams()


def chatml_to_messages(text: str) -> list[dict]:
    """Messages of a ChatML prompt that ends with an open assistant turn."""
    opener = CHATML_TEMPLATE.role_prefix_and_suffix["assistant"][0]
    if not text.endswith(opener):
        raise BackendError("an OpenAI chat model can only generate at the start of an assistant turn "
                           "(put the gen right after `with s.assistant():`)")
    body = text[: -len(opener)]
    messages = [{"role": m.group(1), "content": m.group(2)} for m in _TURN.finditer(body)]
    if _TURN.sub("", body).strip():
        raise BackendError("text outside chat turns cannot be sent to an OpenAI chat model")
    return messages


class OpenAI(Backend):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool | None = None, chat_template: ChatTemplate | None = None, **client_kwargs: Any):
        import openai

        self.model_name = model_name
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", **client_kwargs)
        if is_chat_model is None:
            is_chat_model = not any(h in model_name.lower() for h in _COMPLETION_MODELS)
        self.is_chat_model = is_chat_model
        self.chat_template = chat_template or CHATML_TEMPLATE

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def _kwargs(self, sp: dict) -> dict:
        bad = [k for k in _UNSUPPORTED if sp.get(k)]
        if bad:
            raise BackendError(f"the OpenAI backend cannot apply {bad}; use sgl.Engine or sgl.RuntimeEndpoint")
        kw: dict[str, Any] = {"max_tokens": sp.get("max_new_tokens", _DEFAULTS.max_new_tokens)}
        for ours, theirs in _OPENAI_FIELDS.items():
            if ours != "max_new_tokens" and sp.get(ours) is not None:
                kw[theirs] = sp[ours]
        stop = sp.get("stop") or []
        if self.is_chat_model:  # the server ends the turn itself
            stop = [s for s in stop if s not in self.chat_template.stop_str]
        if stop:
            kw["stop"] = list(stop)  # all of them: OpenAI's API answers more than 4 with a 400, not silence
        extra = {k: v for k, v in sp.items() if k not in _OPENAI_FIELDS and k != "stop" and v is not None
                 and v != getattr(_DEFAULTS, k, None)}
        if extra:
            kw["extra_body"] = extra
        return kw

    def _result(self, text: str, finish: str | None, usage: Any) -> dict:
        return {"text": text, "output_ids": [], "meta_info": {
            "finish_reason": {"type": "length" if finish == "length" else "stop"},
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None)}}

    def generate(self, prompt=None, sampling_params=None, *, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=False):
        if input_ids is not None or not isinstance(prompt, str) or return_logprob:
            raise BackendError("the OpenAI backend only generates from one text prompt, without prompt logprobs")
        sp = dict(sampling_params or {})
        if sp.get("max_new_tokens") == 0:  # a cache warm-up: nothing to warm on a remote API
            return self._result("", "length", None) | {"meta_info": {"prompt_tokens": 0, "finish_reason": None}}
        kw = self._kwargs(sp)
        if self.is_chat_model:
            out = self.client.chat.completions.create(model=self.model_name, messages=chatml_to_messages(prompt), **kw)
            res = [self._result(c.message.content or "", c.finish_reason, out.usage) for c in out.choices]
        else:
            out = self.client.completions.create(model=self.model_name, prompt=prompt, **kw)
            res = [self._result(c.text, c.finish_reason, out.usage) for c in out.choices]
        return res if sp.get("n", 1) > 1 else res[0]

    def generate_stream(self, prompt: str, sampling_params: dict, **opts: Any) -> Iterator[dict]:
        kw = self._kwargs(dict(sampling_params or {}))
        if self.is_chat_model:
            stream = self.client.chat.completions.create(model=self.model_name, messages=chatml_to_messages(prompt),
                                                         stream=True, **kw)
        else:
            stream = self.client.completions.create(model=self.model_name, prompt=prompt, stream=True, **kw)
        text = ""
        for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            text += (c.delta.content or "") if self.is_chat_model else (c.text or "")
            yield self._result(text, c.finish_reason, None)

    def cache_prefix(self, text: str) -> int:
        return 0

    def select(self, prefix, choices, temperature, choices_method):
        raise BackendError("select() needs prompt logprobs, which OpenAI-compatible APIs do not return; "
                           "use sgl.Engine or sgl.RuntimeEndpoint, or gen() with your own parsing")
