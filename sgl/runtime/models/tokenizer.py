"""Tokenizers: rebuild a Hugging Face fast tokenizer from the vocabulary inside a GGUF
file, and load one from a Hugging Face folder.

GGUF stores a byte-level BPE tokenizer as three arrays (tokens, token types, merges)
plus a `pre` name that selects llama.cpp's pre-tokenizer regex. We rebuild the same
pipeline with the `tokenizers` library so that `transformers` code (chat templates,
`decode`) works unchanged on the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# GGUF token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    # SmolLM ("smollm") splits every digit on its own before GPT-2's byte-level regex;
    # the GPT-2 family ("gpt2", "default") uses the byte-level regex alone.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported; supported: smollm, starcoder, gpt2. "
        "Convert the model to a Hugging Face folder and pass that path instead."
    )


def tokenizer_from_gguf_fields(fields: dict[str, Any]) -> tuple[PreTrainedTokenizerFast, dict[str, Any]]:
    """Build the tokenizer from decoded GGUF metadata (`tokenizer.ggml.*`).

    Returns the tokenizer and a dict of special-token info (ids and strings) for the
    generation config.
    """
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types: list[int] = list(fields["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = _pre_tokenizer(str(fields.get("tokenizer.ggml.pre", "gpt2")))
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    if user:
        tk.add_tokens([AddedToken(s, special=False, normalized=False) for s in user])

    def tok_str(key: str) -> str | None:
        i = fields.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    info = {
        "bos_token": tok_str("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_str("tokenizer.ggml.eos_token_id"),
        "unk_token": tok_str("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok_str("tokenizer.ggml.padding_token_id"),
    }
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        model_max_length=int(fields.get("llama.context_length", 8192)),
        chat_template=fields.get("tokenizer.chat_template"),
        additional_special_tokens=[s for s in special if s not in info.values()],
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in info.items() if v is not None},
    )
    return hf, info


def load_tokenizer(hf_dir: str | Path) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer of a Hugging Face folder.

    tokenizer.json is read directly; otherwise transformers may still build a fast
    tokenizer from vocab.json+merges.txt or tokenizer.model (conversion, slower).
    """
    hf_dir = Path(hf_dir)
    if (hf_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(hf_dir), use_fast=True)
    except Exception as e:  # transformers raises many types here; one message for users
        raise ValueError(f"{hf_dir} has no usable tokenizer (add tokenizer.json): {e}") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{hf_dir}: only fast (Rust) tokenizers are supported; add tokenizer.json")
    return tok
