"""Convert a Llama-architecture GGUF file into a Hugging Face folder (config.json,
model.safetensors, tokenizer files, generation_config.json).

Quantized tensors (Q4_*/Q8_0/...) are dequantized to float32 with `gguf.quants`. llama.cpp's
converter reorders the rows of attn_q / attn_k so that each head's rotary pairs are
interleaved (x0,x1),(x2,x3)... as its RoPE kernel expects; Hugging Face Llama rotates the
two halves of each head instead (`rotate_half`). `_unpermute` undoes the reorder so the
written folder is an ordinary HF checkpoint that `transformers` can load too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from sgl.runtime.models.tokenizer import tokenizer_from_gguf_fields

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_fields(reader: GGUFReader) -> dict[str, Any]:
    """All GGUF metadata as plain Python values (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        try:
            out[key] = f.contents()
        except Exception:  # odd/unsupported field types are not needed by us
            continue
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): per head, rows (pair, half) -> (half, pair)."""
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _LAYER_MAP:
            return f"model.layers.{idx}.{_LAYER_MAP[rest]}"
    return None


def hf_config_from_fields(fields: dict[str, Any]) -> dict[str, Any]:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = "llama."
    n_head = int(fields[p + "attention.head_count"])
    hidden = int(fields[p + "embedding_length"])
    head_dim = int(fields.get(p + "rope.dimension_count", hidden // n_head))
    vocab = int(fields.get(p + "vocab_size", len(fields["tokenizer.ggml.tokens"])))
    if p + "rope.scaling.type" in fields and fields[p + "rope.scaling.type"] not in ("none",):
        raise ValueError(f"GGUF rope scaling {fields[p + 'rope.scaling.type']!r} is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(fields[p + "feed_forward_length"]),
        "num_hidden_layers": int(fields[p + "block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(fields.get(p + "attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(fields.get(p + "context_length", 2048)),
        "rms_norm_eps": float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(fields.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,  # flipped below when the file has output.weight
        "torch_dtype": "float32",
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write an HF-format folder for `gguf_path` into the (existing, empty) `out_dir`."""
    out_dir = Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    fields = read_fields(reader)
    config = hf_config_from_fields(fields)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":
                raise ValueError("GGUF with rope_freqs (llama3 rope scaling) is not supported")
            continue
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
            w = _unpermute(w, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    if "lm_head.weight" in tensors:
        config["tie_word_embeddings"] = False

    tokenizer, info = tokenizer_from_gguf_fields(fields)
    # Chat turns end with <|im_end|>; plain completions end with <|endoftext|>: stop on both.
    eos_ids = [int(config["eos_token_id"])] if config["eos_token_id"] is not None else []
    vocab = tokenizer.get_vocab()
    for s in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if s in vocab and vocab[s] not in eos_ids:
            eos_ids.append(vocab[s])
    config["eos_token_id"] = eos_ids
    pad_id = fields.get("tokenizer.ggml.padding_token_id")

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids, "pad_token_id": pad_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tokenizer.save_pretrained(str(out_dir))
    # Keep the chat template inside tokenizer_config.json as well as wherever this
    # transformers version saves it, so older and newer readers both find it.
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = fields.get("tokenizer.chat_template")
    tc["model_max_length"] = config["max_position_embeddings"]
    tc_path.write_text(json.dumps(tc, indent=2))
    (out_dir / "sgl_source.json").write_text(json.dumps({"gguf": str(gguf_path), **info}, indent=2))
