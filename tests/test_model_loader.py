"""Loader: the embedded GGUF converts once into an HF folder, later loads hit the cache,
and the rebuilt tokenizer / chat template behave like SmolLM2's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sgl.runtime.models import loader
from sgl.runtime.models.gguf_convert import _unpermute
from sgl.runtime.models.loader import embedded_gguf_path, load_model

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sglcache"))


@pytest.fixture(scope="module")
def loaded(cache):
    return load_model(cache_dir=cache, dtype="float32")


@pytest.mark.model
def test_converted_folder_and_config(loaded, cache):
    d = loaded.hf_dir
    assert str(d).startswith(cache)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / f).exists(), f
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta) == (49152, 1536, 100000.0)
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = loaded.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert set(c.eos_token_ids) == {im_end, eot} and c.bos_token_id == 1
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    p = next(loaded.model.parameters())
    assert p.dtype == torch.float32


@pytest.mark.model
def test_second_load_hits_cache(loaded, cache, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("converted again despite a cache")

    monkeypatch.setattr(loader, "convert_gguf_to_hf", boom)
    mtime = (loaded.hf_dir / "model.safetensors").stat().st_mtime_ns
    again = load_model(cache_dir=cache)  # auto dtype
    assert again.hf_dir == loaded.hf_dir
    assert (loaded.hf_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert next(again.model.parameters()).dtype == torch.bfloat16
    # The same file given explicitly, and the HF folder itself, load too.
    by_file = load_model(str(embedded_gguf_path()), cache_dir=cache, dtype="float32")
    by_dir = load_model(str(loaded.hf_dir), dtype="float32")
    assert by_file.hf_dir == loaded.hf_dir and by_dir.config == loaded.config
    w1 = loaded.model.layers[3].qkv_weight
    assert torch.equal(by_dir.model.layers[3].qkv_weight, w1)
    # Only our own tmp folders are removed; nothing half-written is left around.
    assert not [p for p in loaded.hf_dir.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.model
def test_tokenizer_round_trip_and_specials(loaded):
    tok = loaded.tokenizer
    text = "Hello, world! 2024 naïve café\n\tindented   spaces 😀"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # SmolLM2 splits digits one by one.
    assert len(tok.encode("12345", add_special_tokens=False)) == 5
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    ids = tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user"
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    # No BOS is added automatically (GGUF add_bos_token is false).
    assert tok.encode("hi")[0] != 1


@pytest.mark.model
def test_chat_template_renders_chatml(loaded):
    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
    msgs = [{"role": "user", "content": "Hi"}]
    text = loaded.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf's row reorder, restated
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(_unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_bad_paths_raise(tmp_path):
    with pytest.raises(ValueError):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError):
        load_model(str(tmp_path))  # a folder without config.json


def test_concurrent_convert_loser_keeps_winner(tmp_path, monkeypatch):
    """Two starts convert at once: the slower rename loses, keeps the winner's folder."""
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    final = loader.gguf_cache_dir(fake, str(cache))

    def racing_convert(src, out):
        (out / "config.json").write_text('{"mine": "loser"}')
        final.mkdir(parents=True)  # the other process finished first
        (final / "config.json").write_text('{"mine": "winner"}')

    monkeypatch.setattr(loader, "convert_gguf_to_hf", racing_convert)
    got = loader.ensure_hf_from_gguf(fake, str(cache))
    assert got == final and json.loads((final / "config.json").read_text()) == {"mine": "winner"}
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # temp folder cleaned up
    # A failing conversion leaves nothing behind and raises.
    other = tmp_path / "n.gguf"
    other.write_bytes(b"GGUF")

    def failing(src, out):
        raise ValueError("bad file")

    monkeypatch.setattr(loader, "convert_gguf_to_hf", failing)
    with pytest.raises(ValueError):
        loader.ensure_hf_from_gguf(other, str(cache))
    assert [p.name for p in final.parent.iterdir()] == [final.name]
