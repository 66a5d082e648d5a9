"""The router's tokenizer: the workers' own, fetched over HTTP, so routing sees their ids.

kv_aware matches a request's page hashes, which are over token ids; those ids must be the
ones the worker will compute. A worker that serves `GET /get_tokenizer` answers
`{"tokenizer_json", "chat_template", "bos_token", "eos_token"}` (its fast tokenizer's
JSON and its Jinja chat template); from these `RouterTokenizer` encodes exactly as the
worker does (`Tokenizer.encode` with special tokens, like `PreTrainedTokenizerFast.encode`)
and renders chat as `transformers`' `apply_chat_template(..., tokenize=False)` does: a
sandboxed Jinja environment with trim_blocks and lstrip_blocks, the loop-controls
extension, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text.
A worker without the endpoint (a real SGLang worker) gives None: route on text instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import httpx
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class RouterTokenizer:
    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        try:
            self._tok = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            raise ValueError(f"tokenizer_json is not a valid tokenizers JSON: {exc}") from exc
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)

    @classmethod
    def from_payload(cls, payload: object) -> RouterTokenizer:
        """From a `/get_tokenizer` JSON body; ValueError naming the field when it is malformed."""
        if not isinstance(payload, dict):
            raise ValueError("tokenizer payload must be a JSON object")
        tj = payload.get("tokenizer_json")
        if not isinstance(tj, str) or not tj:
            raise ValueError("tokenizer payload: 'tokenizer_json' must be a non-empty string")
        fields: dict[str, str | None] = {}
        for name in ("chat_template", "bos_token", "eos_token"):
            v = payload.get(name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"tokenizer payload: {name!r} must be a string or null")
            fields[name] = v
        return cls(tj, **fields)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens added as the worker's encode adds them."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=True)]

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The conversation as the worker's chat template renders it; ValueError if it cannot."""
        if self._template is None:
            raise ValueError("the worker's tokenizer has no chat template")
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed on these messages: {exc}") from exc


async def fetch_tokenizer(client: httpx.AsyncClient, url: str) -> RouterTokenizer | None:
    """The worker's tokenizer from `GET {url}/get_tokenizer`, or None when it has none.

    None on any failure (no such endpoint, worker down, malformed payload): the router
    then routes on text, which every policy supports.
    """
    try:
        resp = await client.get(f"{url}/get_tokenizer")
        if resp.status_code != 200:
            return None
        return RouterTokenizer.from_payload(resp.json())
    except (httpx.HTTPError, ValueError) as exc:
        logger.info("no router-side tokenizer from %s: %s", url, exc)
        return None
