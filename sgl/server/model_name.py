"""The served model name, and which `model` values in an OpenAI request name it.

The served name defaults to a short name derived from the model path (`served_name_for`):
a GGUF file's name without `.gguf` and without a trailing quantization tag
(`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`), a Hugging Face folder's
base name; `--served-model-name` overrides it. `/v1/models` lists it and every response's
`model` field carries it.

The rule for a request's `model` (`resolve_model`; the README says the same in one line):
this server serves one model, so it accepts every value that can only mean that model —
missing, null or "", "default" (SGLang's examples and our README send it), "unknown"
(what sglang-router 0.3.2 puts in a chat request that had no `model`: observed on the
wire, see tests/test_server_router_compat.py; its /generate sends `"model": null`), the
served name, the model path and the path's base name. Any other name is a client asking
for a model this server does not have: OpenAI's 404 `model_not_found`, naming `model`.
"""

from __future__ import annotations

import os
import re

from sgl.server.errors import APIError

# Names that mean "whatever this server serves": OpenAI-client defaults, SGLang's examples
# and the router placeholder for a request without `model` (see the module docstring).
PLACEHOLDER_NAMES = frozenset({"", "default", "unknown"})

# Trailing quantization / precision tag of a GGUF file name: llama.cpp's Q/IQ types
# (Q4_0, Q4_K_M, Q8_0, IQ4_XS, Q4_0_4_4, ...) and plain float types, after "." "-" or "_".
_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d+(?:_[a-z0-9]+)*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)


def served_name_for(model_path: str) -> str:
    """The short default name of the model at `model_path` (file or folder)."""
    base = os.path.basename(model_path.rstrip("/\\")) or model_path
    if base.lower().endswith(".gguf"):
        base = _QUANT_SUFFIX.sub("", base[: -len(".gguf")]) or base
    return base


def accepted_names(served_name: str, model_path: str) -> frozenset[str]:
    """Every non-placeholder `model` value that names this server's model."""
    names = {served_name, model_path, os.path.basename(model_path.rstrip("/\\"))}
    return frozenset(n for n in names if n)


def resolve_model(requested: str | None, served_name: str, accepted: frozenset[str]) -> str:
    """The served name if `requested` names this server's model (the rule in the module
    docstring); otherwise OpenAI's 404 `model_not_found` naming the `model` field."""
    if requested is None or requested in PLACEHOLDER_NAMES or requested in accepted:
        return served_name
    raise APIError(f"model {requested!r} does not exist; this server serves {served_name!r}", 404,
                   param="model", code="model_not_found")
