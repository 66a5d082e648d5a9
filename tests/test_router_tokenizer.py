"""The router's tokenizer equals the worker's: same ids, same rendered chat.

Built from the embedded model's tokenizer (what the worker loads), serialized the way a
worker's `/get_tokenizer` sends it, and fetched over real HTTP by `fetch_tokenizer`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sgl.router.tokenizer import RouterTokenizer, fetch_tokenizer
from tests.json_http import JsonServer

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces  ",
    "Numbers 1234567890 and 3.14159, dates 2024-06-01.",
    "Unicode: café, naïve, 日本語のテキスト, emoji 🚀🔥, Ελληνικά",
    "def f(x):\n    return x ** 2  # code\n\ttabs\r\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "A" * 300,
    "Mixed\u00a0non-breaking\u2009spaces and ‘curly’ “quotes” — dashes…",
    '{"json": [1, 2, {"nested": null}], "ok": true}',
    "The quick brown fox jumps over the lazy dog. " * 20,
]

CHATS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hi there"}], None),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}], None),
    (
        [
            {"role": "system", "content": "Be helpful. Unicode: 日本語 🚀"},
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer"},
            {"role": "user", "content": "Second question\nwith two lines"},
        ],
        None,
    ),
    (
        [{"role": "user", "content": "What is the weather?"}],
        [{"type": "function", "function": {"name": "weather", "description": "Get it",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    ),
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from sgl.runtime.models.loader import embedded_gguf_path, ensure_hf_from_gguf
    from sgl.runtime.models.tokenizer import load_tokenizer

    return load_tokenizer(ensure_hf_from_gguf(embedded_gguf_path()))


def payload_of(tok: Any) -> dict[str, Any]:
    """What a worker's /get_tokenizer answers."""
    return {
        "tokenizer_json": tok.backend_tokenizer.to_str(),
        "chat_template": tok.chat_template,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
    }


@pytest.fixture(scope="module")
def router_tok(hf_tokenizer: Any) -> RouterTokenizer:
    return RouterTokenizer.from_payload(json.loads(json.dumps(payload_of(hf_tokenizer))))


def test_encode_equals_worker_tokenizer(hf_tokenizer: Any, router_tok: RouterTokenizer) -> None:
    for text in TEXTS:
        assert router_tok.encode(text) == hf_tokenizer.encode(text), text
    assert router_tok.encode_batch(TEXTS) == [hf_tokenizer.encode(t) for t in TEXTS]


def test_render_chat_equals_apply_chat_template(hf_tokenizer: Any, router_tok: RouterTokenizer) -> None:
    assert router_tok.chat_template
    for messages, tools in CHATS:
        want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools)
        assert router_tok.render_chat(messages, tools=tools) == want
        assert router_tok.encode(router_tok.render_chat(messages, tools=tools)) == hf_tokenizer.encode(want)


def test_template_errors_and_bad_payloads() -> None:
    tok = RouterTokenizer.from_payload({
        "tokenizer_json": _tiny_tokenizer_json(),
        "chat_template": "{% if messages|length == 0 %}{{ raise_exception('need a message') }}{% endif %}"
                         "{% for m in messages %}{{ m.content|tojson }}{% endfor %}",
    })
    assert tok.render_chat([{"role": "user", "content": "é"}]) == '"é"'  # tojson keeps non-ASCII
    with pytest.raises(ValueError, match="need a message"):
        tok.render_chat([])
    with pytest.raises(ValueError, match="tokenizer_json"):
        RouterTokenizer.from_payload({"chat_template": "x"})
    with pytest.raises(ValueError, match="tokenizer_json"):
        RouterTokenizer.from_payload({"tokenizer_json": "{not json"})
    with pytest.raises(ValueError, match="bos_token"):
        RouterTokenizer.from_payload({"tokenizer_json": _tiny_tokenizer_json(), "bos_token": 3})
    with pytest.raises(ValueError, match="no chat template"):
        RouterTokenizer.from_payload({"tokenizer_json": _tiny_tokenizer_json()}).render_chat([])


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return t.to_str()


class _TokenizerServer(JsonServer):
    def __init__(self, payload: dict[str, Any] | None) -> None:
        super().__init__(lambda path, _: (200, payload) if path == "/get_tokenizer" and payload is not None else None)


@pytest.fixture
def servers(hf_tokenizer: Any) -> Iterator[tuple[_TokenizerServer, _TokenizerServer]]:
    with_tok, without = _TokenizerServer(payload_of(hf_tokenizer)), _TokenizerServer(None)
    yield with_tok, without
    with_tok.close()
    without.close()


def test_fetch_tokenizer_over_http(servers: tuple[_TokenizerServer, _TokenizerServer], hf_tokenizer: Any) -> None:
    with_tok, without = servers

    async def main() -> tuple[RouterTokenizer | None, RouterTokenizer | None, RouterTokenizer | None]:
        async with httpx.AsyncClient(timeout=10) as client:
            return (
                await fetch_tokenizer(client, with_tok.url),
                await fetch_tokenizer(client, without.url),  # 404: e.g. a real SGLang worker
                await fetch_tokenizer(client, "http://127.0.0.1:9"),  # nothing listening
            )

    got, missing, down = asyncio.run(main())
    assert missing is None and down is None
    assert got is not None
    assert got.encode(TEXTS[4]) == hf_tokenizer.encode(TEXTS[4])
