"""RuntimeEndpoint: the DSL over HTTP against a server speaking SGLang's native API.

POST /generate takes the same fields as our protocol (text or input_ids, sampling_params,
logprob options, stream) and answers `{"text", "output_ids", "meta_info"}` (a list for
list input); streaming answers are SSE lines `data: {...}` with cumulative text, ended
by `data: [DONE]`. Works with an `sgl` server and with SGLang's own.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx

from sgl.lang.backends.base import Backend, BackendError
from sgl.lang.chat_template import (CHATML_TEMPLATE, DEFAULT_TEMPLATE, ChatTemplate, chat_template_or_default,
                                   read_template_source)

_NAMED_TEMPLATES = {"chatml": CHATML_TEMPLATE, "default": DEFAULT_TEMPLATE}


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None,
                 chat_template_name: str | None = None, timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout, verify=True if verify is None else verify,
                                    limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        try:
            self.model_info = self._get("/get_model_info")
        except BaseException:  # no endpoint object for the caller to shut down: close it here
            self._client.close()
            raise
        # An sgl server says it takes `token_healing`; SGLang's would refuse the key.
        self.supports_token_healing = bool(self.model_info.get("token_healing"))
        if chat_template_name is not None:
            if chat_template_name not in _NAMED_TEMPLATES:
                raise ValueError(f"unknown chat template {chat_template_name!r}; known: {sorted(_NAMED_TEMPLATES)}")
            self.chat_template = _NAMED_TEMPLATES[chat_template_name]
        else:
            source = self.model_info.get("chat_template")
            eos = self.model_info.get("eos_token") or ""
            if not source:  # older servers do not report it; read it from a local model file
                source, eos = read_template_source(self.model_info.get("tokenizer_path")
                                                   or self.model_info.get("model_path"))
            self.chat_template = chat_template_or_default(source, name=str(self.model_info.get("model_path")),
                                                          eos_token=eos)

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path"))

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # ---- transport ----------------------------------------------------------------

    @staticmethod
    def _raise(res: httpx.Response) -> None:
        if res.status_code != 200:
            try:
                body = res.json()
                msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else None
                msg = msg or body.get("message") or body.get("detail") or body
            except (json.JSONDecodeError, AttributeError, ValueError):
                msg = res.text
            raise BackendError(f"HTTP {res.status_code} from {res.request.url}: {msg}")

    def _get(self, path: str) -> Any:
        res = self._client.get(self.base_url + path)
        self._raise(res)
        return res.json()

    def _post(self, path: str, body: dict) -> Any:
        res = self._client.post(self.base_url + path, json=body)
        self._raise(res)
        return res.json() if res.content else None

    @staticmethod
    def _body(prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
              return_text_in_logprobs) -> dict:
        body: dict[str, Any] = {"sampling_params": sampling_params if sampling_params is not None else {}}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = prompt
        if return_logprob:
            body["return_logprob"] = return_logprob
            body["return_text_in_logprobs"] = bool(return_text_in_logprobs)
            if logprob_start_len is not None:
                body["logprob_start_len"] = logprob_start_len
            if top_logprobs_num is not None:
                body["top_logprobs_num"] = top_logprobs_num
        return body

    # ---- protocol -----------------------------------------------------------------

    def generate(self, prompt=None, sampling_params=None, *, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=False):
        return self._post("/generate", self._body(prompt, sampling_params, input_ids, return_logprob,
                                                  logprob_start_len, top_logprobs_num, return_text_in_logprobs))

    def generate_stream(self, prompt: str, sampling_params: dict, **opts: Any) -> Iterator[dict]:
        body = self._body(prompt, sampling_params, None, opts.get("return_logprob", False),
                          opts.get("logprob_start_len"), opts.get("top_logprobs_num"),
                          opts.get("return_text_in_logprobs", False))
        body["stream"] = True
        with self._client.stream("POST", self.base_url + "/generate", json=body) as res:
            if res.status_code != 200:
                res.read()
                self._raise(res)
            for line in res.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj and "text" not in obj:
                    raise BackendError(f"stream error: {obj['error']}")
                yield obj

    def flush_cache(self) -> bool:
        res = self._client.post(self.base_url + "/flush_cache")
        self._raise(res)
        return True

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        self._client.close()
