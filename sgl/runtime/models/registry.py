"""Model registry: architecture name -> model class.

The name is config.json's `architectures[0]` (a GGUF converts to the same). A new
architecture is one module in this folder plus one line in MODELS. Classes are imported
on first use, so naming an architecture here costs nothing until it is loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> "module:class"; the Llama forward serves the whole Llama family.
MODELS: dict[str, str] = {
    "LlamaForCausalLM": "sgl.runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "sgl.runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "sgl.runtime.models.llama:LlamaForCausalLM",
}


def model_class(architecture: str) -> Any:
    """The class that implements `architecture`; ValueError naming the supported ones."""
    target = MODELS.get(architecture)
    if target is None:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(MODELS)}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
