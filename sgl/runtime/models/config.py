"""ModelConfig: the architecture numbers a Llama-family model needs, from GGUF or HF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.runtime.models.registry import MODELS


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"
    # Llama's `attention_bias` also puts a bias on o_proj; Qwen2's does not.
    o_proj_bias: bool = False
    # HF rope_scaling dict (None, or rope_type 'linear' / 'llama3'); not hashed.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    @staticmethod
    def from_hf_config(cfg: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (Llama / SmolLM / Qwen2 / Mistral)."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in MODELS:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {sorted(MODELS)}")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if cfg.get("use_sliding_window") or (
            arch == "MistralForCausalLM" and cfg.get("sliding_window") not in (None, 0)
            and int(cfg["sliding_window"]) < int(cfg.get("max_position_embeddings", 0))
        ):
            raise ValueError("sliding-window attention is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        is_qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(cfg.get("attention_bias", False)) and not is_qwen2
        # transformers >= 5 nests rope settings under rope_parameters.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = rope_params
        eos = cfg.get("eos_token_id")
        eos_list = [eos] if isinstance(eos, int) else list(eos or [])
        for e in extra_eos:
            if e not in eos_list:
                eos_list.append(e)
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", not is_qwen2)),
            attention_bias=is_qwen2 or llama_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_list),
            architecture=arch,
            o_proj_bias=llama_bias,
            rope_scaling=dict(scaling) if scaling else None,
        )
